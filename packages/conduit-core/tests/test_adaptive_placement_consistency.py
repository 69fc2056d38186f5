"""AdaptivePlacement decides from consistent facts: the observed item size counts bytes as the map was
planned (payload only, so unchanged items never cross a boundary), and ``current`` names the placement the
buffer really uses, also after a migration into the adaptive placement failed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field
from conduit.batch import ExperienceBatch
from conduit.errors import SchemaError
from conduit.placement import AdaptivePlacement, HostPlacement, PlacementSpec, Workload
from conduit.placement.placement_map import MapRange, PlacementMap

HOST = PlacementSpec("host", ("cpu",))
DISK = PlacementSpec("disk", ("disk",))
CAPACITY = 64

#: 8 B id + 8 B per token: 40 B per item at 4 tokens
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
#: 8 B id + 4 float32 = 24 B per item; grown: 8 B id + 8 float32 = 40 B
SMALL = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))
GROWN = ExperienceSchema(id=Field((), torch.int64), obs=Field((8,), torch.float32))


def _map(workload: Workload, boundary: float) -> PlacementMap:
    """Host below ``boundary`` bytes per item, disk from it on (planned up to 10,000 B)."""
    return PlacementMap([MapRange(1.0, boundary, HOST), MapRange(boundary, float("inf"), DISK)], workload, "test",
                        max_item_bytes=10_000)


def _tokens(ids: range, length: int) -> dict[str, object]:
    return {"id": torch.tensor(list(ids)), "tok": [torch.full((length,), i) for i in ids]}


def _contents(edp: ExperienceDataPlane) -> list[tuple[int, list[float]]]:
    st = edp.storage
    b = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)
    col = "tok" if "tok" in edp.schema else "obs"
    return [(int(i), [float(x) for x in v.tolist()]) for i, v in zip(b["id"], b[col], strict=True)]


def _pad(b: ExperienceBatch) -> dict[str, torch.Tensor]:
    return {"id": b["id"], "obs": torch.cat([b["obs"], torch.zeros(b.batch_size, 4)], dim=1)}


# -- 1. the observed size counts bytes as the map was planned -------------------------------------------------
def _token_buffer(tmp_path: Path) -> tuple[ExperienceDataPlane, AdaptivePlacement]:
    template = Workload.from_schema(TOKENS, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    assert sum(template.field_bytes) == TOKENS.item_bytes(4) == 40  # the map plans 4-token items at 40 B
    adaptive = AdaptivePlacement(_map(template, 44), directory=tmp_path, mean_ragged_length=4, window=2)
    # (a pool of the planned 4 tokens per item: host was checked for items below 44 B, no more)
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=CAPACITY * 4)
    assert adaptive.current == HOST and edp.storage.tier == "host"
    return edp, adaptive


def test_unchanged_items_read_as_the_same_size_and_do_not_migrate(tmp_path: Path) -> None:
    edp, adaptive = _token_buffer(tmp_path)
    assumed = adaptive.observed_item_bytes(edp)  # nothing ingested: schema.item_bytes(mean_ragged_length)
    edp.ingest(_tokens(range(0, 8), 4))
    edp.flush()
    observed = adaptive.observed_item_bytes(edp)
    assert observed == assumed == 40, (
        f"4-token items read as {assumed} B before ingestion and {observed} B after: the observed size counts "
        f"the 8 B ragged length per item, which the map (planned on payload bytes) does not")
    storage, before = edp.storage, _contents(edp)
    report = adaptive.rebalance(edp)
    assert report is None, f"unchanged 40 B items migrated across the 44 B boundary: {report}"
    assert edp.storage is storage and adaptive.current == HOST and adaptive.migrations == []
    assert _contents(edp) == before


def test_real_growth_still_migrates_and_keeps_every_item(tmp_path: Path) -> None:
    edp, adaptive = _token_buffer(tmp_path)
    edp.ingest(_tokens(range(0, 8), 4))
    assert adaptive.rebalance(edp) is None
    edp.ingest(_tokens(range(8, 16), 6))  # 56 B per item: window of 2 calls averages 48 B, past 44 B
    edp.flush()
    assert adaptive.observed_item_bytes(edp) == pytest.approx((8 * 40 + 8 * 56) / 16)
    before = _contents(edp)
    report = adaptive.rebalance(edp)
    assert report is not None and report.items == 16, report
    assert adaptive.current == DISK and edp.storage.tier == "disk" and edp.placement is adaptive
    assert _contents(edp) == before
    assert adaptive.rebalance(edp) is None  # the same items again: stays


def test_fixed_size_items_observe_their_schema_size(tmp_path: Path) -> None:
    adaptive = AdaptivePlacement(_map(Workload.from_schema(SMALL, capacity=CAPACITY, batch=1), 30),
                                 directory=tmp_path)
    edp = ExperienceDataPlane(SMALL, capacity=CAPACITY, placement=adaptive)
    edp.ingest({"id": torch.arange(5), "obs": torch.ones(5, 4)})
    edp.flush()
    assert adaptive.observed_item_bytes(edp) == SMALL.item_bytes() == 24


# -- 2. ``current`` changes only when a migration into the adaptive placement succeeded -----------------------
def _small_buffer(tmp_path: Path) -> tuple[ExperienceDataPlane, AdaptivePlacement]:
    adaptive = AdaptivePlacement(_map(Workload.from_schema(SMALL, capacity=CAPACITY, batch=1), 30),
                                 directory=tmp_path)
    edp = ExperienceDataPlane(SMALL, capacity=CAPACITY, placement=adaptive)
    edp.ingest({"id": torch.arange(10), "obs": torch.arange(40, dtype=torch.float32).reshape(10, 4)})
    edp.flush()
    assert adaptive.current == HOST and edp.storage.tier == "host"
    return edp, adaptive


def _raises(b: ExperienceBatch) -> dict[str, torch.Tensor]:
    raise ValueError("broken transform")


def _one_short(b: ExperienceBatch) -> dict[str, torch.Tensor]:
    return {k: v[1:] for k, v in _pad(b).items()}


@pytest.mark.parametrize("transform", [_raises, _one_short], ids=["transform-raises", "transform-drops-an-item"])
def test_a_failed_migration_into_the_adaptive_placement_keeps_current(tmp_path: Path, transform: object) -> None:
    edp, adaptive = _small_buffer(tmp_path)
    storage, before = edp.storage, _contents(edp)
    with pytest.raises(SchemaError):
        edp.migrate(adaptive, schema=GROWN, transform=transform)  # type: ignore[arg-type]
    assert edp.storage is storage and edp.schema == SMALL and edp.storage.tier == "host"
    assert adaptive.current == HOST, (
        f"the migration failed and the buffer stays on host, but adaptive.current says {adaptive.current}")
    assert _contents(edp) == before
    # so the next decision starts from the real placement: grown items (40 B) move to disk
    report = adaptive.rebalance(edp, schema=GROWN, transform=_pad)
    assert report is not None, "rebalance stayed on disk it believed in, while the buffer is on host"
    assert adaptive.current == DISK and edp.storage.tier == "disk" and edp.schema == GROWN
    assert _contents(edp) == [(i, v + [0.0] * 4) for i, v in before]


def test_a_successful_migration_into_the_adaptive_placement_sets_current(tmp_path: Path) -> None:
    edp = ExperienceDataPlane(SMALL, capacity=CAPACITY, placement=HostPlacement())
    edp.ingest({"id": torch.arange(10), "obs": torch.ones(10, 4)})
    adaptive = AdaptivePlacement(_map(Workload.from_schema(SMALL, capacity=CAPACITY, batch=1), 30),
                                 directory=tmp_path)
    with pytest.raises(SchemaError):
        edp.migrate(adaptive, schema=GROWN, transform=_raises)
    assert adaptive.current is None, f"nothing was ever built into use, yet current is {adaptive.current}"
    edp.migrate(adaptive, schema=GROWN, transform=_pad)
    assert adaptive.current == DISK and edp.storage.tier == "disk" and edp.placement is adaptive
    assert len(edp) == 10
