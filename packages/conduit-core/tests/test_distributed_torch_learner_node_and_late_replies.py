"""The torch.distributed delivery transport on a real local Ray cluster (2 nodes, gloo on CPU): a learner node other
than this process's.

* The torch group delivers into this process (its rank 0), and its links are measured to this process's node. With
  ``learner_node`` on another node, ``transport="auto"`` chose the torch path per shard by comparing links to
  ``learner_node``: the shard on this process's node went over loopback TCP (priced as remote) and the shard on
  ``learner_node``, whose rows cross to this process, through the object store (priced as local);
  ``transport="torch"`` priced every shard as if the bytes went to ``learner_node``. Now ``"torch"`` is refused with
  such a ``learner_node`` (typed, before any group forms, saying what to do), and ``"auto"`` delivers through the
  object store.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit import ConfigurationError  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _fill(p: DistributedDataPlane, head: str, worker: str) -> None:
    """Ids 0..9 produced on the head node (shard 0), 10..19 on the worker node (shard 1)."""
    p.ingest(id_batch(np.arange(10)), node=head)
    p.ingest(id_batch(np.arange(10, 20)), node=worker)


# -- 1. a learner node other than this process's -------------------------------------------------------------------
def test_auto_with_another_learner_node_delivers_through_the_object_store(cluster):
    head, worker = cluster.head, cluster.workers[0]
    group = ShardServers([head, worker])
    try:
        g = group.torch_group(timeout=60.0)
        assert g.learner_node == head  # the group's receiving end: this process, on the head node
        kw: dict[str, Any] = dict(capacity=64, servers=group, measure=False, health_period=None, timeout=30.0)
        # learner on this process's node (default or named): torch for the shard whose rows cross nodes
        for named in (None, head):
            with DistributedDataPlane(ID_SCHEMA, learner_node=named, **kw) as p:
                assert p.transports == ["object_store", "torch"]
        # learner on the worker node: the rows still come to this process, so the group's links and choice do not
        # reach it (the head shard went over loopback TCP, the worker shard through the object store)
        with DistributedDataPlane(ID_SCHEMA, learner_node=worker, **kw) as p:
            assert p.transports == ["object_store", "object_store"]
            _fill(p, head, worker)
            assert sorted(check_payload(p.read(p.live_handles())).tolist()) == list(range(20))
        assert g.broken is None and group.torch_group(create=False) is g  # the group is left as it was
    finally:
        group.shutdown()


def test_torch_with_another_learner_node_is_refused_before_a_group_forms(cluster):
    head, worker = cluster.head, cluster.workers[0]
    group = ShardServers([head, worker])
    try:
        for servers in (group, [head, worker]):
            with pytest.raises(ConfigurationError, match=r"transport='torch' delivers into this process.*"
                                                         r"learner_node=.*transport='object_store'"):
                DistributedDataPlane(ID_SCHEMA, capacity=64, servers=servers, learner_node=worker,
                                     transport="torch", health_period=None)
        assert group.torch_group(create=False) is None and group._links is None  # nothing formed or measured
        # this process's node, named, is the learner's: taken
        with DistributedDataPlane(ID_SCHEMA, capacity=64, servers=group, learner_node=head, transport="torch",
                                  measure=False, health_period=None, timeout=30.0) as p:
            assert p.transports == ["torch", "torch"]
            _fill(p, head, worker)
            assert sorted(check_payload(p.read(p.live_handles())).tolist()) == list(range(20))
    finally:
        group.shutdown()
