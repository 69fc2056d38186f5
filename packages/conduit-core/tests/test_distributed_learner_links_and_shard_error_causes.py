"""On a real local Ray cluster (2 nodes): the links a declared learner node is priced from, and the errors a shard
raises reaching the caller as themselves.

* ``learner_node`` on a node that holds no server and is not this process's: ``measure_links`` probes only between
  the servers' nodes and this process's, so deliveries were priced from other nodes' links (the slowest of their
  kind, or an infinite cost where none was measured). Refused before any server starts, typed, saying what to pass.
* A shard's open or read error is the cause (``__cause__``) of the error raised for it (it was kept only as text).
* A server's ``gather_send`` for a closed partition raises its typed "holds no partition" error (it read the
  schema first: a bare ``KeyError``), also inside a joined torch.distributed group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit import ConfigurationError  # noqa: E402
from conduit.distributed import DistributedDataPlane, DistributedError, ShardServers  # noqa: E402
from conduit.distributed._ray import wait_all  # noqa: E402
from conduit.distributed.testing import ServerStandIn  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_a_learner_node_no_link_can_be_measured_to_is_refused_before_any_server_starts(cluster):
    head, worker = cluster.head, cluster.workers[0]
    group = ShardServers([head])
    try:
        for servers in (group, [head]):
            with pytest.raises(ConfigurationError, match=r"learner_node=.*no link to it can be measured.*"
                                                         r"links=LinkProfile.*measure=False"):
                DistributedDataPlane(ID_SCHEMA, capacity=8, servers=servers, learner_node=worker,
                                     health_period=None)
        assert group._links is None  # nothing was measured
        # declared links to it, or no measurement, are taken
        with DistributedDataPlane(ID_SCHEMA, capacity=8, servers=group, learner_node=worker, measure=False,
                                  health_period=None) as p:
            p.ingest(id_batch(np.arange(4)))
            assert p.deliver(4)[0].batch_size == 4
    finally:
        group.shutdown()


def test_a_learner_on_another_servers_node_is_priced_from_the_links_measured_to_it(cluster, servers):
    head, worker = cluster.head, cluster.workers[0]
    with DistributedDataPlane(ID_SCHEMA, capacity=8, servers=servers, learner_node=worker, health_period=None,
                              transport="object_store", timeout=60.0) as p:
        assert p.links is not None and p.links.learner_node == head  # measured from this process's node
        n = float(1 << 20)
        for s, node in enumerate(p.plan.shard_nodes):
            assert p.plan.transfer_seconds(node, worker, n) == n / p.links.link(node, worker).bandwidth(n)
            assert p._read_cost[s] == p.plan.transfer_seconds(node, worker, n)


class _OpensWithABadCapacity(ServerStandIn):
    """The real server's ``open``, given a capacity it refuses (its own ConfigurationError)."""

    @property
    def open(self) -> Any:
        real = self._real

        class _Open:
            @staticmethod
            def remote(buffer_id: str, schema: Any, capacity: int, ragged: Any, *owner: Any) -> Any:
                return real.open.remote(buffer_id, schema, "not a capacity", ragged, *owner)

        return _Open()


class _GathersBadHandles(ServerStandIn):
    """The real server's ``gather``, given local handles that are no ints (its own ValueError, no Conduit error)."""

    @property
    def gather(self) -> Any:
        real = self._real

        class _Gather:
            @staticmethod
            def remote(buffer_id: str, local: np.ndarray) -> Any:
                return real.gather.remote(buffer_id, np.array(["not a handle"] * len(local)))

        return _Gather()


def test_a_shards_open_error_is_the_cause_of_the_cluster_error(servers):
    """(On the module's shared servers: shard 0's opens fail until the stand-in is restored.)"""
    from conduit.distributed import ClusterError

    stand_in = _OpensWithABadCapacity(servers, 0)
    try:
        with pytest.raises(ClusterError, match="could not open its partition") as e:
            DistributedDataPlane(ID_SCHEMA, capacity=8, servers=servers, measure=False, health_period=None)
        assert isinstance(e.value.__cause__, ConfigurationError)
        assert "capacity must be a positive int, got 'not a capacity'" in str(e.value.__cause__)
    finally:
        stand_in.restore()


def test_a_shards_read_error_is_the_cause_of_the_distributed_error(cluster, servers):
    """(On the module's shared servers: the buffer has a partition of its own; its items are all on shard 0.)"""
    with DistributedDataPlane(ID_SCHEMA, capacity=8, servers=servers, measure=False, health_period=None,
                              transport="object_store") as p:
        p.ingest(id_batch(np.arange(4)), node=cluster.head)
        assert servers[0].node_id == cluster.head
        stand_in = _GathersBadHandles(servers, 0)
        try:
            with pytest.raises(DistributedError, match="Shard 0 failed to read items") as e:
                p.deliver(4)
        finally:
            stand_in.restore()
        cause = e.value.__cause__
        assert isinstance(cause, ValueError) and "invalid literal for int()" in str(cause)
        assert not p.losses  # an error, not a loss
        assert p.deliver(4)[0].batch_size == 4


def test_gather_send_for_a_closed_partition_raises_the_typed_error_in_a_joined_group(cluster, servers):
    g = servers.torch_group(timeout=60.0)
    actor = servers[0].actor
    wait_all([actor.open.remote("closed-buffer", ID_SCHEMA.to_dict(), 8, None)], 60.0)
    wait_all([actor.close.remote("closed-buffer")], 60.0)
    (o,) = wait_all([actor.gather_send.remote("closed-buffer", np.arange(1), g.group_id, g.tags())], 60.0).values()
    assert isinstance(o.error, DistributedError) and "holds no partition of buffer 'closed-buffer'" in str(o.error)
    assert g.broken is None  # nothing was sent: the group still works
    with DistributedDataPlane(ID_SCHEMA, capacity=8, servers=servers, measure=False, health_period=None,
                              transport="torch") as p:
        p.ingest(id_batch(np.arange(4)), node=cluster.workers[0])
        assert p.deliver(4)[0].batch_size == 4 and p.transports == ["torch", "torch"]
