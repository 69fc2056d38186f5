"""ExposureLog against the telemetry's bounded ring: an iteration whose calls overflow it is refused, never
silently under-counted; one that fits is measured exactly as before, also when the ring is full from earlier."""

from __future__ import annotations

import threading
import time

import pytest
from conduit.errors import CapacityError
from conduit.exposure import ExposureLog, measure_iteration
from conduit.telemetry import CallRecord, Telemetry, thread_id


def _workers(tel: Telemetry, n_threads: int, per_thread: int, kind: str = "ingest",
             out: list[CallRecord] | None = None) -> None:
    """``n_threads`` real threads each record ``per_thread`` short spans (and note them in ``out``)."""
    start = threading.Barrier(n_threads)

    def work() -> None:
        start.wait()
        for _ in range(per_thread):
            a = time.perf_counter()
            b = time.perf_counter()
            tel.record(kind, 1, 8, a, b)
            if out is not None:
                out.append(CallRecord(kind, 1, 8, a, b, thread_id()))

    threads = [threading.Thread(target=work, name=f"worker{k}") for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_an_iteration_whose_worker_spans_overflow_the_ring_is_refused_not_under_counted() -> None:
    tel = Telemetry(maxlen=64, fold_every=8)
    log = ExposureLog(tel)
    with log.iteration():  # a first iteration that fits
        with tel.span("rollout"):
            _workers(tel, 2, 10)
    assert len(log.iterations) == 1
    with pytest.raises(CapacityError) as info:
        with log.iteration():
            with tel.span("rollout"):
                _workers(tel, 3, 100)  # 300 worker spans into a ring of 64: the earliest are pushed out
    msg = str(info.value)
    assert "maxlen" in msg and "64" in msg and "shorter iterations" in msg, (
        f"the error should say to raise Telemetry's maxlen or measure shorter iterations: {msg!r}")
    assert len(log.iterations) == 1, "a refused iteration must not be appended (it would be under-counted)"
    with log.iteration():  # the log works on afterwards, with a full ring
        with tel.span("rollout"):
            _workers(tel, 2, 10)
    assert len(log.iterations) == 2


@pytest.mark.parametrize("spans, refused", [(15, False), (16, True)])
def test_the_ring_boundary_is_exact(spans: int, refused: bool) -> None:
    """A ring of 16 holds 15 spans plus the iteration's own span: that still measures; one more does not."""
    tel = Telemetry(maxlen=16, fold_every=3)
    for i in range(100):  # the ring is full (and has wrapped) before the iteration starts
        tel.record("ingest", 0, 0, float(i), float(i) + 0.5)
    log = ExposureLog(tel)
    if refused:
        with pytest.raises(CapacityError, match="maxlen"):
            with log.iteration():
                _workers(tel, 1, spans)
        assert len(log.iterations) == 0
    else:
        with log.iteration():
            _workers(tel, 1, spans)
        assert len(log.iterations) == 1, "an iteration that fits the ring exactly should be measured"


def test_an_iteration_within_a_full_ring_measures_exactly_as_every_span_says() -> None:
    """Control: a ring already full (wrapped many times) and workers recording fewer calls than it holds:
    the accounting equals measure_iteration over every span the iteration recorded, with nothing refused."""
    tel = Telemetry(maxlen=256, fold_every=16)
    for i in range(5000):
        tel.record("deliver", 0, 0, float(i), float(i) + 0.5)
    log = ExposureLog(tel)
    for _ in range(5):  # steady state: the ring keeps dropping calls from before each iteration
        mine: list[CallRecord] = []
        with log.iteration():
            a = time.perf_counter()
            _workers(tel, 3, 40, out=mine)
            b = time.perf_counter()
            tel.record("rollout", 0, 0, a, b)
            mine.append(CallRecord("rollout", 0, 0, a, b, thread_id()))
            with tel.span("deliver_wait"):
                pass
            mine.append(tel.recent("deliver_wait", 1)[0])
        it = log.iterations[-1]
        mine.append(CallRecord("iteration", 0, 0, it.start, it.end, thread_id()))
        expected = measure_iteration(mine, it.start, it.end)
        assert it == expected, f"an iteration within the ring was accounted as {it}, every span says {expected}"
        assert it.hidden_s > 0 and it.rollout_s > 0
    assert len(log.iterations) == 5


def test_the_bodys_own_error_propagates_when_the_ring_overflowed() -> None:
    tel = Telemetry(maxlen=8, fold_every=2)
    log = ExposureLog(tel)
    with pytest.raises(KeyError):
        with log.iteration():
            _workers(tel, 2, 20)
            raise KeyError("the loop's own failure")
    assert len(log.iterations) == 0


@pytest.mark.parametrize("maxlen", [-1, 2.5, "64", None, True])
def test_a_ring_size_that_cannot_work_is_refused_with_a_typed_error(maxlen: object) -> None:
    from conduit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="maxlen"):
        Telemetry(maxlen=maxlen)  # type: ignore[arg-type]


def test_an_iteration_reads_only_its_own_calls_from_a_full_ring() -> None:
    """The accounting of an iteration reads the calls since its start, not the whole ring (which may hold 64k
    calls), and still counts a span that began before the iteration and ended inside it."""
    tel = Telemetry(maxlen=1000, fold_every=16)
    log = ExposureLog(tel)
    for i in range(3000):  # a full ring that has dropped 2000 calls
        tel.record("deliver", 1, 1, float(i), float(i) + 0.5)
    before = time.perf_counter()
    mark = tel.mark()
    calls, dropped = tel.calls_since(mark)
    assert (calls, dropped) == ([], 0)
    with log.iteration():
        tel.record("deliver", 1, 1, before - 1.0, time.perf_counter())  # began long before the iteration
        with tel.span("update"):
            pass
    calls, dropped = tel.calls_since(mark)
    assert [c.kind for c in calls] == ["deliver", "update", "iteration"] and dropped == 0
    it = log.iterations[-1]
    assert it.exposed_s > 0, "the span that began before the iteration was not counted"
    all_calls, _ = tel.snapshot(0)
    assert list(all_calls[-3:]) == calls and len(all_calls) == 1000


def test_the_log_keeps_the_newest_iterations_and_skips_warm_up_by_count() -> None:
    """ExposureLog.iterations grew by one record per iteration for the life of the loop."""
    tel = Telemetry()
    log = ExposureLog(tel, keep=3)
    for i in range(5):
        with log.iteration():
            # an update span of exactly i + 1 ms, recorded with its own timestamps (a slept span's length is the
            # machine's scheduling, not the test's); the iteration lasts past its end, so nothing of it is clipped
            start = time.perf_counter()
            tel.record("update", 0, 0, start, start + 0.001 * (i + 1))
            while time.perf_counter() <= start + 0.001 * (i + 1):
                time.sleep(0.001)
    assert log.accounted == 5
    assert len(log.iterations) == 3, "the log holds at most `keep` iterations"
    updates = [round(it.update_s * 1e3) for it in log.iterations]
    assert updates == [3, 4, 5], f"the newest three, oldest first: {updates} ms"
    # skip counts accounted iterations: skipping 4 leaves the fifth only, though two are no longer held
    assert log.summary(skip=4)["update_s"] == log.iterations[-1].update_s
    assert log.summary(skip=2)["update_s"] == log.iterations[1].update_s  # the median of the held three


@pytest.mark.parametrize("keep", [0, -1, 2.5, True])
def test_a_keep_that_cannot_work_is_refused_typed(keep: object) -> None:
    from conduit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="keep"):
        ExposureLog(Telemetry(), keep=keep)  # type: ignore[arg-type]
