"""Automatic's memory budget (a batch over it at g_del = 1 is treated the same whenever it comes; the chunk buffers
held while calibrating stay within it), and the scheduler entry of a DistributedDataPlane's checkpoint (as a
single-node buffer's)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    ConfigurationError,
    ExperienceDataPlane,
    PrioritizedSampler,
    Replay,
    Synchronous,
)
from conduit.scheduling.buffers import buffers_needed
from conduit.testing.reference import ID_SCHEMA, id_batch

ITEM = ID_SCHEMA.fixed_item_bytes


def _replay_buffer(sched: Automatic, **kwargs: Any) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0, **kwargs), scheduler=sched)
    edp.ingest(id_batch(np.arange(1024)))
    return edp


# -- 1. a budget smaller than one batch per delivery call: the same answer whenever that batch comes ------------------
@pytest.mark.parametrize("warm_up", [False, True], ids=["first-delivery", "after-a-small-first-delivery"])
def test_a_batch_over_the_budget_even_at_g_del_1_is_delivered_at_g_del_1_whenever_it_comes(warm_up: bool) -> None:
    budget = 2 * 64 * ITEM  # g_del = 1 needs buffers_needed(1, 2) = 3 batches of 64: over it
    assert buffers_needed(1, 2) * 64 * ITEM > budget
    sched = Automatic(overlap=False, memory_budget=budget, probe_rounds=1)
    edp = _replay_buffer(sched)
    if warm_up:
        edp.deliver(1)  # a batch of 1 fits up to g_del = 8
    for k in range(40):
        batch, _ = edp.deliver(64)  # (the first-delivery case raised ConfigurationError here; the other did not)
        assert batch.batch_size == 64
        held = _held([sched.inner._ring])
        assert held <= buffers_needed(1, 2) * 64 * ITEM, (
            f"delivery {k}: the chunk buffers hold {held:,} bytes, more than g_del = 1 needs for batches of 64 "
            f"({sched!r})")
        if sched.decision is not None:
            break
    assert sched.decision is not None and sched.decision.g_del == 1, repr(sched)
    edp.close()


def test_a_checkpointed_g_del_1_decision_is_taken_under_a_budget_smaller_than_its_batch() -> None:
    settings: dict[str, Any] = dict(overlap=False, g_ing_max=2, g_del_max=4, probe_rounds=3)
    sched = Automatic(**settings, memory_budget=buffers_needed(1, 2) * 64 * ITEM)  # only g_del = 1 fits
    edp = _replay_buffer(sched)
    while sched.decision is None or "phase=run" not in repr(sched):
        edp.deliver(64)
    assert sched.decision.g_del == 1 and sched.decision.batch_bytes == 64 * ITEM, sched.decision.explain()
    state = edp.state_dict()
    edp.close()
    # a scheduler with this budget would itself run batches of 64 at g_del = 1: it takes the saved g_del = 1
    restored = Automatic(**settings, memory_budget=2 * 64 * ITEM)
    target = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=restored)
    target.load_state_dict(copy.deepcopy(state))
    assert restored.decision is not None and "phase=run" in repr(restored), (
        f"a saved g_del = 1 was refused under a budget smaller than one batch: {restored!r}")
    target.close()


# -- 2. the chunk buffers held while calibrating stay within the budget, and delivered batches stay valid -------------
def _held(rings: list[Any]) -> int:
    """Bytes the rings' chunk buffers hold now (their tensors, not a counter)."""
    return sum(t.numel() * t.element_size() for r in rings for s in r.slots for t in (*s.host.values(),
                                                                                      *s.dev.values()))


@pytest.mark.parametrize("depth", [3, 5, 6])
@pytest.mark.parametrize("warm_up", [False, True], ids=["first-64", "first-1"])
@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_calibration_holds_no_more_chunk_buffers_than_the_budget_and_keeps_batches_valid(
        depth: int, warm_up: bool, prioritized: bool) -> None:
    budget = buffers_needed(4, depth) * 4 * 64 * ITEM  # batches of 64: g_del = 4 fits exactly
    sched = Automatic(overlap=None, memory_budget=budget, g_del_max=8, probe_rounds=2, output_depth=depth,
                      confirm_windows=2, confirm_deliveries=3)
    edp = _replay_buffer(sched, **({"sampler": PrioritizedSampler()} if prioritized else {}))
    if warm_up:
        edp.deliver(1)
    recent: list[tuple[int, Any, torch.Tensor]] = []  # (delivery, batch, a copy of its ids)
    peak: dict[str, tuple[int, str]] = {}
    k = 0
    while "phase=run" not in repr(sched):
        phase = getattr(sched, "_phase", "?")
        batch, info = edp.deliver(64)
        if prioritized:
            edp.update_priorities(info.handles, torch.rand(64, generator=torch.Generator().manual_seed(k)) + 0.1)
        k += 1
        assert k < 400, f"calibration did not finish: {sched!r}"
        rings = [sched.inner._ring, *(c._ring for c in sched._candidates.values() if c is not sched.inner)]
        for name, held in (("active", _held(rings[:1])), ("all", _held(rings))):
            if held > peak.get(name, (0, ""))[0]:
                peak[name] = (held, f"delivery {k} ({phase}, {sched.inner!r}, {len(rings[0].slots)} slots)")
        recent = [r for r in recent if r[0] > k - depth] + [(k, batch, batch["id"].clone())]
        for j, b, ids in recent:  # valid until output_depth further deliveries
            assert torch.equal(b["id"], ids), f"the batch of delivery {j} changed at delivery {k} ({phase})"
    for name, (held, at) in peak.items():
        assert held <= budget, (f"the {name} chunk buffers held {held:,} bytes at {at}, over memory_budget="
                                f"{budget:,} (output_depth={depth})")
    edp.close()


# -- 3. DistributedDataPlane carries and applies the scheduler entry as ExperienceDataPlane does ----------------------
SETTINGS: dict[str, Any] = dict(overlap=False, g_ing_max=2, g_del_max=4, probe_rounds=1, memory_budget=None)


def _plane(servers: Any, sched: Any) -> Any:
    from conduit.distributed import DistributedDataPlane

    return DistributedDataPlane(ID_SCHEMA, capacity=512, servers=servers, health_period=None,
                                semantics=Replay(PrioritizedSampler(), seed=3), scheduler=sched)


def _step(p: Any, i: int) -> list[int]:
    batch, info = p.deliver(16)
    out = batch["id"].tolist()
    p.update_priorities(info.handles, torch.rand(16, generator=torch.Generator().manual_seed(100 + i)) + 1e-3)
    p.ingest(id_batch(np.arange(10_000 + 8 * i, 10_008 + 8 * i)))
    return out


def _calibrate(p: Any, sched: Automatic) -> int:
    """Fill ``p`` and step it until ``sched`` has finished calibrating; the next step's index."""
    p.ingest(id_batch(np.arange(200)))
    i = 0
    while "phase=run" not in repr(sched):
        _step(p, i)
        i += 1
        assert i < 300, f"Automatic did not finish calibrating on a DistributedDataPlane: {sched!r}"
    return i


def _ids(p: Any) -> list[int]:
    return sorted(p.read(p.live_handles()).tensor("id").tolist())


@pytest.mark.timeout(300)
def test_a_distributed_checkpoint_carries_automatics_decision_and_a_new_plane_goes_on_with_it(servers: Any) -> None:
    pytest.importorskip("ray")
    sched = Automatic(**SETTINGS)
    with _plane(servers, sched) as p:
        i = _calibrate(p, sched)
        state = p.state_dict()
        assert state.get("scheduler", {}).get("kind") == "conduit.scheduling.auto.Automatic", sorted(state)
        original = [_step(p, i + k) for k in range(6)]
    d = sched.decision
    assert d is not None

    restored = Automatic(**SETTINGS)
    with _plane(servers, restored) as q:
        q.load_state_dict(copy.deepcopy(state))
        assert restored.decision is not None and "phase=run" in repr(restored), f"it calibrated again: {restored!r}"
        assert (restored.decision.g_ing, restored.decision.g_del, restored.decision.overlap) == (
            d.g_ing, d.g_del, d.overlap)
        assert [_step(q, i + k) for k in range(6)] == original, "the restored plane delivers something else"


@pytest.mark.timeout(300)
def test_a_distributed_scheduler_entry_damaged_is_refused_first_and_another_kind_ignores_it(servers: Any) -> None:
    pytest.importorskip("ray")
    sched = Automatic(**SETTINGS)
    with _plane(servers, sched) as p:
        _calibrate(p, sched)
        state = p.state_dict()
        want = _ids(p)
    assert "scheduler" in state, f"the checkpoint has no scheduler entry: {sorted(state)}"
    damaged = copy.deepcopy(state)
    damaged["scheduler"]["state"]["decision"]["g_del"] = 0.5
    fresh = Automatic(**SETTINGS)
    with _plane(servers, fresh) as q:
        q.ingest(id_batch(np.arange(500, 530)))
        before = _ids(q)
        with pytest.raises(ConfigurationError, match="scheduler"):
            q.load_state_dict(damaged)
        assert _ids(q) == before, "a refused load changed the contents"
        assert fresh.decision is None and "phase=probe" in repr(fresh), f"a refused load changed it: {fresh!r}"
        q.load_state_dict(state)
        assert _ids(q) == want and fresh.decision is not None, repr(fresh)
    with _plane(servers, Synchronous()) as r:
        r.load_state_dict(state)  # another kind of scheduler: the entry is ignored
        assert _ids(r) == want
        r.deliver(16)
