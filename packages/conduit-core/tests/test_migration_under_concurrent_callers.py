"""The online migration against concurrent callers.

* a migration inside ``read_locked()`` whose scheduler cannot drop its prepared deliveries (a prefetch job waits
  for the lock the caller holds) is refused before anything changes, instead of swapping the storage and then
  raising, leaving batches prepared in the old schema to be delivered after it;
* a ``close()`` on another thread while a migration copies ends the migration with the "closed" error and the
  buffer's storage untouched (the disk storage it built is removed), instead of swapping storage into a closed
  buffer;
* producers ingesting through an ``Overlapped`` scheduler and a prefetching learner while a migration runs
  (host -> disk -> host) lose, duplicate and reorder nothing, and every delivered row is the item of its handle.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from conduit import ConfigurationError, ExperienceBatch, ExperienceDataPlane, ExperienceSchema, Field
from conduit.placement import DiskPlacement, HostPlacement, Placement
from conduit.placement.migration import MigrationReport, migrate
from conduit.scheduling import Overlapped, Synchronous
from conduit.scheduling.base import Scheduler
from conduit.semantics.base import SampleInfo
from conduit.testing.lifecycle import call_bounded

OLD = ExperienceSchema(obs=Field((3,)))
NEW = ExperienceSchema(obs=Field((5,)))


def _obs(batch: ExperienceBatch) -> torch.Tensor:
    obs = batch["obs"]
    assert isinstance(obs, torch.Tensor)
    return obs


def _deliver(edp: ExperienceDataPlane, n: int) -> tuple[ExperienceBatch, SampleInfo]:
    out = call_bounded(lambda: edp.deliver(n), hang="deliver hung")
    assert isinstance(out, tuple), out
    return out


def _pad(batch: ExperienceBatch) -> dict[str, torch.Tensor]:  # old-schema chunk -> new schema (zero-padded)
    obs = _obs(batch)
    return {"obs": torch.cat([obs, torch.zeros(obs.shape[0], 2)], dim=1)}


def _items(n: int, first: int = 0) -> dict[str, torch.Tensor]:
    """``n`` items whose observation is their handle (one producer, no eviction: handle = sequence number)."""
    h = torch.arange(first, first + n, dtype=torch.float32)
    return {"obs": h[:, None].expand(n, 3).clone()}


def test_migrate_inside_read_locked_with_a_waiting_prefetch_job_is_refused_before_the_swap() -> None:
    sched = Overlapped(g_ing=1, g_del=2, background_ingest=False)
    edp = ExperienceDataPlane(OLD, capacity=64, scheduler=sched)
    try:
        edp.ingest(_items(32))
        edp.flush()
        storage = edp.storage

        def fn() -> object:
            # prepares a chunk of two in the call (one kept ready), then starts a prefetch job that waits for the
            # lock this thread holds
            edp.deliver(4)
            try:
                return edp.migrate(HostPlacement(), schema=NEW, transform=_pad)
            except ConfigurationError as e:
                return e

        out = call_bounded(lambda: edp.read_locked(fn), hang="migrate inside read_locked hung")
        if isinstance(out, ConfigurationError):  # refused: then nothing changed
            assert edp.schema == OLD and edp.storage is storage, "a refused migration swapped the storage"
        else:
            assert isinstance(out, MigrationReport), out
        # whatever was prepared before is delivered in the buffer's schema now
        for _ in range(4):
            batch, _ = _deliver(edp, 4)
            assert _obs(batch).shape[1:] == edp.schema["obs"].shape, "a batch prepared in the replaced schema"
        # outside read_locked the same migration goes through, and deliveries follow the new schema
        report = call_bounded(lambda: edp.migrate(HostPlacement(), schema=NEW, transform=_pad), hang="migrate hung")
        assert isinstance(report, MigrationReport), report
        assert edp.schema == NEW and len(edp) == 32
        for _ in range(4):
            batch, info = _deliver(edp, 4)
            assert _obs(batch).shape == (4, 5)
            assert torch.equal(_obs(batch)[:, 0], info.handles.to(torch.float32))
            assert not _obs(batch)[:, 3:].any()
    finally:
        edp.close()


def test_migrate_inside_read_locked_without_pending_work_still_runs() -> None:
    scheds: list[Scheduler] = [Synchronous(), Overlapped(g_ing=1, g_del=1, background_ingest=False)]
    for sched in scheds:
        edp = ExperienceDataPlane(OLD, capacity=16, scheduler=sched)
        try:
            edp.ingest(_items(10))
            edp.flush()

            def inside(edp: ExperienceDataPlane = edp) -> MigrationReport:
                return edp.read_locked(lambda: edp.migrate(HostPlacement(), schema=NEW, transform=_pad))

            out = call_bounded(inside)
            assert isinstance(out, MigrationReport), out
            assert edp.schema == NEW and len(edp) == 10 and out.items == 10
        finally:
            edp.close()


def _close_during_migration(sched: Scheduler, tmp_path: Any) -> None:
    edp = ExperienceDataPlane(OLD, capacity=64, scheduler=sched)
    edp.ingest(_items(40))
    edp.flush()
    storage = edp.storage
    closed: list[bool] = []

    def progress(chunks: int, copied: int) -> None:  # between chunks, outside the lock: close on another thread
        if not closed:
            t = threading.Thread(target=edp.close, name="closer", daemon=True)
            t.start()
            t.join(60)
            closed.append(not t.is_alive())

    target = DiskPlacement(directory=tmp_path)
    out = call_bounded(lambda: migrate(edp, target, chunk_bytes=4 * OLD.fixed_item_bytes, progress=progress),
                       hang="the migration hung after close()")
    assert closed == [True], "close() on another thread hung while the migration copied"
    assert edp.closed
    assert isinstance(out, ConfigurationError) and "closed" in str(out), f"migrated a closed buffer: {out!r}"
    assert edp.storage is storage and edp.storage.tier == "host"
    assert len(edp) == 40
    state = edp.state_dict()["storage"]
    assert (state["oldest"], state["next"]) == (0, 40)
    assert list(tmp_path.iterdir()) == [], "the abandoned disk storage was left behind"


def test_close_on_another_thread_ends_a_migration_synchronous(tmp_path: Any) -> None:
    _close_during_migration(Synchronous(), tmp_path)


def test_close_on_another_thread_ends_a_migration_overlapped(tmp_path: Any) -> None:
    _close_during_migration(Overlapped(g_ing=2, g_del=2), tmp_path)


def test_migration_under_concurrent_ingest_and_prefetching_delivery(tmp_path: Any) -> None:
    """Nothing lost, duplicated or reordered; no delivered row from a half-migrated storage."""
    total, per = 1200, 8
    edp = ExperienceDataPlane(OLD, capacity=2048, scheduler=Overlapped(g_ing=2, g_del=2, queue_depth=4))
    errors: list[BaseException] = []
    stop = threading.Event()
    started = threading.Event()
    delivered = [0]

    def produce() -> None:
        try:
            for i in range(0, total, per):
                edp.ingest(_items(per, i))
                if i == 10 * per:
                    started.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            started.set()

    def learn() -> None:
        try:
            while not stop.is_set():
                if len(edp) < 8:
                    stop.wait(0.001)
                    continue
                batch, info = edp.deliver(8)
                obs = _obs(batch)
                assert torch.equal(obs[:, 0], info.handles.to(torch.float32)), "a row of another item"
                assert torch.equal(obs[:, 0], obs[:, 2])
                delivered[0] += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    producer = threading.Thread(target=produce, name="producer", daemon=True)
    learner = threading.Thread(target=learn, name="learner", daemon=True)
    producer.start()
    started.wait(60)
    learner.start()
    try:
        chunk = 16 * OLD.fixed_item_bytes
        placements: list[Placement] = [DiskPlacement(directory=tmp_path), HostPlacement()]
        for placement in placements:

            def run(p: Placement = placement) -> MigrationReport:
                return migrate(edp, p, chunk_bytes=chunk)

            out = call_bounded(run, hang="migration hung")
            assert isinstance(out, MigrationReport), out
        producer.join(60)
        assert not producer.is_alive(), "the producer hung"
        edp.flush()
    finally:
        stop.set()
        learner.join(60)
    assert not learner.is_alive(), "the learner hung"
    assert not errors, errors
    assert delivered[0] > 0
    state = edp.state_dict()["storage"]
    assert (state["oldest"], state["next"]) == (0, total)
    obs = _obs(edp.storage.gather(torch.arange(total)))
    assert torch.equal(obs[:, 0], torch.arange(total, dtype=torch.float32)), "lost, duplicated or reordered"
    assert edp.storage.tier == "host"
    edp.close()
