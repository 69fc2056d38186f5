"""A scheduler primitive that raises still records its span (with no items).

``ingest_now``, ``deliver_now``, ``gather_now`` and ``prepare_now`` recorded their ``ingest``/``deliver`` span only
after the work succeeded. A write or a gather that failed on a scheduler's worker thread therefore left no trace:
the worker's time was missing from the hidden time of :mod:`conduit.exposure`, from the totals and from a trace,
although the caller-side ``ingest_wait``/``deliver_wait`` already count a call that raised (with no items). Now a
primitive that raises records its span with no items (none stored or delivered), which the latency model of
``Automatic`` leaves out as it moved nothing.

Real threads, no mocks; every wait is on an event or a condition (generous timeouts), nothing is timed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conduit import ExperienceDataPlane, OnPolicy
from conduit.errors import CapacityError, ConfigurationError, EmptyBufferError
from conduit.exposure import measure_iteration
from conduit.scheduling import Overlapped
from conduit.scheduling.model import observations
from conduit.telemetry import CallRecord, thread_id
from conduit.testing.lifecycle import eventually
from conduit.testing.reference import ID_SCHEMA, id_batch

TIMEOUT = 60.0


def test_a_background_write_that_fails_records_its_worker_span() -> None:
    sched = Overlapped()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=OnPolicy(seed=5, num_minibatches=2),
                              scheduler=sched)
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    loop = thread_id()
    # does not fit until the first rollout is consumed: the worker's write fails (waited for, not slept on)
    edp.ingest(id_batch(np.arange(100, 110)), version=1)
    assert eventually(lambda: sched._ingestion._paused, timeout=TIMEOUT), "the background write never failed"
    worker = [r for r in edp.telemetry.records if r.kind == "ingest" and r.thread != loop]
    assert len(worker) == 2, f"the failed background write recorded no span: {edp.telemetry.records}"
    stored, failed = worker
    assert (stored.items, failed.items, failed.nbytes) == (10, 0, 0), f"a failed write stored nothing: {worker}"
    # its time is the worker's experience-path time: hidden, while the loop did something else
    exp = measure_iteration([failed], failed.start, failed.end, loop_threads={loop})
    assert exp.hidden_s == pytest.approx(failed.seconds) and exp.exposed_s == 0.0
    assert edp.telemetry.totals["ingest"].items == 10, "the failed write counted items it did not store"
    with pytest.raises(CapacityError, match="still queued|stay queued"):  # (the failure, reported once)
        edp.ingest(id_batch(np.arange(200, 202)), version=1)
    while not edp.deliver()[1].last:  # consume the first rollout: room for the second
        pass
    edp.seal()  # flushes: the retry now stores it
    assert edp.telemetry.totals["ingest"].items == 20
    edp.close()


def _empty_replay() -> ExperienceDataPlane:
    return ExperienceDataPlane(ID_SCHEMA, capacity=16)


def _on_worker(fn: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """Run ``fn`` on a fresh thread (as a scheduler's worker runs a primitive); its exception and thread id."""
    out: list[Any] = []

    def run() -> None:
        tid = thread_id()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out.append((e, tid))
        else:
            out.append((None, tid))

    t = threading.Thread(target=run, name="worker")
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive() and out
    return out[0]


def _closed(edp: ExperienceDataPlane) -> ExperienceDataPlane:
    edp.ingest(id_batch(np.arange(4)))
    sels = edp.select_now([2])
    assert sels is not None
    edp.close()
    edp._test_sels = sels  # type: ignore[attr-defined]
    return edp


@pytest.mark.parametrize(("call", "build", "error"), [
    ("deliver_now", _empty_replay, EmptyBufferError),
    ("prepare_now", _empty_replay, EmptyBufferError),
    ("gather_now", lambda: _closed(_empty_replay()), ConfigurationError),
])
def test_a_delivery_primitive_that_raises_on_a_worker_records_its_span(
        call: str, build: Callable[[], ExperienceDataPlane], error: type[BaseException]) -> None:
    edp = build()
    fn: Callable[[], Any] = {
        "deliver_now": lambda: edp.deliver_now(2),
        "prepare_now": lambda: edp.prepare_now([2]),
        "gather_now": lambda: edp.gather_now(edp._test_sels),  # type: ignore[attr-defined]
    }[call]
    before = edp.telemetry.mark()
    err, tid = _on_worker(fn)
    assert isinstance(err, error), f"{call} did not raise as set up: {err!r}"
    calls, dropped = edp.telemetry.calls_since(before)
    assert not dropped
    spans = [r for r in calls if r.kind == "deliver" and r.thread == tid]
    assert len(spans) == 1, f"{call} that raised on a worker recorded no span: {calls}"
    assert spans[0].items == 0 and spans[0].nbytes == 0, "a failed delivery counted items it did not deliver"
    edp.close()


def test_the_latency_model_leaves_out_calls_that_raised() -> None:
    # (a call that raised moved nothing: a point at 0 bytes would pull the fitted per-call overhead down)
    recs = [CallRecord("deliver", 4, 400, 0.0, 1.0, 1), CallRecord("deliver", 0, 0, 2.0, 2.5, 1),
            CallRecord("ingest", 0, 0, 3.0, 3.5, 1)]
    assert observations(recs, "deliver") == [(400.0, 1.0, False)]
    assert observations(recs, "ingest") == []
