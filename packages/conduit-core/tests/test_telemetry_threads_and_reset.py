"""Telemetry's thread ids survive the OS reusing a thread's ident (a trace keeps one lane per thread, named as
that thread), and a reset while an ExposureLog iteration is open is refused instead of under-counting it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from conduit.errors import ConfigurationError
from conduit.exposure import ExposureLog
from conduit.telemetry import Telemetry, thread_id


def _run(target: Callable[[], None], name: str) -> int:
    """Run ``target`` on a new thread called ``name`` to its end; return that thread's OS ident."""
    t = threading.Thread(target=target, name=name)
    t.start()
    t.join()
    assert t.ident is not None
    return t.ident


def _sequential_threads_sharing_an_ident(first: Callable[[], None], second: Callable[[], None]) -> None:
    """Run ``first`` then ``second`` on two threads, the first joined before the second starts, retrying until
    the OS gave both the same ident (glibc reuses an exited thread's stack, so that is the usual case)."""
    for _ in range(50):
        a = _run(first, "first-worker")
        b = _run(second, "second-worker")
        if a == b:
            return
    pytest.skip("this platform never reused an exited thread's ident in 50 tries: nothing to check")


def test_two_exited_threads_with_the_same_os_ident_keep_their_own_lane_and_name() -> None:
    tels: list[Telemetry] = []

    def first() -> None:
        tels[-1].record("ingest", 1, 8, 1.0, 2.0)

    def second() -> None:
        tels[-1].record("deliver", 1, 8, 3.0, 4.0)

    def attempt_first() -> None:
        tels.append(Telemetry())  # a fresh telemetry per attempt, so the trace holds just this pair
        first()

    _sequential_threads_sharing_an_ident(attempt_first, second)
    tel = tels[-1]
    recs = tel.records
    assert [r.kind for r in recs] == ["ingest", "deliver"]
    assert recs[0].thread != recs[1].thread, (
        f"two different threads (the OS reused the first one's ident for the second) were recorded with the "
        f"same thread id {recs[0].thread}: a trace would merge them into one lane")
    events = tel.chrome_trace()["traceEvents"]
    lanes = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert lanes["ingest"] != lanes["deliver"], f"the two threads' spans share one lane: {lanes}"
    assert names.get(lanes["ingest"]) == "first-worker" and names.get(lanes["deliver"]) == "second-worker", (
        f"each lane should carry its own thread's name: lanes {lanes}, names {names}")
    assert lanes == {"ingest": recs[0].thread, "deliver": recs[1].thread}, "a trace's tid is the record's thread"


def test_a_live_thread_reusing_an_exited_threads_ident_does_not_rename_its_lane() -> None:
    """The trace names live threads by their current name: that must not relabel an exited thread's lane."""
    tels: list[Telemetry] = []
    go_on, recorded = threading.Event(), threading.Event()
    live: list[threading.Thread] = []

    def attempt_first() -> None:
        tels.append(Telemetry())
        tels[-1].record("ingest", 1, 8, 1.0, 2.0)

    def second() -> None:
        tels[-1].record("deliver", 1, 8, 3.0, 4.0)

    def record_and_stay() -> None:
        second()
        recorded.set()
        go_on.wait(30)

    for _ in range(50):
        a = _run(attempt_first, "exited-worker")
        t = threading.Thread(target=record_and_stay, name="live-worker")
        t.start()
        recorded.wait(30)
        if t.ident == a:
            live.append(t)
            break
        go_on.set()
        t.join()
        go_on.clear()
        recorded.clear()
    else:
        pytest.skip("this platform never reused an exited thread's ident in 50 tries: nothing to check")
    try:
        live[0].name = "live-worker-renamed"  # a live thread is named by its current name
        events = tels[-1].chrome_trace()["traceEvents"]
    finally:
        go_on.set()
        live[0].join()
    lanes = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names.get(lanes["ingest"]) == "exited-worker", f"the exited thread's lane was renamed: {names}"
    assert names.get(lanes["deliver"]) == "live-worker-renamed", f"the live thread's lane: {names}"


def test_work_on_a_worker_reusing_the_loops_helper_threads_ident_counts_as_hidden() -> None:
    """Within one iteration a helper thread does the rollout (a loop thread) and exits; a worker that gets its
    OS ident then does ingest work: that is off the critical path (hidden), not exposed on the loop."""
    tel = Telemetry()
    log = ExposureLog(tel)

    def rollout() -> None:
        with tel.span("rollout"):
            time.sleep(0.002)

    def ingest() -> None:
        with tel.span("ingest"):
            time.sleep(0.002)

    with log.iteration():
        _sequential_threads_sharing_an_ident(rollout, ingest)
    it = log.iterations[-1]
    assert it.hidden_s > 0 and it.exposed_s == 0, (
        f"the worker's ingest was accounted as exposed {it.exposed_s:.4f}s / hidden {it.hidden_s:.4f}s: it ran on "
        f"a different thread from the rollout's, which had exited")


def test_thread_id_is_the_records_thread_and_stable_per_thread() -> None:
    tel = Telemetry()
    tel.record("ingest", 1, 1, 0.0, 1.0)
    tel.record("ingest", 1, 1, 1.0, 2.0)
    assert {r.thread for r in tel.records} == {thread_id()}
    assert thread_id() == thread_id()
    # the main thread's ident was never an exited thread's, so its id is still threading.get_ident() (callers that
    # pass get_ident() as measure_iteration's loop_threads keep working for it)
    assert threading.current_thread() is threading.main_thread() and thread_id() == threading.get_ident()
    other: list[int] = []
    _run(lambda: other.append(thread_id()), "other")
    assert other[0] != thread_id()


def test_reset_inside_an_open_iteration_is_refused_and_changes_nothing() -> None:
    tel = Telemetry()
    log = ExposureLog(tel)
    with log.iteration():
        with tel.span("rollout"):
            time.sleep(0.002)
        with tel.span("deliver"):
            time.sleep(0.002)
        before = (tel.records, tel.summary())
        with pytest.raises(ConfigurationError, match="between iterations"):
            tel.reset()
        assert (tel.records, tel.summary()) == before, "a refused reset must leave the calls and totals as they were"
    it = log.iterations[-1]
    assert it.rollout_s >= 0.002 and it.exposed_s >= 0.002, (
        f"the iteration dropped the calls it made before the reset attempt: {it}")
    tel.reset()  # between iterations it works
    assert tel.records == () and tel.summary() == {}


def test_reset_from_another_thread_during_an_iteration_is_refused() -> None:
    tel = Telemetry()
    log = ExposureLog(tel)
    errors: list[BaseException] = []

    def reset() -> None:
        try:
            tel.reset()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with log.iteration():
        with tel.span("deliver"):
            time.sleep(0.002)
        _run(reset, "resetter")
    assert len(errors) == 1 and isinstance(errors[0], ConfigurationError), errors
    assert log.iterations[-1].exposed_s >= 0.002


def test_reset_works_again_after_an_iteration_that_raised_or_overflowed() -> None:
    tel = Telemetry(maxlen=4, fold_every=1)
    log = ExposureLog(tel)
    with pytest.raises(KeyError):
        with log.iteration():
            raise KeyError("the body's own failure")
    tel.reset()
    with pytest.raises(Exception, match="maxlen"):
        with log.iteration():
            for i in range(10):
                tel.record("ingest", 0, 0, float(i), float(i))
    tel.reset()
    assert tel.records == ()


def test_snapshot_does_not_count_calls_removed_by_reset_as_dropped() -> None:
    """snapshot(mark) counts the calls after the mark that the ring dropped; what reset removed is not one."""
    tel = Telemetry(maxlen=64, fold_every=1)
    mark = tel.mark()
    for _ in range(10):
        tel.record("ingest", 0, 0, 0.0, 1.0)
    tel.reset()  # removes those 10: not dropped by the ring
    for _ in range(100):
        tel.record("ingest", 0, 0, 0.0, 1.0)  # 100 into a ring of 64: 36 pushed out
    records, dropped = tel.snapshot(mark)
    assert len(records) == 64
    assert dropped == 36, f"the ring dropped 36 calls after the mark, snapshot says {dropped}"
    assert tel.snapshot(tel.mark())[1] == 0
    oldest = tel.mark() - 64  # the mark of the oldest call kept: none from it on were dropped
    assert tel.snapshot(oldest)[1] == 0
    assert tel.snapshot(oldest - 20)[1] == 20, "the 20 calls before the oldest one kept were dropped"
    assert tel.snapshot(oldest - 40)[1] == 36, "of the 40 calls before it, the ring dropped 36 (reset removed 4)"


def test_snapshot_counts_drops_across_resets_and_a_zero_ring() -> None:
    tel = Telemetry(maxlen=0, fold_every=1)
    mark = tel.mark()
    for _ in range(5):
        tel.record("ingest", 0, 0, 0.0, 1.0)
    tel.reset()
    for _ in range(3):
        tel.record("ingest", 0, 0, 0.0, 1.0)
    assert tel.snapshot(mark) == ((), 8), "a ring of 0 drops every call; the reset removed none"


@pytest.mark.parametrize("fold_every", ["8", None, 2.5, -1, True])
def test_a_fold_every_that_cannot_work_is_refused_when_built(fold_every: object) -> None:
    with pytest.raises(ConfigurationError, match="fold_every"):
        Telemetry(fold_every=fold_every)  # type: ignore[arg-type]


@pytest.mark.parametrize("skip", [-1, 1.5, "1", None])
def test_exposure_summary_refuses_a_skip_that_is_not_a_count(skip: object) -> None:
    tel = Telemetry()
    log = ExposureLog(tel)
    for _ in range(3):
        with log.iteration():
            pass
    with pytest.raises(ConfigurationError, match="skip"):
        log.summary(skip=skip)  # type: ignore[arg-type]
    assert log.summary(skip=0) and log.summary(skip=5), "a skip >= 0 still reports"
