"""Scheduling leftovers: close from the ingestion worker itself, counters of a reused scheduler, a failing
caller-side write racing another producer, and Automatic's on-policy ingestion probe."""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    ColumnarStorage,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    OnPolicy,
    Overlapped,
    Replay,
)
from conduit.placement import HostPlacement
from conduit.testing.lifecycle import wait_until
from conduit.testing.reference import ID_SCHEMA, id_batch


class _RecordingStorage(ColumnarStorage):
    """Host storage that waits for ``gate`` before each append, fails appends holding an id in ``fail_ids``
    (``fail_times`` of them, then succeeds) and records the ids it stored, in order."""

    gate: threading.Event
    fail_ids: set[int]
    fail_times = 0
    #: set when an append starts in a thread other than the one named ``quiet_thread``
    other_append: threading.Event
    quiet_thread = ""
    stored: list[int]

    def append(self, batch: Any, *, evict: bool = True) -> Any:
        if threading.current_thread().name != self.quiet_thread:
            self.other_append.set()
        assert self.gate.wait(10), "gate never opened"
        ids = batch["id"].tolist()
        if self.fail_times and self.fail_ids.intersection(ids):
            self.fail_times -= 1
            raise RuntimeError(f"injected append failure (ids {ids})")
        res = super().append(batch, evict=evict)
        self.stored.extend(ids)
        return res


class _RecordingPlacement(HostPlacement):
    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        s = _RecordingStorage(schema, capacity, "cpu")
        s.gate, s.fail_ids, s.stored, s.other_append = self.gate, set(), [], threading.Event()
        return s


def _storage(edp: ExperienceDataPlane) -> _RecordingStorage:
    assert isinstance(edp.storage, _RecordingStorage)
    return edp.storage


# -- 1. close() from a callback on the ingestion worker thread ---------------------------------------------------------
class _CloseOnFirstAppend(Replay):
    """Replay whose first ``on_append`` closes the buffer (as a loss callback run by a background write may)."""

    def __init__(self) -> None:
        super().__init__(seed=1)
        self.edp: ExperienceDataPlane | None = None
        self.close_errors: list[BaseException] = []
        self.closed_from: str = ""
        self.done = threading.Event()

    def on_append(self, result: Any, *, version: int | None, priorities: torch.Tensor | None) -> None:
        super().on_append(result, version=version, priorities=priorities)
        if self.edp is not None and not self.done.is_set():
            self.closed_from = threading.current_thread().name
            try:
                self.edp.close()
            except BaseException as e:  # noqa: BLE001 - recorded for the assertions
                self.close_errors.append(e)
            finally:
                self.done.set()


def _closing_buffer() -> tuple[ExperienceDataPlane, _CloseOnFirstAppend, _RecordingStorage]:
    sem = _CloseOnFirstAppend()
    placement = _RecordingPlacement()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=sem, placement=placement,
                              scheduler=Overlapped(g_ing=1, overlap=False, background_ingest=True))
    sem.edp = edp
    placement.gate.clear()  # the first write waits: every batch below is queued behind it
    for k in range(4):
        edp.ingest(id_batch(np.arange(4 * k, 4 * k + 4)))
    return edp, sem, _storage(edp)


def test_close_from_a_callback_on_the_ingestion_worker_stores_the_queue_and_stops() -> None:
    edp, sem, storage = _closing_buffer()
    storage.gate.set()
    assert sem.done.wait(10), "the callback never ran"
    assert sem.closed_from == "conduit-ingest", f"close() ran on {sem.closed_from!r}, not on the ingestion worker"
    assert sem.close_errors == [], f"close() on the ingestion worker raised {sem.close_errors!r}"
    assert edp.closed, "a close() that returned did not mark the buffer closed"
    with pytest.raises(ConfigurationError, match="closed"):
        edp.ingest(id_batch(np.arange(100, 104)))
    edp.close()  # from the main thread: waits for the worker, which stores the rest of the queue
    assert storage.stored == list(range(16)), f"stored {storage.stored}: a batch was lost, duplicated or reordered"
    assert edp.scheduler.pending() == [], "batches stayed unstored after close()"


def test_close_from_the_ingestion_worker_keeps_what_fails_in_pending_and_a_later_close_retries_it() -> None:
    edp, sem, storage = _closing_buffer()
    storage.fail_ids, storage.fail_times = {8}, 2  # the worker's write fails, and the first retry too
    storage.gate.set()
    assert sem.done.wait(10), "the callback never ran"
    assert sem.close_errors == [], f"close() on the ingestion worker raised {sem.close_errors!r}"
    worker = edp.scheduler._ingestion._thread
    assert worker is not None
    worker.join(10)
    assert not worker.is_alive(), "the ingestion worker did not stop after its write failed"
    left = [int(i) for h in edp.scheduler.pending() for i in h.batch["id"].tolist()]
    assert left == list(range(8, 16)), f"pending() holds {left} after the failed write, expected ids 8..15"
    with pytest.raises(RuntimeError, match="injected append failure"):
        edp.close()  # the worker stopped at the failure; this close retries it and fails once more
    left = [int(i) for h in edp.scheduler.pending() for i in h.batch["id"].tolist()]
    assert left == list(range(8, 16)), f"pending() holds {left} after a failed close, expected ids 8..15"
    assert storage.stored == list(range(8)), f"stored {storage.stored} before the retry"
    edp.close()  # the write succeeds now
    assert storage.stored == list(range(16)), f"stored {storage.stored}: a batch was lost, duplicated or reordered"
    assert edp.scheduler.pending() == []


def test_close_from_the_ingestion_worker_while_a_delivery_waits_for_the_buffer_lock_does_not_hang() -> None:
    sem = _CloseOnFirstAppend()
    placement = _RecordingPlacement()
    sched = Overlapped(g_ing=1, g_del=2, overlap=True)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=sem, placement=placement, scheduler=sched)
    edp.ingest(id_batch(np.arange(0, 16)))
    edp.flush()
    edp.deliver(4)  # a prefetch job starts: the close below meets the prefetch machinery
    sem.edp = edp  # the next write closes the buffer from its callback, under the buffer's lock
    placement.gate.clear()
    edp.ingest(id_batch(np.arange(16, 20)))  # the worker holds the buffer's lock, waiting at the gate
    wait_until(lambda: sched._ingestion._inflight, "the worker took the batch")
    got: list[Any] = []

    refused: list[ConfigurationError] = []

    def learner() -> None:
        for _ in range(6):  # takes the prepared batches, then waits (for the job or in the call) for the lock
            try:
                got.append(edp.deliver(4))
            except ConfigurationError as e:  # the buffer was closed meanwhile: it takes no more deliveries
                refused.append(e)
                return
    t = threading.Thread(target=learner, daemon=True)
    t.start()

    def delivery_waits() -> bool:  # the learner holds the scheduler's delivery lock, waiting for the buffer's
        if sched._mu.acquire(blocking=False):
            sched._mu.release()
            return False
        return True
    wait_until(delivery_waits, "the learner waits inside a delivery")
    placement.gate.set()
    assert sem.done.wait(10), "close() from the ingestion worker hung (a delivery waits for the buffer's lock)"
    assert sem.close_errors == [], f"close() on the ingestion worker raised {sem.close_errors!r}"
    t.join(10)
    assert not t.is_alive(), "the delivery hung after the close"
    assert len(got) == 6 or (refused and "closed" in str(refused[0])), (len(got), refused)
    edp.close()
    assert _storage(edp).stored == list(range(20))


# -- 2. a scheduler serving a new buffer starts its counters afresh ----------------------------------------------------
def test_prefetch_counters_start_afresh_when_the_scheduler_serves_a_new_buffer() -> None:
    sched = Overlapped(g_del=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1), scheduler=sched)
    edp.ingest(id_batch(np.arange(50)))
    edp.flush()
    for _ in range(4):
        edp.deliver(8)
    edp.deliver(4)  # another batch size: the batches prepared for 8 are discarded
    assert sched.prefetch_hits and sched.prefetch_misses and sched.discarded, "the first buffer counted nothing"
    edp.close()
    edp2 = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1), scheduler=sched)
    counts = (sched.prefetch_hits, sched.prefetch_misses, sched.discarded)
    assert counts == (0, 0, 0), f"(hits, misses, discarded) carried over from the closed buffer: {counts}"
    edp2.close()


# -- 3. caller-side ingestion: a failing write and a producer waiting to store -----------------------------------------
def test_a_failed_caller_side_write_is_not_stored_by_a_producer_waiting_to_store() -> None:
    placement = _RecordingPlacement()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1), placement=placement,
                              scheduler=Overlapped(g_ing=1, overlap=False, background_ingest=False))
    storage = _storage(edp)
    storage.fail_ids, storage.fail_times = {0}, 1
    storage.quiet_thread = "failing-producer"
    ing = edp.scheduler._ingestion
    failed = threading.Event()
    real_append = storage.append

    def append(batch: Any, *, evict: bool = True) -> Any:
        try:
            return real_append(batch, evict=evict)
        except RuntimeError:
            failed.set()
            raise
    storage.append = append  # type: ignore[method-assign]
    pause_done = threading.Event()

    def pause_after_the_writer_lock(frame: Any, event: str, arg: Any) -> None:
        # once the failing write has released the writer lock, let the waiting producer store first: the
        # interleaving that happens whenever the failing thread is preempted at that point
        if failed.is_set() and not pause_done.is_set() and not ing._writer.locked():
            pause_done.set()
            storage.other_append.wait(5)

    errors: list[BaseException] = []

    def failing_producer() -> None:
        sys.setprofile(pause_after_the_writer_lock)
        try:
            edp.ingest(id_batch(np.arange(0, 4)))
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            errors.append(e)
        finally:
            sys.setprofile(None)

    placement.gate.clear()
    a = threading.Thread(target=failing_producer, name="failing-producer", daemon=True)
    a.start()
    wait_until(lambda: ing._inflight, "the failing producer's write started")
    c = threading.Thread(target=lambda: edp.ingest(id_batch(np.arange(4, 8))), name="waiting-producer", daemon=True)
    c.start()
    wait_until(lambda: len(ing._pending) == 1, "the second producer queued its batch and waits to store it")
    placement.gate.set()
    a.join(10)
    c.join(10)
    assert not a.is_alive() and not c.is_alive(), "a producer hung"
    assert len(errors) == 1 and "injected" in str(errors[0]), f"the failing ingest raised {errors!r}"
    assert storage.stored == [4, 5, 6, 7], (f"stored {storage.stored}: the batch whose ingest raised was stored "
                                            f"anyway (by the other producer)")
    assert edp.scheduler.pending() == []
    edp.close()


# -- 4. Automatic, on-policy: only a rollout's end advances the ingestion probe ----------------------------------------
def test_automatic_on_policy_probe_advances_once_per_sealed_rollout_not_per_flush() -> None:
    sched = Automatic(probe_rounds=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1000, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    plan = [0.5, 1.0, 0.5, 1.0]
    assert sched.g_ing == plan[0]
    used: list[float] = []
    start = 0
    for r in range(3):
        used.append(sched.g_ing if r == 0 else -1.0)
        edp.ingest(id_batch(np.arange(start, start + 8)), version=0)
        if r:
            used[-1] = sched.g_ing  # the value this rollout's writes use, set before its first hand-over
        edp.flush()  # a user flush inside the rollout
        edp.state_dict()  # a checkpoint inside the rollout (flushes)
        assert sched.g_ing == used[-1], f"rollout {r}: a flush inside the rollout moved g_ing to {sched.g_ing}"
        edp.ingest(id_batch(np.arange(start + 8, start + 16)), version=0)
        edp.seal()
        edp.state_dict()  # a checkpoint after the seal (flushes; ends no rollout)
        edp.flush()
        start += 16
    assert used == plan[:3], f"rollouts were ingested at g_ing {used}, expected one probe value each: {plan[:3]}"
    edp.close()
