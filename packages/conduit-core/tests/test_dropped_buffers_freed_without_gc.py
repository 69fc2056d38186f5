"""A buffer its user drops (closed or not) is freed by reference counting alone, with its scheduler and threads.

Before, the buffer held its scheduler and the scheduler held the buffer back (``scheduler.edp``), and an
``Overlapped`` scheduler held itself (its lock-wait mark, and the traceback of a prefetch job's error): a dropped
buffer, its storage, its delivery buffers (page-locked ones for a GPU learner) and its worker threads lived on
until the cyclic garbage collector happened to run. The tests here run with that collector disabled.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conduit import (
    Automatic,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Replay,
    Scheduler,
    Synchronous,
)
from conduit.semantics import Selection, UniformSampler
from conduit.testing.lifecycle import holds_within, live_workers

SCHEMA = ExperienceSchema(x=Field((8,)))


@pytest.fixture(autouse=True)
def _no_cyclic_gc() -> Iterator[None]:
    gc.collect()  # (what earlier tests left)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()




class _OneDraw(UniformSampler):
    """Uniform, but finds nothing to draw after its first batch (as a queue that waits for new items): the prefetch
    job after the first delivery fails, and the scheduler holds that job's error."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        if getattr(self, "drawn", False):
            raise EmptyBufferError("nothing new to draw")
        self.drawn = True
        return super().sample(n, replace=replace, beta=beta)


def _off_policy(scheduler: Scheduler, close: bool, sampler: Any = None) -> list[weakref.ref[Any]]:
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=Replay(sampler, seed=0), scheduler=scheduler)
    for _ in range(4):
        edp.ingest({"x": torch.ones(16, 8)})
    edp.flush()
    edp.deliver(8)
    if sampler is None:
        edp.deliver(8)
    edp.ingest({"x": torch.ones(16, 8)})  # possibly still queued when the buffer is dropped
    if close:
        edp.close()
    return [weakref.ref(edp), weakref.ref(edp.storage), weakref.ref(scheduler)]


def _on_policy(scheduler: Scheduler, close: bool) -> list[weakref.ref[Any]]:
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=OnPolicy(num_minibatches=2, seed=0),
                              scheduler=scheduler)
    edp.ingest({"x": torch.ones(32, 8)}, version=0)
    edp.seal()
    edp.deliver()
    edp.ingest({"x": torch.ones(32, 8)}, version=0)
    if close:
        edp.close()
    return [weakref.ref(edp), weakref.ref(edp.storage), weakref.ref(scheduler)]


CASES: dict[str, Callable[[bool], list[weakref.ref[Any]]]] = {
    "synchronous": lambda close: _off_policy(Synchronous(), close),
    "overlapped": lambda close: _off_policy(Overlapped(), close),
    "overlapped-granular": lambda close: _off_policy(Overlapped(g_ing=2, g_del=2), close),
    "overlapped-sequential": lambda close: _off_policy(Overlapped(overlap=False), close),
    "overlapped-prefetch-failed": lambda close: _off_policy(Overlapped(), close, _OneDraw()),
    "on-policy": lambda close: _on_policy(Overlapped(g_ing=0.5), close),
    "automatic": lambda close: _off_policy(Automatic(), close),
}


@pytest.mark.parametrize("close", [False, True], ids=["dropped", "closed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_dropped_buffer_is_freed_by_reference_counting(case: str, close: bool) -> None:
    before = live_workers()
    refs = CASES[case](close)
    # (a prefetch job that runs holds the buffer until it has prepared its chunk: polled, never collected)
    assert holds_within(lambda: refs[0]() is None), f"{case}: the dropped buffer is alive without a garbage collection"
    assert refs[1]() is None, f"{case}: the dropped buffer's storage is alive"
    assert holds_within(lambda: refs[2]() is None), f"{case}: the dropped scheduler is alive without a collection"
    assert holds_within(lambda: live_workers() <= before), f"{case}: workers still run: {live_workers() - before}"


def test_a_scheduler_kept_by_its_user_does_not_keep_its_buffer() -> None:
    before = live_workers()
    scheduler = Overlapped(g_ing=2, g_del=2)
    edp_ref = _off_policy(scheduler, close=False)[0]
    assert holds_within(lambda: edp_ref() is None), "the scheduler kept its dropped buffer alive"
    assert holds_within(lambda: live_workers() <= before), f"worker threads still run: {live_workers() - before}"
    assert getattr(scheduler, "edp", None) is None
    # it serves a new buffer (the old one is gone), and serves it whole
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=Replay(seed=0), scheduler=scheduler)
    edp.ingest({"x": torch.arange(32.0).reshape(4, 8)})
    edp.flush()
    batch, _ = edp.deliver(4)
    assert batch["x"].shape == (4, 8) and len(edp) == 4
    edp.close()
