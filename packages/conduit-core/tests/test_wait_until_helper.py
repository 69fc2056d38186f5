"""``conduit.testing.lifecycle.wait_until``: the suites' wait for a state another thread reaches."""

from __future__ import annotations

import threading

import pytest
from conduit.testing.lifecycle import wait_until


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
