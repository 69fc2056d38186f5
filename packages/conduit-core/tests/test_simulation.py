"""The scale simulator: the event engine, its agreement with the placement cost model, trends, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conduit.cli import main
from conduit.placement import PlacementSpec, Planner, Workload, load_topology
from conduit.placement.growth import paper_schedule, simulate_growth
from conduit.simulation import (
    NETWORKS,
    SCENARIOS,
    ClusterCostModel,
    ClusterPlanner,
    Simulation,
    equivalent_specs,
    run_scenario,
    simulate_iteration,
    simulate_scale,
    uniform_view,
)
from conduit.simulation.cluster import load_node
from conduit.simulation.model import layout, node_loads, node_workload


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


def test_a_nodes_ingestion_calls_run_on_one_thread_and_their_dmas_overlap_the_next_call():
    """Several calls on a node: the thread packs them one after another; a call's DMAs overlap the next's packing."""
    sc = dataclasses.replace(SCENARIOS["a100"], capacity=100_000)
    lay = layout(4, sc.total_batch, 4)
    w = node_workload(sc, lay)
    cost = ClusterPlanner(load_topology(sc.topology)).cost
    spec = PlacementSpec("sharded", ("cuda:0", "cuda:2", "cuda:4", "cuda:6"))
    st = cost.ingest_steps(spec, w)
    calls = w.calls_per_iteration
    assert calls == 4
    point = simulate_iteration(cost, spec, sc, lay, NETWORKS[sc.network])
    assert calls * (st.calls_s + st.thread_s) <= point.ingest_s < cost.estimate(spec, w).ingest_s
    assert point.busy["cpu:0"] >= calls * (st.calls_s + st.thread_s)
    assert point.busy["hostlink:0:0"] == pytest.approx(calls * sum(s.link_s for s in st.steps if s.shard == 0))


def test_the_link_blind_view_proposes_gpus_in_rank_order():
    topo = load_topology("mi250x-node")
    w = Workload.transitions(20000, capacity=2_000_000, batch=512, learners=8)
    fast = PlacementSpec("sharded", ("cuda:0", "cuda:2", "cuda:4", "cuda:6"))
    assert fast in [s for s, _ in ClusterPlanner(topo).candidates(w)]
    assert [s for s, _ in ClusterPlanner(topo).candidates(w)] == [s for s, _ in Planner(topo).candidates(w)]
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
    assert ms[16] < ms[1] / 2 and ms[4] < ms[2] < ms[1], ms
    assert rows[-1]["nodes"] == 2


def test_mi250x_adaptive_placement_is_never_worse_and_wins_where_gpu_links_carry_traffic():
    rows = run_scenario(dataclasses.replace(SCENARIOS["mi250x"], gpus=(8, 16, 32, 64, 128, 256, 1024)))
    ms = {r["gpus"]: r["sim_ms"] for r in rows}
    # each node's packing thread binds ingestion (core's staged model), and more nodes share it out; with one
    # fetch per pair of nodes, serving does not grow with the learners, so every doubling is faster
    assert ms[1024] < ms[8] / 10, ms
    assert list(ms.values()) == sorted(ms.values(), reverse=True), ms
    assert all(r["gain"] > 0.05 for r in rows if r["gpus"] in (64, 128, 256)), [(r["gpus"], r["gain"]) for r in rows]
    for r in rows:
        assert r["sim_ms"] <= r["sim_non_adaptive_ms"] * (1 + 1e-9), r
        if r["placement"] == r["non_adaptive_placement"]:
            assert r["sim_ms"] == pytest.approx(r["sim_non_adaptive_ms"], rel=1e-9), r
    for r in rows[:4]:  # 8-64 GCDs: fast, NIC-attached ranks against ranks in order
        assert r["placement"] != r["non_adaptive_placement"], r
        assert r["sim_non_adaptive_ms"] - r["sim_ms"] > 4.0, r  # ms saved in the delivery phase
        assert r["gpu_links_busy_ms"] < r["non_adaptive_gpu_links_busy_ms"], r
    assert rows[3]["gain"] > 0.05  # 64 GCDs: the delivery phase is a larger share of the iteration
    sc = dataclasses.replace(SCENARIOS["mi250x"], gpus=(64,))
    conservative = simulate_scale(sc, 64, adaptive=False, baseline="all-gpus")[0]
    assert conservative.latency_s > ms[64] / 1e3


def test_mi250x_network_cards_are_attached_to_gcds_and_the_link_blind_view_does_not_see_them():
    topo = load_node("mi250x-node")
    cost = ClusterCostModel(topo, nodes=2, network=NETWORKS["slingshot-4x"])
    assert [g for _, g in cost.cards()] == [0, 2, 4, 6]
    assert [cost.card_of(f"cuda:{i}") for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # its package's card
    blind = ClusterCostModel(uniform_view(topo), nodes=2, network=NETWORKS["slingshot-4x"])
    assert blind.cards() == [(NETWORKS["slingshot-4x"].nic, None)]
    assert ClusterCostModel(load_node("dgx-a100-80g")).cards() == []  # no network, no declared cards


def test_remote_bytes_cross_gcd_links_from_the_card_and_one_gcd_serves_through_one_card():
    sc = SCENARIOS["mi250x"]
    net = NETWORKS[sc.network]
    topo = load_node(sc.topology)
    lay = layout(16, sc.total_batch, 8)
    cost = ClusterPlanner(topo, nodes=lay.nodes, network=net).cost
    one = simulate_iteration(cost, PlacementSpec("gpu", ("cuda:0",)), sc, lay, net).busy
    assert one.get("link:0:0:1", 0) > 0 and one.get("link:0:2:3", 0) > 0  # into the learners on GCDs 1 and 3
    assert one.get("nic-out:0:0", 0) > 0 and one.get("nic-out:0:1", 0) == 0  # GCD 0's card only
    fast = simulate_iteration(cost, PlacementSpec("sharded", ("cuda:0", "cuda:2", "cuda:4", "cuda:6")), sc, lay, net)
    assert all(fast.busy.get(f"nic-out:0:{c}", 0) > 0 for c in range(4))
    single = simulate_iteration(cost, PlacementSpec("gpu", ("cuda:0",)), sc, layout(8, sc.total_batch, 8), net).busy
    assert not any(k.startswith(("nic", "server")) for k in single)  # one node: no network


def test_a_nodes_learners_fetch_from_each_other_node_once_with_node_fetch():
    """One fetch per pair of nodes carries every learner's rows: the holder's shard server serves 1/g of the
    requests (g learners a node) and the requester issues 1/g of the RPCs, for the same bytes on the cards."""
    sc = SCENARIOS["mi250x"]
    lay = layout(128, sc.total_batch, 8)  # 16 nodes, 256 items per learner: every learner draws from every node
    topo = load_node(sc.topology)
    spec = PlacementSpec("sharded", ("cuda:0", "cuda:2"))
    busy = {}
    for node_fetch in (True, False):
        net = dataclasses.replace(NETWORKS[sc.network], node_fetch=node_fetch)
        cost = ClusterPlanner(topo, nodes=lay.nodes, network=net).cost
        busy[node_fetch] = simulate_iteration(cost, spec, sc, lay, net)
    per_node, per_learner = busy[True].busy, busy[False].busy
    assert per_learner["server:0"] == pytest.approx(8 * per_node["server:0"], rel=0.05)
    nic = [k for k in per_node if k.startswith("nic-out:0:")]
    assert nic and all(per_node[k] == pytest.approx(per_learner[k], rel=0.01) for k in nic)  # the same bytes
    assert per_node["cpu:0"] < per_learner["cpu:0"]
    assert busy[True].latency_s < busy[False].latency_s


def test_the_planners_node_loads_are_the_simulations_busy_time_on_a_node():
    sc = dataclasses.replace(SCENARIOS["mi250x"], obs_dim=5000)
    net = NETWORKS[sc.network]
    topo = load_node(sc.topology)
    lay = layout(32, sc.total_batch, 8)
    w = node_workload(sc, lay)
    cost = ClusterPlanner(topo, nodes=lay.nodes, network=net).cost
    for spec in (PlacementSpec("gpu", ("cuda:1",)), PlacementSpec("sharded", ("cuda:0", "cuda:1", "cuda:2"))):
        busy = simulate_iteration(cost, spec, sc, lay, net).busy
        loads = node_loads(cost, spec, w, lay.batch, lay.nodes, net)
        for res, v in loads.items():
            if not res.startswith(("cpu", "hostlink", "host:", "disk")):  # ingestion uses these too
                assert busy[res] == pytest.approx(v, rel=1e-9), res
        assert cost.deliver(spec, w)[0] == pytest.approx(max(node_loads(cost, spec, w, w.batch, lay.nodes, net)
                                                             .values()))


# -- the online-migration experiment (issue: the paper's 40 iterations, d 128 -> 20000) -------------
def test_migration_greedy_runs_out_conduit_migrates_at_the_boundaries_and_beats_conservative():
    schedule = paper_schedule(40)
    res = simulate_growth(Planner(load_topology("dgx-a100-80g")), schedule)
    g, c, k = (res.strategies[n] for n in ("greedy", "conservative", "conduit"))
    assert g.failed_at == schedule.index(10000) and g.latency_s[-1] is None  # out of GPU memory
    assert c.failed_at is None and k.failed_at is None
    assert [i for i, *_ in k.migrations] == [schedule.index(10000), schedule.index(20000)]
    assert k.placements[0] == "gpu[cuda:0]" and k.placements[-1].startswith("sharded")
    assert 2 <= k.placements[-1].count("cuda") < 8  # the smallest sharding that fits and is fast, not all GPUs
    assert k.cumulative_s < c.cumulative_s
    for i, d in enumerate(schedule):  # Conduit is below Conservative in every iteration it does not migrate
        if all(m[0] != i for m in k.migrations):
            assert k.latency_s[i] < c.latency_s[i], (i, d)
    assert res.conservative_over_conduit > 1.2


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


def test_tasks_ready_at_the_same_time_take_a_resource_in_submission_order():
    """The engine's docstring: FCFS at a resource, ties in submission order. Two tasks become ready
    at t=1 (their dependencies end together); the one submitted first must run first, whatever the
    order of their dependencies."""
    sim = Simulation()
    x = sim.task("x", 1.0)
    y = sim.task("y", 1.0)
    b = sim.task("b", 2.0, "r", [y])  # submitted first, its dependency submitted second
    a = sim.task("a", 2.0, "r", [x])
    assert sim.run() == 5.0
    assert (b.start, a.start) == (1.0, 3.0)


def test_a_resource_freed_as_two_tasks_become_ready_goes_to_the_one_submitted_first():
    """r frees at t=1 as two tasks become ready there: they run in submission order, and r's busy
    time is the sum of its tasks' durations (zero-duration tasks included)."""
    sim = Simulation()
    t0 = sim.task("t0", 1.0, "r")
    x = sim.task("x", 1.0)
    y = sim.task("y", 1.0)
    b = sim.task("b", 1.0, "r", [y])
    zero = sim.task("zero", 0.0, "r", [b])
    a = sim.task("a", 1.0, "r", [x])
    total = sim.run()
    assert t0.end == 1.0
    assert (b.start, a.start, zero.start) == (1.0, 2.0, 3.0)
    assert total == 3.0 and sim.busy["r"] == 3.0
