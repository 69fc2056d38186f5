"""Regressions of the placement map and migration, ``conduit simulate`` / ``demo`` / ``plan``.

1. ``AdaptivePlacement.rebalance`` of a buffer built by another placement, with more items than the map was
   planned for, is refused (it migrated the buffer to, or stayed on, a placement nothing checked holds it).
2. ``conduit simulate`` with a capacity whose share per node is smaller than one learner's batch is refused up
   front with a message that says which capacity would do (it said "batch (256) exceeds capacity (100)", a batch
   the user never gave, after the output directory was made).
3. ``conduit demo --synthetic --g-ing N`` with N above the rollouts the run produces says so (no ingestion group
   was ever written while the loop ran, so the figures timed no ingestion, silently).
4. ``conduit simulate``'s JSON rows give every time in ms (``run_scenario``: "latencies in ms"), the busiest
   resources too (they were seconds, under a key without a unit, beside ms figures).
5. ``Planner.placement_map`` of a workload the planner refuses at every size (more learners than GPUs) raises
   that refusal; it built a map of "nothing fits" whose lookups told the user to shrink the items.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, PlacementError, Replay
from conduit.cli import main
from conduit.errors import ConfigurationError
from conduit.placement import (
    AdaptivePlacement,
    HostPlacement,
    NothingFitsError,
    PlacementSpec,
    Planner,
    Workload,
    load_topology,
)
from conduit.placement.placement_map import MapRange, PlacementMap
from conduit.simulation import SCENARIOS
from conduit.simulation.model import layout, node_workload, simulate_scale
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

HOST = PlacementSpec("host", ("cpu",))
DISK = PlacementSpec("disk", ("disk",))


# -- 1. rebalance of a buffer larger than the map's plan ---------------------------------------------------------
def _host_then_disk(capacity: int) -> PlacementMap:
    """Planned for ``capacity`` items of ID_SCHEMA (20 B): host below 50 B per item, disk from there."""
    workload = Workload.from_schema(ID_SCHEMA, capacity=capacity, batch=8)
    return PlacementMap([MapRange(1.0, 50, HOST), MapRange(50, math.inf, DISK)], workload, "test",
                        max_item_bytes=10_000)


def _ids(edp: ExperienceDataPlane) -> list[int]:
    st = edp.storage
    return check_payload(st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)).tolist()


@pytest.mark.parametrize("item_bytes", [100, 20])  # a move to disk, and a stay on host
def test_rebalance_of_a_buffer_larger_than_the_plan_is_refused_and_changes_nothing(tmp_path: Path,
                                                                                   item_bytes: int) -> None:
    adaptive = AdaptivePlacement(_host_then_disk(128), directory=tmp_path)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), placement=HostPlacement())
    edp.ingest(id_batch(np.arange(40)))
    storage = edp.storage
    with pytest.raises(PlacementError, match=r"4096 items exceeds the capacity .* planned for \(128 items\)"):
        adaptive.rebalance(edp, item_bytes=item_bytes)  # was: migrated 4096 slots to disk / "stays" on host
    assert edp.storage is storage and edp.storage.tier == "host"
    assert adaptive.migrations == [] and adaptive.current is None
    assert _ids(edp) == list(range(40))
    edp.close()


def test_rebalance_of_a_buffer_the_plan_covers_still_migrates(tmp_path: Path) -> None:
    adaptive = AdaptivePlacement(_host_then_disk(128), directory=tmp_path)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=128, semantics=Replay(seed=0), placement=HostPlacement())
    edp.ingest(id_batch(np.arange(40)))
    report = adaptive.rebalance(edp, item_bytes=100)
    assert report is not None and report.items == 40
    assert edp.storage.tier == "disk" and adaptive.current == DISK
    assert _ids(edp) == list(range(40))
    edp.close()


# -- 2. conduit simulate: a node's share of the capacity below one learner's batch -------------------------------
@pytest.mark.parametrize(("gpus", "capacity", "least"), [(8, 100, 256), (16, 254, 255)])
def test_simulate_refuses_a_capacity_below_one_batch_per_node_and_says_which_would_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], gpus: int, capacity: int, least: int) -> None:
    out = tmp_path / "sim"
    rc = main(["simulate", "--out", str(out), "--scenario", "a100", "--gpus", str(gpus), "--capacity", str(capacity),
               "--replay-ratio", "100"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--gpus {gpus} (a100)" in err and f"raise the capacity to at least {least}" in err, err
    assert "Traceback" not in err
    assert not out.exists()  # refused before the output directory was made


def test_the_least_capacity_named_is_enough() -> None:
    sc = dataclasses.replace(SCENARIOS["a100"], capacity=255, replay_ratio=100.0, gpus=(16,))
    lay = layout(16, sc.total_batch, 8)
    w = node_workload(sc, lay)
    assert (w.capacity, w.batch) == (128, 128)
    with pytest.raises(ConfigurationError, match="at least 255"):
        node_workload(dataclasses.replace(sc, capacity=254), lay)


# -- 3. conduit demo --synthetic: --g-ing above the rollouts of the run ----------------------------------------
_DEMO = ["demo", "--synthetic", "--obs-dim", "8", "--rollout", "16", "--batch", "8", "--updates", "1",
         "--capacity", "64", "--warmup", "1", "--iterations", "2", "--no-baseline", "--trace", ""]


def test_demo_says_when_no_ingestion_group_of_the_run_reaches_the_buffer(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*_DEMO, "--scheduler", "sequential", "--g-ing", "4"])
    err = capsys.readouterr().err
    assert rc == 0  # (it runs: an earlier test takes --g-ing above the run's rollouts to check the scheduler)
    assert "note: --g-ing 4" in err and "more than the 3" in err and "use --g-ing 3 or less" in err, err


def test_demo_says_nothing_with_a_g_ing_of_every_rollout_of_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*_DEMO, "--scheduler", "sequential", "--g-ing", "3"])
    out = capsys.readouterr()
    assert rc == 0 and "median: iteration" in out.out
    assert "--g-ing" not in out.err


# -- 4. conduit simulate: the busiest resources in ms, as the table shows them -----------------------------------
def test_simulate_rows_give_the_busiest_resources_in_ms_as_the_table_shows_them(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--scenario", "a100", "--gpus", "1", "--out", str(out)]) == 0
    row = json.loads((out / "scale-a100.json").read_text())["rows"][0]
    assert "busiest" not in row  # (seconds, beside figures in ms)
    point = simulate_scale(dataclasses.replace(SCENARIOS["a100"], gpus=(1,)), 1)[0]
    assert [(k, pytest.approx(v * 1e3)) for k, v in point.busiest] == [tuple(x) for x in row["busiest_ms"]]
    name, ms = row["busiest_ms"][0]
    assert 1.0 < ms <= row["sim_ms"]  # a resource is busy at most the whole simulated iteration (tens of ms here)
    assert f"{name} {ms:.1f}ms" in (out / "scale-a100.md").read_text()


# -- 5. a placement map of a workload the planner refuses at every size --------------------------------------------
def test_a_placement_map_of_more_learners_than_gpus_raises_the_planners_refusal() -> None:
    planner = Planner(load_topology("dgx-a100-80g"))
    workload = Workload.transitions(100, capacity=1000, batch=10, learners=64)
    with pytest.raises(PlacementError, match="64 learners need 64 GPUs") as caught:
        planner.placement_map(workload, min_item_bytes=100, max_item_bytes=10_000, points=4)  # was: "nothing fits"
    assert not isinstance(caught.value, NothingFitsError)


def test_sizes_that_fit_nowhere_still_map_to_no_placement() -> None:
    planner = Planner(load_topology("h200x1"))
    workload = Workload.transitions(100, capacity=10**6, batch=10)
    with pytest.raises(NothingFitsError):
        planner.plan(workload.resized(10**8))  # 100 TB
    pmap = planner.placement_map(workload, min_item_bytes=1000, max_item_bytes=10**8, points=8)
    assert pmap.ranges[0].spec is not None and pmap.ranges[-1].spec is None
    with pytest.raises(PlacementError, match="No placement"):
        pmap.lookup(10**8)
