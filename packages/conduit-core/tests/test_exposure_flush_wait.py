"""The loop's wait in ``flush()`` for background writes is exposed time.

With background ingestion, ``ingest`` only hands the batch over; a ``flush`` (or an on-policy ``seal``, which
flushes first) then blocks
the loop until the worker has stored it. That wait was recorded nowhere, so the worker's write, which the loop sat
waiting for, was counted as *hidden* (done "while the loop did something else") and the exposed time missed the
wait. ``flush`` now records the caller's wait as a ``flush_wait`` span, one of the experience-path kinds the loop's
exposed time is the union of.

Deterministic: a helper thread holds the buffer's lock so the worker cannot store the batch; a profile hook on the
loop thread releases it only once the loop waits inside ``flush``. No timed assertions.
"""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType
from typing import Any

import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field
from conduit.exposure import EXPERIENCE_KINDS, ExposureLog
from conduit.scheduling import Overlapped
from conduit.telemetry import thread_id

TIMEOUT = 60.0


def _waited_write(edp: ExperienceDataPlane, hand_over: Any, wait: Any) -> tuple[float, ExposureLog]:
    """One iteration: ``hand_over()`` a batch, then ``wait()`` for it while the worker cannot store it until the
    loop is blocked in the wait. Returns when the loop began to block (``time.perf_counter()``) and the log."""
    log = ExposureLog(edp.telemetry, loop_threads={thread_id()})
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with edp.lock:
            holding.set()
            assert release.wait(TIMEOUT)

    helper = threading.Thread(target=hold, name="lock-holder", daemon=True)
    helper.start()
    assert holding.wait(TIMEOUT)
    blocked: list[float] = []

    def on_call(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and not blocked and frame.f_code.co_name == "wait" \
                and frame.f_code.co_filename == threading.__file__:
            blocked.append(time.perf_counter())  # the loop waits for the write: let the worker store it
            release.set()

    with log.iteration():
        hand_over()
        sys.setprofile(on_call)
        try:
            wait()
        finally:
            sys.setprofile(None)
    helper.join(TIMEOUT)
    assert blocked and not helper.is_alive()
    return blocked[0], log


def _check(edp: ExperienceDataPlane, blocked: float, log: ExposureLog) -> None:
    it = log.iterations[-1]
    me = thread_id()
    (write,) = [r for r in edp.telemetry.records if r.kind == "ingest" and r.thread != me]
    assert write.end > blocked  # the worker stored the batch while the loop waited for it
    waits = [r for r in edp.telemetry.records
             if r.thread == me and r.kind in EXPERIENCE_KINDS and r.start <= blocked <= r.end]
    assert waits, "the loop's wait for the background write is on no record: it was counted as hidden"
    (wait,) = waits
    assert wait.kind == "flush_wait" and (wait.items, wait.nbytes) == (0, 0)
    waited = min(write.end, wait.end) - max(write.start, wait.start)
    assert waited > 0
    assert it.hidden_s <= write.seconds - waited + 1e-12  # the part the loop waited for is not hidden
    assert it.exposed_s >= wait.seconds


def test_a_flush_waiting_for_a_background_write_is_exposed_not_hidden() -> None:
    schema = ExperienceSchema(obs=Field((64,), torch.float32))
    edp = ExperienceDataPlane(schema, capacity=1000, scheduler=Overlapped(background_ingest=True))
    try:
        blocked, log = _waited_write(edp, lambda: edp.ingest({"obs": torch.zeros(100, 64)}), edp.flush)
        _check(edp, blocked, log)
        assert len(edp) == 100
    finally:
        edp.close()


def test_a_flush_records_the_callers_wait_unless_the_buffer_stores_in_ingest() -> None:
    schema = ExperienceSchema(obs=Field((4,), torch.float32))
    edp = ExperienceDataPlane(schema, capacity=10, scheduler=Overlapped())
    sync = ExperienceDataPlane(schema, capacity=10)
    try:
        edp.flush()
        sync.flush()
        assert [(r.kind, r.items, r.nbytes, r.thread) for r in edp.telemetry.records] == [
            ("flush_wait", 0, 0, thread_id())]
        assert sync.telemetry.records == ()  # (a Synchronous buffer stores in ingest: a flush waits for nothing)
    finally:
        edp.close()
        sync.close()
