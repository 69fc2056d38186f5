"""One training iteration of the experience path at cluster scale, as a discrete-event simulation.

Every GPU runs one data-parallel learner; nodes fill up ``gpus_per_node`` GPUs at a time.
Each node keeps its share of the buffer in the placement the planner chose for that node
(core's :class:`~conduit.placement.Planner`, through :class:`~.planning.ClusterPlanner`),
and every duration below comes from core's :class:`~conduit.placement.CostModel` for that
placement and a node-sized :class:`~conduit.placement.Workload`. One iteration is:

1. **ingestion**: each node's actors hand over their share of the items in calls of one
   learner's batch (EDP overhead on the node's CPU, packing on host memory, copy into the
   placement's devices), all nodes at once;
2. a barrier (the learners sample from the buffer as it stands after ingestion);
3. **delivery**: each learner draws its batch uniformly over the union of all nodes'
   buffers (the multi-node semantics of :mod:`conduit.distributed`), so ``1/N`` of it is
   local (CPU -> gather on the placement -> transfer to the learner's GPU) and the rest comes
   from the other nodes: per pair of nodes, the requester issues the fetches (RPC overhead
   on its CPU), the holder serves and gathers them, and the bytes cross the requester's NIC.

Resources (each serves one task at a time, first come first served): ``cpu:n`` (the node's
EDP calls), ``host:n`` (host memory copies), ``store:n`` (the placement's devices),
``link:n:i:j`` (GPU ``i`` to GPU ``j``, or the host link of GPU ``j``), ``nic:n``. Where
several learners or nodes need the same resource they queue: that contention, and the
overlap where they do not, is what the simulation adds to the cost model (which prices
one node's deliveries one after another and has no network). Durations are expectations
(fractional items and calls are kept as such).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from conduit.errors import ConfigurationError
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import CostModel, Workload
from conduit.placement.topology import Topology, load_topology
from conduit.simulation.cluster import NETWORKS, Network, Scenario
from conduit.simulation.engine import Simulation, Task
from conduit.simulation.planning import ClusterPlanner, uniform_view

__all__ = ["ReplayWorkload", "ScalePoint", "Layout", "simulate_iteration", "node_workload", "node_in_use",
           "equivalent_specs",
           "simulate_scale", "run_scenario"]


@dataclass(frozen=True)
class ReplayWorkload(Workload):
    """A :class:`Workload` that ingests ``1 / replay_ratio`` of the items it delivers per iteration."""

    replay_ratio: float = 1.0

    @property
    def calls_per_iteration(self) -> float:
        return super().calls_per_iteration / self.replay_ratio


@dataclass(frozen=True)
class Layout:
    """How a scale point maps onto the cluster."""

    gpus: int
    nodes: int
    gpus_per_node: int
    #: items each learner gets per iteration
    batch: float


def layout(gpus: int, total_batch: int, gpus_per_node: int) -> Layout:
    if gpus <= 0:
        raise ConfigurationError(f"gpus must be positive, got {gpus}.")
    nodes = math.ceil(gpus / gpus_per_node)
    if gpus % nodes:
        raise ConfigurationError(f"{gpus} GPUs do not split evenly over {nodes} nodes of {gpus_per_node}.")
    return Layout(gpus, nodes, gpus // nodes, total_batch / gpus)


def node_workload(scenario: Scenario, lay: Layout) -> ReplayWorkload:
    """The per-node workload the planner plans for: the node's share of the capacity and the batch."""
    batch = max(1, round(lay.batch))
    w = Workload.transitions(scenario.obs_dim, capacity=math.ceil(scenario.capacity / lay.nodes), batch=batch,
                             learners=lay.gpus_per_node, ingest_items=batch)
    return ReplayWorkload(w.field_bytes, w.capacity, w.batch, w.learners, w.ingest_items, w.growing, w.name,
                          w.scalar, replay_ratio=scenario.replay_ratio)


def _resized(w: Workload, batch: int) -> Workload:
    return Workload(w.field_bytes, w.capacity, max(1, batch), w.learners, max(1, batch), w.growing, w.name, w.scalar)


def _split(parts: dict[str, float]) -> tuple[float, float, float]:
    """(CPU-side, store-side, transfer) seconds of a delivery's cost-model parts."""
    cpu = parts.get("deliver: edp", 0.0) + parts.get("deliver: calls", 0.0)
    store = parts.get("deliver: gather", 0.0) + parts.get("deliver: scatter", 0.0)
    return cpu, store, parts.get("deliver: transfer", 0.0)


def _home(spec: PlacementSpec) -> str:
    return spec.devices[0] if spec.tier in ("gpu", "sharded") else "host"


@dataclass
class ScalePoint:
    """The simulated iteration at one scale."""

    gpus: int
    nodes: int
    placement: PlacementSpec
    latency_s: float
    ingest_s: float
    #: the resources busy longest (name, seconds)
    busiest: list[tuple[str, float]] = field(default_factory=list)
    #: the cost model's one-node estimate (ingest + deliver), for reference
    cost_model_s: float = 0.0


def simulate_iteration(cost: CostModel, spec: PlacementSpec, scenario: Scenario, lay: Layout,
                       network: Network) -> ScalePoint:
    """Simulate one iteration with ``spec`` as every node's placement."""
    w = node_workload(scenario, lay)
    sim = Simulation()
    n_nodes, g = lay.nodes, lay.gpus_per_node
    home = _home(spec)
    item = w.item_bytes

    # 1. ingestion
    _, ing = cost.ingest(spec, w)
    calls = w.calls_per_iteration
    n_calls = max(1, math.ceil(calls))
    scale = calls / n_calls
    edp = ing.get("ingest: edp", 0.0) / calls * scale if calls else 0.0
    pack = ing.get("ingest: pack", 0.0) / calls * scale if calls else 0.0
    copy = ing.get("ingest: copy", 0.0) / calls * scale if calls else 0.0
    ingest_tasks: list[Task] = []
    for n in range(n_nodes):
        for c in range(n_calls):
            t = sim.task(f"ingest n{n} c{c}: edp", edp, f"cpu:{n}")
            t = sim.task(f"ingest n{n} c{c}: pack", pack, f"host:{n}", [t])
            ingest_tasks.append(sim.task(f"ingest n{n} c{c}: copy", copy, f"store:{n}", [t]))
    barrier = sim.task("barrier", 0.0, None, ingest_tasks)
    ingest_end = [0.0]

    # 2. delivery: each learner's batch b, uniform over the union of the nodes' buffers
    b = lay.batch
    p_touch = 1.0 - (1.0 - 1.0 / n_nodes) ** b  # a learner draws at least one item from a given node
    per_touch = (b / n_nodes) / p_touch  # items drawn from that node, given it is touched
    local_w = _resized(w, round(per_touch))
    f_items = per_touch / local_w.batch  # the rounding, corrected on byte-proportional parts
    # the placement's own work (gather, and for shards their moves to the home GPU) vs the move to the learner
    serve_cpu, serve_store, serve_move = _split(cost.deliver_one(spec, local_w, home if home != "host" else "cpu"))
    for n in range(n_nodes):
        for j in range(g):
            learner = f"cuda:{j}" if cost.topology.num_gpus else "cpu"
            c_cpu, c_store, c_xfer = _split(cost.deliver_one(spec, local_w, learner))
            to_learner = max(0.0, c_xfer - serve_move)
            t = sim.task(f"deliver n{n} l{j}: calls", p_touch * c_cpu, f"cpu:{n}", [barrier])
            t = sim.task(f"deliver n{n} l{j}: gather", p_touch * f_items * (c_store + serve_move), f"store:{n}", [t])
            sim.task(f"deliver n{n} l{j}: transfer", p_touch * f_items * to_learner, f"link:{n}:{home}:{learner}",
                     [t])
    if n_nodes > 1:
        fetches = g * p_touch  # expected fetches from one node to another per iteration
        nbytes = g * b / n_nodes * item
        rpc = fetches * network.rpc_overhead_s
        wire = fetches * network.nic.overhead_s + nbytes / network.nic.bandwidth(nbytes / max(fetches, 1e-9))
        for n, m in itertools.permutations(range(n_nodes), 2):
            t = sim.task(f"fetch n{n}<-n{m}: rpc", rpc, f"cpu:{n}", [barrier])
            t = sim.task(f"fetch n{n}<-n{m}: serve", fetches * serve_cpu, f"cpu:{m}", [t])
            t = sim.task(f"fetch n{n}<-n{m}: gather", fetches * f_items * (serve_store + serve_move), f"store:{m}",
                         [t])
            sim.task(f"fetch n{n}<-n{m}: network", wire, f"nic:{n}", [t])
    total = sim.run()
    ingest_end[0] = barrier.end
    est = cost.estimate(spec, w)
    return ScalePoint(lay.gpus, n_nodes, spec, total, ingest_end[0], sim.busiest(3), est.total_s)


def node_in_use(topology: Topology, gpus: int) -> Topology:
    """``topology`` with only its first ``gpus`` GPUs (a node of which a job uses part)."""
    if gpus >= topology.num_gpus:
        return topology
    return replace(topology, name=f"{topology.name}[{gpus} GPUs]", gpus=topology.gpus[:gpus])


def equivalent_specs(spec: PlacementSpec, num_gpus: int, *, samples: int, seed: int = 0) -> list[PlacementSpec]:
    """Placements a planner blind to the GPU links cannot tell from ``spec``: same tier and number of
    GPUs, any GPUs, any home. Up to ``samples`` of them, drawn with a fixed seed (all when fewer)."""
    if spec.tier not in ("gpu", "sharded"):
        return [spec]
    k = len(spec.devices)
    every = [PlacementSpec(spec.tier, tuple(f"cuda:{i}" for i in (h, *sorted(set(sub) - {h}))))
             for sub in itertools.combinations(range(num_gpus), k) for h in sub]
    if len(every) <= samples:
        return every
    return random.Random(seed).sample(every, samples)


#: the "adaptive placement off" baselines
BASELINES = ("link-blind", "all-gpus")


def simulate_scale(scenario: Scenario, gpus: int, *, adaptive: bool = True, baseline: str = "link-blind",
                   samples: int = 8, network: Network | None = None, topology: Topology | None = None
                   ) -> list[ScalePoint]:
    """Simulate one scale point.

    ``adaptive=True``: every node uses the placement :class:`ClusterPlanner` chooses on the
    real (non-uniform) links; returns one point. ``adaptive=False``, by ``baseline``:

    * ``"link-blind"``: the same planner on uniform links (:func:`uniform_view`); each
      placement it cannot tell apart (same tier and GPU count, any GPUs, any home) is
      simulated on the real links; returns one point per placement (up to ``samples``);
    * ``"all-gpus"``: the buffer sharded over every GPU of the node in rank order (the
      paper's "Conservative" placement), whatever the workload; returns one point.
    """
    if baseline not in BASELINES:
        raise ConfigurationError(f"baseline must be one of {BASELINES}, got {baseline!r}.")
    full = topology or load_topology(scenario.topology)
    net = network or NETWORKS[scenario.network]
    gpn = full.num_gpus or 1
    lay = layout(gpus, scenario.total_batch, min(gpus, gpn))
    topo = node_in_use(full, lay.gpus_per_node)
    w = node_workload(scenario, lay)
    real = ClusterPlanner(topo)
    if adaptive:
        spec = real.plan(w).placement
        return [simulate_iteration(real.cost, spec, scenario, lay, net)]
    if baseline == "all-gpus":
        n = topo.num_gpus
        spec = PlacementSpec("sharded", tuple(f"cuda:{i}" for i in range(n))) if n > 1 else \
            PlacementSpec("gpu", ("cuda:0",)) if n else PlacementSpec("host", ("cpu",))
        return [simulate_iteration(real.cost, spec, scenario, lay, net)]
    blind = ClusterPlanner(uniform_view(topo)).plan(w).placement
    specs = equivalent_specs(blind, lay.gpus_per_node, samples=samples)
    return [simulate_iteration(real.cost, s, scenario, lay, net) for s in specs]


def run_scenario(scenario: Scenario, *, baseline: str = "link-blind", samples: int = 8,
                 network: Network | None = None, gpus: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """Every scale of ``scenario``, adaptive and not; one row per scale (latencies in ms)."""
    topo = load_topology(scenario.topology)
    rows = []
    for n in gpus or scenario.gpus:
        a = simulate_scale(scenario, n, adaptive=True, network=network, topology=topo)[0]
        blind = simulate_scale(scenario, n, adaptive=False, baseline=baseline, samples=samples, network=network,
                               topology=topo)
        mean_blind = sum(p.latency_s for p in blind) / len(blind)
        paper_a, paper_b = scenario.paper.get(n, (None, None))
        rows.append({"gpus": n, "nodes": a.nodes, "placement": str(a.placement),
                     "sim_ms": a.latency_s * 1e3, "sim_ingest_ms": a.ingest_s * 1e3,
                     "sim_non_adaptive_ms": mean_blind * 1e3,
                     "non_adaptive_placements": len(blind),
                     "non_adaptive_range_ms": (min(p.latency_s for p in blind) * 1e3,
                                               max(p.latency_s for p in blind) * 1e3),
                     "gain": 1.0 - a.latency_s / mean_blind if mean_blind > 0 else 0.0,
                     "paper_ms": paper_a, "paper_non_adaptive_ms": paper_b,
                     "busiest": a.busiest, "cost_model_node_ms": a.cost_model_s * 1e3})
    return rows
