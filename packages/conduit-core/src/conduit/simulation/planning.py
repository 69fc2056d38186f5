"""The placement planner as the simulator drives it, with two surgical extensions.

The simulator plans every node's buffer with core's :class:`~conduit.placement.Planner`
and prices it with core's :class:`~conduit.placement.CostModel`. Two of their behaviours
do not fit a node whose every GPU runs a learner, so this module adjusts exactly those,
by subclassing (nothing else differs; both are proposed upstream):

* **Parallel shard ingestion.** ``CostModel.ingest`` adds the copies to every shard's
  device one after another. Each GPU has its own host link, so the copies overlap: here a
  sharded ingestion costs the host-side packing (one memory system, serial) plus the
  *slowest* device's copy, just as ``CostModel.deliver_one`` already counts the slowest
  shard for delivery.
* **Link ranking when every GPU hosts a learner.** ``Planner._link_score`` gives a GPU
  that hosts a learner an infinite score, so with a learner on every GPU all GPUs tie and
  shards are proposed in rank order only. Here such a GPU scores a large constant *plus*
  its bandwidth to the other learners, so the fast ranks (MI250X: 0/2/4/6) come first.

:func:`uniform_view` gives the same node with every GPU-GPU link at the mean bandwidth:
a planner that does not see the non-uniform links, the "adaptive placement off" baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from statistics import fmean
from typing import Any

from conduit.errors import PlacementError
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import CostModel, Workload
from conduit.placement.planner import Planner
from conduit.placement.profile import BandwidthProfile, LinkCost
from conduit.placement.topology import Topology

__all__ = ["ParallelIngestCostModel", "ClusterPlanner", "uniform_view"]

#: the score a learner-hosting GPU starts from: above any sum of link bandwidths (B/s), small enough that
#: adding those sums to it stays exact in float64
_LEARNER_SCORE = 1e15


class ParallelIngestCostModel(CostModel):
    """:class:`CostModel` whose sharded ingestion copies to the shards' devices in parallel."""

    def ingest(self, spec: PlacementSpec, workload: Workload) -> tuple[float, dict[str, float]]:
        if spec.tier != "sharded":
            return super().ingest(spec, workload)
        items = workload.ingest_call_items
        k = len(spec.devices)
        host = self.profile.link("host_copy")
        pack = 0.0
        slowest = 0.0
        for d in spec.devices:
            copy = 0.0
            for fb in workload.field_bytes:
                share = fb * items / k
                pack += host.seconds(share)  # the strided rows of this shard, packed on the host
                link = self._move("cpu", d, pinned=False)
                copy += link.seconds(share) if link is not None else 0.0
            slowest = max(slowest, copy)
        parts = {"ingest: edp": self.profile.link("edp_ingest").overhead_s, "ingest: pack": pack,
                 "ingest: copy": slowest}
        scale = workload.calls_per_iteration
        parts = {name: v * scale for name, v in parts.items()}
        return sum(parts.values()), parts


class ClusterPlanner(Planner):
    """:class:`Planner` with :class:`ParallelIngestCostModel` and learner-aware link ranking."""

    def __init__(self, topology: Topology, profile: BandwidthProfile | None = None, **kwargs: Any) -> None:
        super().__init__(topology, profile, **kwargs)
        cost_kwargs = {k: v for k, v in kwargs.items() if k != "tie_tolerance"}
        self.cost = ParallelIngestCostModel(topology, profile, **cost_kwargs)

    def _link_score(self, gpu: int, learners: Sequence[str]) -> float:
        score = 0.0
        for ld in learners:
            if not ld.startswith("cuda:"):
                continue
            j = int(ld.split(":")[1])
            if j == gpu:
                score += _LEARNER_SCORE
                continue
            try:
                score += self.profile.link("p2p", gpu, j).peak_bandwidth
            except PlacementError:
                pass
        return score


def uniform_view(topology: Topology) -> Topology:
    """``topology`` with every GPU-GPU link at the mean of its declared bandwidths (same overhead).

    Raises:
        PlacementError: the topology declares no link figures.
    """
    prof = topology.declared
    if prof is None:
        raise PlacementError(f"Topology {topology.name!r} declares no links to average.")
    pairs = {k: v for k, v in prof.links.items() if k.startswith("p2p:")}
    if not pairs:
        return topology
    mean_bw = fmean(v.peak_bandwidth for v in pairs.values())
    over = fmean(v.overhead_s for v in pairs.values())
    links = {k: v for k, v in prof.links.items() if not k.startswith("p2p:")}
    links["p2p"] = LinkCost(over, ((1.0, mean_bw),))
    flat = BandwidthProfile(links, source=prof.source, machine=f"{prof.machine}:uniform", details=prof.details)
    return replace(topology, name=f"{topology.name} (uniform links)", declared=flat)
