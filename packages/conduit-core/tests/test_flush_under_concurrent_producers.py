"""A flush returns once what was handed over before it is stored, while other producers keep handing over.

It waited for an empty ingestion queue: producers that kept a bounded queue full (storing slower than producing,
backpressure) starved it, and ``state_dict()`` and ``seal()``, which flush first, hung with it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from conduit import ColumnarStorage, ExperienceDataPlane, OnPolicy, Overlapped, Replay
from conduit.placement import HostPlacement, Placement
from conduit.testing.lifecycle import call_bounded
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

#: what every write of the slow tier below costs (seconds): storing is far slower than producing
WRITE_S = 0.02
#: how long a flush may take before the test calls it stuck (only reached when it is)
STUCK_S = 60.0


class _SlowWriteStorage(ColumnarStorage):
    """Host storage whose every append first waits ``WRITE_S``, as a write to a slow tier would."""

    def append(self, batch: Any, *, evict: bool = True) -> Any:
        time.sleep(WRITE_S)
        return super().append(batch, evict=evict)


class _SlowWritePlacement(HostPlacement):
    def storage(self, schema: Any, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        return _SlowWriteStorage(schema, capacity, "cpu")


def _producer(edp: ExperienceDataPlane, stop: threading.Event, handed: list[int], errors: list[BaseException],
              **kwargs: Any) -> threading.Thread:
    """A thread that hands over batches of two ids until ``stop``; ``handed[0]``: ids whose ingest returned."""

    def run() -> None:
        i = 0
        try:
            while not stop.is_set():
                edp.ingest(id_batch(np.arange(i, i + 2)), **kwargs)
                i += 2
                handed[0] = i
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_handed(handed: list[int], n: int) -> None:
    deadline = time.monotonic() + STUCK_S
    while handed[0] < n:
        assert time.monotonic() < deadline, f"the producer handed over only {handed[0]} ids"
        time.sleep(0.005)


@pytest.mark.parametrize("call", ["flush", "state_dict", "drain"])
def test_a_flush_under_a_producer_that_keeps_the_queue_full_returns_with_what_came_before_it_stored(call) -> None:
    placement: Placement = _SlowWritePlacement()
    sched = Overlapped(queue_depth=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1 << 16, semantics=Replay(seed=1), scheduler=sched,
                              placement=placement)
    stop, handed, errors = threading.Event(), [0], []  # type: ignore[var-annotated]
    t = _producer(edp, stop, handed, errors)
    try:
        _wait_handed(handed, 8)  # (the queue is full: the producer waits for room from here on)
        before = handed[0]
        target = {"flush": edp.flush, "state_dict": edp.state_dict, "drain": sched.drain}[call]
        hang = f"{call}() did not return while a producer kept handing over (it waited for an empty queue)"
        out = call_bounded(target, STUCK_S, hang=hang)
        assert not isinstance(out, BaseException), out
        assert t.is_alive() and not errors, errors
        stored = edp.read_locked(lambda: len(edp))
        assert stored >= before, f"{call}() returned with {stored} items stored, {before} were handed over before it"
        if call == "drain":
            assert out is True
        if call == "state_dict":
            assert out["storage"]["data"]["id"].shape[0] >= before
    finally:
        stop.set()
        t.join(STUCK_S)
    edp.flush()
    ids = check_payload(edp.state_dict()["storage"]["data"])
    assert sorted(ids.tolist()) == list(range(handed[0])), "ids were lost or duplicated"
    edp.close()


def test_seal_under_a_producer_of_the_next_version_returns() -> None:
    """On-policy: a seal of version 0's rollout while version 1 keeps arriving stores version 0's items and returns."""
    sched = Overlapped(queue_depth=2, g_ing=1.0)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1 << 16, semantics=OnPolicy(num_minibatches=1, seed=0),
                              scheduler=sched, placement=_SlowWritePlacement())
    edp.ingest(id_batch(np.arange(0, 4)), version=0)
    stop, handed, errors = threading.Event(), [0], []  # type: ignore[var-annotated]
    t = _producer(edp, stop, handed, errors, version=1)
    try:
        _wait_handed(handed, 8)
        out = call_bounded(edp.seal, STUCK_S, hang="seal() did not return while a producer kept handing over version 1")
        assert out is None, out
        assert not errors, errors
        batch, info = edp.deliver()
        assert info.version == 0 and sorted(check_payload(batch).tolist()) == [0, 1, 2, 3]
    finally:
        stop.set()
        t.join(STUCK_S)
    edp.close()
