"""Declared clusters for the scale simulator: nodes of a declared topology joined by a network.

A node is one of placement's declared topologies (``conduit/placement/topologies/``), so
the GPUs, their memory and their links are exactly what the planner sees. What a node
file does not hold is the fabric between nodes; :class:`Network` declares it (nominal
vendor figures, not measurements), as placement :class:`~conduit.placement.LinkCost`s.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from importlib import resources

from conduit.checks import is_bool, is_int, is_real
from conduit.errors import ConfigurationError
from conduit.placement.profile import LinkCost
from conduit.placement.topology import Topology, load_topology

__all__ = ["Network", "NETWORKS", "Scenario", "SCENARIOS", "load_node"]


def load_node(name: str) -> Topology:
    """A declared node topology (:func:`~conduit.placement.load_topology`) with its network cards.

    A node file may declare ``"nics"``: its network cards (``gbps`` and ``overhead_us`` per
    card, ``attached_gpus``: the GPU each card is attached to, ``source``). Placement's
    loader keeps only what one node needs, so the simulator reads this section itself and
    puts it in ``details["nics"]`` (see :meth:`~.planning.ClusterCostModel.cards`).
    """
    topo = load_topology(name)
    path = resources.files("conduit.placement") / "topologies" / f"{name}.json"
    if not path.is_file():
        return topo
    nics = json.loads(path.read_text()).get("nics")
    if not nics:
        return topo
    if not isinstance(nics.get("attached_gpus"), list) or "gbps" not in nics:
        raise ConfigurationError(f"Topology {name!r}: 'nics' needs 'gbps' and a list 'attached_gpus'.")
    return replace(topo, details={**topo.details, "nics": nics})


@dataclass(frozen=True)
class Network:
    """The fabric between nodes, per node.

    Args:
        name: a short label.
        nic: one node's injection link (bandwidth per direction, per-message latency), used
            as one card every GPU reaches directly when the node file declares no ``"nics"``
            (node files that do, like ``mi250x-node``, give per-card figures and attachment).
        rpc_overhead_s: the requester's own cost of one remote fetch (issue it, take the
            answer), serial per node: the EDP's remote delivery path.
        source: where the figures come from.
        node_fetch: a node's learners draw their batches together and fetch from each other
            node once, with one request per shard for all of their rows there (what
            ``DistributedDataPlane.prepare_now`` / ``gather_now`` of one selection per learner
            does). False: every learner fetches on its own.
    """

    name: str
    nic: LinkCost
    rpc_overhead_s: float
    source: str = ""
    node_fetch: bool = True

    def __post_init__(self) -> None:
        if not is_bool(self.node_fetch):  # (a string such as "no" is truthy)
            raise ConfigurationError(f"node_fetch must be a bool (True: one fetch per pair of nodes), got "
                                     f"{self.node_fetch!r}.")
        if not is_real(self.rpc_overhead_s) or not (math.isfinite(self.rpc_overhead_s) and self.rpc_overhead_s >= 0):
            raise ConfigurationError(f"rpc_overhead_s must be a finite number of seconds >= 0, got "
                                     f"{self.rpc_overhead_s!r}.")


#: nominal fabrics of the paper's two clusters
NETWORKS = {
    "hdr-ib-8x": Network("8x HDR InfiniBand per node", LinkCost.constant(200.0, overhead_us=2.0), 50e-6,
                         "nominal: DGX A100 SuperPOD, 8 x 200 Gb/s HDR HCAs per node (8 x 25 GB/s), GPUDirect RDMA; "
                         "50 us per remote fetch is an assumption (a tuned RPC), not a measurement"),
    "slingshot-4x": Network("4x Slingshot-11 per node", LinkCost.constant(100.0, overhead_us=2.0), 50e-6,
                            "nominal: HPE Cray EX (MI250X) node, 4 x 200 Gb/s Slingshot-11 NICs (4 x 25 GB/s; the "
                            "mi250x-node file declares each card and the GCD it is attached to); "
                            "50 us per remote fetch is an assumption, not a measurement"),
}


@dataclass(frozen=True)
class Scenario:
    """A scaling experiment: a node type, a fabric, a workload and the scales to simulate.

    Args:
        name: a short key.
        topology: the declared node topology (placement data file name).
        network: key of :data:`NETWORKS`.
        gpus: total GPUs at each scale (one learner per GPU; nodes fill up 8 GPUs at a time).
        total_batch: items delivered per iteration over all learners (split evenly).
        obs_dim: transition observation size (the paper's synthetic workload).
        capacity: global buffer capacity (split evenly over the nodes).
        replay_ratio: deliveries per ingested item (1: as many items ingested as delivered); at least
            ``total_batch / capacity``: an iteration ingests ``total_batch / replay_ratio`` items, at most
            the buffer's capacity.
        paper: the paper's figures, ``{gpus: (conduit_ms, adaptive_off_ms)}`` (None where not given).
    """

    name: str
    topology: str
    network: str
    gpus: tuple[int, ...]
    total_batch: int
    obs_dim: int = 20000
    capacity: int = 1_000_000
    replay_ratio: float = 1.0
    paper: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    #: what the scenario is; ``{gpus}`` stands for the GPU counts simulated (e.g. ``1-16``)
    description: str = ""

    @property
    def title(self) -> str:
        """:attr:`description` with the GPU counts filled in."""
        lo, hi = min(self.gpus), max(self.gpus)
        return self.description.replace("{gpus}", f"{lo}-{hi}" if lo != hi else f"{lo}")

    def __post_init__(self) -> None:
        if self.network not in NETWORKS:
            raise ConfigurationError(f"Unknown network {self.network!r}; use one of {sorted(NETWORKS)}.")
        if not isinstance(self.gpus, (tuple, list)) or not self.gpus or any(not is_int(g) or g <= 0 for g in self.gpus):
            raise ConfigurationError(f"gpus must be a non-empty tuple of positive whole GPU counts, got {self.gpus!r}.")
        object.__setattr__(self, "gpus", tuple(self.gpus))
        for name in ("total_batch", "obs_dim", "capacity"):
            if not is_int(getattr(self, name)):  # (a float or a bool is no count of items or values)
                raise ConfigurationError(f"{name} must be a whole number, got {getattr(self, name)!r}.")
        if not is_real(self.replay_ratio):
            raise ConfigurationError(f"replay_ratio must be a number, got {self.replay_ratio!r}.")
        if self.total_batch <= 0 or self.obs_dim <= 0 or self.capacity <= 0 or not (
                math.isfinite(self.replay_ratio) and self.replay_ratio > 0):
            raise ConfigurationError(f"total_batch, obs_dim, capacity and replay_ratio must be positive (and "
                                     f"replay_ratio finite), got {self.total_batch!r}, {self.obs_dim!r}, "
                                     f"{self.capacity!r}, {self.replay_ratio!r}.")
        lowest = self.total_batch / self.capacity
        if self.replay_ratio < lowest:
            # each ingested item is one more ingestion call to simulate: near 0 that never ends
            raise ConfigurationError(
                f"replay_ratio {self.replay_ratio:g} would ingest {self.total_batch / self.replay_ratio:.4g} items per "
                f"iteration into a buffer of capacity {self.capacity}: all but the last {self.capacity} are "
                f"overwritten before any delivery, and simulating their ingestion calls is work for nothing. "
                f"Use replay_ratio >= total batch / capacity = {self.total_batch}/{self.capacity} = {lowest:g} "
                f"(or raise the capacity).")


#: the paper's two scaling experiments (figures from its evaluation; see docs/scale.md)
SCENARIOS = {
    "a100": Scenario("a100", "dgx-a100-80g", "hdr-ib-8x", (1, 2, 4, 8, 16), 2048,
                     paper={1: (95.0, None), 16: (15.0, None)},
                     description="A100 cluster, {gpus} GPUs, total batch 2048"),
    "mi250x": Scenario("mi250x", "mi250x-node", "slingshot-4x", (8, 16, 32, 64, 128, 256, 512, 1024), 32768,
                       paper={8: (614.0, None), 64: (110.0, 140.0), 1024: (50.0, 55.0)},
                       description="MI250X supercomputer, {gpus} GPUs (GCDs), workload 32768"),
}
