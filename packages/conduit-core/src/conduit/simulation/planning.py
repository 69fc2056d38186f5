"""The placement planner as the paper's experiments drive it: core's planner and cost model, three extensions.

The simulations (the scale simulator and the online-migration experiment) plan every buffer
with core's :class:`~conduit.placement.Planner` and price it with core's
:class:`~conduit.placement.CostModel`. Core's model prices Conduit's *implementation* as it
stands; three parts of the mechanism the paper describes differ from it, and this module
models exactly those, by subclassing (everything else is core's; all are proposed upstream):

* **Staged, parallel ingestion** (:class:`StagedCostModel`). The EDP owns page-locked
  staging buffers and the actors write their rollouts into them (the actor writes its
  rollout somewhere in any case; into page-locked memory costs it the same), so moving a
  batch into GPU memory is a DMA at the *pinned* host-link bandwidth, not a pageable copy
  bound by the CPU. A sharded buffer takes each shard's rows by one DMA per field (a 2-D
  strided copy: rows are contiguous, so nothing is packed on the host) on that GPU's own
  host link, and the shards' DMAs run at the same time. GPUs behind one PCIe switch share
  its uplink to the CPU (the topology's ``host_link_groups``; DGX A100: pairs 0/1, 2/3, 4/5,
  6/7), so their bytes add up on it. The calls themselves are issued one after another by
  one thread. Core's model instead copies from the actor's pageable tensor, shard after
  shard (what ``ShardedStorage.append`` does today: a synchronous ``copy_`` per shard).
* **Per-shard index uploads** (:class:`StagedCostModel`). A sharded delivery uploads each
  shard's row indices to that GPU, and each field's output positions to the gathering GPU
  (``ShardedStorage.gather``: ``r.to(device)`` per shard, ``pos.to(target.device)`` per
  field and shard), one small pageable host-to-device copy each. Core's model does not
  count them; they make a sharded delivery cost more the more shards it spans.
* **Candidates and link ranking** (:class:`ClusterPlanner`). Core's ``_link_score`` gives a
  GPU that hosts a learner an infinite score, so with a learner on every GPU all GPUs tie
  and shards are proposed in rank order only; here such a GPU scores a large constant
  *plus* its bandwidth to the other learners, so the fast ranks (MI250X: 0/2/4/6) come
  first. With ``host_link_groups`` the planner also proposes, for each shard count, GPUs
  spread over as many host links as possible (DGX A100: 0/2/4/6 before 0/1/2/3), since
  staged ingestion runs at the bandwidth of the host links a placement spans.

Two more belong to the cluster, not to core's one-node model (both only where they apply):

* **Network cards attached to GPUs** (:meth:`StagedCostModel.cards`). A topology may declare
  its network cards and the GPU each is attached to (``"nics"`` in the data file; MI250X:
  one card per package, on GCDs 0/2/4/6). Bytes from other nodes then enter at that GPU and
  cross GPU-GPU links to reach any other, and bytes served to other nodes leave through the
  card nearest the GPU that holds them (:meth:`StagedCostModel.card_of`). Without such a
  declaration the node has one card of the :class:`~.cluster.Network`'s figures that every
  GPU reaches directly (no GPU-GPU hop).
* **Serving remote fetches** (:meth:`StagedCostModel.serve_steps`) and **multi-node
  pricing**. A node's buffer also answers the other nodes' learners: each shard gathers its
  rows and sends them from its own GPU through its nearest card (no gather to a home GPU).
  With ``nodes > 1`` the model prices a node's delivery phase as the busiest of its
  resources over the iteration (its CPU with its own deliveries, its fetch requests and the
  fetches it serves; every GPU, GPU-GPU link, host link and card), computed from exactly
  the steps the scale simulator runs (:func:`~.model.node_loads`), so the planner sees what
  serving other nodes costs. With ``nodes == 1`` it is core's model as above.

:func:`uniform_view` gives the same node with every GPU-GPU link at the mean bandwidth:
a planner that does not see the non-uniform links nor where the network cards are attached,
the "adaptive placement off" baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
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

__all__ = ["StagedCostModel", "DeliverySteps", "IngestSteps", "ServeSteps", "ClusterPlanner", "uniform_view"]

#: the score a learner-hosting GPU starts from: above any sum of link bandwidths (B/s), small enough that
#: adding those sums to it stays exact in float64
_LEARNER_SCORE = 1e15


def _index(device: str) -> int | None:
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


@dataclass(frozen=True)
class IngestSteps:
    """One ingestion call, as the resources it occupies (seconds).

    ``calls_s`` runs on the node's CPU first (the EDP call and every copy's issue cost, one
    after another); then every entry of ``copies`` (resource key -> seconds) runs at once,
    each on its own resource: ``"hostlink:g"`` (host-link group ``g``), ``"host"`` (host
    memory) or ``"disk"``.
    """

    calls_s: float
    copies: dict[str, float]

    @property
    def total_s(self) -> float:
        return self.calls_s + max(self.copies.values(), default=0.0)


@dataclass(frozen=True)
class DeliverySteps:
    """One delivery to one learner, as the resources it occupies (seconds).

    ``calls_s`` (the EDP call, every gather/copy/upload issued, one after another) runs on
    the node's CPU; then every shard at once: ``(device, gather_s, move_s)``, the gather on
    that device, then its rows over the link to ``home`` (``move_s`` 0 for the home shard);
    then ``scatter_s`` on ``home`` (the shards' rows into the output), then ``transfer_s``
    from ``home`` to ``learner`` (0 when they are one device). ``home`` is ``"cpu"`` for host
    tiers and ``"disk"`` for the disk tier.
    """

    calls_s: float
    shards: tuple[tuple[str, float, float], ...]
    home: str
    scatter_s: float
    transfer_s: float
    learner: str

    @property
    def total_s(self) -> float:
        slowest = max((g + m for _, g, m in self.shards), default=0.0)
        return self.calls_s + slowest + self.scatter_s + self.transfer_s


@dataclass(frozen=True)
class ServeSteps:
    """One remote fetch served by the holder, as the resources it occupies (seconds, bytes).

    ``calls_s`` runs on the holder's CPU (the EDP call; per shard its row-index upload and,
    per field, the gather and the send issued). Then every shard at once:
    ``(device, gather_s, nbytes)``, the gather on that device, then ``nbytes`` leave through
    the card nearest it (:meth:`StagedCostModel.card_of`).
    """

    calls_s: float
    shards: tuple[tuple[str, float, float], ...]


class StagedCostModel(CostModel):
    """:class:`CostModel` with staged, parallel ingestion and per-shard index uploads (module docstring).

    Keyword Args:
        staged: ``False`` keeps core's ingestion (pageable copies, shard after shard) and
            only adds the index uploads; for comparison.
        nodes: nodes the buffer is spread over, one share each (1: core's one-node pricing of
            delivery; more: the busiest resource of one node's delivery phase, serving included).
        network: the fabric between nodes (needed with ``nodes > 1``).
        **kwargs: as :class:`CostModel`.
    """

    def __init__(self, topology: Topology, profile: BandwidthProfile | None = None, *, staged: bool = True,
                 nodes: int = 1, network: Network | None = None, **kwargs: Any) -> None:
        super().__init__(topology, profile, **kwargs)
        if nodes < 1 or (nodes > 1 and network is None):
            raise PlacementError(f"nodes must be >= 1 and a network is needed with several nodes (got {nodes}, "
                                 f"{network}).")
        self.staged = staged
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

    # -- host links ------------------------------------------------------------------------------
    def host_link_group(self, gpu: int) -> int:
        """The host link (PCIe switch uplink) GPU ``gpu`` reaches host memory through (its own by default)."""
        for g, members in enumerate(self.topology.details.get("host_link_groups") or ()):
            if gpu in members:
                return g
        return 1000 + gpu

    # -- ingestion ---------------------------------------------------------------------------------
    def ingest_steps(self, spec: PlacementSpec, workload: Workload) -> IngestSteps:
        """One ingestion call of ``workload.ingest_call_items`` items, step by step."""
        items = workload.ingest_call_items
        edp = self.profile.link("edp_ingest").overhead_s
        if spec.tier not in ("gpu", "sharded"):
            _, parts = super().ingest(spec, workload)
            copy = parts["ingest: copy"] / workload.calls_per_iteration
            return IngestSteps(edp, {"disk" if spec.tier == "disk" else "host": copy})
        if not self.staged:
            _, parts = super().ingest(spec, workload)
            copy = parts["ingest: copy"] / workload.calls_per_iteration
            return IngestSteps(edp, {"host": copy})  # core: one thread copies shard after shard
        k = len(spec.devices)
        calls = edp
        copies: dict[str, float] = {}
        for d in spec.devices:
            i = _index(d)
            assert i is not None
            link = self.profile.link("h2d_pinned", i)
            key = f"hostlink:{self.host_link_group(i)}"
            for fb in workload.field_bytes:
                calls += link.overhead_s
                copies[key] = copies.get(key, 0.0) + link.seconds(fb * items / k) - link.overhead_s
        return IngestSteps(calls, copies)

    def ingest(self, spec: PlacementSpec, workload: Workload) -> tuple[float, dict[str, float]]:
        if spec.tier not in ("gpu", "sharded"):
            return super().ingest(spec, workload)
        st = self.ingest_steps(spec, workload)
        edp = self.profile.link("edp_ingest").overhead_s
        parts = {"ingest: edp": edp, "ingest: calls": st.calls_s - edp,
                 "ingest: copy": max(st.copies.values(), default=0.0)}
        scale = workload.calls_per_iteration
        parts = {name: v * scale for name, v in parts.items()}
        return sum(parts.values()), parts

    # -- delivery ----------------------------------------------------------------------------------
    def delivery_steps(self, spec: PlacementSpec, workload: Workload, learner: str) -> DeliverySteps:
        """One delivery of ``workload.batch`` items to a learner on ``learner``, step by step."""
        if spec.tier != "sharded":
            parts = super().deliver_one(spec, workload, learner)
            home = "disk" if spec.tier == "disk" else spec.devices[0] if spec.tier == "gpu" else "cpu"
            return DeliverySteps(parts["deliver: edp"], ((home, parts["deliver: gather"], 0.0),),
                                 home, 0.0, parts["deliver: transfer"], learner)
        rows = workload.batch
        k = len(spec.devices)
        home = spec.devices[0]
        up = self.profile.link("h2d_pageable").overhead_s
        calls = self.profile.link("edp_deliver").overhead_s
        scatter = 0.0
        for f, fb in enumerate(workload.field_bytes):
            scatter += k * self._gather(home, workload, f, rows).seconds(fb * rows / k, rows / k)
        shards = []
        for d in spec.devices:
            move = self._move(d, home, pinned=False)
            calls += up * (1 + len(workload.field_bytes))  # the shard's row indices, each field's positions
            g_s = m_s = 0.0
            for f, fb in enumerate(workload.field_bytes):
                g = self._gather(d, workload, f, workload.capacity / k)
                b = fb * rows / k
                calls += g.overhead_s
                g_s += g.seconds(b, rows / k) - g.overhead_s
                if move is not None:
                    calls += move.overhead_s
                    m_s += move.seconds(b) - move.overhead_s
            shards.append((d, g_s, m_s))
        link = self._move(home, learner, pinned=False)
        transfer = sum(link.seconds(fb * rows) for fb in workload.field_bytes) if link is not None else 0.0
        return DeliverySteps(calls, tuple(shards), home, scatter, transfer, learner)

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
        delivery phase (its own learners' deliveries and fetches, and the fetches it serves)."""
        if self.nodes <= 1:
            return super().deliver(spec, workload)
        from conduit.simulation.model import node_loads  # the simulator's own steps (it imports this module)

        assert self.network is not None
        loads = node_loads(self, spec, workload, float(workload.batch), self.nodes, self.network)
        res, busiest = max(loads.items(), key=lambda kv: kv[1], default=("none", 0.0))
        return busiest, {f"deliver: busiest {res.split(':')[0]}": busiest}

    def deliver_one(self, spec: PlacementSpec, workload: Workload, learner: str) -> dict[str, float]:
        if spec.tier != "sharded":
            return super().deliver_one(spec, workload, learner)
        st = self.delivery_steps(spec, workload, learner)
        edp = self.profile.link("edp_deliver").overhead_s
        _, g, m = max(st.shards, key=lambda s: s[1] + s[2])
        return {"deliver: edp": edp, "deliver: calls": st.calls_s - edp, "deliver: gather": g,
                "deliver: scatter": st.scatter_s, "deliver: transfer": m + st.transfer_s}


class ClusterPlanner(Planner):
    """:class:`Planner` with :class:`StagedCostModel`, learner-aware link ranking and host-link-spread shards.

    Keyword Args:
        staged, nodes, network: passed to :class:`StagedCostModel`.
        tie_tolerance, **kwargs: as :class:`Planner`.
    """

    def __init__(self, topology: Topology, profile: BandwidthProfile | None = None, *, staged: bool = True,
                 nodes: int = 1, network: Network | None = None, **kwargs: Any) -> None:
        super().__init__(topology, profile, **kwargs)
        cost_kwargs = {k: v for k, v in kwargs.items() if k != "tie_tolerance"}
        self.cost: StagedCostModel = StagedCostModel(topology, profile, staged=staged, nodes=nodes, network=network,
                                                     **cost_kwargs)

    def _link_score(self, gpu: int, learners: Sequence[str]) -> float:
        hosts = 0
        bandwidth = 0.0
        for ld in learners:
            if not ld.startswith("cuda:"):
                continue
            j = int(ld.split(":")[1])
            if j == gpu:
                hosts += 1
                continue
            try:
                bandwidth += self.profile.link("p2p", gpu, j).peak_bandwidth
            except PlacementError:
                pass
        # the learner term added last: equal link sums then give equal scores whatever the GPU's rank
        return hosts * _LEARNER_SCORE + bandwidth

    def candidates(self, workload: Workload) -> list[tuple[PlacementSpec, str]]:
        out = super().candidates(workload)
        n = self.topology.num_gpus
        if not self.topology.details.get("host_link_groups") or n < 2:
            return out
        learners = self.cost.learner_devices(workload)
        order = sorted(range(n), key=lambda i: (-self._link_score(i, learners), i))
        seen = {frozenset(s.devices) for s, _ in out if s.tier == "sharded"}
        for k in sorted({s for s in (2, 4, 8, 16, 32, 64) if s < n}):
            picked: list[int] = []
            used: dict[int, int] = {}
            for _ in range(k):  # the best-ranked GPU on the least-used host link
                i = min((i for i in order if i not in picked),
                        key=lambda i: (used.get(self.cost.host_link_group(i), 0), order.index(i)))
                picked.append(i)
                used[self.cost.host_link_group(i)] = used.get(self.cost.host_link_group(i), 0) + 1
            if frozenset(f"cuda:{i}" for i in picked) in seen:
                continue
            home = picked[0]
            devs = (home, *sorted(i for i in picked if i != home))
            out.append((PlacementSpec("sharded", tuple(f"cuda:{i}" for i in devs)),
                        f"{k} GPUs spread over the host links"))
        return out


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
