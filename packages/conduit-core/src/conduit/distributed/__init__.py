"""Conduit beyond one machine: buffer shards in Ray actors pinned to nodes.

The only part of conduit-core that uses Ray, and only when called: importing this package
does not import Ray (``pip install 'conduit-core[ray]'`` brings it).

* :class:`DistributedDataPlane`: one buffer sharded over nodes, with core's replay or
  on-policy semantics over the union of the shards, shard-loss detection, exact loss
  reports and replication;
* :class:`ShardServers`: the shard actors, pinned to nodes, shareable by several buffers;
* :func:`stage` / :class:`ExperienceRef`: experience put into the producer's node's object
  store, ingested without passing through the driver;
* :func:`measure_links` / :class:`LinkProfile` and :class:`ShardPlan`: measured
  inter-node links and the plan that routes ingestion by them.
"""

from conduit.distributed.errors import (
    ClusterError,
    DistributedError,
    RayUnavailableError,
    RemoteTimeoutError,
    ShardLostError,
    TransferError,
)
from conduit.distributed.experience import ExperienceRef, stage
from conduit.distributed.faults import LossReport
from conduit.distributed.links import LinkProfile, measure_links
from conduit.distributed.plan import ShardPlan
from conduit.distributed.plane import DistributedDataPlane
from conduit.distributed.servers import ShardServers, alive_nodes

__all__ = [
    "DistributedDataPlane",
    "ShardServers",
    "alive_nodes",
    "ExperienceRef",
    "stage",
    "LossReport",
    "LinkProfile",
    "measure_links",
    "ShardPlan",
    "DistributedError",
    "RayUnavailableError",
    "ClusterError",
    "RemoteTimeoutError",
    "ShardLostError",
    "TransferError",
]
