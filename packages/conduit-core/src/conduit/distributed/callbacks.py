"""Loss reports handed to the user's ``on_loss`` callback, and the plane's lock that hands them over.

A report is recorded under the plane's lock and handed over once the thread's outermost hold of that lock (or its
call into the scheduler) ends, so a callback never runs under the lock and may call the buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from conduit.distributed.faults import LossReport

__all__ = ["LossCallbacks", "PlaneLock"]

log = logging.getLogger("conduit.distributed")


class LossCallbacks:
    """Hands loss reports to the user's ``on_loss`` callback: outside the buffer's lock, in the order they were
    recorded in :attr:`DistributedDataPlane.losses`, each exactly once, one call at a time.

    It holds no reference to the plane (the plane's lock holds it, and a plane dropped without ``close()`` must
    still be freed by reference counting).
    """

    def __init__(self, fn: Callable[[LossReport], None] | None) -> None:
        self.fn = fn
        self._queue: deque[LossReport] = deque()
        self._mu = threading.Condition(threading.Lock())  # (notified when a callback ends: see wait_idle)
        self._running: threading.Thread | None = None
        #: per thread: how many scheduler calls (or scheduler primitives) it is inside (see :meth:`run`)
        self._inside = threading.local()

    def depth(self) -> int:
        """How many scheduler calls (:meth:`PlaneLock.scheduler_call`) or scheduler primitives the calling thread is
        inside."""
        return int(getattr(self._inside, "n", 0))

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """While entered, :meth:`run` on this thread does nothing: the thread may hold a scheduler's delivery lock
        (``Overlapped._mu``), or run a prefetch job a delivery waits for, and a callback that took the buffer's lock
        there could wait forever for a thread that holds the buffer's lock and waits for the delivery lock. The
        reports stay queued, in order, for the next :meth:`run` outside (the end of the scheduler call, or of the
        next outermost hold of the buffer's lock on any thread)."""
        self._inside.n = self.depth() + 1
        try:
            yield
        finally:
            self._inside.n -= 1

    def add(self, report: LossReport) -> None:
        """Queue ``report`` (called under the buffer's lock, in the order the reports are recorded)."""
        with self._mu:
            self._queue.append(report)

    def run(self) -> None:
        """Call ``fn`` with every queued report, oldest first (called once a thread's outermost hold of the buffer's
        lock ended). When a callback is already running, this returns at once: that thread's loop takes the queued
        reports next (also when it is this thread, i.e. the callback called into the buffer and found a loss).
        Inside :meth:`deferring` it returns at once too (the reports stay queued)."""
        if self.depth():
            return
        while True:
            with self._mu:
                if self._running is not None:
                    return
                if not self._queue:
                    return
                report = self._queue.popleft()
                self._running = threading.current_thread()
            try:
                fn = self.fn
                if fn is not None:
                    fn(report)
            except Exception:  # noqa: BLE001 - a failing callback must not abort the call that found the loss
                log.exception("conduit: on_loss raised; the loss itself is recorded in .losses")
            finally:
                with self._mu:
                    self._running = None
                    self._mu.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Run the queued reports here (as :meth:`run`), and wait until no callback runs on another thread and none
        is queued; at most ``timeout`` seconds. Returns whether that was reached (a callback running on this thread,
        i.e. one that called in here, counts as idle: it cannot be waited for).

        Only for a thread that holds no buffer lock and is in no scheduler call: a callback waited for may call the
        buffer, or the scheduler."""
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        while True:
            self.run()
            with self._mu:
                if self._running is me or (self._running is None and not self._queue):
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self.depth():
                    return False
                if self._running is not None:  # (None: a report was queued just now; the loop runs it here)
                    self._mu.wait(left)


class PlaneLock:
    """The buffer's re-entrant lock: when a thread's outermost hold ends, the loss reports recorded meanwhile go
    to ``on_loss`` (:class:`LossCallbacks`), so a callback never runs under the lock and may call the buffer,
    from any thread."""

    def __init__(self, callbacks: LossCallbacks) -> None:
        self._lock = threading.RLock()
        self._callbacks = callbacks

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if not self._is_owned():
            self._callbacks.run()

    def _is_owned(self) -> bool:
        """Whether the calling thread holds the lock (what :func:`~conduit.scheduling.base.lock_held` asks)."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    @contextmanager
    def scheduler_call(self) -> Iterator[None]:
        """Around a call into the scheduler (which may take its delivery lock): loss reports found meanwhile go to
        ``on_loss`` once it returned, on this thread, unless it still holds the buffer's lock (then when that hold
        ends)."""
        try:
            with self._callbacks.deferring():
                yield
        finally:
            if not self._callbacks.depth() and not self._is_owned():
                self._callbacks.run()
