"""The scale simulator (conduit.simulation): fractional batches ingested, engine ties and inputs, scenario types."""

from __future__ import annotations

import dataclasses
import math

import pytest
from conduit.placement import PlacementSpec
from conduit.simulation import NETWORKS, SCENARIOS, ClusterPlanner, simulate_iteration
from conduit.simulation.cluster import load_node
from conduit.simulation.model import layout, node_workload


@pytest.mark.parametrize("total_batch", [8, 12, 24, 2048])
def test_a_node_ingests_its_share_of_the_total_batch_when_a_learners_batch_is_not_whole(total_batch):
    """scale.md: fractional items are kept, and an iteration ingests total batch / replay ratio items. With
    16 GPUs and a total batch of 8, 12 or 24 a learner draws 0.5, 0.75 or 1.5 items; ingestion counted the
    rounded batch per learner (1, 1, 2), so each node ingested 8, 8 and 16 items instead of 4, 6 and 12."""
    sc = dataclasses.replace(SCENARIOS["a100"], total_batch=total_batch, gpus=(16,))
    lay = layout(16, total_batch, 8)
    w = node_workload(sc, lay)
    assert w.calls_per_iteration * w.ingest_call_items == pytest.approx(total_batch / lay.nodes, rel=1e-12)
    # and the simulated ingestion follows: host memory ingests one item per call here, so the time is the
    # number of calls times one call's time, proportional to the items
    net = NETWORKS[sc.network]
    cost = ClusterPlanner(load_node(sc.topology), nodes=lay.nodes, network=net).cost
    host = PlacementSpec("host", ("cpu",))
    one = dataclasses.replace(sc, total_batch=16)
    per_item = simulate_iteration(cost, host, one, layout(16, 16, 8), net).ingest_s / 8  # 8 calls of 1 item
    if w.batch == 1:
        assert simulate_iteration(cost, host, sc, lay, net).ingest_s == pytest.approx(
            per_item * total_batch / lay.nodes, rel=1e-9)


def test_a_task_ready_through_a_zero_duration_task_keeps_its_submission_order_at_a_resource():
    """engine.py: FCFS at a resource, ties in submission order. b (submitted first) and c are both ready at
    t=0, b through a zero-duration task without a resource; c took r first because b became ready one
    event later at the same time."""
    from conduit.simulation import Simulation

    sim = Simulation()
    a = sim.task("a", 0.0)
    b = sim.task("b", 1.0, "r", [a])
    c = sim.task("c", 1.0, "r")
    assert sim.run() == 2.0
    assert (a.start, a.end, b.start, c.start) == (0.0, 0.0, 0.0, 1.0)
    # a chain of them, ready later: the same
    sim = Simulation()
    t0 = sim.task("t0", 1.0)
    z1 = sim.task("z1", 0.0, None, [t0])
    z2 = sim.task("z2", 0.0, None, [z1])
    d = sim.task("d", 1.0, "r", [z2])
    e = sim.task("e", 1.0, "r", [t0])
    assert sim.run() == 3.0
    assert (z2.end, d.start, e.start) == (1.0, 1.0, 2.0)
    assert sim.busy == {"r": 2.0}


@pytest.mark.parametrize("duration", [math.inf, "1", True, None])
def test_engine_refuses_a_duration_that_is_no_finite_number(duration):
    """An infinite duration ran (makespan inf), a string raised a bare TypeError from a comparison."""
    from conduit.simulation import Simulation

    with pytest.raises(ValueError, match="finite seconds >= 0"):
        Simulation().task("x", duration)


@pytest.mark.parametrize("k", [-1, 1.5, True, "2", None])
def test_busiest_refuses_a_count_that_is_no_int_of_at_least_zero(k):
    """busiest(-1) returned every resource but the least busy one (a slice from the end), busiest(1.5) raised a
    bare TypeError from the slice and busiest(True) listed one."""
    from conduit.simulation import Simulation

    sim = Simulation()
    sim.task("a", 1.0, "r1")
    sim.task("b", 2.0, "r2")
    sim.run()
    with pytest.raises(ValueError, match="int >= 0"):
        sim.busiest(k)
    assert sim.busiest(0) == [] and sim.busiest(5) == [("r2", 2.0), ("r1", 1.0)]


def test_engine_refuses_a_dependency_on_another_simulations_task():
    """A task of another simulation never ends in this one: the run raised 'a dependency cycle' (there was
    none), after appending to the other simulation's task. It is refused when the task is added."""
    from conduit.simulation import Simulation

    other = Simulation()
    foreign = other.task("foreign", 1.0)
    sim = Simulation()
    mine = sim.task("mine", 1.0)
    with pytest.raises(ValueError, match="'foreign', which is no task of this simulation"):
        sim.task("late", 1.0, "r", [mine, foreign])
    assert sim.run() == 1.0 and len(sim.tasks) == 1
    assert other.run() == 1.0 and foreign.end == 1.0


@pytest.mark.parametrize("change", [{"gpus": (True,)}, {"gpus": (1.5,)}, {"gpus": ()}, {"total_batch": 2048.7},
                                    {"total_batch": "2048"}, {"obs_dim": True}, {"capacity": 1e6},
                                    {"replay_ratio": True}])
def test_a_scenario_refuses_counts_that_are_no_whole_numbers(change):
    """Scenario took gpus=(True,) (one GPU), total_batch=2048.7, capacity=1e6 and replay_ratio=True and
    simulated them; gpus=(1.5,) and total_batch='2048' raised bare TypeErrors deep inside the simulation."""
    from conduit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=next(iter(change))):
        dataclasses.replace(SCENARIOS["a100"], **change)


def test_a_scenario_takes_numpy_counts_and_a_list_of_scales():
    import numpy as np

    sc = dataclasses.replace(SCENARIOS["a100"], gpus=[np.int64(1), 2], capacity=np.int64(10**6),
                             replay_ratio=np.float64(2.0))
    assert sc.gpus == (1, 2) and isinstance(sc.gpus, tuple)


@pytest.mark.parametrize("change", [{"node_fetch": "no"}, {"node_fetch": 0}, {"rpc_overhead_s": True},
                                    {"rpc_overhead_s": "1"}])
def test_a_network_refuses_a_flag_that_is_no_bool_and_a_cost_that_is_no_number(change):
    """node_fetch='no' is truthy: it simulated one fetch per pair of nodes; rpc_overhead_s=True was taken as
    one second, and a string raised a bare TypeError."""
    from conduit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=next(iter(change))):
        dataclasses.replace(NETWORKS["hdr-ib-8x"], **change)


@pytest.mark.parametrize(("gpus", "capacity", "ratio"), [(16, 10**9, 2.048e-6), (1, 10**9, 2.048e-6),
                                                         (4096, 10**6, 2.048e-3)])
def test_an_iteration_of_too_many_ingestion_calls_is_refused_with_a_replay_ratio_that_would_do(gpus, capacity, ratio):
    """--capacity 1e9 --obs-dim 1 --replay-ratio 2.048e-6 (every check passed: the buffer holds what one iteration
    ingests) built millions of ingestion calls, each several tasks, for hours and tens of GB; it is refused before
    anything is built, saying the least replay ratio that is simulated, and that ratio is."""
    import re

    from conduit.errors import ConfigurationError
    from conduit.simulation.model import MAX_INGEST_CALLS

    sc = dataclasses.replace(SCENARIOS["a100"], obs_dim=1, capacity=capacity, replay_ratio=ratio, gpus=(gpus,))
    lay = layout(gpus, sc.total_batch, min(gpus, 8))
    with pytest.raises(ConfigurationError, match="at most 200000 ingestion calls") as e:
        node_workload(sc, lay)
    least = float(re.search(r"replay ratio to at least (\S+) ", str(e.value)).group(1))
    w = node_workload(dataclasses.replace(sc, replay_ratio=least), lay)
    assert lay.nodes * math.ceil(w.calls_per_iteration) <= MAX_INGEST_CALLS


def test_simulate_refuses_too_many_ingestion_calls_before_writing(tmp_path, capsys):
    from conduit.cli import main

    assert main(["simulate", "--scenario", "a100", "--gpus", "16", "--out", str(tmp_path / "o"), "--capacity", "1e9",
                 "--obs-dim", "1", "--replay-ratio", "2.048e-6"]) == 2
    assert "error: --gpus 16 (a100): An iteration would ingest 1e+09 items" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_scale_md_names_every_kind_of_resource_the_simulation_queues_at():
    """scale.md's list of resources left out the shard server (server:n) and the cards' two directions
    (nic-out, nic-in), though the busiest resources in its tables name them."""
    from pathlib import Path

    from conduit.simulation import simulate_scale

    doc = (Path(__file__).resolve().parents[3] / "benchmarks" / "docs" / "scale.md").read_text()
    kinds = {r.split(":")[0] for r in simulate_scale(SCENARIOS["a100"], 16)[0].busy}
    assert {"cpu", "server", "nic-out", "nic-in"} <= kinds
    missing = sorted(k for k in kinds if f"`{k}:n" not in doc)
    assert not missing, f"scale.md does not name the resources {missing}"
