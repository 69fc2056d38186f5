"""Placement: where experience state lives, and how Conduit chooses it.

* tiers: :class:`HostPlacement`, :class:`DevicePlacement`, :class:`ShardedPlacement`,
  :class:`DiskPlacement` (all behind the one storage interface), named as data by
  :class:`PlacementSpec`;
* :class:`Topology` (declared data files or :func:`discover_topology`), measured
  :class:`BandwidthProfile` (:func:`profile_machine`);
* :class:`CostModel` (predicted ingest/deliver latency and memory per candidate) and
  :class:`Planner` (fastest feasible candidate, every candidate explained);
* :class:`PlacementMap` (size -> placement, ahead of time) and :class:`AdaptivePlacement`,
  which migrates a live buffer online (:meth:`conduit.ExperienceDataPlane.migrate`).
"""

from conduit.placement.base import (
    TIERS,
    DevicePlacement,
    DiskPlacement,
    HostPlacement,
    Placement,
    PlacementSpec,
    ShardedPlacement,
)
from conduit.placement.cost import CostModel, Estimate, Workload, transition_schema
from conduit.placement.migration import MigrationReport
from conduit.placement.placement_map import AdaptivePlacement, MapRange, PlacementMap
from conduit.placement.planner import Candidate, NothingFitsError, Plan, Planner
from conduit.placement.profile import (
    BandwidthProfile,
    LinkCost,
    load_profile,
    machine_id,
    profile_machine,
)
from conduit.placement.topology import Gpu, Topology, available_topologies, discover_topology, load_topology

__all__ = [
    "Placement",
    "PlacementSpec",
    "TIERS",
    "HostPlacement",
    "DevicePlacement",
    "ShardedPlacement",
    "DiskPlacement",
    "Topology",
    "Gpu",
    "load_topology",
    "discover_topology",
    "available_topologies",
    "BandwidthProfile",
    "LinkCost",
    "profile_machine",
    "load_profile",
    "machine_id",
    "Workload",
    "Estimate",
    "CostModel",
    "transition_schema",
    "Candidate",
    "Plan",
    "Planner",
    "NothingFitsError",
    "PlacementMap",
    "MapRange",
    "AdaptivePlacement",
    "MigrationReport",
]
