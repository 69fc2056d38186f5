"""Leftovers: a write failing after close() from the ingestion worker is logged, the learned on-policy rollout
size counts whole rollouts only, and a failed migration into a disk placement deletes the new files at once."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    ColumnarStorage,
    ExperienceDataPlane,
    ExperienceSchema,
    OnPolicy,
    Overlapped,
    Replay,
    SchemaError,
)
from conduit.placement import HostPlacement
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import Workload
from conduit.placement.placement_map import AdaptivePlacement, MapRange, PlacementMap
from conduit.testing.lifecycle import eventually
from conduit.testing.reference import ID_SCHEMA, id_batch


class _GatedStorage(ColumnarStorage):
    """Host storage whose appends wait for ``gate``, fail ``fail_times`` times for a batch holding an id in
    ``fail_ids``, and record the size of every append."""

    gate: threading.Event
    fail_ids: set[int]
    fail_times = 0
    sizes: list[int]

    def append(self, batch: Any, *, evict: bool = True) -> Any:
        assert self.gate.wait(10), "gate never opened"
        ids = batch["id"].tolist()
        if self.fail_times and self.fail_ids.intersection(ids):
            self.fail_times -= 1
            raise RuntimeError(f"injected append failure (ids {ids})")
        self.sizes.append(len(ids))
        return super().append(batch, evict=evict)


class _GatedPlacement(HostPlacement):
    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        s = _GatedStorage(schema, capacity, "cpu")
        s.gate, s.fail_ids, s.sizes = self.gate, set(), []
        return s


class _CloseOnFirstAppend(Replay):
    """Replay whose first ``on_append`` closes the buffer (on the ingestion worker, inside its write)."""

    def __init__(self) -> None:
        super().__init__(seed=1)
        self.edp: ExperienceDataPlane | None = None
        self.errors: list[BaseException] = []
        self.done = threading.Event()

    def on_append(self, result: Any, *, version: int | None, priorities: torch.Tensor | None) -> None:
        super().on_append(result, version=version, priorities=priorities)
        if self.edp is not None and not self.done.is_set():
            try:
                self.edp.close()
            except BaseException as e:  # noqa: BLE001 - recorded for the assertions
                self.errors.append(e)
            finally:
                self.done.set()


def _background_replay() -> tuple[ExperienceDataPlane, _GatedPlacement, _GatedStorage]:
    """A replay buffer on gated host storage that stores each hand-over on its background ingestion worker."""
    placement = _GatedPlacement()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1), placement=placement,
                              scheduler=Overlapped(g_ing=1, overlap=False, background_ingest=True))
    assert isinstance(edp.storage, _GatedStorage)
    return edp, placement, edp.storage


def _unstored_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("conduit")
            and "not stored" in r.getMessage()]


# -- 1. a write failing after close() from the ingestion worker is not silent --
def test_a_write_failing_after_close_on_the_worker_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    sem = _CloseOnFirstAppend()
    placement = _GatedPlacement()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=sem, placement=placement,
                              scheduler=Overlapped(g_ing=1, overlap=False, background_ingest=True))
    sem.edp = edp
    placement.gate.clear()  # the first write waits: the batches below queue behind it
    for k in range(4):
        edp.ingest(id_batch(np.arange(4 * k, 4 * k + 4)))
    storage = edp.storage
    assert isinstance(storage, _GatedStorage)
    storage.fail_ids, storage.fail_times = {8}, 1  # the third write (ids 8..11) fails once
    placement.gate.set()
    assert sem.done.wait(10), "the closing callback never ran"
    assert sem.errors == [], f"close() on the ingestion worker raised {sem.errors!r}"
    worker = edp.scheduler._ingestion._thread
    assert worker is not None
    worker.join(10)
    assert not worker.is_alive(), "the ingestion worker did not stop after its write failed"
    assert len(edp.scheduler.pending()) == 2, f"expected 2 unstored batches, got {len(edp.scheduler.pending())}"
    found = _unstored_warnings(caplog)
    assert len(found) == 1, (f"a write failing after close() on the ingestion worker should log one warning about the "
                             f"unstored batches; logged {[r.getMessage() for r in caplog.records]}")
    msg = found[0].getMessage()
    assert "2 " in msg and "close()" in msg and "injected append failure" in msg, f"unhelpful warning: {msg!r}"
    caplog.clear()
    edp.close()  # the retry succeeds now
    assert edp.scheduler.pending() == []
    assert _unstored_warnings(caplog) == [], "a close() that stored everything logged an unstored-batches warning"


def test_a_failing_close_from_another_thread_raises_without_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    edp, placement, storage = _background_replay()
    storage.fail_ids, storage.fail_times = {0}, 1
    ingestion = edp.scheduler._ingestion
    placement.gate.clear()  # the write waits until close() has begun: it fails inside close(), not before it
    edp.ingest(id_batch(np.arange(0, 4)))

    def open_once_closing() -> None:
        eventually(lambda: ingestion._closing, timeout=10)
        placement.gate.set()

    opener = threading.Thread(target=open_once_closing)
    opener.start()
    with pytest.raises(RuntimeError, match="injected append failure"):
        edp.close()
    opener.join(10)
    assert _unstored_warnings(caplog) == [], "close() raised the failure; a warning on top of it is noise"
    edp.close()
    assert storage.sizes == [4]


def test_a_write_failing_before_close_is_retried_by_close_and_nothing_is_lost() -> None:
    """close() makes one last try: a background write that failed before it (unreported) is retried, and when the
    retry stores everything, close() returns with every batch stored once, in order."""
    edp, placement, storage = _background_replay()
    storage.fail_ids, storage.fail_times = {4}, 1
    ingestion = edp.scheduler._ingestion
    placement.gate.clear()  # all three are handed over before the failure (a hand-over after it would raise it)
    for k in range(3):
        edp.ingest(id_batch(np.arange(4 * k, 4 * k + 4)))
    placement.gate.set()
    with ingestion._cv:  # the second write fails on the worker, which pauses with two batches queued
        assert ingestion._cv.wait_for(lambda: ingestion._paused, 10), "the injected failure never happened"
    assert len(edp.scheduler.pending()) == 2
    edp.close()
    assert storage.sizes == [4, 4, 4], f"writes {storage.sizes}: the retry should store both queued batches"
    assert edp.scheduler.pending() == []
    ids = storage.gather(torch.arange(12))["id"]
    assert isinstance(ids, torch.Tensor)
    stored = ids.tolist()
    assert stored == list(range(12)), f"stored ids {stored}: a retried batch was stored out of order"


# -- 2. the learned on-policy rollout size counts whole rollouts --
def test_learned_rollout_size_counts_whole_rollouts_when_every_rollout_is_flushed_part_way() -> None:
    placement = _GatedPlacement()
    sched = Overlapped(g_ing=0.5, overlap=False, background_ingest=False)  # rollout_size learned
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=OnPolicy(num_minibatches=2), placement=placement,
                              scheduler=sched)
    storage = edp.storage
    assert isinstance(storage, _GatedStorage)
    nxt = 0
    for version in range(3):
        for part in range(4):  # 8 items per rollout, in 4 hand-overs of 2
            edp.ingest(id_batch(np.arange(nxt, nxt + 2)), version=version)
            nxt += 2
            if part == 1 and version < 2:
                edp.flush()  # part way through the rollout (as state_dict() or the caller may)
        edp.seal()
    learned = sched._ingestion._learned
    assert learned == 8, f"learned a rollout size of {learned} items; every rollout had 8 (flushes part way counted)"
    # the third rollout (not flushed part way) is stored in writes of g_ing * 8 = 4 items
    assert storage.sizes[-2:] == [4, 4], f"writes of the last rollout: {storage.sizes[-4:]}, expected [4, 4]"
    edp.close()


def test_learned_rollout_size_ends_a_rollout_at_a_new_version_too() -> None:
    sched = Overlapped(g_ing=0.5, overlap=False, background_ingest=False)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    nxt = 0
    for version in range(2):
        for part in range(3):  # 6 items per rollout, each rollout flushed part way, ended by the next version
            edp.ingest(id_batch(np.arange(nxt, nxt + 2)), version=version)
            nxt += 2
            if part == 0:
                edp.flush()
    edp.ingest(id_batch(np.arange(nxt, nxt + 2)), version=2)
    edp.flush()
    learned = sched._ingestion._learned
    assert learned == 6, f"learned a rollout size of {learned} items; every rollout had 6"
    edp.close()


# -- 3. a failed migration into a disk placement deletes the new storage's directory at once --
def test_a_failed_migration_into_a_disk_placement_removes_its_directory_at_once(tmp_path: Path) -> None:
    disk = PlacementSpec("disk", ("disk",))
    workload = Workload(field_bytes=(8, 12), capacity=64, batch=8)
    pmap = PlacementMap([MapRange(1.0, float("inf"), disk)], workload, "test", max_item_bytes=1e6)
    adaptive = AdaptivePlacement(pmap, directory=tmp_path)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1))
    edp.ingest(id_batch(np.arange(16)))
    edp.flush()

    def bad_transform(batch: Any) -> Any:
        raise RuntimeError("injected transform failure")

    grown = ExperienceSchema(id=ID_SCHEMA["id"], obs=type(ID_SCHEMA["obs"])((5,), torch.float32))
    kept = edp.storage
    err: BaseException | None = None
    try:
        edp.migrate(adaptive, schema=grown, transform=bad_transform)
    except SchemaError as e:
        err = e  # its traceback keeps the failed migration's frames (and the new storage) alive, as a caller's may
    assert err is not None and "injected transform failure" in str(err), f"the migration did not fail: {err!r}"
    left = [p.name for p in tmp_path.iterdir()]
    assert left == [], f"the failed migration left the disk storage's files behind: {left}"
    assert edp.storage is kept and len(edp) == 16, "the failed migration changed the buffer"
    edp.close()


def test_a_failed_migration_into_a_plain_disk_placement_removes_its_directory_at_once(tmp_path) -> None:
    """``rebalance`` migrates through the map's spec, a DiskPlacement: its abandoned storage is closed too."""
    import torch
    from conduit import ExperienceDataPlane, ExperienceSchema, Field
    from conduit.errors import SchemaError
    from conduit.placement.base import DiskPlacement

    schema = ExperienceSchema(x=Field((2,), torch.float32))
    grown = ExperienceSchema(x=Field((3,), torch.float32))
    edp = ExperienceDataPlane(schema, capacity=16)
    edp.ingest({"x": torch.zeros(4, 2)})

    def broken(batch):  # noqa: ANN001, ANN202 - a transform that fails on the first chunk
        raise ValueError("no")

    with pytest.raises(SchemaError) as err:  # kept: its traceback holds the abandoned storage alive
        edp.migrate(DiskPlacement(directory=tmp_path), schema=grown, transform=broken)
    assert not list(tmp_path.glob("conduit-disk-*")), "the abandoned disk storage's directory is still there"
    assert err.value is not None
    assert len(edp) == 4 and edp.schema == schema
    edp.close()
