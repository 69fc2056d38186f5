"""``conduit.testing.lifecycle.wait_until``: the suites' wait for a state another thread reaches."""

from __future__ import annotations

import threading

import pytest
from conduit.testing.lifecycle import thread_frame, wait_until


def test_wait_until_returns_once_another_thread_reaches_the_state() -> None:
    reached = threading.Event()
    timer = threading.Timer(0.05, reached.set)
    timer.start()
    try:
        wait_until(reached.is_set, "the timer fired", timeout=30)
    finally:
        timer.cancel()
    assert reached.is_set()


def test_wait_until_fails_the_test_naming_the_state_when_it_never_comes() -> None:
    calls: list[int] = []

    def never() -> bool:
        calls.append(1)
        return False

    with pytest.raises(AssertionError, match="timed out after 0.05 s waiting until the worker took the batch"):
        wait_until(never, "the worker took the batch", timeout=0.05)
    assert len(calls) >= 2, "the condition was not polled again before the wait gave up"


def test_thread_frame_shows_where_another_thread_waits_and_leaves_the_collector_as_it_was() -> None:
    """``thread_frame`` (the suites' look at where another thread waits) finds the waiting function, gives None for
    a thread not started, and turns the cyclic collector off only for its own call (python/cpython#106883)."""
    import gc

    go = threading.Event()

    def parked_here() -> None:
        go.wait(30)

    t = threading.Thread(target=parked_here, daemon=True)
    assert thread_frame(t) is None  # not started: no ident
    t.start()
    try:
        def names() -> list[str]:
            frame, out = thread_frame(t), []
            while frame is not None:
                out.append(frame.f_code.co_name)
                frame = frame.f_back
            return out

        wait_until(lambda: "parked_here" in names(), "the thread waits in parked_here", timeout=30)
        assert names()[0] == "wait"  # innermost first: Condition.wait under Event.wait
        was = gc.isenabled()
        try:
            for state in (True, False):
                (gc.enable if state else gc.disable)()
                thread_frame(t)
                assert gc.isenabled() is state
        finally:
            (gc.enable if was else gc.disable)()
    finally:
        go.set()
        t.join(30)
