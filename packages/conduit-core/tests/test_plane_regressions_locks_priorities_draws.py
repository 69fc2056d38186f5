"""Data-plane regressions: caller-side ingestion inside ``read_locked`` racing another
producer, priority updates naming never-issued handles, ``beta`` on a uniform buffer, and what ``Overlapped``
draws against ``Synchronous``."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    ConfigurationError,
    ExperienceDataPlane,
    Overlapped,
    PrioritizedSampler,
    PriorityError,
    Replay,
    Synchronous,
)
from conduit.scheduling.base import Scheduler
from conduit.testing.lifecycle import thread_frame, wait_until
from conduit.testing.reference import ID_SCHEMA, id_batch


def _innermost(thread: threading.Thread) -> str:
    frame = thread_frame(thread)
    return "" if frame is None else frame.f_code.co_name


def _ids(edp: ExperienceDataPlane) -> list[int]:
    return [int(i) for i in edp.storage.state_dict()["data"]["id"].tolist()] if len(edp) else []


# -- 1. caller-side ingestion inside read_locked() against another producer --------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_ingest_inside_read_locked_does_not_deadlock_against_a_producer_waiting_to_store(overlap: bool) -> None:
    """A producer (``background_ingest=False``) that handed its batch over waits to store it while this thread
    holds the buffer's lock in ``read_locked``; this thread's ``ingest`` then stores both, in queue order."""
    sched = Overlapped(g_ing=1, overlap=overlap, background_ingest=False)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=sched)
    producer = threading.Thread(target=lambda: edp.ingest(id_batch(np.arange(0, 4))), name="producer", daemon=True)
    seen: list[int] = []

    def locked() -> None:
        producer.start()
        wait_until(lambda: sched.pending() and _innermost(producer) in ("ingest_now", "_store_ready"),
                   "the producer handed its batch over and waits for the buffer's lock to store it", timeout=30)
        edp.ingest(id_batch(np.arange(4, 8)))
        seen.extend(_ids(edp))

    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            edp.read_locked(locked)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            errors.append(e)
        done.set()

    threading.Thread(target=run, name="locked-reader", daemon=True).start()
    assert done.wait(60), "ingest() inside read_locked() deadlocked against a producer waiting to store"
    producer.join(60)
    assert not producer.is_alive(), "the other producer never stored"
    assert errors == [], errors
    assert seen == list(range(8)), f"inside the locked function the buffer held {seen}, expected both batches in order"
    assert _ids(edp) == list(range(8)) and sched.pending() == []
    edp.close()


def test_a_flush_from_a_callback_inside_a_caller_side_write_is_refused_and_an_ingest_there_is_stored_next() -> None:
    """Re-entering caller-side storing from a callback inside one of its own writes never hangs: an ``ingest`` there
    is queued and stored right after that write, in order; a ``flush`` there (which could not return with the write
    in progress) is refused."""

    class Nested(Replay):
        def __init__(self) -> None:
            super().__init__(seed=2)
            self.edp: ExperienceDataPlane | None = None
            self.refused: list[BaseException] = []

        def on_append(self, result: Any, *, version: int | None, priorities: torch.Tensor | None) -> None:
            super().on_append(result, version=version, priorities=priorities)
            if self.edp is not None and result.first == 0:
                edp, self.edp = self.edp, None
                edp.ingest(id_batch(np.arange(4, 6)))
                try:
                    edp.flush()
                except ConfigurationError as e:
                    self.refused.append(e)

    sem = Nested()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=sem,
                              scheduler=Overlapped(g_ing=1, overlap=False, background_ingest=False))
    sem.edp = edp
    done = threading.Event()

    def produce() -> None:
        edp.ingest(id_batch(np.arange(0, 4)))
        done.set()

    threading.Thread(target=produce, daemon=True).start()
    assert done.wait(60), "ingest() from a callback inside a caller-side write hung"
    assert len(sem.refused) == 1 and "flush()" in str(sem.refused[0]), sem.refused
    assert _ids(edp) == list(range(6)), f"stored {_ids(edp)}, expected the nested batch right after the first"
    edp.close()


def test_a_delivery_inside_read_locked_while_another_thread_delivers_is_refused_not_hung() -> None:
    """The same lock order on the delivery side: another thread's delivery holds the prefetching scheduler's lock and
    waits for the buffer's lock, which this thread holds in ``read_locked``; a delivery here is refused (typed,
    nothing drawn) instead of waiting for it forever."""
    def make() -> ExperienceDataPlane:
        e = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1),
                                scheduler=Overlapped(g_del=1, overlap=True, background_ingest=False))
        e.ingest(id_batch(np.arange(32)))
        e.deliver(4)
        return e

    edp, ref = make(), make()
    other = threading.Thread(target=lambda: edp.deliver(8), name="other-learner", daemon=True)  # a new key: peeks
    refused: list[BaseException] = []

    def locked() -> None:
        other.start()
        wait_until(lambda: _innermost(other) == "select_now", "the other delivery waits for the buffer's lock",
                   timeout=30)
        try:
            edp.deliver(4)
        except ConfigurationError as e:
            refused.append(e)

    done = threading.Event()

    def run() -> None:
        edp.read_locked(locked)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(60), "deliver() inside read_locked() hung behind another thread's delivery"
    other.join(60)
    assert not other.is_alive()
    assert len(refused) == 1 and "delivery running on another thread" in str(refused[0]), refused
    ref.deliver(8)
    got = [edp.deliver(4)[1].handles.tolist() for _ in range(3)]
    assert got == [ref.deliver(4)[1].handles.tolist() for _ in range(3)], "the refused delivery drew"
    edp.close()
    ref.close()


# -- 2. update_priorities with never-issued handles --------------------------------------------------------------------
def _prioritized(capacity: int = 8) -> ExperienceDataPlane:
    return ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=4))


@pytest.mark.parametrize("bad", [4, 5, 100, -1])
def test_update_priorities_refuses_never_issued_handles_and_changes_nothing(bad: int) -> None:
    edp, ref = _prioritized(), _prioritized()
    for e in (edp, ref):
        e.ingest(id_batch(np.arange(4)))  # handles 0..3 issued
    before = edp.state_dict()["semantics"]["sampler"]["leaves"].clone()
    with pytest.raises(PriorityError, match="never issued"):
        edp.update_priorities(torch.tensor([1, bad]), torch.tensor([5.0, 7.0]))
    after = edp.state_dict()["semantics"]["sampler"]["leaves"]
    assert torch.equal(after, before), "a refused update changed priorities"
    assert edp.deliver(16)[1].handles.tolist() == ref.deliver(16)[1].handles.tolist()
    # a new item gets the largest priority seen: the refused call must not have raised it
    for e in (edp, ref):
        e.ingest(id_batch(np.arange(4, 5)))
    assert torch.equal(edp.state_dict()["semantics"]["sampler"]["leaves"],
                       ref.state_dict()["semantics"]["sampler"]["leaves"])


def test_update_priorities_still_ignores_evicted_handles() -> None:
    edp = _prioritized(capacity=4)
    edp.ingest(id_batch(np.arange(4)))
    edp.ingest(id_batch(np.arange(4, 6)))  # handles 0, 1 evicted; 2..5 live
    assert edp.update_priorities(torch.tensor([0, 1, 5]), torch.tensor([9.0, 9.0, 3.0])) == 1
    leaves = edp.state_dict()["semantics"]["sampler"]["leaves"]
    assert leaves[5 % 4] == 3.0 and leaves[0] == 1.0, f"an evicted handle's update reached a live slot: {leaves}"


# -- 3. beta on a uniform buffer ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", [Synchronous, lambda: Overlapped(g_del=2)])
def test_beta_on_a_uniform_buffer_is_refused_before_anything_is_drawn(scheduler: Any) -> None:
    def make() -> ExperienceDataPlane:
        s: Scheduler = scheduler()
        e = ExperienceDataPlane(ID_SCHEMA, capacity=32, semantics=Replay(seed=6), scheduler=s)
        e.ingest(id_batch(np.arange(32)))
        e.flush()
        return e

    edp, ref = make(), make()
    got = [edp.deliver(4)[1].handles.tolist()]
    want = [ref.deliver(4)[1].handles.tolist()]
    with pytest.raises(ConfigurationError, match="beta applies only to prioritized replay"):
        edp.deliver(4, beta=0.4)
    got += [edp.deliver(4)[1].handles.tolist() for _ in range(3)]
    want += [ref.deliver(4)[1].handles.tolist() for _ in range(3)]
    assert got == want, "the refused call drew, or dropped prepared draws"
    assert edp.deliver(4, beta=None)[1].handles.shape == (4,)  # the default stays accepted
    edp.close()
    ref.close()


# -- 4. Overlapped's draws against Synchronous's -----------------------------------------------------------------------
def _draws(scheduler: Scheduler, steps: str, *, prioritized: bool = False,
           update: bool = True) -> list[tuple[list[int], list[float]]]:
    """Run ``steps`` ('i': ingest 3 items, 'f': flush, 'd': deliver 4 and, prioritized, update their priorities
    unless not ``update``); the handles and importance weights delivered."""
    sem = Replay(PrioritizedSampler(alpha=0.7), seed=5) if prioritized else Replay(seed=5)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=32, semantics=sem, scheduler=scheduler)
    out, k = [], 0
    for step in steps:
        if step == "i":
            edp.ingest(id_batch(np.arange(3 * k, 3 * k + 3)))
            k += 1
        elif step == "f":
            edp.flush()
        else:
            _, info = edp.deliver(4, beta=0.5) if prioritized else edp.deliver(4)
            out.append((info.handles.tolist(), [] if info.weights is None else info.weights.tolist()))
            if prioritized and update:
                edp.update_priorities(info.handles, (info.handles % 5 + 1).double())
    edp.close()
    return out


INTERLEAVED = "id" * 10


@pytest.mark.parametrize("prioritized", [False, True])
def test_sequential_overlapped_at_granularity_one_draws_what_synchronous_draws(prioritized: bool) -> None:
    sync = _draws(Synchronous(), INTERLEAVED, prioritized=prioritized)
    assert _draws(Overlapped(overlap=False), INTERLEAVED, prioritized=prioritized) == sync


def test_sequential_overlapped_draws_a_chunk_at_its_first_delivery() -> None:
    """g_del = 2: a chunk's two batches are drawn at its first delivery call, so the ingest between them reaches the
    draws from the next chunk on: the draws of a synchronous buffer that delivers them back to back, then ingests.
    Deterministic: the same seed and calls give the same draws."""
    seq = _draws(Overlapped(overlap=False, g_del=2), INTERLEAVED)
    assert seq == _draws(Overlapped(overlap=False, g_del=2), INTERLEAVED)
    moved = "i" + "ddii" * 4 + "ddi"  # each chunk's second delivery moved before the ingest that preceded it
    assert seq == _draws(Synchronous(), moved)
    assert seq != _draws(Synchronous(), INTERLEAVED), "the chunk saw an ingest made after it was drawn"


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("g_del", [1, 3])
def test_overlapped_draws_what_synchronous_draws_with_nothing_ingested_between_deliveries(
        g_del: int, prioritized: bool) -> None:
    steps = "iiiiif" + "d" * 12
    got = _draws(Overlapped(g_del=g_del), steps, prioritized=prioritized, update=False)
    want = _draws(Synchronous(), steps, prioritized=prioritized, update=False)
    assert [h for h, _ in got] == [h for h, _ in want]
    for (_, w_got), (_, w_want) in zip(got, want, strict=True):
        np.testing.assert_allclose(w_got, w_want, rtol=1e-6)
