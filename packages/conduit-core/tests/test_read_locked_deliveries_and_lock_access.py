"""Deliveries inside ``read_locked`` and access to the lock: a delivery inside ``read_locked`` while another thread
delivers, the ingestion role reaching into the plane's private lock, and the default size of the ragged pools."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Ragged,
    Replay,
)
from conduit.testing.lifecycle import call_bounded
from conduit.testing.reference import ID_SCHEMA, id_batch

JOIN_S = 60.0


def _in_thread(fn: Callable[[], object]) -> object:
    """``fn()``'s result or exception (a hang fails, instead of hanging the suite)."""
    return call_bounded(fn, JOIN_S)


class _Observed(Overlapped):
    """The real scheduler, with events at two points of a delivery, to build interleavings without sleeping.

    ``pause_handover``: the next delivery stops just before it hands its batch out (it holds the delivery lock and
    needs the buffer's lock no more) until another thread's call starts to wait for the delivery lock. ``wants``:
    set when a delivery (holding the delivery lock) is about to take the buffer's lock.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pause_handover = False
        self.paused = threading.Event()
        self.entering = threading.Event()
        self.wants = threading.Event()

    def _handover(self, p: Any) -> None:
        if self.pause_handover:
            self.pause_handover = False
            self.paused.set()
            assert self.entering.wait(JOIN_S), "no other call came to wait for the delivery lock"
        super()._handover(p)

    def _enter(self, call: str) -> None:
        if not self._mu.acquire(blocking=False):
            self.entering.set()  # this call meets the delivery lock held (by the paused delivery)
        else:
            self._mu.release()
        super()._enter(call)

    @contextmanager
    def _wanting_buffer_lock(self) -> Iterator[None]:
        with super()._wanting_buffer_lock():
            self.wants.set()
            yield


def _pair(g_del: int, *, on_policy: bool = False,
          overlap: bool = True) -> tuple[ExperienceDataPlane, _Observed, ExperienceDataPlane]:
    """An ``Overlapped`` buffer and a synchronous twin with the same contents and seed (on-policy: one sealed
    rollout of 32 items, 4 minibatches x 2 epochs)."""
    sched = _Observed(g_del=g_del, overlap=overlap, background_ingest=False)

    def build(s: _Observed | None) -> ExperienceDataPlane:
        sem = OnPolicy(num_minibatches=4, num_epochs=2) if on_policy else Replay(seed=3)
        e = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=sem, scheduler=s)
        e.ingest(id_batch(np.arange(32)), version=0 if on_policy else None)
        if on_policy:
            e.seal()
        return e
    return build(sched), sched, build(None)


def _ids(batch_info: tuple[Any, Any]) -> list[int]:
    return [int(i) for i in batch_info[1].handles.tolist()]


# -- 1. a delivery inside read_locked() while another thread's delivery holds the delivery lock ------------------------
@pytest.mark.parametrize("on_policy", [False, True], ids=["replay", "on-policy"])
def test_a_delivery_inside_read_locked_waits_for_another_threads_delivery_that_no_longer_needs_the_lock(
        on_policy: bool) -> None:
    """Another thread's delivery holds the delivery lock but has its batch (it needs the buffer's lock no more): a
    delivery inside ``read_locked`` waits for it and goes on, whatever the timing; it was refused before.

    (Replay with ``g_del=2``: the second batch of the chunk the other delivery prepared is served without the
    prefetch job it started. On-policy with ``overlap=False``: with prefetch, an on-policy delivery first waits for
    the job the other delivery started, which cannot take the lock held here: that is refused as "prefetch worker".)
    """
    edp, sched, ref = _pair(g_del=1 if on_policy else 2, on_policy=on_policy, overlap=not on_policy)
    n = None if on_policy else 4
    sched.pause_handover = True
    other: list[object] = []
    b = threading.Thread(target=lambda: other.append(_ids(edp.deliver(n))), name="other-learner", daemon=True)
    b.start()
    assert sched.paused.wait(JOIN_S), "the other delivery did not reach its hand-over"

    def locked() -> list[int]:
        return _ids(edp.deliver(n))  # meets the delivery lock held by the paused delivery, which then goes on

    mine = _in_thread(lambda: edp.read_locked(locked))
    b.join(JOIN_S)
    assert not b.is_alive()
    assert not isinstance(mine, BaseException), f"the delivery inside read_locked was refused: {mine!r}"
    assert other == [_ids(ref.deliver(n))] and mine == _ids(ref.deliver(n)), "not the synchronous draws, in order"
    for _ in range(3):  # nothing skipped or drawn twice after it
        assert _ids(edp.deliver(n)) == _ids(ref.deliver(n))
    edp.close()


@pytest.mark.parametrize("on_policy", [False, True], ids=["replay", "on-policy"])
def test_a_delivery_inside_read_locked_is_refused_when_the_other_delivery_waits_for_the_lock(on_policy: bool) -> None:
    """Another thread's delivery holds the delivery lock and waits for the buffer's lock, which this thread holds in
    ``read_locked``: waiting would last forever, so the delivery here is refused (typed, saying what to do, nothing
    drawn) every time; the other delivery goes on once the lock is let go."""
    edp, sched, ref = _pair(g_del=1, on_policy=on_policy)
    n = None if on_policy else 4
    other: list[object] = []
    b = threading.Thread(target=lambda: other.append(_ids(edp.deliver(n))), name="other-learner", daemon=True)

    def locked() -> None:
        b.start()
        assert sched.wants.wait(JOIN_S), "the other delivery did not come to the buffer's lock"
        edp.deliver(n)

    err = _in_thread(lambda: edp.read_locked(locked))
    b.join(JOIN_S)
    assert not b.is_alive(), "the other delivery never finished"
    assert isinstance(err, ConfigurationError), err
    assert "delivery running on another thread" in str(err) and "after the locked function returns" in str(err)
    assert other == [_ids(ref.deliver(n))]
    for _ in range(3):  # the refused call drew nothing
        assert _ids(edp.deliver(n)) == _ids(ref.deliver(n))
    edp.close()


@pytest.mark.parametrize("call", ["retune", "release_buffers", "close"])
def test_scheduler_calls_inside_read_locked_are_refused_not_hung_behind_a_delivery_waiting_for_the_lock(
        call: str) -> None:
    """``retune`` and ``release_buffers`` (and ``close``'s stop of the prefetch, after its checkpoint step) took the
    delivery lock unconditionally: from inside ``read_locked`` while another delivery held it and waited for the
    buffer's lock, both threads waited forever. They are refused instead (nothing changed), and work once the lock is
    let go."""
    edp, sched, ref = _pair(g_del=1)
    b = threading.Thread(target=lambda: edp.deliver(4), name="other-learner", daemon=True)
    calls: dict[str, Callable[[], object]] = {"retune": lambda: sched.retune(g_del=3),
                                              "release_buffers": sched.release_buffers, "close": edp.close}

    def locked() -> None:
        b.start()
        assert sched.wants.wait(JOIN_S), "the other delivery did not come to the buffer's lock"
        calls[call]()

    err = _in_thread(lambda: edp.read_locked(locked))
    b.join(JOIN_S)
    assert not b.is_alive()
    assert isinstance(err, ConfigurationError) and "delivery running on another thread" in str(err), err
    assert not edp.closed and sched.g_del == 1, "a refused call changed something"
    ref.deliver(4)
    assert _ids(edp.deliver(4)) == _ids(ref.deliver(4))
    calls[call]()  # outside the lock it works
    edp.close()


def test_deliveries_inside_read_locked_on_the_same_thread_are_deterministic() -> None:
    """With no other delivery: deliveries inside ``read_locked`` are served, with the synchronous draws, also the one
    that needs the prefetch job started under this lock (which cannot take it): the job is cancelled and the batch
    drawn in the call (session 25; that delivery was refused before)."""
    edp, _, ref = _pair(g_del=2)

    def locked() -> list[list[int]]:
        return [_ids(edp.deliver(4)) for _ in range(3)]

    res = _in_thread(lambda: edp.read_locked(locked))
    assert res == [_ids(ref.deliver(4)) for _ in range(3)]
    for _ in range(4):
        assert _ids(edp.deliver(4)) == _ids(ref.deliver(4))
    edp.close()


# -- 2. the ingestion role takes the buffer's lock through the plane's public accessor --------------------------------
class _CountingLock:
    """The plane's own lock, counting the holds taken through it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.holds = inner, 0

    def __enter__(self) -> None:
        self.inner.acquire()
        self.holds += 1

    def __exit__(self, *exc: object) -> None:
        self.inner.release()


class _CountedPlane(ExperienceDataPlane):
    @property
    def lock(self) -> Any:
        counted = self.__dict__.get("_counted")
        if counted is None:
            counted = self.__dict__["_counted"] = _CountingLock(self._lock)
        return counted


@pytest.mark.parametrize("background", [False, True], ids=["caller-side", "worker"])
def test_ingestion_takes_the_buffer_lock_through_the_planes_accessor(background: bool) -> None:
    """``Ingestion`` read the plane's private ``_lock``; it takes ``edp.lock`` now (the same lock: ``read_locked``
    holds it, and everything is stored, in order)."""
    edp = _CountedPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1),
                        scheduler=Overlapped(g_ing=2, overlap=background, background_ingest=background))
    assert isinstance(edp.lock, _CountingLock)
    with edp.lock:
        assert edp.holds_lock(), "edp.lock is not the lock holds_lock() and read_locked() answer for"
    held = edp.lock.holds
    for i in range(3):
        edp.ingest(id_batch(np.arange(4 * i, 4 * i + 4)))
    edp.flush()
    if not background:  # (the worker thread stores through ingest_now alone)
        assert edp.lock.holds > held, "caller-side storing did not take the buffer's lock through edp.lock"
    assert edp.state_dict()["storage"]["data"]["id"].tolist() == list(range(12))
    edp.close()


def test_the_plain_planes_lock_accessor_is_the_lock_read_locked_holds() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=8)
    assert edp.read_locked(edp.holds_lock) and not edp.holds_lock()
    with edp.lock:
        assert edp.holds_lock() and edp.read_locked(lambda: len(edp)) == 0
    edp.close()
    with edp.lock:  # (usable after close: a scheduler stores what was handed over before it)
        assert edp.holds_lock()


# -- 3. the ragged pools' default size -------------------------------------------------------------------------------
RAGGED = ExperienceSchema(tok=Field((), torch.int64, ragged=True), r=Field((), torch.float32))


def _seqs(lengths: list[int]) -> dict[str, Any]:
    return {"tok": [torch.arange(n) for n in lengths], "r": torch.zeros(len(lengths))}


@pytest.mark.parametrize("ragged_capacity", [None, 100], ids=["default", "given"])
def test_a_batch_larger_than_a_ragged_pool_says_what_sizes_the_pool_and_what_to_set(
        ragged_capacity: int | None) -> None:
    """Neither the schema nor a planned placement carries a mean sequence length, so the plane's pools default to 64
    elements per item of capacity; a batch that does not fit says so (only when it is the default) and names the
    parameter to set, and changes nothing."""
    edp = ExperienceDataPlane(RAGGED, capacity=4, ragged_capacity=ragged_capacity)
    pool = 64 * 4 if ragged_capacity is None else ragged_capacity
    assert getattr(edp.storage, "ragged_capacity", None) == pool
    edp.ingest(_seqs([3]))
    with pytest.raises(CapacityError) as err:
        edp.ingest(_seqs([pool, 1]))
    msg = str(err.value)
    assert f"{pool} elements" in msg and "ragged_capacity=" in msg and "mean_ragged_length" in msg, msg
    assert ("the default: 64 per item of capacity" in msg) == (ragged_capacity is None), msg
    tok = edp.deliver(1)[0]["tok"]
    assert isinstance(tok, Ragged) and tok.values.tolist() == [0, 1, 2] and len(edp) == 1, "the buffer changed"
    edp.close()
