"""Placement, simulation and the command line: refusals without tracebacks, exact migrations, placement maps."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from pathlib import Path

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay
from conduit.cli import main
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement import (
    AdaptivePlacement,
    HostPlacement,
    LinkCost,
    Planner,
    ShardedPlacement,
    Topology,
    Workload,
    load_profile,
    load_topology,
)
from conduit.placement.migration import migrate
from conduit.simulation import NETWORKS, SCENARIOS, equivalent_specs, run_scenario
from conduit.simulation.model import simulate_scale

# -- conduit simulate: bad values are argument errors (exit 2), never tracebacks ----------------------------


@pytest.mark.parametrize(("flag", "value"), [
    ("--gpus", "a,b"), ("--gpus", ","), ("--gpus", "1,,2"), ("--gpus", "0"), ("--gpus", "1.5"),
    ("--samples", "0"), ("--samples", "-1"),
    ("--obs-dim", "0"), ("--capacity", "-3"),
    ("--replay-ratio", "nan"), ("--replay-ratio", "inf"), ("--replay-ratio", "0"),
    ("--rpc-us", "-5"), ("--rpc-us", "nan"),
])
def test_simulate_bad_values_are_argument_errors(flag: str, value: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--scenario", "a100", "--gpus", "1", "--out", str(tmp_path / "o"), f"{flag}={value}"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, f"{flag} {value}: exit {e.value.code}"
    assert flag in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists(), "a refused command still wrote output"


def test_simulate_out_that_is_a_file_is_an_error_not_a_traceback(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "taken"
    f.write_text("keep")
    assert main(["simulate", "--scenario", "a100", "--gpus", "1", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--out" in err, err
    assert f.read_text() == "keep"


def test_simulate_accepts_good_values_and_writes_where_documented(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main(["simulate", "--scenario", "a100", "--gpus", "1, 2", "--samples", "1", "--replay-ratio", "2",
                 "--rpc-us", "0", "--out", str(out)]) == 0
    assert (out / "scale-a100.md").read_text().startswith("**SIMULATION**")
    assert (out / "scale-a100.json").is_file()


# -- the simulator's library entry points refuse the same values with typed errors --------------------------


@pytest.mark.parametrize("ratio", [math.nan, math.inf, 0.0, -1.0])
def test_scenario_refuses_non_finite_or_non_positive_replay_ratio(ratio: float) -> None:
    with pytest.raises(ConfigurationError, match="replay_ratio"):
        dataclasses.replace(SCENARIOS["a100"], replay_ratio=ratio)


@pytest.mark.parametrize("rpc", [-1e-6, math.nan, math.inf])
def test_network_refuses_a_negative_or_non_finite_rpc_cost(rpc: float) -> None:
    with pytest.raises(ConfigurationError, match="rpc_overhead_s"):
        dataclasses.replace(NETWORKS["hdr-ib-8x"], rpc_overhead_s=rpc)


@pytest.mark.parametrize("samples", [0, -1])
def test_link_blind_baseline_refuses_fewer_than_one_sample(samples: int) -> None:
    sc = dataclasses.replace(SCENARIOS["mi250x"], gpus=(8,))
    with pytest.raises(ConfigurationError, match="samples"):
        run_scenario(sc, baseline="link-blind", samples=samples)  # was: ZeroDivisionError / ValueError
    with pytest.raises(ConfigurationError, match="samples"):
        simulate_scale(sc, 8, adaptive=False, baseline="link-blind", samples=samples)
    spec = simulate_scale(sc, 8)[0].placement
    with pytest.raises(ConfigurationError, match="samples"):
        equivalent_specs(spec, 8, samples=samples)


# -- migration: two migrations at once must not drop what the first one's storage received ------------------


def test_a_migration_overtaken_by_another_does_not_drop_items_ingested_meanwhile() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64))
    edp = ExperienceDataPlane(schema, capacity=100, semantics=Replay(seed=0))
    edp.ingest({"id": torch.arange(40)})
    first_done, parked = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow_progress(chunks: int, copied: int) -> None:
        if chunks == 1:  # between chunks: another migration runs to completion and more items arrive
            parked.set()
            first_done.wait(60)

    def second() -> None:
        try:
            migrate(edp, ShardedPlacement(["cpu"] * 2), chunk_bytes=8 * 10, progress=slow_progress)
        except BaseException as e:  # noqa: BLE001 - inspected below
            errors.append(e)

    t = threading.Thread(target=second)
    t.start()
    # (waited for, not assumed: a loaded machine may start the thread's migration only after this one has ended)
    assert parked.wait(60), "the migration in the thread never finished its first chunk"
    migrate(edp, HostPlacement())
    edp.ingest({"id": torch.arange(40, 50)})  # into the storage the first migration swapped in
    first_done.set()
    t.join(60)
    assert not t.is_alive()
    ids = edp.state_dict()["storage"]["data"]["id"].tolist()
    assert ids == list(range(50)), f"items ingested after the first swap were lost: {ids[-5:]}"
    # the overtaken migration says so, with a typed error (the buffer keeps the first migration's storage)
    assert len(errors) == 1 and isinstance(errors[0], PlacementError), errors
    assert "another migration" in str(errors[0])


# -- profiles: a malformed cache file or a NaN figure is a PlacementError, as documented ---------------------


@pytest.mark.parametrize("content", [[1, 2], "text", None, {"links": [1]}, {"links": {"host_copy": "abc"}}],
                         ids=["list", "string", "null", "links-list", "link-string"])
def test_load_profile_of_a_malformed_file_is_a_placement_error(content: object, tmp_path: Path) -> None:
    if isinstance(content, dict):  # a whole profile with one broken section
        declared = load_topology("h200x1").declared
        assert declared is not None
        content = {**declared.to_dict(), **content}
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(content))
    with pytest.raises(PlacementError, match="not a readable bandwidth profile"):
        load_profile(f)  # was: AttributeError


@pytest.mark.parametrize(("overhead", "per_row", "bw"), [(math.nan, 0.0, 1e9), (math.inf, 0.0, 1e9),
                                                        (0.0, math.nan, 1e9), (0.0, 0.0, math.nan)])
def test_link_cost_refuses_nan_and_infinite_costs(overhead: float, per_row: float, bw: float) -> None:
    with pytest.raises(PlacementError, match="re-run `conduit profile`"):
        LinkCost(overhead, ((1.0, bw),), per_row)
    assert LinkCost(0.0, ((1.0, math.inf),)).seconds(100) == 0.0  # an unlimited bandwidth stays allowed


# -- conduit demo --synthetic: negative counts are refused, not run as an empty loop --------------------------

TINY = ["--no-baseline", "--trace", "", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64",
        "--iterations", "1", "--warmup", "0"]


@pytest.mark.parametrize(("flag", "value"), [("--iterations", "-1"), ("--warmup", "-1"), ("--updates", "-2"),
                                             ("--hidden", "0")])
@pytest.mark.timeout(120)
def test_demo_negative_counts_are_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--synthetic", *TINY, flag, value]) == 2, f"{flag} {value} was accepted"
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flag.lstrip("-") in err and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_demo_zero_iterations_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--synthetic", *TINY, "--iterations", "0"]) == 0
    assert "no iterations" in capsys.readouterr().out


# -- placement map: its covered range and refusals ------------------------------------------------------------


def _small_planner_and_workload() -> tuple[Planner, Workload]:
    return Planner(load_topology("h200x1")), Workload.transitions(100, capacity=1000, batch=10)


@pytest.mark.parametrize(("lo", "hi"), [(1, math.inf), (math.nan, 10), (1, math.nan), (10, 1), (0, 5)])
def test_placement_map_refuses_bad_size_ranges_with_a_configuration_error(lo: float, hi: float) -> None:
    planner, w = _small_planner_and_workload()
    with pytest.raises(ConfigurationError, match="min_item_bytes"):
        planner.placement_map(w, min_item_bytes=lo, max_item_bytes=hi, points=4)  # inf was: OverflowError


def test_placement_map_reports_the_largest_size_it_was_planned_for() -> None:
    planner, w = _small_planner_and_workload()
    pmap = planner.placement_map(w, min_item_bytes=64, max_item_bytes=200, points=4)
    assert pmap.max_item_bytes == 200, f"max_item_bytes {pmap.max_item_bytes}, planned up to 200"
    assert pmap.lookup(200) == planner.plan(w.resized(200)).placement


def test_placement_map_over_a_range_without_a_whole_byte_starts_inside_it() -> None:
    planner, w = _small_planner_and_workload()
    pmap = planner.placement_map(w, min_item_bytes=0.5, max_item_bytes=0.5, points=4)
    assert pmap.ranges[0].lo >= 0.5, f"the map starts at {pmap.ranges[0].lo} B, below the range asked for"


@pytest.mark.timeout(120)
def test_demo_unwritable_trace_is_an_error_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [a for a in TINY if a not in ("--trace", "")]
    missing = tmp_path / "no-such-folder" / "t.json"
    assert main(["demo", "--synthetic", *args, "--trace", str(missing)]) == 2  # was: FileNotFoundError at the end
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and "--trace" in err and "Traceback" not in err, err
    assert "iter" not in out, "the loop ran before the trace path was refused"
    assert main(["demo", "--synthetic", *args, "--trace", str(tmp_path)]) == 2  # a directory
    assert not missing.parent.exists()
    ok = tmp_path / "t.json"
    assert main(["demo", "--synthetic", *args, "--trace", str(ok)]) == 0
    assert ok.read_text().startswith(("{", "[")), "the trace was not written where --trace says"


@pytest.mark.parametrize("depth", [0, -5, 1.5, True])
def test_cost_model_refuses_a_bad_output_depth(depth: object) -> None:
    topo = load_topology("h200x1")
    with pytest.raises(ConfigurationError, match="output_depth"):
        Planner(topo, output_depth=depth)  # was accepted: negative output buffers made plans "fit"
    assert Planner(topo, output_depth=1).cost.output_depth == 1


@pytest.mark.parametrize("bad", [
    {"name": "x", "host_memory_gib": -1},
    {"name": "x", "host_memory_gib": "inf"},
    {"name": "x", "host_memory_gib": 1, "disk_gib": -5},
    {"name": "x", "host_memory_gib": 1, "gpu": {"count": -2, "name": "g", "memory_gib": 1}},
    {"name": "x", "host_memory_gib": 1, "gpu": {"count": 2, "name": "g", "memory_gib": -1}},
], ids=["negative-host", "infinite-host", "negative-disk", "negative-gpu-count", "negative-gpu-memory"])
def test_topology_data_with_negative_or_infinite_sizes_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(PlacementError, match="Topology 'x'|Malformed"):
        Topology.from_file_dict(bad)  # was: accepted (negative memory), or OverflowError


@pytest.mark.parametrize(("kwargs", "name"), [({"window": 0}, "window"), ({"window": -3}, "window"),
                                              ({"mean_ragged_length": -1.0}, "mean_ragged_length"),
                                              ({"mean_ragged_length": math.nan}, "mean_ragged_length")])
def test_adaptive_placement_refuses_settings_that_would_silently_never_observe_growth(
        kwargs: dict[str, float], name: str) -> None:
    planner, w = _small_planner_and_workload()
    pmap = planner.placement_map(w, min_item_bytes=64, max_item_bytes=200, points=4)
    with pytest.raises(ConfigurationError, match=name):
        AdaptivePlacement(pmap, **kwargs)  # type: ignore[arg-type]
    assert AdaptivePlacement(pmap, window=1).window == 1


@pytest.mark.parametrize("size", [math.nan, -1.0])
def test_placement_map_lookup_refuses_nan_and_negative_sizes(size: float) -> None:
    planner, w = _small_planner_and_workload()
    pmap = planner.placement_map(w, min_item_bytes=64, max_item_bytes=200, points=4)
    with pytest.raises(ConfigurationError, match="item_bytes"):
        pmap.lookup(size)  # NaN was: silently the last range's placement
    adaptive = AdaptivePlacement(pmap)
    edp = ExperienceDataPlane(ExperienceSchema(id=Field((), torch.int64)), capacity=8, placement=adaptive)
    with pytest.raises(ConfigurationError, match="item_bytes"):
        adaptive.rebalance(edp, item_bytes=size)
    assert adaptive.migrations == []
    assert pmap.lookup(0.0) == pmap.ranges[0].spec  # below the map: its first range


def test_growth_a_failed_strategy_stays_failed_when_sizes_shrink_again() -> None:
    from conduit.placement.growth import simulate_growth

    res = simulate_growth(Planner(load_topology("dgx-a100-80g")), [20000, 100000, 20000])
    for name in ("greedy", "conservative"):
        tr = res.strategies[name]
        assert tr.failed_at == 1, f"{name} failed at {tr.failed_at}"
        assert tr.latency_s[2] is None and tr.placements[2] is None, \
            f"{name} ran again after running out of memory: {tr.latency_s}"
        assert tr.cumulative_s == tr.latency_s[0]
    assert all(x is not None for x in res.strategies["conduit"].latency_s)


@pytest.mark.parametrize(("schedule", "updates"), [([], 16), ([128], 0), ([128], -1)])
def test_growth_refuses_an_empty_schedule_or_no_updates(schedule: list[int], updates: int) -> None:
    from conduit.placement.growth import simulate_growth

    with pytest.raises(ConfigurationError):
        simulate_growth(Planner(load_topology("dgx-a100-80g")), schedule, updates=updates)  # was: IndexError
