"""The placement planner as the scale simulator drives it: core's planner and cost model, plus the cluster.

Core's :class:`~conduit.placement.CostModel` prices one node as Conduit's implementation
runs it (staged ingestion into GPU shards over their host links, PCIe-switch sharing, the
per-shard index uploads of a sharded delivery), and core's
:class:`~conduit.placement.Planner` ranks GPUs by their links to the learners and proposes
shards spread over the host links. This module adds only what belongs to a cluster of
such nodes (both only where they apply):

* **Network cards attached to GPUs** (:meth:`ClusterCostModel.cards`). A topology may declare
  its network cards and the GPU each is attached to (``"nics"`` in the data file; MI250X:
  one card per package, on GCDs 0/2/4/6). Bytes from other nodes then enter at that GPU and
  cross GPU-GPU links to reach any other, and bytes served to other nodes leave through the
  card nearest the GPU that holds them (:meth:`ClusterCostModel.card_of`). Without such a
  declaration the node has one card of the :class:`~.cluster.Network`'s figures that every
  GPU reaches directly (no GPU-GPU hop).
* **Serving remote fetches** (:meth:`ClusterCostModel.serve_steps`) and **multi-node
  pricing**. A node's buffer also answers the other nodes' learners: each shard gathers its
  rows and sends them from its own GPU through its nearest card (no gather to a home GPU).
  With ``nodes > 1`` the model prices a node's delivery phase as the busiest of its
  resources over the iteration (its CPU with its own deliveries, its fetch requests and the
  fetches it serves; every GPU, GPU-GPU link, host link and card), computed from exactly
  the steps the scale simulator runs (:func:`~.model.node_loads`), so the planner sees what
  serving other nodes costs. With ``nodes == 1`` it is core's model.

:func:`uniform_view` gives the same node with every GPU-GPU link at the mean bandwidth:
a planner that does not see the non-uniform links nor where the network cards are attached,
the "adaptive placement off" baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import fmean
from typing import Any

from conduit.errors import PlacementError
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import CostModel, Workload
from conduit.placement.planner import Planner
from conduit.placement.profile import BandwidthProfile, LinkCost
from conduit.placement.topology import Topology
from conduit.simulation.cluster import Network

__all__ = ["ClusterCostModel", "ServeSteps", "ClusterPlanner", "uniform_view"]


def _index(device: str) -> int | None:
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


@dataclass(frozen=True)
class ServeSteps:
    """One remote fetch served by the holder, as the resources it occupies (seconds, bytes).

    ``calls_s`` runs on the holder's CPU (the EDP call; per shard its row-index upload and,
    per field, the gather and the send issued). Then every shard at once:
    ``(device, gather_s, nbytes)``, the gather on that device, then ``nbytes`` leave through
    the card nearest it (:meth:`ClusterCostModel.card_of`).
    """

    calls_s: float
    shards: tuple[tuple[str, float, float], ...]


class ClusterCostModel(CostModel):
    """:class:`CostModel` for one node of a cluster: network cards, serving other nodes, multi-node pricing.

    Keyword Args:
        nodes: nodes the buffer is spread over, one share each (1: core's one-node pricing of
            delivery; more: the busiest resource of one node's delivery phase, serving included).
        network: the fabric between nodes (needed with ``nodes > 1``).
        **kwargs: as :class:`CostModel`.
    """

    def __init__(self, topology: Topology, profile: BandwidthProfile | None = None, *, nodes: int = 1,
                 network: Network | None = None, **kwargs: Any) -> None:
        super().__init__(topology, profile, **kwargs)
        if nodes < 1 or (nodes > 1 and network is None):
            raise PlacementError(f"nodes must be >= 1 and a network is needed with several nodes (got {nodes}, "
                                 f"{network}).")
        self.nodes = nodes
        self.network = network

    # -- network cards -----------------------------------------------------------------------------
    def cards(self) -> list[tuple[LinkCost, int | None]]:
        """The node's network cards: (one card's link, the GPU it is attached to or None).

        From the topology's ``details["nics"]`` (declared: ``gbps``, ``overhead_us``,
        ``attached_gpus``) when present; else one card with the network's per-node figures,
        reached from every GPU directly.
        """
        nics = self.topology.details.get("nics")
        if nics:
            link = LinkCost.constant(float(nics["gbps"]), float(nics.get("overhead_us", 0.0)))
            return [(link, int(g)) for g in nics["attached_gpus"] if int(g) < self.topology.num_gpus]
        if self.network is None:
            return []
        return [(self.network.nic, None)]

    def card_of(self, device: str) -> int:
        """The card bytes to or from ``device`` go through: the one attached to it, else the one attached
        to the GPU with the fastest link to it (ties: lower card), else card 0."""
        cards = self.cards()
        i = _index(device)
        if i is None or not cards:
            return 0
        best, best_bw = 0, -1.0
        for k, (_, g) in enumerate(cards):
            if g is None:
                return k
            if g == i:
                return k
            bw = self.profile.link("p2p", i, g).peak_bandwidth
            if bw > best_bw:
                best, best_bw = k, bw
        return best

    def card_gpu(self, card: int) -> str | None:
        """The device card ``card`` is attached to (None: reached from every GPU directly)."""
        g = self.cards()[card][1]
        return None if g is None else f"cuda:{g}"

    def serve_steps(self, spec: PlacementSpec, workload: Workload) -> ServeSteps:
        """One remote fetch of ``workload.batch`` items served from this node's buffer, step by step."""
        rows = workload.batch
        cards = self.cards()
        send = cards[0][0].overhead_s if cards else 0.0
        calls = self.profile.link("edp_deliver").overhead_s
        if spec.tier in ("gpu", "sharded"):
            where: tuple[str, ...] = spec.devices
        else:
            where = ("disk",) if spec.tier == "disk" else ("cpu",)
        k = len(where)
        up = self.profile.link("h2d_pageable").overhead_s if spec.tier == "sharded" else 0.0
        shards = []
        for d in where:
            calls += up
            g_s = 0.0
            for f, fb in enumerate(workload.field_bytes):
                g = self._gather(d, workload, f, workload.capacity / k)
                calls += g.overhead_s + send
                g_s += g.seconds(fb * rows / k, rows / k) - g.overhead_s
            shards.append((d, g_s, workload.item_bytes * rows / k))
        return ServeSteps(calls, tuple(shards))

    def deliver(self, spec: PlacementSpec, workload: Workload) -> tuple[float, dict[str, float]]:
        """Core's serialised deliveries on one node; with ``nodes > 1`` the busiest resource of one node's
        delivery phase (its own learners' deliveries and fetches, and the fetches it serves), for the
        learners' unrounded batch where the workload gives one (``ReplayWorkload.learner_batch``)."""
        if self.nodes <= 1:
            return super().deliver(spec, workload)
        from conduit.simulation.model import node_loads  # the simulator's own steps (it imports this module)

        assert self.network is not None
        # the learners' batch as the simulation draws it (a ReplayWorkload's ``learner_batch``: not rounded)
        batch = getattr(workload, "learner_batch", None)
        loads = node_loads(self, spec, workload, float(workload.batch if batch is None else batch), self.nodes,
                           self.network)
        res, busiest = max(loads.items(), key=lambda kv: kv[1], default=("none", 0.0))
        return busiest, {f"deliver: busiest {res.split(':')[0]}": busiest}


class ClusterPlanner(Planner):
    """:class:`Planner` pricing with :class:`ClusterCostModel` (a node of ``nodes``, joined by ``network``).

    Keyword Args:
        nodes, network: passed to :class:`ClusterCostModel`.
        tie_tolerance, **kwargs: as :class:`Planner`.
    """

    def __init__(self, topology: Topology, profile: BandwidthProfile | None = None, *, nodes: int = 1,
                 network: Network | None = None, **kwargs: Any) -> None:
        super().__init__(topology, profile, **kwargs)
        cost_kwargs = {k: v for k, v in kwargs.items() if k != "tie_tolerance"}
        self.cost: ClusterCostModel = ClusterCostModel(topology, profile, nodes=nodes, network=network,
                                                       **cost_kwargs)


def uniform_view(topology: Topology) -> Topology:
    """``topology`` with every GPU-GPU link at the mean of its declared bandwidths (same overhead) and
    without its network cards' attachment (the node then has one card every GPU reaches directly).

    Raises:
        PlacementError: the topology declares no link figures.
    """
    prof = topology.declared
    if prof is None:
        raise PlacementError(f"Topology {topology.name!r} declares no links to average.")
    details = {k: v for k, v in topology.details.items() if k != "nics"}
    pairs = {k: v for k, v in prof.links.items() if k.startswith("p2p:")}
    if not pairs:
        return replace(topology, details=details)
    mean_bw = fmean(v.peak_bandwidth for v in pairs.values())
    over = fmean(v.overhead_s for v in pairs.values())
    links = {k: v for k, v in prof.links.items() if not k.startswith("p2p:")}
    links["p2p"] = LinkCost(over, ((1.0, mean_bw),))
    flat = BandwidthProfile(links, source=prof.source, machine=f"{prof.machine}:uniform", details=prof.details)
    return replace(topology, name=f"{topology.name} (uniform links)", declared=flat, details=details)
