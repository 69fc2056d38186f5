"""One training iteration of the experience path at cluster scale, as a discrete-event simulation.

Every GPU runs one data-parallel learner; nodes fill up ``gpus_per_node`` GPUs at a time.
Each node keeps its share of the buffer in the placement the planner chose for that node
(:class:`~.planning.ClusterPlanner`: core's planner for a node of the cluster), and every
duration below comes from :class:`~.planning.ClusterCostModel` (core's cost model plus the
cluster) for that placement and a node-sized :class:`~conduit.placement.Workload`, step by
step (core's ``ingest_steps`` and ``delivery_steps``). One iteration is:

1. **ingestion**: each node's actors hand over their share of the items in calls of one
   learner's batch, one call after another on the node's CPU: the EDP call, then each
   step's work on the thread (a copy; for GPU shards, packing the shard's rows into its
   page-locked staging and issuing the DMA), each DMA then on the host link (PCIe switch
   uplink) of the GPU it fills while the thread goes on; rewriting a shard's staging waits
   for that shard's copies of the previous call;
2. a barrier (the learners sample from the buffer as it stands after ingestion);
3. **delivery**: each learner draws its batch uniformly over the union of all nodes'
   buffers (the multi-node semantics of :mod:`conduit.distributed`), so ``1/N`` of it is
   local and the rest comes from the other nodes. A local delivery is what the EDP does:
   the calls on the CPU; every shard gathers its rows on its GPU and sends them over the
   GPU-GPU link to the gathering (home) GPU; the home GPU scatters them into the output;
   the output crosses the home -> learner link. A node's learners draw together and fetch
   from each other node once (``Network.node_fetch``, the default: one request per shard
   for all their rows there, as ``conduit.distributed`` reads several selections), or each
   learner on its own (``node_fetch=False``). A remote fetch: the requester issues it
   (RPC overhead on its CPU); the holder's shard server (a process of its own, as in
   :mod:`conduit.distributed`, where each node's shard server is an actor that runs its
   data calls one at a time) issues the serve
   (:meth:`~.planning.ClusterCostModel.serve_steps`); every shard gathers its rows on its
   GPU and sends them out through the network card nearest it (crossing the GPU-GPU link
   to the GPU the card is attached to, when it is another); they enter the requesting
   node through the card nearest each learner and cross the GPU-GPU link from that
   card's GPU to the learner's. The sending and the receiving card are busy with the
   bytes at the same time (the transfer is cut through, not stored and forwarded).
   Without declared cards a node has one, reached from every GPU directly.

Resources (each serves one task at a time, first come first served): ``cpu:n`` (the node's
EDP calls and fetch requests), ``server:n`` (the node's shard server, serving other nodes),
``host:n`` (host memory), ``disk:n``, ``gpu:n:i`` (GPU ``i``'s gathers and
scatters), ``link:n:i:j`` (the GPU ``i`` -> GPU ``j`` link), ``hostlink:n:g`` (host link
``g``, shared by the GPUs behind one PCIe switch), ``nic-out:n:c`` and ``nic-in:n:c`` (card
``c``, each direction). Where several learners or
nodes need the same resource they queue: that contention, and the overlap where they do
not, is what the simulation adds to the cost model (which prices one node's deliveries one
after another and has no network; with several nodes the planner prices a node by
:func:`node_loads`, the busy time of the same steps). Durations are expectations (fractional items and calls
are kept as such).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from statistics import fmean
from typing import Any

from conduit.errors import ConfigurationError, PlacementError
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import DeliverySteps, Workload
from conduit.placement.profile import LinkCost
from conduit.placement.topology import Topology
from conduit.simulation.cluster import NETWORKS, Network, Scenario, load_node
from conduit.simulation.engine import Simulation, Task
from conduit.simulation.planning import ClusterCostModel, ClusterPlanner, uniform_view

__all__ = ["ReplayWorkload", "ScalePoint", "Layout", "MAX_NODES", "MAX_INGEST_CALLS", "layout", "simulate_iteration",
           "node_workload", "node_in_use", "equivalent_specs", "simulate_scale", "run_scenario"]


@dataclass(frozen=True)
class ReplayWorkload(Workload):
    """A :class:`Workload` that ingests ``1 / replay_ratio`` of the items it delivers per iteration.

    ``learner_batch``: the items each learner draws per iteration as the simulation draws them (the
    cluster's total batch over its learners, not always a whole number; ``batch`` is it rounded). With
    several nodes :class:`~.planning.ClusterCostModel` prices this batch, as :func:`node_loads` does for
    the simulation, and ingestion ingests it (:attr:`calls_per_iteration`). None: ``batch``.
    """

    replay_ratio: float = 1.0
    learner_batch: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.replay_ratio) and self.replay_ratio > 0):
            raise ConfigurationError(f"replay_ratio must be a finite number > 0 (deliveries per ingested item), got "
                                     f"{self.replay_ratio!r}.")
        lb = self.learner_batch
        if lb is not None and not (math.isfinite(lb) and lb > 0):
            raise ConfigurationError(f"learner_batch must be a finite number of items > 0 (or None), got {lb!r}.")

    @property
    def calls_per_iteration(self) -> float:
        """Ingestion calls of ``ingest_call_items`` items per iteration: the learners' unrounded batches
        (``learner_batch``) over ``replay_ratio``, so a node ingests its share of the total batch, not of
        the rounded one (fractional calls are kept)."""
        drawn = 1.0 if self.learner_batch is None else self.learner_batch / self.batch
        return super().calls_per_iteration * drawn / self.replay_ratio


@dataclass(frozen=True)
class Layout:
    """How a scale point maps onto the cluster."""

    gpus: int
    nodes: int
    gpus_per_node: int
    #: items each learner gets per iteration
    batch: float


#: the most nodes one simulated iteration may span: it builds a fetch for every ordered pair of nodes, so its time
#: and memory grow with nodes**2 (512 nodes: about half a minute and 2 GB here; the paper's largest run is 128)
MAX_NODES = 512

#: the most ingestion calls (all nodes together) one simulated iteration may make: each is several tasks, so a
#: low replay ratio on a big buffer (an iteration ingesting 10^9 small items) would build tens of millions of
#: them, for hours and more memory than there is (200000: about half a minute and 1.5 GB here)
MAX_INGEST_CALLS = 200_000


def layout(gpus: int, total_batch: int, gpus_per_node: int) -> Layout:
    """``gpus`` learners on nodes of ``gpus_per_node`` GPUs, filled up ``gpus_per_node`` at a time.

    Raises:
        ConfigurationError: ``gpus`` < 1, more than one node that the GPUs do not fill (the nodes
            of a simulation are identical), or more than :data:`MAX_NODES` nodes.
    """
    if gpus <= 0:
        raise ConfigurationError(f"gpus must be positive, got {gpus}.")
    nodes = math.ceil(gpus / gpus_per_node)
    if nodes > MAX_NODES:  # checked first: its pairs of nodes would take hours and more memory than there is
        raise ConfigurationError(f"{gpus} GPUs need {nodes} nodes of {gpus_per_node}; the simulator runs at most "
                                 f"{MAX_NODES} nodes ({MAX_NODES * gpus_per_node} GPUs), as it builds a fetch for "
                                 f"every pair of nodes. Simulate fewer GPUs.")
    if nodes > 1 and gpus % gpus_per_node:
        raise ConfigurationError(f"{gpus} GPUs do not fill nodes of {gpus_per_node} (nodes fill up {gpus_per_node} "
                                 f"GPUs at a time and the simulated nodes are identical): use at most "
                                 f"{gpus_per_node} GPUs or a multiple of {gpus_per_node}.")
    return Layout(gpus, nodes, gpus // nodes, total_batch / gpus)


def node_workload(scenario: Scenario, lay: Layout) -> ReplayWorkload:
    """The per-node workload the planner plans for: the node's share of the capacity and the batch.

    Raises:
        ConfigurationError: a node's share of the capacity holds fewer items than one learner's batch
            (the message says the capacity that would), or the iteration's ingestion takes more than
            :data:`MAX_INGEST_CALLS` calls (the message says the replay ratio that would do).
    """
    batch = max(1, round(lay.batch))
    capacity = math.ceil(scenario.capacity / lay.nodes)
    if batch > capacity:
        least = (batch - 1) * lay.nodes + 1  # the smallest capacity whose share per node holds one batch
        raise ConfigurationError(
            f"Each node's share of the buffer holds {capacity} items (capacity {scenario.capacity} over {lay.nodes} "
            f"node(s)), fewer than one learner's batch of {batch} items (total batch {scenario.total_batch} over "
            f"{lay.gpus} GPUs); raise the capacity to at least {least}.")
    w = Workload.transitions(scenario.obs_dim, capacity=capacity, batch=batch,
                             learners=lay.gpus_per_node, ingest_items=batch)
    rw = ReplayWorkload(w.field_bytes, w.capacity, w.batch, w.learners, w.ingest_items, w.growing, w.name,
                        w.scalar, replay_ratio=scenario.replay_ratio, learner_batch=lay.batch)
    calls = lay.nodes * math.ceil(rw.calls_per_iteration)
    if calls > MAX_INGEST_CALLS:
        # (each node's calls are whole: its share of the budget, rounded down; the ratio said is rounded up)
        ratio = scenario.replay_ratio * rw.calls_per_iteration / (MAX_INGEST_CALLS // lay.nodes) * (1 + 1e-9)
        said = f"{ratio:.4g}" if float(f"{ratio:.4g}") >= ratio else f"{ratio * (1 + 1e-3):.4g}"
        raise ConfigurationError(
            f"An iteration would ingest {scenario.total_batch / scenario.replay_ratio:.4g} items in {calls} calls of "
            f"{batch} (one learner's batch) over {lay.nodes} node(s); the simulator simulates at most "
            f"{MAX_INGEST_CALLS} ingestion calls per iteration, as each is several tasks. Raise the replay ratio to "
            f"at least {said} (or simulate a smaller capacity).")
    return rw


def _resized(w: Workload, batch: int) -> Workload:
    return Workload(w.field_bytes, w.capacity, max(1, batch), w.learners, max(1, batch), w.growing, w.name, w.scalar)


def _device(n: int, device: str) -> str:
    """The resource of a storage device on node ``n``: host memory, the disk, or one GPU."""
    if device == "cpu":
        return f"host:{n}"
    if device == "disk":
        return f"disk:{n}"
    return f"gpu:{n}:{device.split(':', 1)[1]}"


def _link(cost: ClusterCostModel, n: int, src: str, dst: str) -> str:
    """The resource carrying bytes from ``src`` to ``dst`` on node ``n``: a GPU pair, or a GPU's host link."""
    if src.startswith("cuda:") and dst.startswith("cuda:"):
        return f"link:{n}:{src.split(':')[1]}:{dst.split(':')[1]}"
    gpu = dst if dst.startswith("cuda:") else src
    return f"hostlink:{n}:{cost.host_link_group(int(gpu.split(':')[1]))}"


def _delivery(sim: Simulation | Loads, cost: ClusterCostModel, st: DeliverySteps, n: int, label: str, deps: list[Task],
              f_calls: float, f_bytes: float) -> list[Task]:
    """The tasks of one delivery (``st``) on node ``n``: calls, shard gathers and moves, scatter, transfer."""
    t = sim.task(f"{label}: calls", f_calls * st.calls_s, f"cpu:{n}", deps)
    ends = []
    for d, g, m in st.shards:
        x = sim.task(f"{label}: gather {d}", f_bytes * g, _device(n, d), [t])
        if m:
            x = sim.task(f"{label}: move {d}->{st.home}", f_bytes * m, _link(cost, n, d, st.home), [x])
        ends.append(x)
    if st.scatter_s:
        ends = [sim.task(f"{label}: scatter", f_bytes * st.scatter_s, _device(n, st.home), ends)]
    if st.transfer_s:
        ends = [sim.task(f"{label}: transfer", f_bytes * st.transfer_s, _link(cost, n, st.home, st.learner), ends)]
    return ends


class Loads:
    """A stand-in for :class:`Simulation` that only adds up each resource's busy seconds (times ``scale``)."""

    def __init__(self) -> None:
        self.busy: dict[str, float] = {}
        self.scale = 1.0

    def task(self, name: str, duration: float, resource: str | None = None, deps: Iterable[Task] = ()) -> Task:
        if resource is not None:
            self.busy[resource] = self.busy.get(resource, 0.0) + duration * self.scale
        return Task(name, duration, resource)


Sink = Simulation | Loads


@dataclass(frozen=True)
class _FetchPlan:
    """What every pair's fetch shares (the same on every pair of identical nodes), worked out once."""

    #: per shard: device, gather seconds per fetch, the card it sends through, that card's link, the hop to the
    #: card's GPU (GPU, seconds) or None
    shards: tuple[tuple[str, float, int, LinkCost, tuple[str, float] | None], ...]
    serve_calls_s: float
    #: per receiving card: card, its link, its GPU (None: reached from every GPU), its learners with their hop
    #: seconds (None: no hop)
    into: tuple[tuple[int, LinkCost, str | None, tuple[tuple[str, float | None], ...]], ...]


def _fetch_plan(cost: ClusterCostModel, spec: PlacementSpec, local_w: Workload, nbytes: float) -> _FetchPlan:
    """The per-pair constants of :func:`_fetch` for fetches of ``local_w.batch`` items, ``nbytes`` per pair."""
    g = local_w.learners
    cards = cost.cards()
    serve = cost.serve_steps(spec, local_w)
    k = len(serve.shards)
    share = nbytes / k
    shards = []
    for d, gather_s, _ in serve.shards:
        c = cost.card_of(d)
        link, at = cards[c][0], cost.card_gpu(c)
        hop_to: tuple[str, float] | None = None
        if at is not None and d != at:  # to the GPU the card is attached to
            hop = cost._move(d, at, pinned=False)
            assert hop is not None
            hop_to = (at, hop.seconds(share) - hop.overhead_s)
        shards.append((d, gather_s, c, link, hop_to))
    per_card: dict[int, list[str]] = {}
    for j in range(g):
        learner = f"cuda:{j}" if cost.topology.num_gpus else "cpu"
        per_card.setdefault(cost.card_of(learner), []).append(learner)
    into = []
    for c, learners in per_card.items():
        link, at = cards[c][0], cost.card_gpu(c)
        hops: list[tuple[str, float | None]] = []
        for learner in learners:
            hop = cost._move(at, learner, pinned=False) if at is not None else None
            hops.append((learner, None if hop is None else hop.seconds(nbytes / g) - hop.overhead_s))
        into.append((c, link, at, tuple(hops)))
    return _FetchPlan(tuple(shards), serve.calls_s, tuple(into))


def _fetch(sim: Sink, cost: ClusterCostModel, plan: _FetchPlan, local_w: Workload, n: int, m: int,
           fetches: float, f_items: float, nbytes: float, network: Network, deps: list[Task]) -> None:
    """Node ``n``'s learners fetch from node ``m`` (see the module docstring, step 3): ``fetches`` fetches
    per iteration, each of ``local_w.batch * f_items`` items, ``nbytes`` in all (``plan``: :func:`_fetch_plan`)."""
    g = local_w.learners
    label = f"fetch n{n}<-n{m}"
    rpc = sim.task(f"{label}: rpc", fetches * network.rpc_overhead_s, f"cpu:{n}", deps)
    calls = sim.task(f"{label}: serve calls", fetches * plan.serve_calls_s, f"server:{m}", [rpc])
    k = len(plan.shards)
    ready: list[Task] = []
    sent: list[Task] = []
    for d, gather_s, c, link, hop_to in plan.shards:
        x = sim.task(f"{label}: gather {d}", fetches * f_items * gather_s, _device(m, d), [calls])
        share = nbytes / k
        if hop_to is not None:  # to the GPU the card is attached to
            x = sim.task(f"{label}: {d}->{hop_to[0]}", hop_to[1], _link(cost, m, d, hop_to[0]), [x])
        ready.append(x)
        sent.append(sim.task(f"{label}: out card {c}", share / link.bandwidth(share / max(fetches, 1e-9)),
                             f"nic-out:{m}:{c}", [x]))
    # the bytes enter node n through the card nearest each learner, then cross to the learner's GPU
    for c, link, card_gpu, hops in plan.into:
        share = nbytes * len(hops) / g
        msgs = fetches if network.node_fetch else fetches * len(hops) / g
        wire = msgs * link.overhead_s + share / link.bandwidth(share / max(msgs, 1e-9))
        into = sim.task(f"{label}: in card {c}", wire, f"nic-in:{n}:{c}", ready)  # with the sending cards
        done = [into, *sent]
        if card_gpu is None:  # no GPU behind this card: no hop to a learner's GPU
            continue
        for learner, hop_in in hops:
            if hop_in is not None:
                sim.task(f"{label}: {card_gpu}->{learner}", hop_in, _link(cost, n, card_gpu, learner), done)


def delivery_phase(sim: Sink, cost: ClusterCostModel, spec: PlacementSpec, w: Workload, batch: float, n_nodes: int,
                   network: Network | None, deps: list[Task], *, nodes: Iterable[int] | None = None,
                   pairs: Iterable[tuple[int, int]] | None = None) -> None:
    """Add the delivery phase's tasks to ``sim``: every learner's local delivery on every node in ``nodes``
    and, with several nodes, the fetches of every ordered pair ``(requester, holder)`` in ``pairs``."""
    g = w.learners
    b = batch
    p_touch = 1.0 - (1.0 - 1.0 / n_nodes) ** b  # a learner draws at least one item from a given node
    per_touch = (b / n_nodes) / p_touch  # items drawn from that node, given it is touched
    local_w = _resized(w, round(per_touch))
    f_items = per_touch / local_w.batch  # the rounding, corrected on byte-proportional parts
    # remote fetches are requested first (their serving and transfer overlap the local deliveries)
    if n_nodes > 1:
        if network is None:
            raise ConfigurationError("several nodes need a network")
        if network.node_fetch:  # one fetch per pair of nodes, when any of n's learners draws from m
            fetches = 1.0 - (1.0 - 1.0 / n_nodes) ** (g * b)
            per_fetch = (g * b / n_nodes) / fetches
            fetch_w = _resized(w, round(per_fetch))
            f_fetch = per_fetch / fetch_w.batch
        else:  # every learner fetches on its own
            fetches, fetch_w, f_fetch = g * p_touch, local_w, f_items
        nbytes = g * b / n_nodes * w.item_bytes
        plan = _fetch_plan(cost, spec, fetch_w, nbytes)
        for n, m in itertools.permutations(range(n_nodes), 2) if pairs is None else pairs:
            _fetch(sim, cost, plan, fetch_w, n, m, fetches, f_fetch, nbytes, network, deps)
    for n in range(n_nodes) if nodes is None else nodes:
        for j in range(g):
            learner = f"cuda:{j}" if cost.topology.num_gpus else "cpu"
            st = cost.delivery_steps(spec, local_w, learner)
            _delivery(sim, cost, st, n, f"deliver n{n} l{j}", deps, p_touch, p_touch * f_items)


def node_loads(cost: ClusterCostModel, spec: PlacementSpec, w: Workload, batch: float, n_nodes: int,
               network: Network | None) -> dict[str, float]:
    """Busy seconds of every resource of one node in the delivery phase of a cluster of ``n_nodes``
    identical nodes: exactly what :func:`simulate_iteration` puts on node 0 after the barrier
    (its learners' deliveries and fetches, and the fetches it serves), without running it."""
    loads = Loads()
    delivery_phase(loads, cost, spec, w, batch, n_nodes, network, [], nodes=(0,), pairs=())
    if n_nodes > 1:
        loads.scale = n_nodes - 1  # every other node is alike: one pair each way, n_nodes - 1 times
        delivery_phase(loads, cost, spec, w, batch, n_nodes, network, [], nodes=(), pairs=((0, 1), (1, 0)))
    return {k: v for k, v in loads.busy.items() if k.split(":")[1] == "0"}


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
    #: busy seconds of every resource
    busy: dict[str, float] = field(default_factory=dict)


def simulate_iteration(cost: ClusterCostModel, spec: PlacementSpec, scenario: Scenario, lay: Layout,
                       network: Network) -> ScalePoint:
    """Simulate one iteration with ``spec`` as every node's placement (see the module docstring)."""
    w = node_workload(scenario, lay)
    sim = Simulation()
    n_nodes = lay.nodes

    # 1. ingestion: the calls one after another on the node's CPU; each DMA on its host link while the thread goes on
    ing = cost.ingest_steps(spec, w)
    calls = w.calls_per_iteration
    n_calls = max(1, math.ceil(calls))
    scale = calls / n_calls
    ingest_tasks: list[Task] = []
    for n in range(n_nodes):
        thread: list[Task] = []
        copies: dict[int, list[Task]] = {}  # shard -> the copies out of its staging issued by the last call
        for c in range(n_calls):
            t = sim.task(f"ingest n{n} c{c}: call", ing.calls_s * scale, f"cpu:{n}", thread)
            issued: dict[int, list[Task]] = {}
            for j, step in enumerate(ing.steps):
                deps = [t]
                if step.shard is not None and step.shard not in issued:  # its staging is free once copied out
                    deps += copies.get(step.shard, [])
                    issued[step.shard] = []
                t = sim.task(f"ingest n{n} c{c}: step {j}", step.cpu_s * scale, f"cpu:{n}", deps)
                if step.resource is not None:
                    kind, _, rest = step.resource.partition(":")
                    res = f"{kind}:{n}" + (f":{rest}" if rest else "")
                    x = sim.task(f"ingest n{n} c{c}: copy {j}", step.link_s * scale, res, [t])
                    ingest_tasks.append(x)
                    if step.shard is not None:
                        issued[step.shard].append(x)
            thread = [t]
            copies.update(issued)
        ingest_tasks.extend(thread)
    barrier = sim.task("barrier", 0.0, None, ingest_tasks)

    # 2. delivery: each learner's batch b, uniform over the union of the nodes' buffers
    delivery_phase(sim, cost, spec, w, lay.batch, n_nodes, network, [barrier])
    total = sim.run()
    est = cost.estimate(spec, w)
    return ScalePoint(lay.gpus, n_nodes, spec, total, barrier.end, sim.busiest(3), est.total_s, dict(sim.busy))


def node_in_use(topology: Topology, gpus: int) -> Topology:
    """``topology`` with only its first ``gpus`` GPUs (a node of which a job uses part)."""
    if gpus >= topology.num_gpus:
        return topology
    return replace(topology, name=f"{topology.name}[{gpus} GPUs]", gpus=topology.gpus[:gpus])


def equivalent_specs(spec: PlacementSpec, num_gpus: int, *, samples: int, seed: int = 0) -> list[PlacementSpec]:
    """Placements a planner blind to the GPU links cannot tell from ``spec``: same tier and number of
    GPUs, any GPUs, any home. Up to ``samples`` of them, drawn with a fixed seed (all when fewer).

    Raises:
        ConfigurationError: ``samples`` < 1, or ``spec`` uses more GPUs than ``num_gpus``.
    """
    if samples < 1:
        raise ConfigurationError(f"samples must be >= 1 (placements simulated per scale), got {samples!r}.")
    if spec.tier not in ("gpu", "sharded"):
        return [spec]
    k = len(spec.devices)
    if k > num_gpus:
        raise ConfigurationError(f"{spec} uses {k} GPUs but the node has {num_gpus}; no placement of {num_gpus} "
                                 f"GPUs is equivalent to it (pass the node's GPU count).")
    every = [PlacementSpec(spec.tier, tuple(f"cuda:{i}" for i in (h, *sorted(set(sub) - {h}))))
             for sub in itertools.combinations(range(num_gpus), k) for h in sub]
    if len(every) <= samples:
        return every
    return random.Random(seed).sample(every, samples)


def _links_busy(busy: dict[str, float]) -> float:
    """Busy seconds of node 0's busiest GPU-GPU link."""
    return max((v for k, v in busy.items() if k.startswith("link:0:")), default=0.0)


#: the "adaptive placement off" baselines
BASELINES = ("rank-order", "link-blind", "all-gpus")


def simulate_scale(scenario: Scenario, gpus: int, *, adaptive: bool = True, baseline: str = "rank-order",
                   samples: int = 8, network: Network | None = None,
                   topology: Topology | None = None) -> list[ScalePoint]:
    """Simulate one scale point.

    ``adaptive=True``: every node uses the placement :class:`ClusterPlanner` chooses on the
    real (non-uniform) links; returns one point. ``adaptive=False``, by ``baseline``:

    * ``"rank-order"``: what a planner that does not see the GPU-GPU link speeds chooses,
      taken as it proposes it: the same planner on uniform links (:func:`uniform_view`),
      whose GPUs come in rank order (``0..k-1``, home ``cuda:0``; on MI250X these mix fast
      and slow links); returns one point;
    * ``"link-blind"``: the same planner on uniform links (:func:`uniform_view`); each
      placement it cannot tell apart (same tier and GPU count, any GPUs, any home) is
      simulated on the real links; returns one point per placement (up to ``samples``);
    * ``"all-gpus"``: the buffer sharded over every GPU of the node in rank order (the
      paper's "Conservative" placement), whatever the workload; returns one point.

    Raises:
        PlacementError: ``baseline="all-gpus"`` and the node's GPUs cannot hold its share of the buffer (the
            usable share of their memory, as the planner counts it): that placement cannot run, so it has
            no latency. (The other choices come from the planner, which raises when nothing fits.)
    """
    if baseline not in BASELINES:
        raise ConfigurationError(f"baseline must be one of {BASELINES}, got {baseline!r}.")
    if samples < 1:
        raise ConfigurationError(f"samples must be >= 1 (placements simulated per scale), got {samples!r}.")
    full = topology or load_node(scenario.topology)
    net = network or NETWORKS[scenario.network]
    gpn = full.num_gpus or 1
    lay = layout(gpus, scenario.total_batch, min(gpus, gpn))
    topo = node_in_use(full, lay.gpus_per_node)
    w = node_workload(scenario, lay)
    real = ClusterPlanner(topo, nodes=lay.nodes, network=net)
    if adaptive:
        spec = real.plan(w).placement
        return [simulate_iteration(real.cost, spec, scenario, lay, net)]
    if baseline == "all-gpus":
        n = topo.num_gpus
        spec = PlacementSpec("sharded", tuple(f"cuda:{i}" for i in range(n))) if n > 1 else \
            PlacementSpec("gpu", ("cuda:0",)) if n else PlacementSpec("host", ("cpu",))
        est = real.cost.estimate(spec, w)
        if not est.feasible:
            raise PlacementError(f"The all-gpus baseline {spec} does not fit {w.capacity} items of {w.item_bytes} B "
                                 f"per node: {'; '.join(est.shortfalls())}.")
        return [simulate_iteration(real.cost, spec, scenario, lay, net)]
    blind = ClusterPlanner(uniform_view(topo), nodes=lay.nodes, network=net).plan(w).placement
    if baseline == "rank-order":
        return [simulate_iteration(real.cost, blind, scenario, lay, net)]
    specs = equivalent_specs(blind, lay.gpus_per_node, samples=samples)
    return [simulate_iteration(real.cost, s, scenario, lay, net) for s in specs]


def run_scenario(scenario: Scenario, *, baseline: str = "rank-order", samples: int = 8,
                 network: Network | None = None, gpus: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """Every scale of ``scenario``, adaptive and not; one row per scale (latencies in ms; ``busiest_ms``: the
    adaptive iteration's three busiest resources, ``[name, busy ms]``).

    Where the ``all-gpus`` baseline does not fit (:func:`simulate_scale`), its row has no non-adaptive
    figures (``sim_non_adaptive_ms``, ``non_adaptive_range_ms``, ``gain`` and
    ``non_adaptive_gpu_links_busy_ms`` are None) and ``non_adaptive_placement`` says why.
    """
    topo = load_node(scenario.topology)
    rows = []
    for n in gpus or scenario.gpus:
        a = simulate_scale(scenario, n, adaptive=True, network=network, topology=topo)[0]
        paper_a, paper_b = scenario.paper.get(n, (None, None))
        row = {"gpus": n, "nodes": a.nodes, "placement": str(a.placement),
               "sim_ms": a.latency_s * 1e3, "sim_ingest_ms": a.ingest_s * 1e3,
               "paper_ms": paper_a, "paper_non_adaptive_ms": paper_b,
               "busiest_ms": [(k, v * 1e3) for k, v in a.busiest], "cost_model_node_ms": a.cost_model_s * 1e3,
               "gpu_links_busy_ms": _links_busy(a.busy) * 1e3}
        try:
            blind = simulate_scale(scenario, n, adaptive=False, baseline=baseline, samples=samples, network=network,
                                   topology=topo)
        except PlacementError as e:
            if baseline != "all-gpus":  # the planner's baselines fit wherever the adaptive placement does
                raise
            rows.append(row | {"sim_non_adaptive_ms": None, "non_adaptive_placements": 0,
                               "non_adaptive_range_ms": None, "gain": None, "non_adaptive_placement": str(e),
                               "non_adaptive_gpu_links_busy_ms": None})
            continue
        mean_blind = sum(p.latency_s for p in blind) / len(blind)
        rows.append(row | {"sim_non_adaptive_ms": mean_blind * 1e3,
                           "non_adaptive_placements": len(blind),
                           "non_adaptive_range_ms": (min(p.latency_s for p in blind) * 1e3,
                                                     max(p.latency_s for p in blind) * 1e3),
                           "gain": 1.0 - a.latency_s / mean_blind if mean_blind > 0 else 0.0,
                           "non_adaptive_placement": str(blind[0].placement) if len(blind) == 1 else "various",
                           "non_adaptive_gpu_links_busy_ms": fmean(_links_busy(p.busy) for p in blind) * 1e3})
    return rows
