"""A buffer its owner drops without ``close()`` is freed, storage and worker threads included.

Background ingestion and prefetch run on worker threads. Before, an idle ingestion thread held
its buffer (and so every byte of its storage) for the life of the process, and a prefetch
thread held the last job it ran, with the scheduler and the buffer behind it.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch
from conduit import (
    Automatic,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Replay,
    Scheduler,
)
from conduit.scheduling.worker import Worker

SCHEMA = ExperienceSchema(x=Field((8,)))
WORKER_NAMES = ("conduit-ingest", "conduit-prefetch")


def _workers() -> int:
    return sum(t.name in WORKER_NAMES for t in threading.enumerate())


def _gone(ref: weakref.ref[object], timeout: float = 10.0) -> bool:
    """Whether ``ref`` dies within ``timeout`` (a prefetch job in flight holds its buffer until it ends)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.02)
    return False


def _threads_end(before: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _workers() <= before:
            return True
        time.sleep(0.02)
    return False


def _off_policy(scheduler: Scheduler) -> weakref.ref[object]:
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=Replay(seed=0), scheduler=scheduler)
    for _ in range(5):
        edp.ingest({"x": torch.ones(16, 8)})
    edp.flush()
    for _ in range(3):
        edp.deliver(8)
    edp.ingest({"x": torch.ones(16, 8)})  # possibly still queued when the buffer is dropped
    return weakref.ref(edp)


def _on_policy(scheduler: Scheduler) -> weakref.ref[object]:
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=OnPolicy(num_minibatches=2, seed=0),
                              scheduler=scheduler)
    edp.ingest({"x": torch.ones(32, 8)}, version=0)
    edp.seal()
    edp.deliver()
    return weakref.ref(edp)


CASES: dict[str, Callable[[], weakref.ref[object]]] = {
    "overlapped": lambda: _off_policy(Overlapped(g_ing=2, g_del=2)),
    "overlapped-no-background-ingest": lambda: _off_policy(Overlapped(g_ing=2, g_del=2, background_ingest=False)),
    "on-policy": lambda: _on_policy(Overlapped(g_ing=0.5)),
    "automatic": lambda: _off_policy(Automatic()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_buffer_dropped_without_close_is_freed_and_its_threads_end(case: str) -> None:
    before = _workers()
    ref = CASES[case]()
    assert _gone(ref), f"{case}: the dropped buffer is still alive: {gc.get_referrers(ref()) if ref() else ''}"
    assert _threads_end(before), f"{case}: {_workers() - before} worker threads still run for a freed buffer"


def test_a_finished_job_keeps_nothing_of_its_caller() -> None:
    class Owner:
        def work(self) -> int:
            return 1

    owner = Owner()
    pool = Worker("conduit-prefetch")
    try:
        job = pool.submit(owner.work)
        assert job.result() == 1
        ref = weakref.ref(owner)
        del owner
        assert _gone(ref), "the finished job (or the idle worker) still holds its function's owner"
    finally:
        pool.shutdown()
