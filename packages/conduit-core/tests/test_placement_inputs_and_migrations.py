"""Placement inputs and migrations: refusals are typed (profile cache, topology names, planner inputs), an adaptive
placement observes the size of the items the buffer now holds, and migrations that run beside background
work or fail part way keep every item, handle, priority and on-policy position exactly."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import (
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    Replay,
    SchemaError,
)
from conduit.batch import ExperienceBatch
from conduit.cli import main
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement import (
    AdaptivePlacement,
    CostModel,
    HostPlacement,
    Placement,
    PlacementSpec,
    Planner,
    ShardedPlacement,
    Workload,
    load_profile,
    load_topology,
)
from conduit.placement import profile as profile_module
from conduit.placement import topology as topology_module
from conduit.placement.migration import migrate
from conduit.placement.placement_map import MapRange, PlacementMap
from conduit.scheduling import Overlapped

HOST = PlacementSpec("host", ("cpu",))
DISK = PlacementSpec("disk", ("disk",))
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((2,), torch.float32))
#: 8 B id + 4 float32 = 24 B per item; grown: 8 B id + 8 float32 = 40 B
SMALL = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))
GROWN = ExperienceSchema(id=Field((), torch.int64), obs=Field((8,), torch.float32))


def batch(ids: range | list[int]) -> dict[str, torch.Tensor]:
    t = torch.as_tensor(np.asarray(list(ids)), dtype=torch.int64)
    return {"id": t, "obs": torch.stack([t.float(), 2 * t.float()], 1)}


def _pad(b: ExperienceBatch) -> dict[str, torch.Tensor]:
    return {"id": b["id"], "obs": torch.cat([b["obs"], torch.zeros(b.batch_size, 4)], dim=1)}


# -- the profile cache: a cache entry that cannot be read is a PlacementError, never an OSError --------------


def test_load_profile_of_a_directory_is_a_placement_error(tmp_path: Path) -> None:
    (tmp_path / "profile.json").mkdir()
    with pytest.raises(PlacementError, match="Cannot read the bandwidth profile"):
        load_profile(tmp_path / "profile.json")  # was: IsADirectoryError


def test_cli_cached_profile_that_is_a_directory_is_an_error_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    profile_module.profile_path().mkdir()  # this machine's cache entry, but a directory
    assert main(["profile", "--cached"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Cannot read the bandwidth profile" in err, err


def test_a_measurement_whose_cache_cannot_be_written_is_returned_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_machine measured everything, then raised from save(): `conduit plan --topology local` failed and
    the measurement was lost."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(blocker))
    with pytest.warns(RuntimeWarning, match="not cached"):
        prof = profile_module.profile_machine(quick=True, disk_directory=str(tmp_path))
    assert prof.source == "measured" and prof.has("host_gather")
    assert blocker.read_text() == "", "the blocking file was changed"


# -- topology names: data-file names only; a broken data file is a PlacementError ---------------------------


@pytest.mark.parametrize("name", ["../topologies/h200x1", "./h200x1", "", ".hidden"])
def test_a_topology_name_that_is_a_path_is_unknown(name: str) -> None:
    with pytest.raises(PlacementError, match="Unknown topology"):
        load_topology(name)  # "../topologies/h200x1" was loaded from outside the name space


class _Files:
    """``importlib.resources`` stand-in whose package files live under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def files(self, package: str) -> Path:
        return self.root


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff"], ids=["broken", "list", "not-utf8"])
def test_a_malformed_topology_data_file_is_a_placement_error(text: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "topologies").mkdir()
    f = tmp_path / "topologies" / "broken.json"
    if text == "\xff":
        f.write_bytes(b"\xff\xfe{")
    else:
        f.write_text(text)
    monkeypatch.setattr(topology_module, "resources", _Files(tmp_path))
    with pytest.raises(PlacementError, match="topology 'broken'"):
        load_topology("broken")  # was: json.JSONDecodeError / UnicodeDecodeError / AttributeError


# -- planner inputs: NaN, infinite, negative and bool values are ConfigurationErrors -------------------------


@pytest.mark.parametrize("field_bytes", [(math.nan,), (math.inf,), (-1,), (True,), ("8",)])
def test_workload_refuses_non_finite_or_non_numeric_field_bytes(field_bytes: tuple[object, ...]) -> None:
    with pytest.raises(ConfigurationError, match="field_bytes"):
        Workload(field_bytes, capacity=10, batch=1)  # type: ignore[arg-type]  # NaN was: ValueError


@pytest.mark.parametrize("name", ["capacity", "batch", "learners", "ingest_items"])
def test_workload_refuses_bool_counts(name: str) -> None:
    kwargs: dict[str, object] = {"capacity": 10, "batch": 1, "learners": 1, "ingest_items": None, name: True}
    with pytest.raises(ConfigurationError, match=name):
        Workload((8,), **kwargs)  # type: ignore[arg-type]  # True was taken as 1


@pytest.mark.parametrize("size", [math.nan, math.inf, -5.0])
def test_resized_refuses_nan_infinite_or_negative_sizes(size: float) -> None:
    w = Workload.transitions(8, capacity=100, batch=4)
    with pytest.raises(ConfigurationError, match="item_bytes"):
        w.resized(size)  # NaN was: ValueError; inf: OverflowError; -5: a silently clamped item


def test_resized_still_gives_exactly_the_requested_size() -> None:
    w = Workload.transitions(8, capacity=100, batch=4)
    assert [w.resized(b).item_bytes for b in (13, 14, 1000, 1001.0)] == [13, 14, 1000, 1001]


@pytest.mark.parametrize("length", [math.nan, math.inf, -1.0])
def test_from_schema_refuses_a_bad_mean_ragged_length(length: float) -> None:
    schema = ExperienceSchema(tok=Field((), torch.int64, ragged=True))
    with pytest.raises(ConfigurationError, match="mean_ragged_length"):
        Workload.from_schema(schema, capacity=10, batch=1, mean_ragged_length=length)  # NaN was: ValueError


@pytest.mark.parametrize("nbytes", [math.nan, math.inf, -math.inf])
def test_move_seconds_refuses_non_finite_sizes(nbytes: float) -> None:
    model = CostModel(load_topology("dgx-a100-80g"))
    with pytest.raises(ConfigurationError, match="nbytes"):
        model.move_seconds(nbytes, HOST, PlacementSpec("gpu", ("cuda:0",)))  # was: ValueError / OverflowError
    assert model.move_seconds(0, HOST, PlacementSpec("gpu", ("cuda:0",))) == 0.0


@pytest.mark.parametrize("points", [0, 1, -3, 2.5, math.nan, True])
def test_placement_map_refuses_bad_point_counts(points: object) -> None:
    planner = Planner(load_topology("h200x1"))
    w = Workload.transitions(8, capacity=1000, batch=4)
    with pytest.raises(ConfigurationError, match="points"):
        planner.placement_map(w, min_item_bytes=64, max_item_bytes=200, points=points)  # type: ignore[arg-type]


def test_placement_map_with_two_points_still_finds_the_boundary() -> None:
    planner = Planner(load_topology("h200x1"))
    w = Workload.transitions(8, capacity=10**6, batch=512)
    two = planner.placement_map(w, min_item_bytes=64, max_item_bytes=400_000, points=2)
    many = planner.placement_map(w, min_item_bytes=64, max_item_bytes=400_000, points=32)
    assert two.boundaries and two.boundaries[-1] == many.boundaries[-1]


def test_a_placement_map_of_one_range_looks_up_within_it() -> None:
    pmap = PlacementMap([MapRange(10.0, math.inf, HOST)], Workload((8,), 10, 1), "t", max_item_bytes=100)
    assert pmap.boundaries == []
    assert pmap.lookup(0) == pmap.lookup(10) == pmap.lookup(100) == HOST
    with pytest.raises(PlacementError, match="exceed the range"):
        pmap.lookup(101)
    with pytest.raises(ConfigurationError, match="at least one range"):
        PlacementMap([], Workload((8,), 10, 1), "t")


# -- AdaptivePlacement: after a migration to a grown schema, the observed size is the new items' -----------


def _adaptive(tmp_path: Path) -> tuple[ExperienceDataPlane, AdaptivePlacement]:
    w = Workload.from_schema(SMALL, capacity=64, batch=1)
    pmap = PlacementMap([MapRange(1.0, 30, HOST), MapRange(30, math.inf, DISK)], w, "t", max_item_bytes=10_000)
    adaptive = AdaptivePlacement(pmap, directory=tmp_path, window=4)
    edp = ExperienceDataPlane(SMALL, capacity=64, placement=adaptive)
    for i in range(5):
        edp.ingest({"id": torch.arange(4 * i, 4 * i + 4), "obs": torch.ones(4, 4)})
    return edp, adaptive


def test_rebalance_after_a_grown_schema_does_not_move_back(tmp_path: Path) -> None:
    edp, adaptive = _adaptive(tmp_path)
    assert adaptive.observed_item_bytes(edp) == 24.0 and adaptive.current == HOST
    report = adaptive.rebalance(edp, schema=GROWN, transform=_pad)
    assert report is not None and edp.storage.tier == "disk" and adaptive.current == DISK
    # no ingestion yet in the grown schema: the size is the schema's (40 B, disk), not the old calls' 24 B
    assert adaptive.observed_item_bytes(edp) == 40.0
    assert adaptive.rebalance(edp) is None, "migrated back to host on the old schema's telemetry"
    assert edp.storage.tier == "disk" and len(adaptive.migrations) == 1
    edp.ingest({"id": torch.arange(20, 24), "obs": torch.ones(4, 8)})
    assert adaptive.observed_item_bytes(edp) == 40.0 and adaptive.rebalance(edp) is None
    ids = edp.state_dict()["storage"]["data"]["id"].tolist()
    assert ids == list(range(24))
    edp.close()


def test_a_placement_only_migration_keeps_the_observed_size(tmp_path: Path) -> None:
    """Without a schema change every recent call still counts (nothing falls back to the assumed size)."""
    schema = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
    w = Workload.from_schema(schema, capacity=64, batch=1, mean_ragged_length=4)
    pmap = PlacementMap([MapRange(1.0, 100, HOST), MapRange(100, math.inf, DISK)], w, "t", max_item_bytes=10_000)
    adaptive = AdaptivePlacement(pmap, directory=tmp_path, mean_ragged_length=4, window=4)
    edp = ExperienceDataPlane(schema, capacity=64, placement=adaptive, ragged_capacity=64 * 4)  # the planned 4 tokens
    edp.ingest({"id": torch.arange(8), "tok": [torch.zeros(20, dtype=torch.int64)] * 8})  # 8 + 160 B
    assert adaptive.observed_item_bytes(edp) == 168.0
    assert adaptive.rebalance(edp) is not None and edp.storage.tier == "disk"
    assert adaptive.observed_item_bytes(edp) == 168.0 and adaptive.rebalance(edp) is None
    edp.close()


# -- migrations beside background work, and failing part way -------------------------------------------------


def test_a_migration_failing_part_way_under_prefetch_leaves_a_prioritized_buffer_exactly() -> None:
    """The transform fails on the third chunk while a background scheduler holds prepared draws: contents,
    handles, priorities and the sampler's RNG are as before: the buffer delivers on exactly as a twin that
    never tried the migration, and takes priority updates and ingestion."""
    def build() -> ExperienceDataPlane:
        edp = ExperienceDataPlane(SCHEMA, capacity=100, semantics=Replay(PrioritizedSampler(alpha=0.6), seed=1),
                                  scheduler=Overlapped(g_ing=2, g_del=2))
        for i in range(0, 130, 10):  # wrapped: 30 evicted
            edp.ingest(batch(range(i, i + 10)), priorities=torch.arange(i, i + 10).float() + 1)
        edp.flush()
        for _ in range(2):
            edp.deliver(8)
        return edp

    twin, edp = build(), build()
    grown = ExperienceSchema(id=Field((), torch.int64), obs=Field((3,), torch.float32))
    calls = {"n": 0}

    def fails_third(b: ExperienceBatch) -> dict[str, torch.Tensor]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return {"id": b["id"], "obs": torch.cat([b["obs"], torch.zeros(b.batch_size, 1)], 1)}

    try:
        before, twin_state = edp.state_dict(), twin.state_dict()
        with pytest.raises(SchemaError, match="transform failed"):
            migrate(edp, ShardedPlacement(["cpu"] * 2), schema=grown, transform=fails_third, chunk_bytes=25 * 20)
        assert calls["n"] == 3, "the failure was meant to come part way"
        twin.scheduler.invalidate("contents")  # what the failed migration's flush and refusal may have dropped
        after = edp.state_dict()
        assert edp.schema is SCHEMA and edp.storage.tier == "host"
        assert (after["storage"]["oldest"], after["storage"]["next"]) == (30, 130)
        for k, v in before["storage"]["data"].items():
            assert torch.equal(v, after["storage"]["data"][k]), k
        assert repr(before["semantics"]) == repr(after["semantics"]) == repr(twin_state["semantics"])
        for step in range(4):  # (no ingestion in between: the prefetch's timing then changes no draw)
            (a, ia), (b, ib) = twin.deliver(8), edp.deliver(8)
            assert a["id"].tolist() == b["id"].tolist() and torch.equal(ia.weights, ib.weights), f"step {step}"
            assert torch.equal(b["obs"][:, 1], 2 * b["id"].float())
        assert edp.update_priorities(ib.handles, torch.full((8,), 3.0)) == 8
        edp.ingest(batch(range(130, 140)), priorities=torch.full((10,), 2.0))
        edp.flush()
        assert edp.state_dict()["storage"]["data"]["id"].tolist() == list(range(40, 140))
    finally:
        twin.close()
        edp.close()


def test_an_on_policy_buffer_migrated_under_prefetch_continues_as_a_synchronous_one() -> None:
    def make(scheduler: Overlapped | None) -> ExperienceDataPlane:
        edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=4, num_epochs=2, seed=3),
                                  scheduler=scheduler)
        edp.ingest(batch(range(20)), version=0)
        edp.seal()
        edp.ingest(batch(range(20, 40)), version=1)
        return edp

    a, b = make(None), make(Overlapped(g_ing=1, g_del=1))
    try:
        for i in range(12):
            if i == 2:
                report = b.migrate(ShardedPlacement(["cpu"] * 3))
                assert report.items == 40 and (report.oldest, report.next_handle) == (0, 40)
            if i == 3:
                a.seal()
                b.seal()
            if i == 4:
                a.set_policy_version(1)
                b.set_policy_version(1)
            (xa, ia), (xb, ib) = a.deliver(), b.deliver()
            assert xa["id"].tolist() == xb["id"].tolist(), f"delivery {i}"
            assert (ia.version, ia.epoch, ia.minibatch, ia.last) == (ib.version, ib.epoch, ib.minibatch, ib.last)
        assert len(a) == len(b) == 0
    finally:
        a.close()
        b.close()


def test_profile_cache_of_another_machine_is_refused(tmp_path: Path) -> None:
    declared = load_topology("h200x1").declared
    assert declared is not None
    d = {**declared.to_dict(), "source": "measured", "machine": "0123456789abcdef"}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlacementError, match="another machine"):
        load_profile(f)
    assert os.path.exists(f)


@pytest.mark.parametrize("target", ["host", "sharded"])
def test_a_migration_ends_when_ingestion_outpaces_its_chunks(target: str) -> None:
    """Between every two chunks more items arrive than a chunk copies: the migration still ends (the rest is
    copied in its last lock hold), and holds exactly what a twin that never moved holds, drawing alike."""
    def build() -> ExperienceDataPlane:
        edp = ExperienceDataPlane(SCHEMA, capacity=40, semantics=Replay(PrioritizedSampler(), seed=2))
        for i in range(0, 60, 10):  # wrapped
            edp.ingest(batch(range(i, i + 10)), priorities=torch.arange(i, i + 10).float() + 1)
        return edp

    twin, edp = build(), build()
    nxt = {"id": 60, "calls": 0}

    def progress(chunks: int, copied: int) -> None:
        nxt["calls"] += 1
        if nxt["calls"] > 500:
            raise AssertionError("the migration never catches up with ingestion")
        ids = range(nxt["id"], nxt["id"] + 5)  # 5 items per 3-item chunk
        for e in (twin, edp):
            e.ingest(batch(ids), priorities=torch.tensor([float(i % 7 + 1) for i in ids]))
        nxt["id"] += 5

    placement = HostPlacementOrSharded(target)
    report = migrate(edp, placement, chunk_bytes=3 * SCHEMA.fixed_item_bytes, progress=progress)
    assert nxt["calls"] < 500 and report.items == len(edp) == 40
    assert (report.oldest, report.next_handle) == (nxt["id"] - 40, nxt["id"])
    ids = edp.state_dict()["storage"]["data"]["id"].tolist()
    assert ids == twin.state_dict()["storage"]["data"]["id"].tolist() == list(range(nxt["id"] - 40, nxt["id"]))
    (a, ia), (b, ib) = twin.deliver(16), edp.deliver(16)
    assert a["id"].tolist() == b["id"].tolist() and torch.equal(ia.weights, ib.weights)


def HostPlacementOrSharded(target: str) -> Placement:  # noqa: N802 - reads as a constructor
    return HostPlacement() if target == "host" else ShardedPlacement(["cpu"] * 3)


@pytest.mark.parametrize("ranges", [
    [MapRange(100.0, math.inf, DISK), MapRange(1.0, 100.0, HOST)],  # unsorted: 50 B looked up as disk
    [MapRange(1.0, 50.0, HOST), MapRange(100.0, math.inf, DISK)],  # a gap
    [MapRange(1.0, 200.0, HOST), MapRange(100.0, math.inf, DISK)],  # overlapping
    [MapRange(math.nan, math.inf, HOST)],
    [MapRange(5.0, 5.0, HOST)],
    [(1.0, math.inf, HOST)],
], ids=["unsorted", "gap", "overlap", "nan", "empty", "tuple"])
def test_a_placement_map_refuses_ranges_that_are_not_sorted_and_contiguous(ranges: list[MapRange]) -> None:
    with pytest.raises(ConfigurationError, match="range"):
        PlacementMap(ranges, Workload((8,), 10, 1), "t", max_item_bytes=1000)  # was: silently wrong lookups


@pytest.mark.parametrize("kwargs", [{"sizes": ()}, {"iterations": 2.5}, {"iterations": 0}, {"iterations": -3}],
                         ids=["no-sizes", "float", "zero", "negative"])
def test_paper_schedule_refuses_bad_arguments(kwargs: dict[str, object]) -> None:
    from conduit.placement.growth import paper_schedule

    with pytest.raises(ConfigurationError):
        paper_schedule(**kwargs)  # type: ignore[arg-type]  # was: ZeroDivisionError, TypeError, or []
    assert paper_schedule(5, (1, 2)) == [1, 1, 1, 2, 2]


def test_a_disk_placement_in_a_path_that_is_a_file_is_a_placement_error(tmp_path: Path) -> None:
    """Building the buffer, and migrating a live one there: a typed refusal, the live buffer unchanged."""
    from conduit.placement import DiskPlacement

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    schema = ExperienceSchema(id=Field((), torch.int64))
    with pytest.raises(PlacementError, match="cannot use"):
        ExperienceDataPlane(schema, capacity=8, placement=DiskPlacement(directory=not_a_dir))  # was: FileExistsError
    edp = ExperienceDataPlane(schema, capacity=8)
    edp.ingest({"id": torch.arange(5)})
    with pytest.raises(PlacementError, match="cannot use"):
        edp.migrate(DiskPlacement(directory=not_a_dir / "sub"))  # was: NotADirectoryError
    assert edp.storage.tier == "host" and edp.state_dict()["storage"]["data"]["id"].tolist() == list(range(5))
