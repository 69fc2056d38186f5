"""Core data-plane regressions, as a demanding user: checkpoint exactness, schedulers, delivery buffers."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    CapacityError,
    ConfigurationError,
    DiskPlacement,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    ShardedPlacement,
)
from conduit.testing.lifecycle import call_bounded

SCALAR = ExperienceSchema(r=Field((), torch.float32))
#: bound on a join that must not hang (a deadlock guard, not a timing)
JOIN_S = 60.0

RAGGED = ExperienceSchema(tok=Field((), torch.int64, ragged=True), r=Field((), torch.float32))


def _rollout(i: int, lens: list[int]) -> dict[str, object]:
    return {"tok": [torch.arange(n) + 100 * i for n in lens], "r": torch.full((len(lens),), float(i))}


# -- checkpoints of ragged pools -------------------------------------------------------------------
def _host(**kw: Any) -> ExperienceDataPlane:
    return ExperienceDataPlane(RAGGED, capacity=8, ragged_capacity=20, **kw)


def _sharded(**kw: Any) -> ExperienceDataPlane:
    return ExperienceDataPlane(RAGGED, capacity=8, ragged_capacity=20, placement=ShardedPlacement(["cpu", "cpu"]),
                               **kw)


def _disk(**kw: Any) -> ExperienceDataPlane:
    return ExperienceDataPlane(RAGGED, capacity=8, ragged_capacity=20, placement=DiskPlacement(), **kw)


@pytest.mark.parametrize("make", [_host, _sharded, _disk], ids=["host", "sharded", "disk"])
def test_a_restored_ragged_pool_evicts_what_the_saved_one_evicts(make: Callable[..., ExperienceDataPlane]) -> None:
    """Which items a ragged append evicts depends on where the pool's live elements lie. A restore that packed them
    from the pool's start kept items the saved buffer evicts: the contents, and every draw after, parted ways."""
    saved = make()
    for i in range(3):  # 7 elements each in a pool of 20: the third wraps and evicts the first rollout
        saved.ingest(_rollout(i, [3, 4]))
    restored = make()
    restored.load_state_dict(saved.state_dict())
    for edp in (saved, restored):
        edp.ingest(_rollout(3, [3, 3]))  # lands on the second rollout's elements in the saved pool
    assert (len(restored), restored.storage.oldest) == (len(saved), saved.storage.oldest) == (4, 4)
    for _ in range(3):
        a, _ = saved.deliver(4)
        b, _ = restored.deliver(4)
        assert torch.equal(a.tensor("r"), b.tensor("r"))
        ra, rb = a["tok"], b["tok"]
        assert not isinstance(ra, torch.Tensor) and not isinstance(rb, torch.Tensor)
        assert torch.equal(ra.values, rb.values) and torch.equal(ra.lengths, rb.lengths)
    again = make()
    again.load_state_dict(restored.state_dict())  # a restored buffer's checkpoint restores the same layout
    for edp in (saved, again):
        edp.ingest(_rollout(4, [6, 6]))
    assert len(again) == len(saved) and torch.equal(again.deliver(4)[0].tensor("r"), saved.deliver(4)[0].tensor("r"))


def test_a_damaged_ragged_layout_is_refused_and_changes_nothing() -> None:
    saved = _host()
    for i in range(3):
        saved.ingest(_rollout(i, [3, 4]))
    state = saved.state_dict()
    layout = state["storage"]["ragged_layout"]
    starts = layout["starts"]["tok"]
    layout["starts"]["tok"] = torch.full_like(starts, int(starts[0]))  # items on top of each other
    edp = _host()
    edp.ingest(_rollout(9, [2]))
    with pytest.raises(ConfigurationError, match="ragged_layout"):
        edp.load_state_dict(state)
    assert len(edp) == 1 and edp.deliver(1)[0].tensor("r").item() == 9.0
    layout["starts"]["tok"] = starts
    layout["heads"]["tok"] = 21  # past the pool
    with pytest.raises(ConfigurationError, match="ragged_layout"):
        edp.load_state_dict(state)
    layout["heads"]["tok"] = int(saved.storage.ragged_layout()["heads"]["tok"])  # type: ignore[index]
    edp.load_state_dict(state)
    assert len(edp) == len(saved)


def test_a_ragged_checkpoint_loads_packed_into_a_pool_of_another_size() -> None:
    """The layout fits only a pool of the saved size; a buffer built with another ragged_capacity packs the items."""
    saved = _host()
    for i in range(3):
        saved.ingest(_rollout(i, [3, 4]))
    bigger = ExperienceDataPlane(RAGGED, capacity=8, ragged_capacity=64)
    bigger.load_state_dict(saved.state_dict())
    assert len(bigger) == 4
    got = bigger.state_dict()["storage"]["data"]
    want = saved.state_dict()["storage"]["data"]
    assert torch.equal(got["r"], want["r"])
    assert all(torch.equal(x, y) for x, y in zip(got["tok"], want["tok"], strict=True))


# -- on-policy version order under concurrent producers ---------------------------------------------
class _SignalsCheck(OnPolicy):
    """OnPolicy that tells when an ingestion of ``version`` passed its (caller-side) checks."""

    def __init__(self, version: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.watch, self.passed = version, threading.Event()

    def check_ingest(self, n: int, *, version: int | None, priorities: torch.Tensor | None) -> None:
        super().check_ingest(n, version=version, priorities=priorities)
        if version == self.watch:
            self.passed.set()


def test_an_older_version_checked_before_a_newer_one_was_stored_is_still_refused() -> None:
    """Two producers of a synchronous on-policy buffer: version 3 passes ingest()'s order check while nothing is
    stored, then version 5 is stored before 3's write. The write of 3 used to land after 5 (a rollout of 5 sealed,
    then one of 3 opened: versions went backwards); it must be refused, and nothing of it stored."""
    sem = _SignalsCheck(3, num_minibatches=1)
    edp = ExperienceDataPlane(SCALAR, capacity=16, semantics=sem)
    errors: list[BaseException] = []

    def old_producer() -> None:
        try:
            edp.ingest({"r": torch.full((2,), 3.0)}, version=3)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    older = threading.Thread(target=old_producer)

    def newer_stored_first() -> None:  # holds the buffer's lock: the old producer's write waits for it
        older.start()
        sem.passed.wait()
        edp.ingest({"r": torch.full((2,), 5.0)}, version=5)

    edp.read_locked(newer_stored_first)
    older.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigurationError), errors
    assert "backwards" in str(errors[0])
    assert len(edp) == 2 and sem.open_rollout == (5, 0) and sem.pending_rollouts == 0
    edp.seal()
    batch, info = edp.deliver()
    assert info.version == 5 and batch.tensor("r").tolist() == [5.0, 5.0]


# -- calls inside read_locked that would wait for a worker needing the lock --------------------------
def _in_thread(fn: Callable[[], object]) -> object:
    """``fn()``'s result or exception (a hang fails, instead of hanging the suite)."""
    return call_bounded(fn, JOIN_S,
                        hang="the call hung: it waited for a worker thread that needs the lock the caller holds")


@pytest.mark.parametrize("call", ["flush", "state_dict", "seal", "close", "ingest into a full queue"])
def test_a_call_inside_read_locked_that_would_wait_for_background_storing_is_refused(call: str) -> None:
    """read_locked says its function may call the buffer's methods. With background ingestion, a flush there (also
    seal, state_dict, close, or an ingest into a full queue) waited for the ingestion worker, which waits for the
    lock the caller holds: both waited forever. It is refused (typed, saying what to do) and changes nothing."""
    on_policy = call == "seal"
    sem = OnPolicy(num_minibatches=1) if on_policy else None
    edp = ExperienceDataPlane(SCALAR, capacity=64, semantics=sem,
                              scheduler=Overlapped(g_ing=1 if on_policy else 4, queue_depth=4, rollout_size=64))
    kw: dict[str, Any] = {"version": 0} if on_policy else {}
    accepted: list[int] = []

    def locked() -> None:
        edp.ingest({"r": torch.zeros(2)}, **kw)  # queued: the group of 4 is not complete (or the rollout is open)
        if call == "ingest into a full queue":
            for i in range(12):  # (the worker may take a group of 4 off the queue before it waits for the lock)
                edp.ingest({"r": torch.full((2,), float(i + 1))}, **kw)
                accepted.append(i + 1)
        else:
            getattr(edp, call)()

    err = _in_thread(lambda: edp.read_locked(locked))
    assert isinstance(err, ConfigurationError) and "read_locked" in str(err), err
    assert not edp.closed
    edp.flush()  # outside the lock: everything handed over is stored, nothing lost or doubled
    stored = edp.state_dict()["storage"]["data"]["r"].tolist()
    assert stored == [float(v) for v in [0, *accepted] for _ in range(2)]
    assert len(accepted) in ((3, 7) if call == "ingest into a full queue" else (0,))
    if on_policy:
        edp.seal()
        assert edp.deliver()[1].version == 0
    edp.close()
    assert edp.closed


@pytest.mark.parametrize("on_policy", [False, True], ids=["replay", "on-policy"])
def test_a_checkpoint_inside_read_locked_while_a_prefetch_waits_for_the_lock_is_refused(on_policy: bool) -> None:
    """A delivery inside read_locked starts the next batch's prefetch, which waits for the lock; a state_dict there
    waited for that job forever. Refused instead; once the lock is let go all goes on. (Another delivery there
    cancels the job, which has drawn nothing, and draws its batch in the call, as a synchronous one: session 25.)"""
    def build(scheduler: Overlapped | None) -> ExperienceDataPlane:
        sem = OnPolicy(num_minibatches=4, num_epochs=2) if on_policy else None
        edp = ExperienceDataPlane(SCALAR, capacity=64, semantics=sem, scheduler=scheduler)
        edp.ingest({"r": torch.arange(16.0)}, version=0 if on_policy else None)
        if on_policy:
            edp.seal()
        return edp

    edp = build(Overlapped(g_del=1, overlap=True, background_ingest=False))
    twin = build(None)
    n = None if on_policy else 4

    def locked() -> object:
        first = edp.deliver(n)[0].tensor("r").clone()
        with pytest.raises(ConfigurationError, match="prefetch worker"):
            edp.state_dict()
        return first, edp.deliver(n)[0].tensor("r").clone()

    res = _in_thread(lambda: edp.read_locked(locked))
    assert isinstance(res, tuple), res
    first, second = res
    assert torch.equal(first, twin.deliver(n)[0].tensor("r"))
    assert torch.equal(second, twin.deliver(n)[0].tensor("r"))
    state = _in_thread(edp.state_dict)  # outside: the prefetched draw is given back, as for any checkpoint
    assert isinstance(state, dict)
    for _ in range(5):  # the same batches as a synchronous buffer from here on
        assert torch.equal(edp.deliver(n)[0].tensor("r"), twin.deliver(n)[0].tensor("r"))
    edp.close()


# -- versions given as NumPy or tensor integers ------------------------------------------------------
@pytest.mark.parametrize("version", [np.int64(3), torch.tensor(3)], ids=["numpy", "tensor"])
@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "overlapped"])
def test_a_numpy_or_tensor_version_is_kept_as_an_int(version: Any, background: bool) -> None:
    """ingest(version=...) takes a NumPy or 0-d tensor integer. The rollout kept it as given, so the checkpoint held a
    NumPy scalar, which torch.load's default weights_only=True refuses (the README promises it carries the state),
    and deliveries reported the version as a tensor."""
    sched = Overlapped() if background else None
    edp = ExperienceDataPlane(SCALAR, capacity=16, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    edp.ingest({"r": torch.arange(4.0)}, version=version)
    edp.seal()
    edp.set_policy_version(np.int64(3))  # type: ignore[arg-type]  # (documented: a NumPy integer is fine)
    edp.ingest({"r": torch.arange(4.0)}, version=version)  # the open rollout's version, as given
    buf = io.BytesIO()
    torch.save(edp.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)  # weights_only=True by default
    restored = ExperienceDataPlane(SCALAR, capacity=16, semantics=OnPolicy(num_minibatches=2))
    restored.load_state_dict(state)
    for b in (edp, restored):
        _, info = b.deliver()
        assert type(info.version) is int and info.version == 3 and type(info.staleness) is int
    assert restored.semantics.open_rollout == (3, 4)  # type: ignore[attr-defined]
    edp.close()


# -- an on-policy ragged pool that is full says which setting to raise -----------------------------------
@pytest.mark.parametrize("make", [_host, _sharded], ids=["host", "sharded"])
def test_an_on_policy_write_refused_for_the_ragged_pool_names_ragged_capacity(
        make: Callable[..., ExperienceDataPlane]) -> None:
    """The slots had room (1 of 8 used) but the pool's elements did not: the error said "raise capacity", which does
    not help with an explicit ragged_capacity."""
    edp = make(semantics=OnPolicy(num_minibatches=1))
    edp.ingest({"tok": [torch.arange(12)], "r": torch.zeros(1)}, version=0)
    edp.seal()
    with pytest.raises(CapacityError, match="raise ragged_capacity"):
        edp.ingest({"tok": [torch.arange(10)], "r": torch.ones(1)}, version=1)
    assert len(edp) == 1
    with pytest.raises(CapacityError, match=r"raise capacity\."):  # the slots are what is short here
        edp.ingest({"tok": [torch.arange(1)] * 8, "r": torch.ones(8)}, version=1)
    edp.deliver()  # consumed: the pool's elements are free again
    edp.ingest({"tok": [torch.arange(10)], "r": torch.ones(1)}, version=1)
    assert len(edp) == 1


# -- a delivery refused during Automatic's probe --------------------------------------------------------
def test_a_delivery_refused_during_the_probe_leaves_the_probed_granularity() -> None:
    """A refused call leaves the buffer unchanged: during the probe, a delivery too large for the memory budget at
    the probed g_del lowered the scheduler's g_del before the semantics refused it, and the lowered value stayed
    for the rest of that probe step (timed under the probed value's plan)."""
    schema = ExperienceSchema(obs=Field((256,), torch.float32))  # 1 KiB items
    edp = ExperienceDataPlane(schema, capacity=4096, scheduler=Automatic(memory_budget=4 << 20))
    edp.ingest({"obs": torch.randn(4096, 256)})
    edp.deliver(32)  # the first probe step (g_del = 1) is over: the next one probes g_del = 2
    assert edp.scheduler.g_del == 2
    with pytest.raises(CapacityError):
        edp.deliver(5000, replace=False)  # 5 MiB batches fit the budget only at g_del = 1; refused: 4096 items
    assert edp.scheduler.g_del == 2
    batch, _ = edp.deliver(32)
    assert batch.batch_size == 32 and edp.scheduler.g_del == 2
    edp.close()
