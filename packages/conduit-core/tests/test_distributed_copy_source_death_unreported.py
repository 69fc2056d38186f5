"""Re-replication on a real local Ray cluster: a copy that times out because its source is dead but not yet
reported dead, and the healthy target of that copy.

The copy's source never produced its rows (its data thread was held, as a node that stopped answering without Ray
knowing it yet), so the copy times out after ``timeout`` and its target is skipped for the round's retries. The probe
after the round then finds the source lost (its node was killed meanwhile, for real): the target only waited for a
source that is gone, so it is a candidate again for the next rounds' copies.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import ExperienceSchema, Field  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.distributed._ray import Outcome  # noqa: E402
from conduit.distributed.testing import kill_server  # noqa: E402
from conduit.testing.lifecycle import eventually  # noqa: E402

pytestmark = pytest.mark.timeout(400)

#: 64 KiB an item: a segment of 4 is a 256 KiB object, kept in the source node's object store
_WIDTH = 16384
BIG = ExperienceSchema(id=Field((), torch.int64), obs=Field((_WIDTH,), torch.float32))


def _batch(ids: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    return {"id": t, "obs": t.to(torch.float32)[:, None].expand(-1, _WIDTH).contiguous()}


def _ids(batch: Any) -> list[int]:
    ids = batch["id"].numpy()
    assert (batch["obs"].numpy() == ids[:, None].astype(np.float32)).all(), "a payload does not match its id"
    return sorted(ids.tolist())


def _replicas(plane: DistributedDataPlane, handles: Any) -> set[int]:
    h = np.asarray(handles)
    shard, _ = plane.index.replicas(plane.index.segments_of(h), h)
    return set(shard[shard >= 0].tolist())


def _hold_until_its_node_dies(server: Any) -> Any:
    """Hold the data thread of ``server`` for good (its health checks still answer): it joins a two-rank gloo group
    whose other rank never joins, and so runs no other data call until its process dies. Returns the group's store
    (keep it until the server's node is killed)."""
    import ray
    import torch.distributed as dist

    host = str(ray.util.get_node_ip_address())
    store = dist.TCPStore(host, 0, 2, True, timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    server.actor.join_group.remote("conduit-test-hold-forever", host, int(store.port), 1, 2, "gloo", 300.0)
    return store


def test_a_copy_timed_out_on_a_source_found_dead_leaves_its_target_a_candidate(cluster):
    """Shards 0 (node N), 1 (node W), 2 (the head node) and 3 (node M). Segment A lives on shards 0 and 2, segment
    B on shards 3 and 2. Shard 0's data thread is held (its pings answer): it stands for a node that died without
    Ray knowing yet. Shard 2 is lost: A is copied from shard 0 to shard 1 and B from shard 3 to shard 0; both copies
    time out (shard 0 reads and stores nothing), so shards 0 and 1 are skipped for the retries. Before the probe
    that follows, node N is killed for real: the probe finds shard 0 lost (A is lost: both replicas are gone). Shard
    1 answered the probe and only waited for shard 0's rows, so B's copy is sent again to shard 1, and B gets its
    second replica back: nothing that survived is reported lost, nothing is left under-replicated."""
    import ray

    n_node, m_node = cluster.add_node(), cluster.add_node()
    servers = ShardServers([n_node, cluster.workers[0], cluster.head, m_node])
    plane = DistributedDataPlane(BIG, capacity=32, shard_capacity=16, servers=servers, replication=2, measure=False,
                                 health_period=None, timeout=10.0, transport="object_store")
    probes: list[set[int]] = []
    settle = plane._settle

    def settle_after_the_source_node_died(failed: dict[int, Outcome]) -> set[int]:
        probes.append(set(failed))
        if len(probes) == 1:
            assert 0 in failed, "the first round's copies did not time out on shard 0"
            cluster.kill_node(n_node)
            assert eventually(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == n_node),
                              timeout=60), "Ray did not report the killed node dead"
        return settle(failed)

    try:
        a = plane.ingest(_batch(np.arange(4)), node=n_node)
        b = plane.ingest(_batch(np.arange(4, 8)), node=m_node)
        assert _replicas(plane, a) == {0, 2} and _replicas(plane, b) == {2, 3}
        plane._settle = settle_after_the_source_node_died  # type: ignore[method-assign]
        store = _hold_until_its_node_dies(servers[0])
        kill_server(servers[2].actor)
        found = plane.check_health()
        del store
        # the first round's two copies timed out (shard 0 held), and their shards were probed after it
        assert probes[0] == {0, 1, 3}
        assert sorted(r.shard for r in found) == [0, 2]
        by = {r.shard: r for r in found}
        # A had its replicas on shards 2 and 0: lost, exactly, once
        assert sorted(np.concatenate([r.lost for r in found]).tolist()) == sorted(a.tolist())
        assert plane.lost_items == 4
        assert by[2].recovered == 4, "B (replica on shard 3) is recovered by shard 2's loss"
        assert plane.alive_shards == [1, 3]
        assert _replicas(plane, b) == {1, 3}, \
            "B's copy was not sent again to shard 1, whose only failed copy timed out on a source found dead"
        assert by[2].re_replicated == 4
        assert plane.under_replicated == 0
        assert _ids(plane.read(b)) == list(range(4, 8))
    finally:
        plane.close()
        servers.shutdown()
