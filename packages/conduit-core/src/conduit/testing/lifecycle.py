"""Helpers for tests that a dropped or closed buffer releases what it held: memory, threads, descriptors.

Garbage collection and thread exits are asynchronous, so every check polls until it holds or a
deadline passes, collecting garbage between tries, instead of sleeping a fixed time.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

__all__ = ["WORKER_THREADS", "HANG_S", "call_bounded", "start_bounded", "eventually", "wait_until", "thread_frame",
           "worker_threads", "live_workers", "no_workers_beyond", "open_fds", "fd_targets", "process_running",
           "ctrl_c_enabled"]

#: the names of the threads Conduit's schedulers and adapters start
WORKER_THREADS = ("conduit-ingest", "conduit-prefetch", "conduit-minibatch", "conduit-srl-assembler")


#: how long :func:`call_bounded` waits by default before it calls a call hung (reached only on a hang)
HANG_S = 60.0


def call_bounded(fn: Callable[[], object], timeout: float = HANG_S, *, name: str = "caller",
                 hang: str = "the call hung") -> object:
    """Run ``fn()`` on a daemon thread named ``name`` and return what it returned, or the exception it raised.

    A call that has not returned within ``timeout`` seconds fails the test with ``hang`` as the assertion
    message (the thread is left behind, as a daemon), instead of hanging the whole suite.
    """
    t, out = start_bounded(fn, name=name)
    t.join(timeout)
    assert not t.is_alive(), hang
    return out[0]


def start_bounded(fn: Callable[..., object], *args: object,
                  name: str = "caller") -> tuple[threading.Thread, list[object]]:
    """Start ``fn(*args)`` on a daemon thread named ``name``; return the thread and a list that gets what the call
    returned, or the exception it raised, once it ends.

    For a call that runs beside the test (one the test lets go of later): the test joins the thread with a bound
    reached only on a hang (e.g. :data:`HANG_S`) and asserts it is no longer alive; a hung thread is left behind,
    as a daemon. :func:`call_bounded` is the same with the join right away.
    """
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


#: :func:`eventually` first collects garbage this long after it started polling, then at most this often
FIRST_COLLECT_S, COLLECT_EVERY_S = 0.1, 0.5


def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds.

    ``cond`` is polled every 10 ms. Garbage is collected between tries from :data:`FIRST_COLLECT_S` on, at most
    every :data:`COLLECT_EVERY_S`, and once more before giving up: a wait that needs a collection (a dropped
    buffer's finalizer, its threads and memory) gets one soon, and a wait that needs none (a worker finishing a
    job) does not pay for one per try -- a full collection costs ~0.1 s of CPU in a process that loaded torch and
    Ray.
    """
    start = time.monotonic()
    end, collect_at = start + timeout, start + FIRST_COLLECT_S
    while True:
        if cond():
            return True
        now = time.monotonic()
        if now >= end:
            gc.collect()
            return bool(cond())
        if now >= collect_at:
            gc.collect()
            collect_at = time.monotonic() + COLLECT_EVERY_S
            continue
        time.sleep(0.01)


def holds_within(cond: Callable[[], bool], timeout: float = HANG_S) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds, polled every 10 ms without ever collecting garbage
    (unlike :func:`eventually`): in a test that disabled the cyclic collector, what holds then was freed by
    reference counting (a worker finishing the job it runs may take a moment)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def wait_until(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Fail the test unless ``cond()`` holds within ``timeout`` seconds (the bound is reached only on a hang).

    For a state another thread reaches on its own (a worker took a batch, a caller waits for a lock): polled every
    2 ms, with no garbage collection between tries (:func:`eventually` is the wait that collects). ``what`` names
    the state in the failure message ("timed out after 10 s waiting until <what>").
    """
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting until {what}"
        time.sleep(0.002)


_FRAMES_LOCK = threading.Lock()


def thread_frame(thread: threading.Thread | int | None) -> FrameType | None:
    """The frame ``thread`` (a thread or its ident) runs now, or ``None`` where it is not running.

    Use this, never ``sys._current_frames()`` directly, to see where another thread waits: on CPython 3.11 that
    call holds the interpreter's thread-list lock while it allocates frame objects, and a garbage collection
    started by one of those allocations can finalize an object that needs the same lock, which freezes the whole
    process (GIL included, so no timeout ever fires; python/cpython#106883). The cyclic collector is off for the
    call, under a lock so that two callers never turn it back on under each other.
    """
    ident = thread.ident if isinstance(thread, threading.Thread) else thread
    if ident is None:
        return None
    with _FRAMES_LOCK:
        was_on = gc.isenabled()
        gc.disable()
        try:
            frames = sys._current_frames()
        finally:
            if was_on:
                gc.enable()
    return frames.get(ident)


def worker_threads() -> list[str]:
    """The names of Conduit's worker threads alive now, sorted."""
    return sorted(t.name for t in live_workers())


def live_workers() -> set[threading.Thread]:
    """Conduit's worker threads alive now (the thread objects: to compare with :func:`no_workers_beyond`)."""
    return {t for t in threading.enumerate() if t.name in WORKER_THREADS}


def no_workers_beyond(before: set[threading.Thread]) -> bool:
    """Whether every Conduit worker thread alive now was alive at ``before`` (a :func:`live_workers` reading).
    Threads that were ending then (an earlier test's) may have ended since."""
    return live_workers() <= before


def process_running(pid: int) -> bool:
    """Whether process ``pid`` on this machine still runs (neither gone nor a zombie): e.g. a Ray worker a buffer
    started, which a test expects to stop or to stay."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # (the name in parentheses may hold spaces)
    except (FileNotFoundError, ProcessLookupError):
        return False


def open_fds() -> int:
    """File descriptors open in this process (Linux: ``/proc/self/fd``)."""
    return len(os.listdir("/proc/self/fd"))


def fd_targets() -> dict[int, str]:
    """What each descriptor open in this process refers to (``socket:[...]``, a path...): for a leak's message."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (closed meanwhile, or the listing's own descriptor)
            pass
    return out


def ctrl_c_enabled() -> None:
    """A ``preexec_fn`` for a child process a test will interrupt with SIGINT: the child gets Ctrl-C's default.

    A test runner started as a background job of a non-interactive shell (``cmd &`` in a script) ignores SIGINT,
    and its children inherit that: their Python then never raises ``KeyboardInterrupt``, and a test that sends
    SIGINT would wait on a command that does not stop. Restoring the default disposition in the child makes
    it start as it would at a terminal.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
