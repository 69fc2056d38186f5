"""The scale simulator: the event engine, its agreement with the placement cost model, trends, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conduit.cli import main
from conduit.placement import CostModel, PlacementSpec, Planner, Workload, load_topology
from conduit.simulation import (
    NETWORKS,
    SCENARIOS,
    ClusterPlanner,
    ParallelIngestCostModel,
    Simulation,
    equivalent_specs,
    run_scenario,
    simulate_iteration,
    simulate_scale,
    uniform_view,
)
from conduit.simulation.model import layout, node_workload


# -- the engine ------------------------------------------------------------------------------------
def test_tasks_on_one_resource_queue_and_on_different_resources_overlap():
    sim = Simulation()
    a = sim.task("a", 2.0, "link")
    b = sim.task("b", 3.0, "link")
    c = sim.task("c", 4.0, "gpu")
    d = sim.task("d", 1.0, "gpu", [a, b])
    assert sim.run() == 6.0
    assert (a.start, a.end, b.start, b.end) == (0.0, 2.0, 2.0, 5.0)
    assert (c.start, d.start, d.end) == (0.0, 5.0, 6.0)
    assert sim.busy == {"link": 5.0, "gpu": 5.0}


def test_engine_rejects_bad_durations_and_runs_once():
    sim = Simulation()
    with pytest.raises(ValueError):
        sim.task("x", -1.0)
    with pytest.raises(ValueError):
        sim.task("x", math.nan)
    sim.task("y", 1.0)
    sim.run()
    with pytest.raises(RuntimeError):
        sim.run()


# -- the planner and cost model it drives ----------------------------------------------------------
def test_one_learner_on_one_node_simulates_exactly_the_cost_models_estimate():
    """With nothing to contend for, the simulation is the cost model's ingest + deliver, for every tier."""
    sc = dataclasses.replace(SCENARIOS["a100"], obs_dim=5000, capacity=100_000)
    lay = layout(1, sc.total_batch, 1)
    w = node_workload(sc, lay)
    topo = load_topology(sc.topology)
    cost = ClusterPlanner(topo).cost
    for spec in (PlacementSpec("host", ("cpu",)), PlacementSpec("gpu", ("cuda:0",)),
                 PlacementSpec("gpu", ("cuda:3",)), PlacementSpec("sharded", ("cuda:0", "cuda:1", "cuda:2"))):
        point = simulate_iteration(cost, spec, sc, lay, NETWORKS[sc.network])
        assert point.latency_s == pytest.approx(cost.estimate(spec, w).total_s, rel=1e-9), spec


def test_learners_of_one_node_overlap_where_the_cost_model_adds_them_up():
    sc = dataclasses.replace(SCENARIOS["mi250x"], obs_dim=5000, capacity=100_000)
    lay = layout(8, sc.total_batch, 8)
    w = node_workload(sc, lay)
    cost = ClusterPlanner(load_topology(sc.topology)).cost
    spec = PlacementSpec("gpu", ("cuda:0",))
    point = simulate_iteration(cost, spec, sc, lay, NETWORKS[sc.network])
    est = cost.estimate(spec, w)
    assert est.ingest_s <= point.latency_s <= est.total_s * (1 + 1e-9)


def test_parallel_ingest_counts_the_slowest_shard_not_the_sum():
    topo = load_topology("mi250x-node")
    w = Workload.transitions(20000, capacity=100_000, batch=1024, learners=8)
    spec = PlacementSpec("sharded", tuple(f"cuda:{i}" for i in range(8)))
    serial, _ = CostModel(topo).ingest(spec, w)
    parallel, parts = ParallelIngestCostModel(topo).ingest(spec, w)
    assert parallel < serial
    one, _ = CostModel(topo).ingest(PlacementSpec("gpu", ("cuda:0",)), dataclasses.replace(w, ingest_items=w.batch))
    assert parts["ingest: copy"] < one  # an eighth of the bytes per host link


def test_cluster_planner_ranks_fast_links_first_when_every_gpu_hosts_a_learner():
    topo = load_topology("mi250x-node")
    w = Workload.transitions(20000, capacity=2_000_000, batch=512, learners=8)
    fast = PlacementSpec("sharded", ("cuda:0", "cuda:2", "cuda:4", "cuda:6"))
    assert fast in [s for s, _ in ClusterPlanner(topo).candidates(w)]
    assert fast not in [s for s, _ in Planner(topo).candidates(w)], "core's ranking ties every learner GPU"
    blind = ClusterPlanner(uniform_view(topo)).candidates(w)
    assert fast not in [s for s, _ in blind], "a planner blind to the links proposes GPUs in rank order"


def test_equivalent_specs_are_every_choice_a_link_blind_planner_cannot_tell_apart():
    assert len(equivalent_specs(PlacementSpec("gpu", ("cuda:0",)), 8, samples=100)) == 8
    homes = equivalent_specs(PlacementSpec("sharded", tuple(f"cuda:{i}" for i in range(8))), 8, samples=100)
    assert sorted(s.devices[0] for s in homes) == [f"cuda:{i}" for i in range(8)]
    four = equivalent_specs(PlacementSpec("sharded", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")), 8, samples=5)
    assert len(four) == 5 and all(len(s.devices) == 4 for s in four)
    assert equivalent_specs(PlacementSpec("host", ("cpu",)), 8, samples=5) == [PlacementSpec("host", ("cpu",))]


# -- the paper's trends ------------------------------------------------------------------------------
def test_a100_latency_falls_from_one_to_sixteen_gpus():
    rows = run_scenario(SCENARIOS["a100"], samples=2)
    ms = {r["gpus"]: r["sim_ms"] for r in rows}
    assert [r["gpus"] for r in rows] == [1, 2, 4, 8, 16]
    assert ms[16] < ms[1] / 2, ms
    assert rows[-1]["nodes"] == 2


def test_mi250x_latency_falls_with_scale_and_the_conservative_placement_loses():
    sc = dataclasses.replace(SCENARIOS["mi250x"], gpus=(8, 16, 32, 64))
    rows = run_scenario(sc, samples=2)
    ms = [r["sim_ms"] for r in rows]
    assert all(a > b for a, b in zip(ms, ms[1:], strict=False)), ms
    conservative = simulate_scale(sc, 64, adaptive=False, baseline="all-gpus")[0]
    assert conservative.latency_s > rows[-1]["sim_ms"] / 1e3
    for r in rows:  # the link-blind planner's choices are never clearly better than the link-aware one
        assert r["sim_ms"] <= r["sim_non_adaptive_ms"] * 1.02


# -- the CLI -------------------------------------------------------------------------------------------
def test_conduit_simulate_writes_a_labelled_table_json_and_plot(tmp_path, capsys):
    rc = main(["simulate", "--scenario", "a100", "--gpus", "1,2", "--samples", "2", "--out", str(tmp_path)])
    assert rc == 0
    md = (tmp_path / "scale-a100.md").read_text()
    assert "SIMULATION" in md and "| 1 | 1 |" in md and "95.0" in md
    data = json.loads((tmp_path / "scale-a100.json").read_text())
    assert data["label"] == "SIMULATION" and [r["gpus"] for r in data["rows"]] == [1, 2]
    png = tmp_path / "scale.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "SIMULATION" in capsys.readouterr().out
