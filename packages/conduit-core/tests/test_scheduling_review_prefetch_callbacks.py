"""Calls into the buffer from a callback that runs on Overlapped's prefetch worker (a storage tier's or a sampler's
hook inside the job's select-and-gather).

Such a call that would wait for the prefetch job (a delivery that needs the job's batches, ``state_dict()``,
``migrate()``, ``close()``) waited for the very job it runs in: the worker hung forever, and so did every later
delivery, ``flush``-free ``close`` and the interpreter's exit hook. It is refused instead
(:class:`~conduit.ConfigurationError`, nothing changed), as the same calls are from a callback on the ingestion
worker, and the buffer goes on delivering exactly what a synchronous one does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    ColumnarStorage,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Overlapped,
    Replay,
    Synchronous,
)
from conduit.placement import HostPlacement
from conduit.scheduling.base import Scheduler
from conduit.testing.lifecycle import call_bounded, wait_until
from conduit.testing.reference import ID_SCHEMA, id_batch


class _HookStorage(ColumnarStorage):
    """Host storage that runs ``hook`` once, inside a gather made on the prefetch worker (under the buffer's lock),
    and keeps what it returned or raised in ``outcome``; ``ran`` is set after it."""

    hook: Callable[[], object] | None = None

    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> Any:
        hook = self.hook
        if hook is not None and threading.current_thread().name == "conduit-prefetch":
            self.hook = None
            try:
                self.outcome: object = hook()
            except BaseException as e:  # noqa: BLE001 - inspected by the test
                self.outcome = e
            self.ran.set()
        return super().gather(slots, out)


class _HookPlacement(HostPlacement):
    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        s = _HookStorage(schema, capacity, "cpu")
        s.ran = threading.Event()
        return s


def _buffer(scheduler: Scheduler, placement: HostPlacement | None = None) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1000, semantics=Replay(seed=1), scheduler=scheduler,
                              placement=placement)
    edp.ingest(id_batch(np.arange(100)))
    edp.flush()
    return edp


_CALLS: dict[str, Callable[[ExperienceDataPlane], object]] = {
    "deliver": lambda edp: edp.deliver(4),  # (another batch size: it needs the job's batches dropped)
    "state_dict": lambda edp: edp.state_dict(),
    "migrate": lambda edp: edp.migrate(HostPlacement()),
    "close": lambda edp: edp.close(),
    "scheduler.close": lambda edp: edp.scheduler.close(),
}


@pytest.mark.parametrize("call", sorted(_CALLS))
def test_a_call_that_waits_for_the_prefetch_job_from_inside_it_is_refused_not_hung(call: str) -> None:
    ref = _buffer(Synchronous())
    want = [ref.deliver(8)[1].handles.tolist() for _ in range(4)]
    ref.close()

    edp = _buffer(Overlapped(), _HookPlacement())
    storage = edp.storage
    assert isinstance(storage, _HookStorage)
    storage.hook = lambda: _CALLS[call](edp)
    got = [edp.deliver(8)[1].handles.tolist()]  # starts the prefetch job, whose gather runs the hook
    sched = edp.scheduler
    assert isinstance(sched, Overlapped)
    job = sched._job
    assert job is not None, "the delivery started no prefetch job"
    call_bounded(job.wait, hang=f"{call} from a callback on the prefetch worker waited for its own job forever")
    assert storage.ran.is_set()
    err = storage.outcome
    assert isinstance(err, ConfigurationError), f"{call} inside the prefetch job was not refused: {err!r}"
    assert "prefetch worker" in str(err) and "Nothing was changed" in str(err), err
    # nothing changed: the buffer is open, and delivers what the synchronous buffer does (the job's batches too)
    assert not edp.closed
    got += [edp.deliver(8)[1].handles.tolist() for _ in range(3)]
    assert got == want
    call_bounded(edp.close, hang="close() after the refused call hung")
    pool = sched._pool
    assert pool is not None and not pool._thread.is_alive(), "close() left the prefetch worker running"


_WHILE_AWAITED: dict[str, Callable[[ExperienceDataPlane], object]] = {
    "deliver": lambda edp: edp.deliver(4),
    "state_dict": lambda edp: edp.state_dict(),
    "retune": lambda edp: edp.scheduler.retune(g_del=2),
    "release_buffers": lambda edp: edp.scheduler.release_buffers(),
    "close": lambda edp: edp.close(),
}


@pytest.mark.parametrize("call", sorted(_WHILE_AWAITED))
def test_a_call_from_inside_the_prefetch_job_while_a_delivery_waits_for_that_job_is_refused(call: str) -> None:
    """Another thread's delivery holds the scheduler's delivery lock while it waits for the prefetch job; a call from a
    callback inside that job that takes the delivery lock (even one that never waits for the job itself, such as
    ``retune`` or ``release_buffers``) waited for that delivery, which waited for the job: both hung forever."""
    ref = _buffer(Synchronous())
    want = [ref.deliver(8)[1].handles.tolist() for _ in range(3)]
    ref.close()

    edp = _buffer(Overlapped(), _HookPlacement())
    sched = edp.scheduler
    assert isinstance(sched, Overlapped)
    storage = edp.storage
    assert isinstance(storage, _HookStorage)
    started: list[Any] = []

    def hook() -> object:
        # until the other delivery waits for this very job (it marks that wait in the scheduler before it begins)
        wait_until(lambda: started and sched._awaited is started[0], "the second delivery waits for the prefetch job",
                   timeout=60)
        return _WHILE_AWAITED[call](edp)

    storage.hook = hook
    got = [edp.deliver(8)[1].handles.tolist()]  # starts the prefetch job, whose gather runs the hook
    job = sched._job
    assert job is not None, "the delivery started no prefetch job"
    started.append(job)
    # the same request: it waits for the job's batch (a request for another size would first wait for the lock)
    second = call_bounded(lambda: edp.deliver(8), name="second",
                          hang=f"{call} from inside the prefetch job and the delivery waiting for that job hung")
    assert storage.ran.is_set()
    err = storage.outcome
    assert isinstance(err, ConfigurationError), f"{call} inside the prefetch job was not refused: {err!r}"
    assert "prefetch worker" in str(err) and "Nothing was changed" in str(err), err
    assert not isinstance(second, BaseException), second
    got.append(second[1].handles.tolist())
    got.append(edp.deliver(8)[1].handles.tolist())
    assert got == want
    call_bounded(edp.close, hang="close() after the refused call hung")
