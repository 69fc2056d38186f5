"""Shard faults: re-replication when a shard is found lost by an ingestion that evicts.

The first tests use the in-process harness of ``test_distributed_bookkeeping`` (real shard server
bodies, faults injected at exact points); the last one runs the same loss on the real local Ray
cluster of ``conftest.py`` with a killed shard server.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conduit.distributed import ClusterError, DistributedDataPlane, ShardServers, TransferError
from conduit.distributed.experience import ExperienceRef
from conduit.distributed.testing import kill_server
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import _Ref, _ids, _plane, fake_ray  # noqa: E402, F401, I001

pytestmark = pytest.mark.timeout(300)


def _copies(plane: DistributedDataPlane) -> dict[int, int]:
    """Replicas of every live item, by handle."""
    out = {}
    for row in plane.index.live_rows():
        first, count, reps = plane.index.segment(row)
        for h in range(first, first + count):
            out[h] = len(reps)
    return out


def _fill_three_nodes(p: DistributedDataPlane, nodes: list[str]) -> None:
    """Items 0-5, two from each node, two copies each."""
    for i, node in enumerate(nodes):
        p.ingest(id_batch(np.arange(2 * i, 2 * i + 2)), node=node)
    assert set(_copies(p).values()) == {2}


def test_a_shard_found_lost_by_an_evicting_ingestion_leaves_no_kept_item_with_one_copy(fake_ray):  # noqa: F811
    """Replication 2 on three nodes of 6 slots, a full buffer of 6 items. Shard a dies; the next ingestion (3
    items, evicting 0-2) finds it. The two survivors have room for every kept item twice once the eviction is
    counted, but the re-replication copied items 0-2 (which the ingestion evicts) and filled the room: kept
    items were left with one copy and counted under-replicated."""
    p = _plane(["a", "b", "c"], capacity=6, shard_capacity=6, replication=2)
    _fill_three_nodes(p, ["a", "b", "c"])
    p.servers[0].actor.dead = True
    p.ingest(id_batch(np.arange(6, 9)), node="a")
    assert len(p.losses) == 1 and p.losses[0].num_lost == 0
    copies = _copies(p)
    assert sorted(copies) == [3, 4, 5, 6, 7, 8]
    short = sorted(h for h, c in copies.items() if c < 2)
    assert not short, f"items {short} kept with one copy although the surviving shards have room for two"
    assert p.under_replicated == 0, f"{p.under_replicated} items counted under-replicated; every kept item has 2"
    assert _ids(p) == [3, 4, 5, 6, 7, 8]


def test_a_failed_ingestion_that_found_a_loss_copies_the_items_it_would_have_evicted(fake_ray):  # noqa: F811
    """The same loss found by an ingestion that evicts everything and then fails with no shard storing
    anything (its staged batch cannot be read): it evicts nothing, so the items it would have evicted are
    still live and get their second copy."""
    p = _plane(["a", "b", "c"], capacity=6, shard_capacity=6, replication=2)
    _fill_three_nodes(p, ["a", "b", "c"])
    p.servers[0].actor.dead = True
    unreadable = ExperienceRef(_Ref(error=RuntimeError("the producer's node died")), "a", 6, 48, ID_SCHEMA.to_dict())
    with pytest.raises((TransferError, ClusterError)):
        p.ingest(unreadable)
    assert len(p.losses) == 1 and p.losses[0].num_lost == 0
    copies = _copies(p)
    assert sorted(copies) == [0, 1, 2, 3, 4, 5], "the failed ingestion evicted items"
    short = sorted(h for h, c in copies.items() if c < 2)
    assert not short and p.under_replicated == 0, f"items {short} left with one copy"
    assert _ids(p) == [0, 1, 2, 3, 4, 5]


def test_an_ingestion_that_loses_two_of_three_replicas_copies_both_back(fake_ray):  # noqa: F811
    """Replication 3 on five nodes; two of the three shards an ingestion writes to are dead. The items were
    stored on one shard and re-replicated once: two copies of three, with a fifth node free, and not
    counted in ``under_replicated``."""
    p = _plane(["a", "b", "c", "d", "e"], capacity=8, replication=3)
    p.servers[0].actor.dead = True
    p.servers[1].actor.dead = True
    p.ingest(id_batch(np.arange(4)), node="a")
    assert sorted(r.shard for r in p.losses) == [0, 1] and p.lost_items == 0
    copies = _copies(p)
    assert copies == {0: 3, 1: 3, 2: 3, 3: 3}, (f"copies per item {copies} (under_replicated={p.under_replicated}); "
                                                f"three live nodes can hold three")
    assert p.under_replicated == 0
    assert _ids(p) == [0, 1, 2, 3]


def test_a_health_check_returns_the_loss_its_re_replication_found(fake_ray):  # noqa: F811
    """Items 0-3 live on shards a and b, which both die. The health check finds a; copying its items from b
    fails and finds b lost too (items 0-3 lost). The check returned only a's report, and the items were
    counted both lost and under-replicated."""
    p = _plane(["a", "b", "c", "d"], capacity=8, replication=2)
    p.ingest(id_batch(np.arange(4)), node="a")
    assert sorted(s for s, _ in p.index.segment(0)[2]) == [0, 1]
    p.servers[0].actor.dead = True
    p.servers[1].actor.dead = True
    found = p.check_health()
    assert sorted(r.shard for r in found) == [0, 1], f"check_health returned {[str(r) for r in found]}"
    assert [r.shard for r in found] == [r.shard for r in p.losses]
    assert p.lost_items == 4 and sorted(np.concatenate([r.lost for r in p.losses]).tolist()) == [0, 1, 2, 3]
    assert p.under_replicated == 0, f"{p.under_replicated} lost items also counted under-replicated"
    assert len(p) == 0


@pytest.mark.slow
def test_real_cluster_a_killed_server_and_two_killed_nodes_are_found_exactly(cluster):
    """The evicting-ingestion and health-check tests on the real local cluster, two buffers with shards on the same
    two victim nodes (one pair of nodes started for both; each buffer finds its loss through its own call):

    * evicting ingestion: replication 2 over three nodes, the victim's shard server of this buffer is killed, and
      the ingestion that evicts finds it: every kept item has two copies, none is counted under-replicated;
    * health check: items 0-3 on the two victim nodes, both nodes killed: one health check reports both shards,
      the 4 items lost and none under-replicated, and the training loop goes on with the survivors."""
    import ray

    va, vb = cluster.add_node(), cluster.add_node()
    killed = False
    own_e = ShardServers([va, cluster.head, cluster.workers[0]])  # the evicting buffer's shard 0 on a victim
    own = ShardServers([va, vb, cluster.head, cluster.workers[0]])
    e = DistributedDataPlane(ID_SCHEMA, capacity=6, shard_capacity=6, replication=2, servers=own_e, measure=False,
                             health_period=None, timeout=10.0, transport="object_store")
    # (the plan ranks the producer's node, then the learner's: items 0-3 go to both victims)
    p = DistributedDataPlane(ID_SCHEMA, capacity=8, replication=2, servers=own, measure=False, health_period=None,
                             timeout=10.0, transport="object_store", learner_node=vb)
    try:
        # health check: the items on both victims
        p.ingest(id_batch(np.arange(4)), node=va)
        assert sorted(s for s, _ in p.index.segment(0)[2]) == [0, 1], "the plan put the items elsewhere"

        # evicting ingestion: only this buffer's server on the victim is killed (the node stays up)
        _fill_three_nodes(e, [va, cluster.head, cluster.workers[0]])
        kill_server(own_e[0].actor)
        e.ingest(id_batch(np.arange(6, 9)), node=va)
        assert len(e.losses) == 1 and e.losses[0].shard == 0 and e.losses[0].num_lost == 0
        copies = _copies(e)
        short = sorted(h for h, c in copies.items() if c < 2)
        assert sorted(copies) == [3, 4, 5, 6, 7, 8] and not short, f"items {short} kept with one copy"
        assert e.under_replicated == 0, f"{e.under_replicated} items counted under-replicated"
        assert sorted(check_payload(e.read(e.live_handles())).tolist()) == [3, 4, 5, 6, 7, 8]

        # health check: both victim nodes killed
        assert not p.losses
        killed = True
        cluster.kill_node(va)
        cluster.kill_node(vb)
        deadline = time.monotonic() + 60
        while {n["NodeID"] for n in ray.nodes() if n.get("Alive")} & {va, vb}:  # Ray declares both dead first
            assert time.monotonic() < deadline, "Ray did not declare the killed nodes dead"
            time.sleep(0.2)
        found = p.check_health()
        assert sorted(r.shard for r in found) == [0, 1], f"check_health returned {[str(r) for r in found]}"
        assert p.lost_items == 4 and sorted(np.concatenate([r.lost for r in p.losses]).tolist()) == [0, 1, 2, 3]
        assert p.under_replicated == 0, f"{p.under_replicated} lost items also counted under-replicated"
        assert len(p) == 0 and p.alive_shards == [2, 3]
        p.ingest(id_batch(np.arange(4, 8)))  # the training loop goes on with the survivors
        assert sorted(check_payload(p.read(p.live_handles())).tolist()) == [4, 5, 6, 7]
    finally:
        e.close()
        p.close()
        own_e.shutdown()
        own.shutdown()
        if not killed:
            cluster.kill_node(va)
            cluster.kill_node(vb)
