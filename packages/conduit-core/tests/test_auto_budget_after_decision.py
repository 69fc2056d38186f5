"""Automatic's memory budget after the decision: a delivery whose batch is larger than any the probe priced keeps its
delivery buffers within the budget for its own size (in the confirm phase and once decided), a later batch that fits
goes back to the decided g_del, and a size already checked costs no re-check (prefetched batches are kept)."""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    CapacityError,
    ColumnarStorage,
    ExperienceDataPlane,
    ExperienceSchema,
    PrioritizedSampler,
    Replay,
)
from conduit.placement import HostPlacement, Placement
from conduit.scheduling.auto import TIE_SHARE
from conduit.scheduling.buffers import buffers_needed
from conduit.scheduling.granularity import g_del_fitting
from conduit.scheduling.model import choose_granularity
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

ITEM = ID_SCHEMA.fixed_item_bytes
STORED = 4096
#: what every read of the slow tier below costs before it starts (seconds)
READ_S = 0.01


class _SlowReadStorage(ColumnarStorage):
    """Host storage whose every gather (one per delivery call: a chunk of ``g_del`` batches) first waits ``READ_S``, as
    a read from a remote tier would. That fixed cost per call is hundreds of times what a call of the probe's sizes
    costs here otherwise (tens of us), so the probe measures fewer, larger calls as cheaper per batch by far, however
    fast or loaded this machine is: a delay only adds to a call's time, and it would take delays of about ``READ_S``
    on every probed call of g_del = 2 (and of twice that at 4) for the model to choose g_del = 1."""

    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> Any:
        time.sleep(READ_S)
        return super().gather(slots, out)


class _SlowReadPlacement(HostPlacement):
    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        return _SlowReadStorage(schema, capacity, "cpu")


def _buffer(sched: Automatic, *, placement: Placement | None = None, **kwargs: Any) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=2 * STORED, semantics=Replay(seed=0, **kwargs), scheduler=sched,
                              placement=placement)
    edp.ingest(id_batch(np.arange(STORED)))
    edp.flush()
    return edp


def _rings(sched: Automatic) -> list[Any]:
    """The chunk rings of the scheduler serving calls and of the confirm phase's idle candidate."""
    return [sched.inner._ring, *(c._ring for c in sched._candidates.values() if c is not sched.inner)]


def _held(rings: list[Any]) -> int:
    """Bytes the rings' chunk buffers hold now (their tensors, not a counter)."""
    return sum(t.numel() * t.element_size() for r in rings for s in r.slots for t in (*s.host.values(),
                                                                                      *s.dev.values()))


def _allowed(budget: int, n: int, depth: int) -> int:
    """What the buffers may hold for batches of ``n``: the budget, or what g_del = 1 needs when even that is over."""
    return max(budget, buffers_needed(1, depth) * n * ITEM)


def _fitting(g: int, n: int, budget: int, depth: int) -> int:
    fits = g_del_fitting(g, batch_bytes=n * ITEM, memory_budget=budget, output_depth=depth)
    return fits[-1] if fits else 1


class _Checker:
    """Delivers, and checks every batch: its size, ids among those stored with their payload, and that batches
    delivered stay unchanged for output_depth deliveries; also the bytes the chunk buffers hold."""

    def __init__(self, edp: ExperienceDataPlane, sched: Automatic, budget: int, depth: int) -> None:
        self.edp, self.sched, self.budget, self.depth = edp, sched, budget, depth
        self.k = 0
        self.recent: list[tuple[int, Any, torch.Tensor]] = []

    def deliver(self, n: Any, **kwargs: Any) -> Any:
        phase = self.sched._phase
        batch, info = self.edp.deliver(n, **kwargs)
        self.k += 1
        where = f"delivery {self.k} of {int(n)} ({phase}, {self.sched!r})"
        assert batch.batch_size == int(n), f"{where}: got {batch.batch_size} items"
        ids = check_payload(batch)
        assert ((ids >= 0) & (ids < STORED)).all(), f"{where}: ids not stored: {ids[(ids < 0) | (ids >= STORED)]}"
        self.recent = [r for r in self.recent if r[0] > self.k - self.depth] + [(self.k, batch,
                                                                                 batch.tensor("id").clone())]
        for j, b, old in self.recent:
            assert torch.equal(b["id"], old), f"the batch of delivery {j} changed by {where}"
        held, allowed = _held(_rings(self.sched)), _allowed(self.budget, int(n), self.depth)
        assert held <= allowed, (f"{where}: the delivery buffers hold {held:,} bytes, over {allowed:,} (memory_budget="
                                 f"{self.budget:,}, output_depth={self.depth}, g_del now {self.sched.g_del:g})")
        return batch, info


def _calibrated(overlap: bool | None, depth: int, budget: int, *, placement: Placement | None = None,
                **kwargs: Any) -> tuple[ExperienceDataPlane, Automatic, _Checker]:
    sched = Automatic(overlap=overlap, memory_budget=budget, g_del_max=4, probe_rounds=2, output_depth=depth,
                      confirm_windows=2, confirm_deliveries=3)
    edp = _buffer(sched, placement=placement, **kwargs)
    check = _Checker(edp, sched, budget, depth)
    while "phase=run" not in repr(sched):
        check.deliver(64)
        assert check.k < 400, f"calibration did not finish: {sched!r}"
    assert sched.decision is not None
    return edp, sched, check


@pytest.mark.parametrize("depth", [2, 6])
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_a_batch_larger_than_the_probe_priced_stays_within_the_budget_once_decided(overlap: bool, depth: int) -> None:
    budget = buffers_needed(4, depth) * 4 * 64 * ITEM  # the probe's batches of 64 fit at g_del = 4
    edp, sched, check = _calibrated(overlap, depth, budget, placement=_SlowReadPlacement())
    d = sched.decision
    assert d is not None
    decided = int(d.g_del)
    # the decision is the model's own choice among the costs it predicted from what the probe measured
    costs, slack = (d.deliver_overlapped, TIE_SHARE * d.deliver_gap_s) if overlap else (d.deliver_sequential, 0.0)
    assert decided == choose_granularity(costs, slack_s=slack), f"decided g_del={decided}: {d.explain()}"
    # and, with a slow read per call, one above 1 (2, 3 or 4): at it a batch of 256 does not fit the budget, so the
    # deliveries below lower g_del (at g_del = 1 every batch would fit and prove nothing)
    assert _fitting(decided, 256, budget, depth) < decided, f"decided g_del={decided}: {d.explain()}"
    for n in [256] * 6 + [64] * 6 + [1024] * 5 + [128] * 5 + [32] * 4 + [64] * 6:
        check.deliver(n)
        want = _fitting(decided, n, budget, depth)
        assert sched.g_del == want, f"batches of {n}: g_del {sched.g_del:g}, expected {want} ({sched!r})"
    decision = sched.decision
    assert decision is not None and sched.g_del == decided and decision.g_del == decided, (
        f"batches of 64 did not go back to the decided g_del={decided}: {sched!r}, decision {decision}")
    assert "phase=run" in repr(sched)
    edp.close()


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_the_confirm_windows_keep_a_larger_batch_within_the_budget(prioritized: bool) -> None:
    depth = 3
    budget = buffers_needed(4, depth) * 4 * 64 * ITEM
    sched = Automatic(overlap=None, memory_budget=budget, g_del_max=4, probe_rounds=2, output_depth=depth,
                      confirm_windows=3, confirm_deliveries=3)
    sampler: dict[str, Any] = {"sampler": PrioritizedSampler()} if prioritized else {}
    edp = _buffer(sched, **sampler)
    check = _Checker(edp, sched, budget, depth)
    while sched._phase == "probe":
        check.deliver(64)
        assert check.k < 400, f"the probe did not finish: {sched!r}"
    sizes = [512, 512, 64, 2048, 2048, 256, 64, 64, 512]
    seen = 0
    while sched._phase == "confirm":
        n = sizes[seen % len(sizes)]
        _, info = check.deliver(n)
        if prioritized:
            edp.update_priorities(info.handles, torch.rand(n, generator=torch.Generator().manual_seed(seen)) + 0.1)
        seen += 1
        assert seen < 400, f"the confirm phase did not finish: {sched!r}"
    for n in [512] * 3 + [64] * 3:
        check.deliver(n)
    assert sched.decision is not None
    assert sched.g_del == sched.decision.g_del, f"back at batches of 64: {sched!r}, decision {sched.decision.g_del}"
    edp.close()


def test_a_restored_decision_keeps_a_larger_batch_within_the_budget_and_loads_unchanged() -> None:
    depth = 2
    budget = buffers_needed(4, depth) * 4 * 64 * ITEM
    edp, sched, _ = _calibrated(False, depth, budget)
    edp.deliver(1024)  # (lowered for this one; the decision, and so the checkpoint, stays as chosen)
    state = edp.state_dict()
    assert sched.decision is not None
    assert state["scheduler"]["state"]["decision"]["g_del"] == sched.decision.g_del, state["scheduler"]
    edp.close()
    decision = copy.deepcopy(state["scheduler"]["state"]["decision"])
    decision["g_del"] = 4.0  # the largest g_del the probe's batches fit (whatever this machine's model picked)
    state["scheduler"]["state"]["decision"] = decision
    restored = Automatic(overlap=False, memory_budget=budget, g_del_max=4, output_depth=depth)
    target = ExperienceDataPlane(ID_SCHEMA, capacity=2 * STORED, semantics=Replay(seed=0), scheduler=restored)
    target.load_state_dict(state)
    assert "phase=run" in repr(restored) and restored.g_del == 4, repr(restored)
    check = _Checker(target, restored, budget, depth)
    for n in [64] * 3 + [512] * 5 + [64] * 4:
        check.deliver(n)
        assert restored.g_del == _fitting(4, n, budget, depth), (n, repr(restored))
    assert target.state_dict()["scheduler"] == state["scheduler"], "the decision changed by delivering other sizes"
    target.close()


def test_a_checked_size_keeps_its_prefetched_batches_and_a_refused_size_changes_nothing() -> None:
    depth = 2
    budget = buffers_needed(4, depth) * 4 * 64 * ITEM
    edp, sched, check = _calibrated(True, depth, budget)
    decided = sched.g_del
    for n in [64, 64, np.int64(64), 32, 64]:  # sizes checked already (up to 64 at the decided g_del)
        check.deliver(n)
    hits, discarded = sched.inner.prefetch_hits, sched.inner.discarded
    for n in [64, np.int64(64), 64, 64]:
        check.deliver(n)
    assert sched.inner.prefetch_hits == hits + 4 and sched.inner.discarded == discarded, (
        f"a size already checked re-checked and dropped prefetched batches: hits {hits} -> "
        f"{sched.inner.prefetch_hits}, discarded {discarded} -> {sched.inner.discarded}")
    # a size the semantics refuse: g_del, the prefetched batches and the checked sizes stay as they were
    with pytest.raises(CapacityError):
        edp.deliver(STORED + 1, replace=False)
    assert sched.g_del == decided and sched.inner.discarded == discarded, (repr(sched), sched.inner.discarded)
    hits = sched.inner.prefetch_hits
    check.deliver(64)
    assert sched.inner.prefetch_hits == hits + 1, "the refused delivery dropped the batches prefetched for 64"
    edp.close()
