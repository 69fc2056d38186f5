"""``Overlapped`` calls interrupted (Ctrl-C's ``KeyboardInterrupt``), refused or failing part way.

Each case was a known defect:

* a delivery interrupted while it waited for the prefetch job forgot the job: the batches the job drew were
  dropped once it ended, so a sampler that hands every item out once (a queue) skipped them for good, and the
  chunk buffer they were gathered into stayed marked busy;
* a ``deliver`` or ``ingest`` call that raised (e.g. refused after waiting for a flush, or for room in a full
  queue) was not recorded: the loop's wait was not exposed time, and the background work it waited for was
  counted as hidden;
* an on-policy delivery whose read failed kept its chunk buffer marked busy for good.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conduit import Automatic, CapacityError, EmptyBufferError, ExperienceDataPlane, OnPolicy, Overlapped, Replay
from conduit.errors import ConfigurationError
from conduit.exposure import ExposureLog
from conduit.semantics import Selection
from conduit.testing.lifecycle import HANG_S, eventually

sys.path.insert(0, str(Path(__file__).parent))
from test_prefetch_retry_and_cli_interrupts import (  # noqa: E402, I001
    SCHEMA, _gate_ingestion, _Queue, _queue_plane, _rows, _values)


class _GatedQueue(_Queue):
    """:class:`_Queue` whose draws on the prefetch worker wait for ``gate`` (set: they go on at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        if threading.current_thread().name == "conduit-prefetch":
            assert self.gate.wait(HANG_S), "the test never let the prefetch draw"
        return super().sample(n, replace=replace, beta=beta)


@pytest.fixture
def interrupt_main() -> Iterator[Any]:
    """A function that raises ``KeyboardInterrupt`` in the main thread (this test's), as Ctrl-C does: a signal
    whose handler raises it, so that it also interrupts the main thread's wait for a lock. (SIGUSR1, not SIGINT:
    a test runner started in the background ignores SIGINT.)"""
    assert threading.current_thread() is threading.main_thread(), "signals are handled on the main thread only"

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, raise_interrupt)
    main = threading.main_thread().ident
    assert main is not None
    try:
        yield lambda: signal.pthread_kill(main, signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _gated_prefetch() -> tuple[ExperienceDataPlane, Overlapped, _GatedQueue]:
    """A buffer of rows 0..7 whose first delivery ([0, 1]) is made and whose prefetch job waits at the gate."""
    sampler = _GatedQueue()
    sched = Overlapped(g_ing=1, g_del=1)
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=Replay(sampler), scheduler=sched)
    try:
        edp.ingest(_rows(0, 8))
        edp.flush()
        sampler.gate.clear()
        assert _values(edp.deliver(2)[0]) == [0, 1]
        assert sched._job is not None, "no prefetch after the first delivery"
    except BaseException:
        sampler.gate.set()
        edp.close()
        raise
    return edp, sched, sampler


def test_a_delivery_interrupted_while_it_waits_for_the_prefetch_keeps_the_prefetched_batch(
        interrupt_main: Any) -> None:
    edp, sched, sampler = _gated_prefetch()
    try:
        job = sched._job
        assert job is not None

        def kick() -> None:  # once the next delivery waits for the job (it is stuck in the gated draw)
            if eventually(lambda: sched._awaited is job, timeout=HANG_S):
                interrupt_main()

        kicker = threading.Thread(target=kick, daemon=True)
        kicker.start()
        with pytest.raises(KeyboardInterrupt):
            edp.deliver(2)
        kicker.join(HANG_S)
        sampler.gate.set()
        assert eventually(job.done, timeout=HANG_S)
        got = [_values(edp.deliver(2)[0]) for _ in range(3)]
        assert got == [[2, 3], [4, 5], [6, 7]], f"the prefetched batch [2, 3] was lost: {got}"
        assert sampler.drawn == 4
        assert eventually(lambda: sched._job is None or sched._job.done(), timeout=HANG_S)
        sched._await_job()  # (the prefetch after the last delivery, which found nothing)
        assert not any(s.busy for s in sched._ring.slots), "a chunk buffer stayed marked busy"
    finally:
        sampler.gate.set()
        edp.close()


def test_a_close_interrupted_while_it_stops_the_prefetch_is_finished_by_the_next_close(interrupt_main: Any) -> None:
    """``close`` marked the scheduler closed before it stopped the prefetch worker: interrupted while it waited for
    the job in flight, a later ``close`` (here the buffer's) returned at once, leaving the worker thread running for
    good."""
    edp, sched, sampler = _gated_prefetch()
    try:
        job, pool = sched._job, sched._pool
        assert job is not None and pool is not None

        def kick() -> None:  # once close() waits for the job (stuck in the gated draw)
            if eventually(lambda: sched._closed and sched._awaited is job, timeout=HANG_S):
                interrupt_main()

        kicker = threading.Thread(target=kick, daemon=True)
        kicker.start()
        with pytest.raises(KeyboardInterrupt):
            sched.close()  # (as Automatic closes its candidates; a buffer's close drops the prepared draws first)
        kicker.join(HANG_S)
        sampler.gate.set()
        assert eventually(job.done, timeout=HANG_S)
        assert pool._thread.is_alive()  # (the interrupted close did not stop it)
        edp.close()
        assert not pool._thread.is_alive(), "the second close() left the prefetch worker running"
        assert sched.prepared == 0 and not sched._ring.slots, "the second close() kept the prepared batches"
    finally:
        sampler.gate.set()
        edp.close()


# -- a call that raised is still the caller's time on the experience path ----------------------------------------


def test_a_delivery_that_raised_after_waiting_for_background_ingestion_counts_as_exposed() -> None:
    """The delivery flushes (nothing stored yet), so the loop waits for the ingestion worker's write, then is refused
    (no sealed rollout): that write coincided with the loop waiting for it, so it is not hidden, and the call's time
    is exposed."""
    sched = Overlapped(g_ing=1, g_del=1)
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    gate = threading.Event()
    ingestion = sched._ingestion
    store = ingestion._store

    def gated(group: Any) -> None:  # the worker's write waits until the delivery waits for it
        assert gate.wait(HANG_S), "the test never opened the ingestion gate"
        store(group)

    ingestion._store = gated  # type: ignore[method-assign]
    log = ExposureLog(edp.telemetry)
    try:
        with log.iteration():
            edp.ingest(_rows(0, 4), version=0)
            opener = threading.Thread(target=lambda: eventually(lambda: ingestion._force > 0, HANG_S) and gate.set(),
                                      daemon=True)
            opener.start()
            t0 = time.perf_counter()
            with pytest.raises(EmptyBufferError):
                edp.deliver()  # (nothing sealed)
            t1 = time.perf_counter()
            opener.join(HANG_S)
        waits = [r for r in edp.telemetry.records if r.kind == "deliver_wait"]
        assert len(waits) == 1 and t0 <= waits[0].start <= waits[0].end <= t1 and waits[0].items == 0, \
            f"the refused delivery's call was not recorded: {waits}"
        (write,) = [r for r in edp.telemetry.records if r.kind == "ingest"]
        it = log.iterations[-1]
        assert it.hidden_s == 0.0, f"the write the loop waited for was counted as hidden: {it}"
        assert it.exposed_s >= write.end - write.start
        assert it.total_s == it.exposed_s + it.hidden_s
    finally:
        gate.set()
        edp.close()


def test_an_ingest_refused_after_waiting_for_room_counts_as_exposed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer blocked on a full queue until the buffer closed: its call is recorded, with no items."""
    edp, sched, _ = _queue_plane(queue_depth=1)
    gate = _gate_ingestion(sched, monkeypatch)
    ingestion = sched._ingestion
    try:
        edp.ingest(_rows(0, 2))  # taken by the worker, which waits at the gate
        assert eventually(lambda: ingestion._inflight != [], timeout=HANG_S)
        edp.ingest(_rows(2, 4))  # fills the queue
        refused: list[BaseException] = []

        def produce() -> None:
            try:
                edp.ingest(_rows(4, 6))  # waits for room
            except ConfigurationError as e:
                refused.append(e)

        waiting = threading.Event()
        refuse_wait = ingestion.refuse_wait

        def waits_for_room(call: str) -> None:  # called under the queue's lock just before the producer waits in it
            refuse_wait(call)
            waiting.set()

        monkeypatch.setattr(ingestion, "refuse_wait", waits_for_room)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        # (the queue is full already: only the producer's own call says it is about to wait; close() takes the lock
        # it waits in, so it cannot refuse the call before the call is recorded)
        assert waiting.wait(HANG_S), "the producer did not wait for room in the full queue"
        closer = threading.Thread(target=edp.close, daemon=True)
        closer.start()
        assert eventually(lambda: ingestion._closing, timeout=HANG_S)
        gate.set()
        producer.join(HANG_S)
        closer.join(HANG_S)
        assert refused, "the producer waiting for room was not refused by close()"
        assert edp.storage.next_handle == 4
        waits = [r for r in edp.telemetry.records if r.kind == "ingest_wait"]
        assert sorted(r.items for r in waits) == [0, 2, 2], f"the refused hand-over was not recorded: {waits}"
    finally:
        gate.set()
        edp.close()


def test_refused_deliveries_recorded_with_no_items_do_not_size_the_automatic_model() -> None:
    """The automatic scheduler sizes a delivered batch from the deliveries' records: the refused ones (recorded
    with no items, see above) are left out, however many there are."""
    sched = Automatic(overlap=False, probe_rounds=3, g_ing_max=1, g_del_max=1, memory_budget=None)
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=Replay(), scheduler=sched)
    try:
        edp.ingest(_rows(0, 50))
        while sched.decision is None:
            for _ in range(3):  # more refused calls than delivered ones
                with pytest.raises(CapacityError):
                    edp.deliver(100, replace=False)
            edp.deliver(8)
        assert sched.decision.batch_bytes == 8 * 4, sched.decision  # 8 items of one float32
    finally:
        edp.close()


# -- a failed read gives its chunk buffer back --------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_on_policy_deliveries_whose_read_failed_leave_no_chunk_buffer_busy(overlap: bool) -> None:
    """Each on-policy delivery that gathers in its call (a miss) takes a chunk buffer; one whose read failed kept
    it marked busy for good, so every failed read added a buffer (and its memory) to the ring."""
    sched = Overlapped(g_ing=1, g_del=1, overlap=overlap)
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=OnPolicy(num_minibatches=4, num_epochs=50),
                              scheduler=sched)
    try:
        edp.ingest(_rows(0, 32), version=0)
        edp.seal()
        gather = edp.storage.gather

        def failing(*args: Any, **kwargs: Any) -> Any:
            raise OSError("the read failed")

        for _ in range(10):
            sched._await_job()  # (a prefetch prepared nothing for the next call: it gathers in the call)
            sched._discard_all()
            edp.storage.gather = failing  # type: ignore[method-assign]
            try:
                with pytest.raises(OSError, match="the read failed"):
                    edp.deliver()
            finally:
                edp.storage.gather = gather  # type: ignore[method-assign]
            edp.deliver()
        sched._await_job()
        sched._discard_all()
        busy = [i for i, s in enumerate(sched._ring.slots) if s.busy]
        assert busy == [], f"chunk buffers {busy} of {len(sched._ring.slots)} stayed busy after failed reads"
        assert len(sched._ring.slots) <= 4, f"the ring grew to {len(sched._ring.slots)} buffers"
    finally:
        edp.close()
