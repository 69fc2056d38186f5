"""A single background thread that runs one job at a time, with a hand-off cheap enough for every delivery.

:class:`concurrent.futures.ThreadPoolExecutor` costs the submitting thread a future, a
work item, a semaphore and Python-level condition variables per job. A prefetching
scheduler submits a job every few deliveries and checks it on every one, on the
learner's critical path, so :class:`Worker` keeps that path to a C-level queue put
and a lock test: a job's completion is a lock, held from submission until the job ends.

A stopped worker refuses work: :meth:`Worker.submit` after :meth:`Worker.stop` (or
:meth:`Worker.shutdown`) raises :class:`~conduit.ConfigurationError` instead of queueing a
job behind the end of its thread, which would never run (and whoever waited for it would
wait forever). Jobs submitted before the stop still run.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from conduit.errors import ConfigurationError

__all__ = ["Worker", "Job"]

T = TypeVar("T")


class Job(Generic[T]):
    """One call to run in the worker; :meth:`result` waits for it and returns or raises what it did."""

    __slots__ = ("_fn", "_args", "_value", "_error", "_running")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self._fn: Callable[..., Any] = fn  # (replaced by _done once the job ran)
        self._args = args
        self._value: T | None = None
        self._error: BaseException | None = None
        self._running = threading.Lock()
        self._running.acquire()  # released when the job has finished

    def _run(self) -> None:
        try:
            self._value = self._fn(*self._args)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by result()
            self._error = e
            _drop_locals(e)
        finally:
            self._fn, self._args = _done, ()  # a finished job keeps nothing of its caller (e.g. a buffer) alive
            self._running.release()
            del self  # (an error's traceback holds this frame: no cycle through the job)

    def done(self) -> bool:
        """Whether the job has finished (never blocks)."""
        return not self._running.locked()

    def wait(self) -> None:
        """Wait for the job to finish, whatever its outcome (nothing is raised)."""
        with self._running:
            pass

    def result(self) -> T:
        """Wait for the job, then return its value or raise its exception."""
        self.wait()
        if self._error is not None:
            try:
                raise self._error
            finally:
                del self  # (the error's traceback holds this frame: no cycle through the job)
        return self._value  # type: ignore[return-value]


def _done() -> None:
    """What a finished :class:`Job` holds instead of its function."""


def _drop_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback (and those of the exceptions it
    chains): a job's function is often a method of whoever holds the job (a scheduler holds its job in flight), and
    the frames would reference it back, a cycle only the cyclic garbage collector frees. The traceback still
    shows where the error came from."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # (frames still running, such as Job._run's, are left as they are)
        e = e.__cause__ or e.__context__


class Worker:
    """One daemon thread running submitted jobs in order.

    Args:
        name: the thread's name (shown in traces).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Job[Any] | None] = queue.SimpleQueue()
        self._stopped = False
        # orders submit against stop: a job is queued before the end mark or refused, never queued behind it
        self._gate = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Job[T]:
        """Queue ``fn(*args)``; the returned job reports its outcome.

        Raises:
            ConfigurationError: the worker was stopped (:meth:`stop` or :meth:`shutdown`, on any thread, came
                first): the job would never run, so nothing is queued. Submit to a new :class:`Worker`.
        """
        job: Job[T] = Job(fn, args)
        with self._gate:
            if self._stopped:
                raise ConfigurationError("This worker was stopped (stop() or shutdown() ran), so the job would "
                                         "never run and was not queued; submit it to a new Worker.")
            self._queue.put(job)
        return job

    @property
    def on_thread(self) -> bool:
        """Whether the calling thread is this worker's (a job, or a callback inside one, is running there)."""
        return threading.current_thread() is self._thread

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop the thread; later submits are refused (see :meth:`submit`)."""
        self.stop()
        self._thread.join()

    def stop(self) -> None:
        """Let the thread end after the queued jobs, without waiting for it (callable from any thread, more than
        once); later submits are refused (see :meth:`submit`)."""
        with self._gate:
            if self._stopped:
                return
            self._stopped = True
            self._queue.put(None)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job._run()
            del job  # an idle worker holds no job (nor what its function or value reference)
