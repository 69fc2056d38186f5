"""A worker span recorded after the iteration it overlaps was measured.

A span is recorded when it ends. A scheduler's worker that was still inside a call when the loop's iteration
ended (or had read its end time but not yet recorded the call) records it after :class:`ExposureLog` measured that
iteration. The next iteration only counts spans overlapping its own window, so the part of such a span inside the
earlier iteration was counted in no iteration: the log under-counted hidden time at every boundary a worker
straddled, and dropped a worker call that ended inside an iteration altogether when its record came a moment late.
The log now revises its newest entry when the next iteration is measured (or :meth:`ExposureLog.settle` is
called), adding the part of those late spans within it.

Real threads, synchronised by events; the times asserted are the spans' own recorded times, never durations.
"""

from __future__ import annotations

import threading
import time

import pytest
from conduit.exposure import ExposureLog
from conduit.telemetry import Telemetry, thread_id

TIMEOUT = 60.0


class _Worker(threading.Thread):
    """Runs ``body`` on its own thread; re-raises its error in :meth:`finish`."""

    def __init__(self, body) -> None:  # type: ignore[no-untyped-def]
        super().__init__(name="late-worker", daemon=True)
        self._body = body
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._body()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e

    def finish(self) -> None:
        self.join(TIMEOUT)
        assert not self.is_alive(), "the worker did not finish"
        if self.error is not None:
            raise self.error


def test_a_worker_span_straddling_an_iteration_boundary_counts_its_part_in_both_iterations() -> None:
    tel = Telemetry()
    log = ExposureLog(tel, loop_threads={thread_id()})
    inside, release = threading.Event(), threading.Event()

    def work() -> None:
        with tel.span("stage", 1, 8):
            inside.set()
            assert release.wait(TIMEOUT)

    worker = _Worker(work)
    with log.iteration():
        worker.start()
        assert inside.wait(TIMEOUT)  # the worker's span began in this iteration and is still running
    with log.iteration():
        release.set()
        worker.finish()  # its span ends, and is recorded, in this iteration
    (span,) = [r for r in tel.records if r.kind == "stage"]
    first, second = log.iterations
    assert first.start < span.start < first.end < second.start < span.end < second.end
    assert first.hidden_s == pytest.approx(first.end - span.start, rel=1e-9)  # was 0.0: counted in neither
    assert second.hidden_s == pytest.approx(span.end - second.start, rel=1e-9)
    assert first.exposed_s == second.exposed_s == 0.0
    assert log.accounted == 2


def test_a_worker_call_that_ended_inside_an_iteration_but_was_recorded_after_it_counts_there() -> None:
    tel = Telemetry()
    log = ExposureLog(tel, loop_threads={thread_id()})
    timed, measured = threading.Event(), threading.Event()
    times: list[float] = []

    def work() -> None:  # a call that read its end time, then recorded it a moment later
        t0 = t1 = time.perf_counter()
        while t1 <= t0:  # a call that took some time
            t1 = time.perf_counter()
        times.extend((t0, t1))
        timed.set()
        assert measured.wait(TIMEOUT)
        tel.record("ingest", 4, 64, times[0], times[1])

    worker = _Worker(work)
    with log.iteration():
        worker.start()
        assert timed.wait(TIMEOUT)
    measured.set()
    worker.finish()
    assert log.iterations[-1].hidden_s == 0.0  # not recorded yet when the iteration was measured
    with log.iteration():
        pass
    first, second = log.iterations
    assert first.start < times[0] < times[1] < first.end
    assert first.hidden_s == pytest.approx(times[1] - times[0], rel=1e-9)  # was counted in no iteration
    assert first.total_s == first.hidden_s
    assert second.hidden_s == 0.0


def test_settle_revises_the_newest_iteration_without_measuring_another() -> None:
    tel = Telemetry()
    log = ExposureLog(tel, loop_threads={thread_id()})
    inside, release = threading.Event(), threading.Event()

    def work() -> None:
        with tel.span("deliver", 2, 16):
            inside.set()
            assert release.wait(TIMEOUT)

    worker = _Worker(work)
    with log.iteration():
        worker.start()
        assert inside.wait(TIMEOUT)
    before = log.iterations[-1]
    assert before.hidden_s == 0.0
    release.set()
    worker.finish()
    log.settle()
    (span,) = [r for r in tel.records if r.kind == "deliver"]
    after = log.iterations[-1]
    assert after.hidden_s == pytest.approx(after.end - span.start, rel=1e-9)
    assert (after.start, after.end, log.accounted, len(log.iterations)) == (before.start, before.end, 1, 1)
    log.settle()  # nothing new: the entry stays
    assert log.iterations[-1] == after


def test_spans_the_previous_iteration_already_counted_are_not_counted_twice() -> None:
    """The revision reads what was recorded since the previous iteration was measured: the spans it counted then
    (the loop's own included) stay counted once."""
    tel = Telemetry()
    log = ExposureLog(tel)
    with log.iteration():
        with tel.span("rollout"):
            pass
        with tel.span("deliver_wait"):
            pass
    first = log.iterations[-1]
    with log.iteration():
        with tel.span("update"):
            pass
    assert log.iterations[0] == first
    log.settle()
    assert log.iterations[0] == first


def test_an_iteration_inside_another_on_the_same_log_revises_nothing() -> None:
    tel = Telemetry()
    log = ExposureLog(tel, loop_threads={thread_id()})
    with log.iteration():
        with log.iteration():
            with tel.span("deliver"):
                pass
        inner = log.iterations[-1]
    outer = log.iterations[-1]
    assert list(log.iterations) == [inner, outer]
    assert inner.exposed_s > 0.0 and outer.exposed_s >= inner.exposed_s


def test_settle_on_a_log_with_no_iteration_does_nothing() -> None:
    log = ExposureLog(Telemetry())
    log.settle()
    assert (len(log.iterations), log.accounted) == (0, 0)

