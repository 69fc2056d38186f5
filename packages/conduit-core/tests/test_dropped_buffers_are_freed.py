"""A buffer its owner drops without ``close()`` is freed, storage and worker threads included.

Background ingestion and prefetch run on worker threads. Before, an idle ingestion thread held
its buffer (and so every byte of its storage) for the life of the process, and a prefetch
thread held the last job it ran, with the scheduler and the buffer behind it.
"""

from __future__ import annotations

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
from conduit.testing.lifecycle import eventually, live_workers, no_workers_beyond, worker_threads

SCHEMA = ExperienceSchema(x=Field((8,)))
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
    before = live_workers()
    ref = CASES[case]()
    assert eventually(lambda: ref() is None), f"{case}: the dropped buffer is still alive"
    assert eventually(lambda: no_workers_beyond(before)), f"{case}: worker threads still run: {worker_threads()}"


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
        assert eventually(lambda: ref() is None), "the finished job (or idle worker) still holds its function's owner"
    finally:
        pool.shutdown()
