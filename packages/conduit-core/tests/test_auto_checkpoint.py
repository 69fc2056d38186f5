"""Automatic scheduling across a checkpoint (its decision travels with the buffer's state), and the memory budget
while it probes (a later, larger batch never makes a probed delivery depth exceed it)."""

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
    Overlapped,
    PrioritizedSampler,
    Replay,
    Synchronous,
)
from conduit.scheduling.buffers import buffers_needed
from conduit.testing.reference import ID_SCHEMA, id_batch

SETTINGS: dict[str, Any] = dict(overlap=False, g_ing_max=2, g_del_max=4, probe_rounds=1, memory_budget=None)


def _buffer(scheduler: Any) -> ExperienceDataPlane:
    return ExperienceDataPlane(ID_SCHEMA, capacity=256, semantics=Replay(PrioritizedSampler(), seed=3),
                               scheduler=scheduler)


def _step(edp: ExperienceDataPlane, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step: deliver, new priorities for what was delivered, ingest a rollout."""
    batch, info = edp.deliver(16)
    out = (batch["id"].clone(), info.weights.clone() if info.weights is not None else torch.empty(0))
    g = torch.Generator().manual_seed(1000 + i)
    edp.update_priorities(info.handles, torch.rand(16, generator=g) * 10 + 1e-3)
    edp.ingest(id_batch(np.arange(10_000 + 8 * i, 10_000 + 8 * i + 8)))
    return out


def _calibrated(**kwargs: Any) -> tuple[ExperienceDataPlane, int]:
    """A prioritized buffer whose Automatic scheduler has finished calibrating; also the next step's index."""
    sched = Automatic(**{**SETTINGS, **kwargs})
    edp = _buffer(sched)
    edp.ingest(id_batch(np.arange(200)))
    i = 0
    while "phase=run" not in repr(sched):
        _step(edp, i)
        i += 1
        assert i < 500, f"Automatic did not finish calibrating: {sched!r}"
    for _ in range(5):  # a few steps on the chosen configuration
        _step(edp, i)
        i += 1
    return edp, i


def _diverged(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    for k, ((ia, wa), (ib, wb)) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(ia, ib) or not torch.equal(wa, wb):
            return f"delivery {k} after the checkpoint differs: original ids {ia.tolist()}, restored {ib.tolist()}"
    return ""


# -- 1. the decision travels with the checkpoint -----------------------------------------------------------------
def test_restored_automatic_buffer_delivers_what_the_original_would_have() -> None:
    edp, i = _calibrated()
    d = edp.scheduler.decision  # type: ignore[attr-defined]
    state = edp.state_dict()
    original = [_step(edp, i + k) for k in range(40)]
    edp.close()

    sched = Automatic(**SETTINGS)
    restored_edp = _buffer(sched)
    restored_edp.load_state_dict(copy.deepcopy(state))
    restored = [_step(restored_edp, i + k) for k in range(40)]
    msg = _diverged(original, restored)
    assert not msg, f"{msg} (original decision: g_ing={d.g_ing}, g_del={d.g_del}; restored scheduler {sched!r})"
    assert sched.decision is not None and "phase=run" in repr(sched), f"the restored scheduler calibrated: {sched!r}"
    assert (sched.decision.g_ing, sched.decision.g_del, sched.decision.overlap) == (d.g_ing, d.g_del, d.overlap)
    assert sched.decision.explain() == d.explain(), "the restored decision does not say what was measured"
    restored_edp.close()


# -- 2. the memory budget holds at every probed depth, not only for the first batch's size ---------------------------
def _delivery_buffer_bytes(sched: Automatic) -> int:
    """Bytes the active scheduler's chunk buffers hold now (their tensors, not a counter of the scheduler's)."""
    inner = sched.inner
    return sum(t.numel() * t.element_size() for s in inner._ring.slots for t in s.host.values())


def test_probe_never_prepares_more_than_the_memory_budget_after_a_small_first_delivery() -> None:
    item = ID_SCHEMA.fixed_item_bytes
    budget = buffers_needed(2, 2) * 2 * 64 * item  # batches of 64: two per delivery call fit, three do not
    assert buffers_needed(3, 2) * 3 * 64 * item > budget
    sched = Automatic(overlap=False, memory_budget=budget, g_del_max=8, probe_rounds=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    edp.ingest(id_batch(np.arange(1024)))
    edp.deliver(1)  # a small first delivery (a warm-up): for it alone g_del = 8 fits
    peak, at = 0, ""
    for k in range(80):
        if sched.decision is not None:
            break
        edp.deliver(64)
        used = _delivery_buffer_bytes(sched)
        if used > peak:
            peak, at = used, f"delivery {k + 2} (g_del={sched.g_del:g})"
    assert sched.decision is not None, "the probe did not finish"
    assert peak <= budget, (f"the probe's delivery buffers took {peak:,} bytes at {at}, over "
                            f"memory_budget={budget:,} bytes for batches of 64")
    edp.close()


# -- the scheduler entry: when it is written, where it loads, what a damaged one does --------------------------------
def _ids(edp: ExperienceDataPlane) -> list[int]:
    return sorted(edp.state_dict()["storage"]["data"]["id"].tolist())


def test_the_entry_is_plain_data_and_survives_a_weights_only_torch_load(tmp_path: Any) -> None:
    edp, _ = _calibrated()
    state = edp.state_dict()
    edp.close()
    assert state["format"] == 1 and state["scheduler"]["kind"] == "conduit.scheduling.auto.Automatic", state.keys()
    torch.save(state, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    sched = Automatic(**SETTINGS)
    target = _buffer(sched)
    target.load_state_dict(loaded)
    assert sched.decision is not None and "phase=run" in repr(sched), f"the decision was not taken: {sched!r}"
    target.close()


def test_no_entry_from_a_scheduler_with_nothing_to_keep_or_while_calibrating() -> None:
    for sched in (Synchronous(), Overlapped(g_del=2), Automatic(**SETTINGS)):
        edp = _buffer(sched)
        edp.ingest(id_batch(np.arange(50)))
        for i in range(3):
            _step(edp, i)
        state = edp.state_dict()
        assert set(state) == {"format", "storage", "semantics"}, f"{sched!r} wrote {sorted(state)}"
        edp.close()


def test_a_checkpoint_without_the_entry_loads_and_the_scheduler_calibrates_as_before() -> None:
    old = _buffer(Synchronous())
    old.ingest(id_batch(np.arange(100)))
    state = old.state_dict()
    old.close()
    sched = Automatic(**SETTINGS)
    edp = _buffer(sched)
    edp.load_state_dict(state)
    assert _ids(edp) == list(range(100)) and sched.decision is None and "phase=probe" in repr(sched)
    edp.close()


@pytest.mark.parametrize("make", [Synchronous, lambda: Overlapped(g_del=3, overlap=False),
                                  lambda: Automatic(**{**SETTINGS, "g_del_max": 1})],
                         ids=["synchronous", "overlapped", "automatic-with-other-caps"])
def test_an_automatic_checkpoint_loads_into_a_buffer_with_any_scheduler(make: Any) -> None:
    edp, i = _calibrated(g_del_max=4)
    saved_d = edp.scheduler.decision  # type: ignore[attr-defined]
    state = edp.state_dict()
    want = _ids(edp)
    edp.close()
    sched = make()
    target = _buffer(sched)
    target.load_state_dict(state)
    assert _ids(target) == want
    if isinstance(sched, Automatic) and saved_d.g_del > 1:  # a decision above this scheduler's g_del_max=1
        assert sched.decision is None, f"a decision outside g_del_max=1 was applied: {sched!r}"
    _step(target, i)
    target.close()


def _damaged(state: dict[str, Any], how: str) -> dict[str, Any]:
    s = copy.deepcopy(state)
    d = s["scheduler"]["state"]["decision"]
    if how == "entry-not-a-dict":
        s["scheduler"] = [1, 2]
    elif how == "kind-missing":
        del s["scheduler"]["kind"]
    elif how == "state-not-a-dict":
        s["scheduler"]["state"] = "decision"
    elif how == "unknown-key":
        s["scheduler"]["state"]["extra"] = 1
    elif how == "decision-not-a-dict":
        s["scheduler"]["state"]["decision"] = 3
    elif how == "g_del-zero":
        d["g_del"] = 0.0
    elif how == "g_del-fraction":
        d["g_del"] = 1.5
    elif how == "g_ing-outside-range":
        d["g_ing"] = 64.0
    elif how == "overlap-not-bool":
        d["overlap"] = "yes"
    elif how == "fit-missing-field":
        d["deliver_fit"] = {"overhead_s": 1.0}
    elif how == "gap-nan":
        d["deliver_gap_s"] = float("nan")
    elif how == "costs-not-pairs":
        d["deliver_sequential"] = [1.0, 2.0]
    elif how == "range-missing":
        del d["range"]
    return s


DAMAGE = ["entry-not-a-dict", "kind-missing", "state-not-a-dict", "unknown-key", "decision-not-a-dict", "g_del-zero",
          "g_del-fraction", "g_ing-outside-range", "overlap-not-bool", "fit-missing-field", "gap-nan",
          "costs-not-pairs", "range-missing"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_scheduler_entry_is_refused_typed_and_changes_nothing(how: str) -> None:
    edp, _ = _calibrated()
    state = edp.state_dict()
    edp.close()
    sched = Automatic(**SETTINGS)
    target = _buffer(sched)
    target.ingest(id_batch(np.arange(500, 530)))
    before = _ids(target)
    with pytest.raises(ConfigurationError, match="scheduler"):
        target.load_state_dict(_damaged(state, how))
    assert _ids(target) == before, "a refused load changed the contents"
    assert sched.decision is None and "phase=probe" in repr(sched), f"a refused load changed the scheduler: {sched!r}"
    target.load_state_dict(state)  # the undamaged checkpoint still loads
    assert sched.decision is not None
    target.close()


def test_an_on_policy_decision_travels_and_another_m_does_not_take_it() -> None:
    from conduit import OnPolicy

    def rollout(edp: ExperienceDataPlane, v: int) -> list[list[int]]:
        edp.set_policy_version(v)
        for part in range(4):
            edp.ingest(id_batch(np.arange(1000 * v + 16 * part, 1000 * v + 16 * part + 16)), version=v)
        edp.seal()
        out = []
        while True:
            b, info = edp.deliver()
            out.append(b["id"].tolist())
            if info.last:
                return out

    sched = Automatic(overlap=False, probe_rounds=1)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=OnPolicy(num_minibatches=4), scheduler=sched)
    v = 0
    while "phase=run" not in repr(sched):
        rollout(edp, v)
        v += 1
        assert v < 50, f"the on-policy probe did not finish: {sched!r}"
    state = edp.state_dict()
    original = [rollout(edp, v + k) for k in range(2)]
    edp.close()
    restored_sched = Automatic(overlap=False, probe_rounds=1)
    restored = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=OnPolicy(num_minibatches=4),
                                   scheduler=restored_sched)
    restored.load_state_dict(state)
    assert restored_sched.decision is not None and restored_sched.g_ing == sched.g_ing, repr(restored_sched)
    assert [rollout(restored, v + k) for k in range(2)] == original
    restored.close()
    other = Automatic(overlap=False, probe_rounds=1)
    two = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=OnPolicy(num_minibatches=2), scheduler=other)
    two.load_state_dict(state)
    assert other.decision is None, f"a decision for M=4 was applied to a buffer with M=2: {other!r}"
    two.close()


def test_a_calibrated_automatic_takes_the_checkpoints_decision_and_goes_on_as_the_original() -> None:
    edp, i = _calibrated()
    d = edp.scheduler.decision  # type: ignore[attr-defined]
    state = edp.state_dict()
    original = [_step(edp, i + k) for k in range(20)]
    edp.close()
    other, _ = _calibrated(probe_rounds=2)  # calibrated on its own measurements, then it loads the checkpoint
    other.load_state_dict(state)
    sched = other.scheduler
    assert sched.decision is not None and sched.g_ing == d.g_ing and sched.g_del == d.g_del, repr(sched)
    msg = _diverged(original, [_step(other, i + k) for k in range(20)])
    assert not msg, msg
    other.close()
