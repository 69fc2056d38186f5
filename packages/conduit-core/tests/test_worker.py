"""The prefetch worker: jobs run in order on one thread; results and errors reach the caller."""

from __future__ import annotations

import threading

import pytest
from conduit.scheduling.worker import Worker


def test_jobs_run_in_order_on_one_thread_and_return_their_values() -> None:
    w = Worker("test-worker")
    seen: list[tuple[int, int]] = []
    gate = threading.Event()

    def job(i: int) -> int:
        if i == 0:
            gate.wait(5)  # hold the first job so the others queue behind it
        seen.append((i, threading.get_ident()))
        return i * i

    jobs = [w.submit(job, i) for i in range(5)]
    assert not jobs[0].done() and not jobs[4].done()
    gate.set()
    assert [j.result() for j in jobs] == [0, 1, 4, 9, 16]
    assert all(j.done() for j in jobs)
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
    w.shutdown()


def test_an_error_is_raised_by_result_and_the_worker_goes_on() -> None:
    w = Worker("test-worker")

    def boom() -> None:
        raise KeyError("no such field")

    bad = w.submit(boom)
    good = w.submit(lambda: "next")
    bad.wait()  # waits for the outcome without raising it
    assert bad.done()
    with pytest.raises(KeyError, match="no such field"):
        bad.result()
    assert good.result() == "next"
    w.shutdown()


def test_shutdown_finishes_queued_jobs() -> None:
    w = Worker("test-worker")
    out: list[int] = []
    for i in range(20):
        w.submit(out.append, i)
    w.shutdown()
    assert out == list(range(20))
