"""``read_locked``, a close that raised, and pending counts (EDP and SRL).

* ``read_locked``: the public way to run a read under a buffer's lock (it replaced ``select_now([], when=fn)``);
* SRL ``qsize()`` while a sample is being stored: it was counted both as pending and as stored;
* ``DistributedDataPlane.close()`` whose scheduler's close raised: the plane stays open, nothing is dropped.
"""

from __future__ import annotations

import threading
from contextlib import closing
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Synchronous
from conduit.errors import ConduitError
from conduit.telemetry import Telemetry
from conduit.testing.lifecycle import start_bounded

#: waits for another thread, hit only on failure: generous (a loaded machine, a Ray write)
JOIN_S = 60.0
#: how long a qsize() that waits for a paused store is given before the store goes on (it returns either way)
QSIZE_WAIT_S = 0.5


# -- read_locked ---------------------------------------------------------------------------------------------
def test_read_locked_returns_the_result_runs_under_the_buffer_lock_and_is_refused_when_closed() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=8)
    edp.ingest({"obs": torch.ones(3, 2)})
    inside = threading.Event()
    release = threading.Event()
    read: list[int] = []
    stored: list[int] = []

    def slow_read() -> int:
        inside.set()
        release.wait(JOIN_S)
        return len(edp.storage)

    def writer() -> None:
        edp.ingest({"obs": torch.ones(2, 2)})
        stored.append(len(edp))

    reader = threading.Thread(target=lambda: read.append(edp.read_locked(slow_read)))
    reader.start()
    w = threading.Thread(target=writer)
    try:
        assert inside.wait(JOIN_S), "read_locked did not run its function"
        w.start()
        w.join(0.3)
        assert not stored, "an ingest stored while read_locked's function ran: it did not hold the buffer's lock"
    finally:
        release.set()
    reader.join(JOIN_S)
    w.join(JOIN_S)
    assert read == [3], f"read_locked returned {read}, not its function's result (3 items stored then)"
    assert stored == [5], f"the ingest that waited for the lock stored {stored}"

    edp.close()
    ran: list[bool] = []
    with pytest.raises(ConfigurationError, match="closed"):
        edp.read_locked(lambda: ran.append(True))
    assert not ran, "read_locked ran its function on a closed buffer"


# -- SRL qsize while a sample is being stored ----------------------------------------------------------------
class GatedTelemetry(Telemetry):
    """A buffer's telemetry that pauses the thread storing a batch right after its write.

    ``ingest_now`` records its call after it stored the batch, and before the scheduler marks the batch stored:
    the real write is paused at exactly that point (puts run on another thread than the test's, so only a write
    on another thread waits). A background ingestion worker has released the buffer's lock by then; a store run
    in the putting thread (no overlap) still holds it.
    """

    def __init__(self, main: threading.Thread) -> None:
        super().__init__()
        self.main = main
        self.gate = threading.Event()
        self.entered = threading.Event()

    def record(self, kind: str, items: int, nbytes: int, start: float, end: float) -> None:
        super().record(kind, items, nbytes, start, end)
        if kind == "ingest" and threading.current_thread() is not self.main and not self.gate.is_set():
            self.entered.set()
            self.gate.wait(JOIN_S)


def _sample(i: int, version: int = 0) -> Any:
    from conduit_srl.testing import make_sample

    return make_sample([i], version=version)


@pytest.mark.parametrize(("semantics", "overlap"), [("queue", True), ("queue", False), ("replay", True),
                                                    ("on_policy", True), ("on_policy", False)])
def test_srl_qsize_counts_a_sample_being_stored_once(semantics: str, overlap: bool) -> None:
    pytest.importorskip("conduit_srl")
    from conduit_srl import ConduitBuffer

    kw: dict[str, Any] = {"num_minibatches": 1} if semantics == "on_policy" else {"batch_size": 2}
    with closing(ConduitBuffer(semantics=semantics, capacity=64, overlap=overlap, **kw)) as b:
        b.put(_sample(0))
        b.flush()
        assert b.qsize() == 1
        edp = b._a.edp
        tel = GatedTelemetry(threading.current_thread())
        edp.telemetry = tel
        put = threading.Thread(target=b.put, args=(_sample(1),))
        put.start()
        try:
            assert tel.entered.wait(JOIN_S), "the write of the second sample did not run"
            # (the storage read directly: a store in the putting thread holds the buffer's lock through its record)
            assert len(edp.storage) == 2, "the paused write had not stored its sample"
            # qsize() may answer now, or wait for the store to finish (a put stored in the caller's thread holds
            # the buffer's lock through it): either is right, as long as it counts the sample once
            reader, seen = start_bounded(b.qsize, name="qsize")
            reader.join(QSIZE_WAIT_S)
        finally:
            tel.gate.set()
        put.join(JOIN_S)
        reader.join(JOIN_S)
        assert not reader.is_alive(), "qsize() did not return once the store finished"
        b.flush()
        assert seen == [2], (f"qsize() said {seen[0]} while the second sample was being stored ({semantics}, "
                             f"overlap={overlap}); 2 samples were put (the one being stored counted twice)")
        assert b.qsize() == 2


# -- DistributedDataPlane.close() whose scheduler's close raised ---------------------------------------------
class _FirstCloseFails:
    """Mixed in first: the scheduler's first close fails before it stops anything (as one that cannot store
    what was handed over); the next close is the scheduler's own."""

    failures = 1

    def close(self) -> None:
        if self.failures:
            self.failures -= 1
            raise ConduitError("could not store what was handed over (test)")
        super().close()  # type: ignore[misc]


class CloseFailsOnce(_FirstCloseFails, Synchronous):
    """Synchronous scheduling whose first close fails."""


class OverlappedCloseFailsOnce(_FirstCloseFails, Overlapped):
    """Overlapped scheduling (no overlap) whose first close fails."""

    def __init__(self) -> None:
        super().__init__(overlap=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("make_scheduler", [CloseFailsOnce, OverlappedCloseFailsOnce])
def test_distributed_close_that_raised_leaves_the_plane_open_and_a_second_close_finishes(servers: Any,
                                                                                        make_scheduler: Any) -> None:
    pytest.importorskip("ray")
    import ray
    from conduit import Replay
    from conduit.distributed import DistributedDataPlane
    from conduit.distributed.server import ping
    from conduit.testing.reference import ID_SCHEMA, id_batch

    def partitions() -> list[int]:
        return [int(ray.get(ping(s.actor), timeout=60)) for s in servers.servers]

    before = partitions()
    plane = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=servers, semantics=Replay(seed=0), measure=False,
                                 health_period=0.2, scheduler=make_scheduler())
    try:
        plane.ingest(id_batch(np.arange(8)))
        plane.flush()
        held = partitions()
        assert plane.read_locked(lambda: len(plane.storage)) == 8, "read_locked on the plane did not return its result"
        with pytest.raises(ConduitError, match="could not store"):
            plane.close()
        assert not plane.closed, "close() raised, yet the plane says it is closed"
        assert partitions() == held, f"close() raised, yet the shards dropped the plane's partitions: {partitions()}"
        assert plane._monitor is not None and plane._monitor.is_alive(), "close() raised, yet the monitor stopped"
        plane.ingest(id_batch(np.arange(8, 12)))
        plane.flush()
        assert len(plane) == 12, f"the plane kept {len(plane)} items after a failed close and 4 more ingested"
        batch, _ = plane.deliver(4)
        assert batch.batch_size == 4
        assert plane.state_dict() is not None
    finally:
        plane.close()
    assert plane.closed, "the second close() did not finish"
    assert partitions() == before, f"the second close() left partitions: {partitions()} (before: {before})"
    with pytest.raises(ConfigurationError, match="closed"):
        plane.read_locked(lambda: None)


# -- Overlapped.pending() agrees with the storage (core, single-node and distributed) ---------------------------
def _pending_and_stored_while_a_write_is_paused(plane: Any, first: np.ndarray, second: np.ndarray) -> tuple[int, int]:
    """(items stored, items pending) read under the plane's lock while the write of ``second`` is paused just
    after it stored the items (``plane`` has an Overlapped scheduler with background ingestion)."""
    from conduit.testing.reference import id_batch

    plane.ingest(id_batch(first))
    plane.flush()
    tel = GatedTelemetry(threading.current_thread())
    plane.telemetry = tel
    plane.ingest(id_batch(second))
    try:
        assert tel.entered.wait(JOIN_S), "the background write did not run"
        seen = plane.read_locked(lambda: (len(plane.storage),
                                          sum(h.batch.batch_size for h in plane.scheduler.pending())))
    finally:
        tel.gate.set()
    plane.flush()
    return seen


def test_overlapped_pending_leaves_out_a_batch_once_its_write_stored_it() -> None:
    from conduit.testing.reference import ID_SCHEMA

    with ExperienceDataPlane(ID_SCHEMA, capacity=64, scheduler=Overlapped()) as edp:
        seen = _pending_and_stored_while_a_write_is_paused(edp, np.arange(4), np.arange(4, 10))
    assert seen == (10, 0), (f"(stored, pending) read under the lock was {seen} once the write of 6 items had stored "
                             f"them: the batch counted both as stored and as pending")


@pytest.mark.timeout(600)
def test_distributed_overlapped_pending_leaves_out_a_batch_once_its_write_stored_it(servers: Any) -> None:
    pytest.importorskip("ray")
    from conduit import Replay
    from conduit.distributed import DistributedDataPlane
    from conduit.testing.reference import ID_SCHEMA

    plane = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=servers, semantics=Replay(seed=0), measure=False,
                                 scheduler=Overlapped())
    with plane:
        seen = _pending_and_stored_while_a_write_is_paused(plane, np.arange(4), np.arange(4, 10))
    assert seen == (10, 0), (f"(stored, pending) read under the lock was {seen} once the write of 6 items had stored "
                             f"them: the batch counted both as stored and as pending")
