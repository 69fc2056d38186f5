"""The placement map's limits and the ragged pools of an adaptive placement, reproduced and fixed.

1. An adaptive placement checks the buffer's ragged pool against what its map planned: a pool whose bytes (plus the
   fixed fields') exceed what the map checked for the looked-up placement is refused; the default pool is sized from
   the plan (capacity x ``mean_ragged_length``), not 64 x capacity; a migration by :meth:`rebalance` sizes the
   target's pool for the target item size (never below the old pool, so no live item is lost).
2. ``PlacementMap(max_item_bytes=inf)`` is refused (its ``to_dict`` emitted ``Infinity``, not JSON).
3. ``PlacementMap.build(points=...)`` has an upper bound.
4. ``conduit demo --synthetic --batch 0`` is refused up front, naming ``--batch``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, PlacementError
from conduit.batch import Ragged
from conduit.demo import run_synthetic
from conduit.placement import AdaptivePlacement, HostPlacement, PlacementSpec, Planner, Workload, load_topology
from conduit.placement.placement_map import MAX_POINTS, MapRange, PlacementMap
from conduit.storage.columnar import ColumnarStorage

HOST = PlacementSpec("host", ("cpu",))
DISK = PlacementSpec("disk", ("disk",))
CAPACITY = 100
#: 8 B id + 8 B per token: 40 B per item at 4 tokens
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
#: the host range's end: the map checked host for CAPACITY items of < 44 B, i.e. of at most 43 whole bytes,
#: 4,300 B; the ids take 800 B, which leaves 3,500 B = 437 tokens for the pool
HOST_POOL = 437


def _map() -> PlacementMap:
    """Host below 44 B per item, disk from it on (planned up to 10,000 B), for CAPACITY items of 4 tokens."""
    template = Workload.from_schema(TOKENS, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    return PlacementMap([MapRange(1.0, 44, HOST), MapRange(44, math.inf, DISK)], template, "test",
                        max_item_bytes=10_000)


def _tokens(ids: range, length: int) -> dict[str, object]:
    return {"id": torch.tensor(list(ids)), "tok": [torch.full((length,), i) for i in ids]}


def _contents(edp: ExperienceDataPlane) -> list[tuple[int, list[int]]]:
    st = edp.storage
    b = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)
    tok = b["tok"]
    assert isinstance(tok, Ragged)
    ids = b["id"]
    assert isinstance(ids, torch.Tensor)
    return [(int(i), tok[k].tolist()) for k, i in enumerate(ids.tolist())]


def _pool(edp: ExperienceDataPlane) -> int:
    """The buffer's ragged pool (elements per ragged field)."""
    st = edp.storage
    assert isinstance(st, ColumnarStorage)  # (the disk tier's storage is one too)
    return st.ragged_capacity


# -- 1. the ragged pool and the plan ----------------------------------------------------------------------------
def test_the_default_pool_of_an_adaptive_buffer_is_sized_from_the_plan(tmp_path: Path) -> None:
    adaptive = AdaptivePlacement(_map(), directory=tmp_path, mean_ragged_length=4)
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive)
    assert edp.storage.tier == "host"
    assert _pool(edp) == CAPACITY * 4, (  # was 6,400: 64 x capacity, never checked by the plan
        f"the default pool holds {_pool(edp)} tokens; the plan checked {CAPACITY} items of 4")


def test_an_adaptive_placement_refuses_a_pool_beyond_what_its_map_checked(tmp_path: Path) -> None:
    adaptive = AdaptivePlacement(_map(), directory=tmp_path, mean_ragged_length=4)
    with pytest.raises(PlacementError, match="ragged_capacity"):
        ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=HOST_POOL + 1)
    assert adaptive.current is None  # nothing was built
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=HOST_POOL)
    assert _pool(edp) == HOST_POOL and adaptive.current == HOST


def test_a_ragged_buffer_without_a_planned_length_needs_a_pool(tmp_path: Path) -> None:
    """mean_ragged_length=0: the map checked no pool memory; a pool of 0 (or 1) tokens would refuse every item."""
    adaptive = AdaptivePlacement(_map(), directory=tmp_path)
    with pytest.raises(PlacementError, match="mean_ragged_length"):
        ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive)
    assert adaptive.current is None
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=HOST_POOL)
    assert _pool(edp) == HOST_POOL


def test_a_migration_into_an_adaptive_placement_with_an_oversized_pool_is_refused_and_changes_nothing(
        tmp_path: Path) -> None:
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=HostPlacement())  # the 64 x capacity pool
    edp.ingest(_tokens(range(10), 4))
    storage, before = edp.storage, _contents(edp)
    adaptive = AdaptivePlacement(_map(), directory=tmp_path, mean_ragged_length=4)
    with pytest.raises(PlacementError, match="ragged_capacity"):
        edp.migrate(adaptive)
    with pytest.raises(PlacementError, match="ragged_capacity"):
        adaptive.rebalance(edp)  # was: None, a stay on a pool nothing checked
    assert edp.storage is storage and _contents(edp) == before and adaptive.migrations == []


def test_a_rebalance_sizes_the_target_pool_for_the_target_items_and_keeps_every_item(tmp_path: Path) -> None:
    adaptive = AdaptivePlacement(_map(), directory=tmp_path, mean_ragged_length=4, window=2)
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive)
    edp.ingest(_tokens(range(0, 8), 4))
    edp.ingest(_tokens(range(8, 16), 36))  # window of 2 calls: (40 + 296) / 2 = 168 B per item, on disk
    edp.flush()
    before = _contents(edp)
    report = adaptive.rebalance(edp)
    assert report is not None and edp.storage.tier == "disk" and report.items == 16
    assert _pool(edp) == CAPACITY * (168 - 8) // 8, (  # was 400: the old pool, kept
        f"the disk pool holds {_pool(edp)} tokens, not {CAPACITY} items of 168 B")
    assert _contents(edp) == before
    # back to small items: host's plan holds 450 tokens, the live items need the 2,000 the pool has (never shrunk)
    storage = edp.storage
    with pytest.raises(PlacementError, match="ragged_capacity"):
        adaptive.rebalance(edp, item_bytes=40)
    assert edp.storage is storage and _contents(edp) == before and len(adaptive.migrations) == 1
    edp.close()


# -- 2. max_item_bytes=inf ---------------------------------------------------------------------------------------
def test_a_placement_map_refuses_an_infinite_maximum_and_its_dict_is_json() -> None:
    template = Workload.from_schema(TOKENS, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    with pytest.raises(ConfigurationError, match="max_item_bytes"):
        PlacementMap([MapRange(1.0, math.inf, HOST)], template, "test", max_item_bytes=math.inf)
    pmap = PlacementMap([MapRange(1.0, math.inf, HOST)], template, "test", max_item_bytes=1e6)
    assert json.loads(json.dumps(pmap.to_dict(), allow_nan=False))["max_item_bytes"] == 1e6


# -- 3. points has an upper bound --------------------------------------------------------------------------------
@pytest.mark.parametrize("points", [MAX_POINTS + 1, 10**12])
def test_placement_map_build_refuses_absurd_points(points: int) -> None:
    planner = Planner(load_topology("h200x1"))
    template = Workload.from_schema(TOKENS, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    with pytest.raises(ConfigurationError, match=f"at most {MAX_POINTS}"):
        PlacementMap.build(planner, template, min_item_bytes=40, max_item_bytes=400, points=points)


def test_placement_map_build_takes_points_up_to_the_limit() -> None:
    planner = Planner(load_topology("h200x1"))
    template = Workload.from_schema(TOKENS, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    pmap = PlacementMap.build(planner, template, min_item_bytes=40, max_item_bytes=60, points=MAX_POINTS)
    assert pmap.lookup(40) is not None


# -- 4. conduit demo --synthetic --batch 0 -----------------------------------------------------------------------
@pytest.mark.parametrize("batch", ["0", "-3"])
def test_demo_refuses_a_batch_below_one_up_front_naming_the_flag(batch: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigurationError, match="--batch"):
        run_synthetic(["--obs-dim", "4", "--rollout", "8", "--batch", batch, "--iterations", "1", "--warmup", "0",
                       "--trace", "", "--no-baseline"])
    assert capsys.readouterr().out == "", "the refusal came after the run had started printing"
