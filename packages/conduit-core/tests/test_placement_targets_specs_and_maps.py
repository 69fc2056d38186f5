"""Placement review: a migration target must keep the buffer's capacity (slots and sampler state are keyed by
``handle % capacity``); a placement spec names devices, not the characters of one name; a hand-built placement map
answers only the sizes its ranges cover; a plan on a discovered topology builds its disk tier on the volume it
checked; batches handed over either side of a migration to a new schema are stored apart; a corrupt profile cache
is a PlacementError (which profile_machine answers by measuring again); the host memory planned for ragged fields
covers their per-item index; a batch validated just before a migration to a new schema is stored through the
transform."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay
from conduit.batch import ExperienceBatch
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement import (
    BandwidthProfile,
    CostModel,
    HostPlacement,
    LinkCost,
    PlacementSpec,
    Planner,
    Workload,
    discover_topology,
    load_profile,
    load_topology,
    machine_id,
)
from conduit.placement.migration import migrate
from conduit.placement.placement_map import MapRange, PlacementMap
from conduit.placement.profile import PROFILE_FORMAT
from conduit.scheduling import Overlapped
from conduit.storage.base import Storage
from conduit.storage.columnar import ColumnarStorage

SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((2,), torch.float32))
HOST = PlacementSpec("host", ("cpu",))
TEMPLATE = Workload.from_schema(SCHEMA, capacity=100, batch=10)


def batch(ids: range) -> dict[str, torch.Tensor]:
    t = torch.as_tensor(np.asarray(list(ids)), dtype=torch.int64)
    return {"id": t, "obs": torch.stack([t.float(), 2 * t.float()], 1)}


def prioritized(items: int) -> ExperienceDataPlane:
    """A prioritized buffer of 8 slots that has taken ``items`` items (more than 8: the ring wrapped)."""
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(PrioritizedSampler(alpha=0.6), seed=3))
    for a in range(0, items, 3):
        b = min(items, a + 3)
        edp.ingest(batch(range(a, b)), priorities=torch.arange(a + 1.0, b + 1.0))
    return edp


class _Resized(HostPlacement):
    """A custom placement whose storage has another capacity than the one asked for."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.built: list[Storage] = []

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        st = ColumnarStorage(schema, int(capacity * self.factor), "cpu")
        self.built.append(st)
        return st


@pytest.mark.parametrize(("factor", "items"), [(2, 10), (0.5, 3)])
def test_a_migration_target_of_another_capacity_is_refused_and_changes_nothing(factor: float, items: int) -> None:
    edp, twin = prioritized(items), prioritized(items)
    old = edp.storage
    target = _Resized(factor)
    with pytest.raises(PlacementError, match="keeps the capacity"):
        edp.migrate(target)
    assert target.built, "the target's storage was never built"
    assert edp.storage is old and edp.capacity == 8 and len(edp) == len(twin)
    # the buffer goes on as its twin that never tried: same draws, and ingestion into the ring it has
    for _ in range(3):
        (a, ia), (b, ib) = edp.deliver(4), twin.deliver(4)
        assert torch.equal(ia.handles, ib.handles) and torch.equal(a["id"], b["id"])
    for e in (edp, twin):
        e.ingest(batch(range(10, 13)), priorities=torch.tensor([1.0, 2.0, 3.0]))
    assert edp.state_dict()["storage"]["data"]["id"].tolist() == twin.state_dict()["storage"]["data"]["id"].tolist()


@pytest.mark.parametrize("devices", ["cpu", "cuda:0", "disk"])
def test_a_spec_whose_devices_are_one_name_is_refused_naming_the_tuple_to_write(devices: str) -> None:
    with pytest.raises(PlacementError, match=r"sequence of device names"):
        PlacementSpec("host", devices)  # type: ignore[arg-type]


def test_a_spec_still_takes_any_sequence_of_device_names() -> None:
    assert PlacementSpec("sharded", ["cpu", torch.device("cpu")]).devices == ("cpu", "cpu")  # type: ignore[list-item]


def test_a_map_whose_maximum_lies_beyond_its_last_range_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="last range"):
        PlacementMap([MapRange(0.0, 50.0, HOST)], TEMPLATE, "t", max_item_bytes=100.0)


def test_a_map_whose_maximum_ends_its_last_range_still_answers_it() -> None:
    pmap = PlacementMap([MapRange(0.0, 50.0, HOST)], TEMPLATE, "t", max_item_bytes=50.0)
    assert pmap.lookup(40.0) == HOST
    with pytest.raises(PlacementError):
        pmap.lookup(60.0)


@pytest.mark.parametrize("bad", [MapRange("0", 50.0, HOST), MapRange(0.0, None, HOST),  # type: ignore[arg-type]
                                 MapRange(True, 50.0, HOST)])  # type: ignore[arg-type]
def test_a_map_range_that_is_no_number_is_a_configuration_error(bad: MapRange) -> None:
    with pytest.raises(ConfigurationError, match="range 0"):
        PlacementMap([bad], TEMPLATE, "t")


def test_a_plan_on_a_discovered_topology_builds_the_disk_tier_in_the_directory_it_checked(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    local = discover_topology(disk_directory=str(volume))
    small = dataclasses.replace(local, host_memory_bytes=1 << 20, gpus=())  # memory cannot hold the buffer
    links = {k: LinkCost.constant(5.0, 10.0) for k in ("host_copy", "host_gather", "disk_read", "disk_write")}
    links |= {"edp_deliver": LinkCost(4e-5), "edp_ingest": LinkCost(3e-5)}
    profile = BandwidthProfile(links, source="measured", machine=machine_id())
    plan = Planner(small, profile).plan(Workload.from_schema(SCHEMA, capacity=100_000, batch=10))
    assert plan.placement.tier == "disk"
    edp = ExperienceDataPlane(SCHEMA, capacity=100_000, placement=plan.build())
    try:
        assert Path(edp.storage.directory).parent == volume.absolute()  # type: ignore[attr-defined]
        assert os.listdir(volume)
    finally:
        edp.close()
    other = tmp_path / "other"
    other.mkdir()
    edp = ExperienceDataPlane(SCHEMA, capacity=100_000, placement=plan.build(directory=other))
    try:
        assert Path(edp.storage.directory).parent == other.absolute()  # type: ignore[attr-defined]
    finally:
        edp.close()


# -- a migration to a new schema under background ingestion ----------------------------------------------------------
ID = ExperienceSchema(id=Field((), torch.int64), obs=Field((2,), torch.float32))
#: the schema grown two ways: a field added (the old batch's columns would stand for the new one's), and a field
#: wider (the two could not be staged together at all)
ADDED = ExperienceSchema(id=Field((), torch.int64), obs=Field((2,), torch.float32), extra=Field((), torch.float32))
WIDER = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))


def _grow(schema: ExperienceSchema) -> Callable[[ExperienceBatch], dict[str, torch.Tensor]]:
    def transform(b: ExperienceBatch) -> dict[str, torch.Tensor]:
        obs = b.tensor("obs")
        if schema is WIDER:
            return {"id": b.tensor("id"), "obs": torch.cat([obs, torch.full((b.batch_size, 2), -1.0)], 1)}
        return {"id": b.tensor("id"), "obs": obs, "extra": torch.full((b.batch_size,), -1.0)}
    return transform


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("grown", ["added", "wider"])
def test_batches_either_side_of_a_schema_migration_are_never_staged_into_one_write(overlap: bool, grown: str) -> None:
    """An old-schema batch handed over while the items are copied waits for its group (g_ing=4) past the swap; a
    new-schema batch handed over after the migration joined that group: its own columns were dropped for the old
    batch's (ADDED: its ``extra`` stored as the transform's -1) or the staging failed (WIDER: a RuntimeError from
    every flush, state_dict and close after, nothing more stored)."""
    new = ADDED if grown == "added" else WIDER
    edp = ExperienceDataPlane(ID, capacity=64, scheduler=Overlapped(g_ing=4, overlap=overlap, queue_depth=8))
    edp.ingest({"id": torch.arange(3), "obs": torch.zeros(3, 2)})
    edp.flush()
    during: list[int] = []

    def progress(chunks: int, upto: int) -> None:  # between two copied chunks, outside the lock
        if not during:
            during.append(chunks)
            edp.ingest({"id": torch.tensor([100, 101]), "obs": torch.ones(2, 2)})  # the old schema, as documented

    migrate(edp, HostPlacement(), schema=new, transform=_grow(new), chunk_bytes=1, progress=progress)
    assert during, "the migration copied one chunk only: nothing was handed over during it"
    after = {"id": torch.tensor([200, 201]), "obs": torch.full((2, 2 if new is ADDED else 4), 5.0)}
    if new is ADDED:
        after["extra"] = torch.tensor([7.0, 8.0])
    edp.ingest(after)
    edp.flush()
    data = edp.state_dict()["storage"]["data"]
    assert data["id"].tolist() == [0, 1, 2, 100, 101, 200, 201]
    if new is ADDED:
        assert data["extra"].tolist() == [-1.0] * 5 + [7.0, 8.0]
    else:
        assert data["obs"][5:].tolist() == [[5.0] * 4] * 2 and data["obs"][3:5, 2:].tolist() == [[-1.0] * 2] * 2
    edp.close()


# -- a corrupt profile cache ------------------------------------------------------------------------------------------
_HUGE = "1" + "0" * 400  # a JSON integer no float holds


@pytest.mark.parametrize("link", [f'{{"overhead_s": {_HUGE}, "points": [[1, 2]]}}',
                                  f'{{"overhead_s": 0, "points": [[{_HUGE}, 2]]}}',
                                  '{"overhead_s": 0, "points": [[1, 2]], "by_row": "false"}',
                                  "[" * 100_000 + "]" * 100_000],
                         ids=["huge-overhead", "huge-point", "by_row-string", "nested"])
def test_a_corrupt_profile_figure_is_a_placement_error_saying_to_re_measure(link: str, tmp_path: Path) -> None:
    """(Was: OverflowError / RecursionError out of load_profile, and so out of profile_machine, which re-measures
    only on a PlacementError; "false" read as by_row=True, pricing the path per row.)"""
    doc = json.dumps({"format": PROFILE_FORMAT, "source": "measured", "machine": machine_id(), "details": {},
                      "links": {"host_copy": "LINK"}}).replace('"LINK"', link)
    f = tmp_path / "profile.json"
    f.write_text(doc)
    with pytest.raises(PlacementError, match="not a readable bandwidth profile"):
        load_profile(f)


# -- the memory a ragged buffer takes ---------------------------------------------------------------------------------
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True),
                          logp=Field((), torch.float32, ragged=True))


def _tensor_bytes(obj: object) -> int:
    """Bytes of every distinct tensor ``obj`` holds in its attributes (directly or in dicts of them)."""
    seen: dict[int, int] = {}
    for v in vars(obj).values():
        for t in (v.values() if isinstance(v, dict) else [v]):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("length", [1, 2, 16])
def test_the_host_memory_planned_for_a_ragged_buffer_covers_what_its_storage_takes(length: int) -> None:
    """(Was: the cost model charged the columns and pools only; each item's start and length in the pools, 16 B
    per ragged field kept in host memory by every tier, went uncharged: at length 2 the host storage took 1.7x
    the memory the planner checked, so a buffer it called a fit could exceed the host's share.)"""
    w = Workload.from_schema(TOKENS, capacity=1000, batch=10, mean_ragged_length=length)
    model = CostModel(load_topology("h200x1"))
    out = model.output_depth * w.batch * w.item_bytes  # (the delivery buffers, on the host for a host tier)
    st = HOST.build(ragged_item_bytes=sum(w.field_bytes[i] for i in w.ragged)).storage(TOKENS, w.capacity)
    assert _tensor_bytes(st) <= model.memory(HOST, w)["cpu"] - out
    # a GPU tier keeps that index in host memory too
    index = 2 * 16 * w.capacity
    assert model.memory(PlacementSpec("gpu", ("cuda:0",)), w).get("cpu", 0) >= index


@pytest.mark.parametrize("bad", ["x", 2.5, True])
def test_a_ragged_capacity_that_is_no_int_is_refused_by_a_migration_of_fixed_fields_too(bad: object) -> None:
    """(Was: silently ignored when neither schema has ragged fields; the constructor refuses it for any schema.)"""
    edp, twin = prioritized(5), prioritized(5)
    old = edp.storage
    with pytest.raises(ConfigurationError, match="ragged_capacity"):
        edp.migrate(HostPlacement(), ragged_capacity=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ragged_capacity"):
        ExperienceDataPlane(SCHEMA, capacity=8, ragged_capacity=bad)  # type: ignore[arg-type]
    assert edp.storage is old
    assert torch.equal(edp.deliver(4)[1].handles, twin.deliver(4)[1].handles)


# -- a batch validated just before a migration to a new schema swaps the storage -------------------------------------
PLAIN = ExperienceSchema(id=Field((), torch.int64))
SEQ_A = ExperienceSchema(id=Field((), torch.int64), a=Field((), torch.int64, ragged=True))
SEQ_B = ExperienceSchema(id=Field((), torch.int64), b=Field((), torch.int64, ragged=True))


@pytest.mark.parametrize(("old", "new"), [(PLAIN, SEQ_A), (SEQ_A, SEQ_B)], ids=["ragged-field-added", "renamed"])
def test_a_batch_validated_just_before_a_schema_migration_is_stored_through_its_transform(
        old: ExperienceSchema, new: ExperienceSchema, monkeypatch: pytest.MonkeyPatch) -> None:
    """migrate's docstring: old-schema batches validated just before the swap go through the transform. The
    ingest's pool check read the new schema and storage after validating against the old one: KeyError 'a' / 'b'
    (untyped), the batch refused. The migration lands between validation and that check (a producer racing it)."""
    edp = ExperienceDataPlane(old, capacity=16, ragged_capacity=64)
    seqs = {"a": [torch.arange(2)] * 3} if old is SEQ_A else {}
    edp.ingest({"id": torch.arange(3), **seqs})
    name = "b" if new is SEQ_B else "a"

    def grow(b: ExperienceBatch) -> dict[str, object]:
        return {"id": b.tensor("id"), name: [torch.full((1,), -1, dtype=torch.int64)] * b.batch_size}

    validate = ExperienceBatch.checked.__func__  # type: ignore[attr-defined]
    armed = [True]

    def checked(cls: type[ExperienceBatch], data: Mapping[str, object], schema: ExperienceSchema) -> ExperienceBatch:
        out = validate(cls, data, schema)
        if armed[0] and schema is old and data["id"][0] == 10:  # the producer's batch, valid for the old schema
            armed[0] = False
            edp.migrate(HostPlacement(), schema=new, transform=grow)
        return out

    monkeypatch.setattr(ExperienceBatch, "checked", classmethod(checked))
    late = {"id": torch.tensor([10, 11]), **({"a": [torch.arange(3)] * 2} if old is SEQ_A else {})}
    edp.ingest(MappingProxyType(late))  # (a mapping that is no dict: the validating path, not the row store's)
    assert not armed[0], "the migration did not run between validation and storing"
    data = edp.state_dict()["storage"]["data"]
    assert data["id"].tolist() == [0, 1, 2, 10, 11] and edp.schema == new
    edp.close()
