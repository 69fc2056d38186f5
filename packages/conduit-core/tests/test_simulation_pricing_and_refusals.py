"""The scale simulator (conduit.simulation): multi-node pricing, speed, refusals."""

from __future__ import annotations

import dataclasses

import pytest
from conduit.placement import PlacementSpec
from conduit.simulation import NETWORKS, SCENARIOS, ClusterPlanner, simulate_scale
from conduit.simulation.cluster import load_node
from conduit.simulation.model import layout, node_in_use, node_loads, node_workload


def _cluster(scenario_name: str, gpus: int):
    sc = SCENARIOS[scenario_name]
    net = NETWORKS[sc.network]
    lay = layout(gpus, sc.total_batch, 8)
    w = node_workload(sc, lay)
    topo = node_in_use(load_node(sc.topology), lay.gpus_per_node)
    cost = ClusterPlanner(topo, nodes=lay.nodes, network=net).cost
    return sc, net, lay, w, cost


@pytest.mark.parametrize("scenario_name, gpus", [("mi250x", 24), ("a100", 24)])
def test_multi_node_pricing_uses_the_learners_unrounded_batch_like_the_simulation(scenario_name, gpus):
    """scale.md: the planner prices a node's delivery phase by node_loads of exactly the steps the simulator
    runs. The simulation draws total_batch / gpus items per learner (here not a whole number: 32768/24,
    2048/24); the planner priced the rounded batch instead, so its price was not the simulation's busy time."""
    sc, net, lay, w, cost = _cluster(scenario_name, gpus)
    assert lay.batch != int(lay.batch)  # the case under test
    for spec in (PlacementSpec("gpu", ("cuda:0",)), PlacementSpec("sharded", ("cuda:0", "cuda:2"))):
        simulated = max(node_loads(cost, spec, w, lay.batch, lay.nodes, net).values())
        priced = cost.deliver(spec, w)[0]
        assert priced == pytest.approx(simulated, rel=1e-12), (
            f"{spec}: planner prices {priced!r} s, the simulation's busiest resource is {simulated!r} s")


#: (scenario, gpus, node_fetch, adaptive) -> (placement, latency_s, ingest_s), computed before the fetch
#: steps' per-pair constants were worked out once per delivery phase instead of once per pair of nodes
_BEFORE = {
    ("mi250x", 16, True, True): ("sharded[cuda:0,cuda:2,cuda:4,cuda:6]", 0.28101574647272726, 0.26639829984),
    ("mi250x", 16, True, False): ("sharded[cuda:0,cuda:1,cuda:2,cuda:3]", 0.29412201143272726, None),
    ("mi250x", 64, True, True): ("sharded[cuda:0,cuda:2,cuda:4,cuda:6]", 0.07679451473454546, 0.06854582495999992),
    ("mi250x", 64, True, False): ("sharded[cuda:0,cuda:1]", 0.09133045730909087, None),
    ("mi250x", 16, False, True): ("sharded[cuda:0,cuda:2,cuda:4,cuda:6]", 0.28400978373818186, 0.26639829984),
    ("mi250x", 64, False, True): ("sharded[cuda:0,cuda:2]", 0.08464663458909089, 0.06775532512000007),
    ("mi250x", 64, False, False): ("sharded[cuda:0,cuda:1]", 0.09510323234909086, None),
    ("a100", 16, True, True): ("sharded[cuda:0,cuda:1]", 0.021479689470307064, 0.01801301309090908),
}


@pytest.mark.parametrize("key", list(_BEFORE))
def test_faster_fetch_construction_simulates_the_same_iteration_as_before(key):
    name, gpus, node_fetch, adaptive = key
    sc = SCENARIOS[name]
    net = dataclasses.replace(NETWORKS[sc.network], node_fetch=node_fetch)
    point = simulate_scale(sc, gpus, network=net, adaptive=adaptive)[0]
    placement, latency, ingest = _BEFORE[key]
    assert str(point.placement) == placement
    assert point.latency_s == pytest.approx(latency, rel=1e-12, abs=0.0), key
    if ingest is not None:
        assert point.ingest_s == pytest.approx(ingest, rel=1e-12, abs=0.0), key


def test_equivalent_specs_refuses_a_placement_with_more_gpus_than_the_node_has():
    """A four-GPU sharding has no equivalent on a two-GPU node: a typed refusal, not an empty list (which
    run_scenario would average into a ZeroDivisionError)."""
    from conduit.errors import ConfigurationError
    from conduit.simulation import equivalent_specs

    four = PlacementSpec("sharded", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"))
    with pytest.raises(ConfigurationError, match="4 GPUs"):
        equivalent_specs(four, 2, samples=8)
    assert len(equivalent_specs(four, 4, samples=100)) == 4  # every home of the one 4-subset


@pytest.mark.parametrize("gpus", [12, 20, 36])
def test_gpus_that_do_not_fill_whole_nodes_of_eight_are_refused_not_spread_evenly(gpus):
    """scale.md: nodes have 8 GPUs and fill up 8 at a time, so 12 GPUs are a full node and half of another,
    which the simulator (identical nodes) cannot model. It simulated 2 nodes of 6 GPUs instead, a cluster
    that was not asked for; it refuses, saying what to use."""
    from conduit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="multiple of 8"):
        layout(gpus, 2048, 8)
    with pytest.raises(ConfigurationError, match="multiple of 8"):
        simulate_scale(SCENARIOS["a100"], gpus)
    assert layout(24, 2048, 8).gpus_per_node == 8 and layout(24, 2048, 8).nodes == 3
    assert layout(5, 2048, 5) == layout(5, 2048, 5) and layout(5, 2048, 5).nodes == 1  # one node, part used


@pytest.mark.parametrize("bad", [{"replay_ratio": 0.0}, {"replay_ratio": -1.0}, {"replay_ratio": float("inf")},
                                 {"replay_ratio": float("nan")}, {"learner_batch": 0.0},
                                 {"learner_batch": float("nan")}])
def test_replay_workload_refuses_ratios_and_batches_it_cannot_price(bad):
    """ReplayWorkload(replay_ratio=0) was accepted and raised ZeroDivisionError at the first price."""
    from conduit.errors import ConfigurationError
    from conduit.simulation import ReplayWorkload

    with pytest.raises(ConfigurationError, match=next(iter(bad))):
        ReplayWorkload((4000,), 1000, 10, 2, **bad)
    assert ReplayWorkload((4000,), 1000, 10, 2, replay_ratio=0.5).calls_per_iteration == 2.0
