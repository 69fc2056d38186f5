"""A stopped Worker refuses work instead of queueing a job that never runs.

``Worker.submit`` after ``stop()``/``shutdown()`` used to queue the job behind the end mark of the thread:
it never ran, and ``Job.wait()``/``result()`` waited forever. Each wait under test runs on its own thread,
bounded by a join that is only reached on a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from conduit import ConduitError, ConfigurationError
from conduit.scheduling.worker import Job, Worker
from conduit.testing.lifecycle import call_bounded

BOUND = 30.0  # seconds: reached only on a hang


def submit_and_wait(w: Worker, fn: Callable[..., Any], *args: Any) -> Any:
    """submit, then wait for the job's outcome: what a caller of the worker does."""

    def call() -> Any:
        job: Job[Any] = w.submit(fn, *args)
        return job.result()

    hang = f"{fn} did not return within {BOUND} s (a job submitted after stop never ran)"
    return call_bounded(call, BOUND, hang=hang)


def test_submit_after_stop_is_refused_with_a_typed_error_and_queued_jobs_still_run() -> None:
    w = Worker("test-s28-worker")
    gate = threading.Event()
    ran: list[int] = []

    def job(i: int) -> int:
        if i == 0:
            gate.wait(BOUND)  # hold the first job: the others queue behind it, before the stop
        ran.append(i)
        return i

    queued = [w.submit(job, i) for i in range(3)]
    w.stop()  # the thread is still running the first job
    late = submit_and_wait(w, ran.append, 99)
    assert isinstance(late, ConfigurationError), late
    assert isinstance(late, ConduitError)
    assert "stopped" in str(late)
    gate.set()
    assert [call_bounded(j.result, BOUND) for j in queued] == [0, 1, 2]
    assert ran == [0, 1, 2]  # the refused job never ran


def test_submit_after_shutdown_is_refused_and_the_jobs_before_it_ran() -> None:
    w = Worker("test-s28-worker")
    out: list[int] = []
    for i in range(5):
        w.submit(out.append, i)
    assert call_bounded(w.shutdown, BOUND) is None
    assert out == list(range(5))
    late = submit_and_wait(w, out.append, 99)
    assert isinstance(late, ConfigurationError), late
    assert out == list(range(5))


def test_stop_twice_and_shutdown_after_stop_return() -> None:
    w = Worker("test-s28-worker")
    done = w.submit(lambda: "before")
    w.stop()
    w.stop()
    assert call_bounded(w.shutdown, BOUND) is None
    assert done.result() == "before"


def test_a_stop_racing_submits_leaves_no_job_that_never_finishes() -> None:
    """One thread submits until refused while another stops the worker: every job accepted runs, and the first
    submit after the stop is refused (none is queued behind the end of the thread)."""
    for _ in range(20):
        w = Worker("test-s28-worker")
        started = threading.Event()
        jobs: list[Job[int]] = []
        refused: list[ConfigurationError] = []

        def submitter(w: Worker = w, started: threading.Event = started, jobs: list[Job[int]] = jobs,
                      refused: list[ConfigurationError] = refused) -> None:
            for i in range(100_000):
                if i == 20:
                    started.set()
                try:
                    jobs.append(w.submit(int, i))
                except ConfigurationError as e:
                    refused.append(e)
                    return

        t = threading.Thread(target=submitter, daemon=True)
        t.start()
        assert started.wait(BOUND)
        w.stop()
        t.join(BOUND)
        assert not t.is_alive()
        assert len(refused) == 1, "the submits went on after stop() and none was refused"
        # every job that was accepted runs (their results read on one bounded thread, not a thread per job)
        assert call_bounded(lambda jobs=jobs: [j.result() for j in jobs], BOUND) == list(range(len(jobs)))
