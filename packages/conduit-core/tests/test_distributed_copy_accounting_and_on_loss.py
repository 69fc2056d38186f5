"""Multi-node copy accounting and ``on_loss`` on the ingestion worker, each reproduced on a real local Ray cluster.

* a re-replication copy that lands on a target which dies later in the same copy round (another segment's copy
  there finds it dead) is accounted by that target's loss only: the first loss's report does not count it
  re-replicated, and ``under_replicated`` counts it once;
* an ``on_loss`` callback that runs on the background ingestion worker (the worker's write found the loss) and
  calls ``flush()`` or ``ingest()`` into a full queue is refused with a ConfigurationError instead of waiting forever
  for the write it runs in.

The faults are real: a server's actor is killed with ``ray.kill`` at a precise point (between two copies sent to
it), as a crash would kill it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit import ConfigurationError  # noqa: E402
from conduit.distributed import DistributedDataPlane, LossReport, ShardServers  # noqa: E402
from conduit.distributed.testing import ServerStandIn, kill_server  # noqa: E402
from conduit.scheduling import Overlapped  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _replicas(plane: DistributedDataPlane, handles: Any) -> set[int]:
    h = np.asarray(handles)
    shard, _ = plane.index.replicas(plane.index.segments_of(h), h)
    return set(shard[shard >= 0].tolist())


class _DiesBeforeAppend(ServerStandIn):
    """Stands in for a server's actor handle: the first ``nth - 1`` ``append`` calls go through; before the
    ``nth`` is sent, they have run and the actor is killed for real (``ray.kill``), so that one finds it dead.
    Every other call goes to the real actor; once killed (or on :meth:`restore`), the server's entry holds the real
    handle again."""

    def __init__(self, servers: ShardServers, shard: int, nth: int) -> None:
        super().__init__(servers, shard)
        self._nth = nth
        self._sent: list[Any] = []
        self.killed = False

    @property
    def append(self) -> Any:
        proxy = self

        class _Append:
            @staticmethod
            def remote(*args: Any) -> Any:
                import ray

                if len(proxy._sent) + 1 < proxy._nth:
                    proxy._sent.append(proxy._real.append.remote(*args))
                    return proxy._sent[-1]
                ray.get(proxy._sent, timeout=60)  # the copies before it are stored
                kill_server(proxy._real)
                proxy.restore()
                proxy.killed = True
                return proxy._real.append.remote(*args)

        return _Append()


# -- 1. a copy whose target dies later in the same round -------------------------------------------------------------
def test_a_copy_whose_target_dies_in_the_same_round_is_accounted_by_that_loss_only(cluster):
    """Two segments live on shards 0 and 1. Shard 1 is lost: both are copied to shard 2 (the only other node's),
    which stores the first copy and dies before the second. Shard 2's loss accounts the first segment (recovered,
    left with one copy: under-replicated); shard 1's report must not count that copy re-replicated, and
    ``under_replicated`` counts each segment once."""
    servers = ShardServers([cluster.head, cluster.workers[0], cluster.workers[0]])
    plane = DistributedDataPlane(ID_SCHEMA, capacity=20, servers=servers, replication=2, measure=False,
                                 health_period=None, timeout=20.0, transport="object_store")
    try:
        a = plane.ingest(id_batch(np.arange(5)))
        b = plane.ingest(id_batch(np.arange(5, 10)))
        assert _replicas(plane, a) == {0, 1} and _replicas(plane, b) == {0, 1}
        dies = _DiesBeforeAppend(servers, 2, nth=2)
        kill_server(servers[1].actor)
        try:
            found = plane.check_health()
        finally:
            dies.restore()
        assert dies.killed
        assert [r.shard for r in found] == [2, 1]
        r2, r1 = found
        assert r2.num_lost == 0 and r2.recovered == 5 and r2.re_replicated == 0
        assert r1.num_lost == 0 and r1.recovered == 10
        assert r1.re_replicated == 0, "a copy lost with its target in the same call was counted re-replicated"
        assert plane.under_replicated == 10, "a segment was counted under-replicated by both losses"
        assert plane.alive_shards == [0]
        assert _replicas(plane, a) == {0} and _replicas(plane, b) == {0}
        assert sorted(check_payload(plane.read(np.concatenate([a.numpy(), b.numpy()]))).tolist()) == list(range(10))
        assert plane.lost_items == 0
    finally:
        plane.close()
        servers.shutdown()


def test_a_copy_that_landed_is_in_the_index_before_a_failed_copy_finds_a_loss(cluster):
    """Shard 1 is lost: segment R1 is copied to shard 2 and R2 to shard 3 (shard 2 has room for one). Shard 2 is dead
    (R1's copy fails), and its loss copies segment S, which it held with shard 4, to shard 3, which stored R2's copy
    and died since. R2's copy must be in the index before shard 3's loss is settled, so that loss drops it: the index
    never names a replica on a lost shard, and every segment is counted under-replicated once."""
    h, w = cluster.head, cluster.workers[0]
    servers = ShardServers([h, w, w, w, h])
    plane = DistributedDataPlane(ID_SCHEMA, capacity=16, shard_capacity=8, servers=servers, replication=2,
                                 measure=False, health_period=None, timeout=20.0, transport="object_store")
    try:
        r1 = plane.ingest(id_batch(np.arange(4)))
        r2 = plane.ingest(id_batch(np.arange(4, 8)))
        s = plane.ingest(id_batch(np.arange(8, 12)))  # shards 0 and 1 are full
        assert _replicas(plane, r1) == {0, 1} and _replicas(plane, r2) == {0, 1} and _replicas(plane, s) == {2, 4}
        u, t = _DiesBeforeAppend(servers, 2, nth=1), _DiesBeforeAppend(servers, 3, nth=2)
        kill_server(servers[1].actor)
        try:
            found = plane.check_health()
        finally:
            u.restore()
            t.restore()
        assert u.killed and t.killed
        assert plane.alive_shards == [0, 4]
        for handles in (r1, r2, s):
            assert _replicas(plane, handles) <= set(plane.alive_shards), "the index names a replica on a lost shard"
        assert [r.shard for r in found] == [3, 2, 1]
        assert [r.num_lost for r in found] == [0, 0, 0]
        assert [(r.recovered, r.re_replicated) for r in found] == [(4, 0), (4, 0), (8, 0)]
        assert plane.under_replicated == 12
        every = np.concatenate([r1.numpy(), r2.numpy(), s.numpy()])
        assert check_payload(plane.read(every)).tolist() == list(range(12))
    finally:
        plane.close()
        servers.shutdown()


# -- 3. an on_loss callback on the ingestion worker that calls back into the buffer ---------------------------------
def test_calls_that_wait_for_the_write_are_refused_from_on_loss_on_the_ingestion_worker(cluster):
    """Shard 1 dies with no monitor running: the background worker's write finds it lost, and the callback runs on
    that worker, inside its write. A ``flush()`` there, or an ``ingest()`` into a full queue, could never return
    (they wait for that write): each raises a ConfigurationError at once, changing nothing; an ``ingest()`` with room
    is accepted and stored after the write, in order, and ``deliver()`` serves what is stored. The loss is reported
    once."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    seen: list[tuple[LossReport, list[str]]] = []
    plane = DistributedDataPlane(ID_SCHEMA, capacity=20, servers=servers, replication=1, measure=False,
                                 health_period=None, timeout=20.0, transport="object_store",
                                 scheduler=Overlapped(g_ing=1, g_del=1, queue_depth=1))

    delivered: list[list[int]] = []

    def on_loss(report: LossReport) -> None:
        errors = []
        for call in (plane.flush, lambda: plane.ingest(id_batch(np.arange(8, 10))),
                     lambda: plane.ingest(id_batch(np.arange(10, 12)))):
            try:
                call()
            except ConfigurationError as e:
                errors.append(str(e))
            else:
                errors.append("")
        delivered.append(check_payload(plane.deliver(3)[0]).tolist())  # waits for no write: served
        seen.append((report, errors))

    plane.on_loss = on_loss
    try:
        far = cluster.workers[0]  # produced on the worker node: stored on its shard (1)
        plane.ingest(id_batch(np.arange(4)), node=far)
        plane.flush()
        assert len(plane) == 4 and _replicas(plane, np.arange(4)) == {1}
        kill_server(servers[1].actor)
        plane.ingest(id_batch(np.arange(4, 8)), node=far)  # the worker's write finds shard 1 dead, stores on 0
        plane.flush()  # returns: the worker's write ended (the callback inside it included)
        plane.flush()  # what the callback handed over (maybe after the first flush began, which then does not wait)
        assert [r.shard for r in plane.losses] == [1]
        assert len(seen) == 1 and seen[0][0] is plane.losses[0]
        flushed, room, full = seen[0][1]
        assert "flush()" in flushed and "callback" in flushed, "flush() on the worker did not refuse"
        assert room == ""
        assert "full queue" in full and "callback" in full, "ingest() into a full queue on the worker did not refuse"
        # what was stored when the callback ran: the second batch (the first was lost, the callback's is queued)
        assert len(delivered) == 1 and len(delivered[0]) == 3 and set(delivered[0]) <= set(range(4, 8))
        assert plane.alive_shards == [0]
        assert len(plane) == 6  # the second batch and the callback's, on shard 0; the first was lost with shard 1
        h = np.arange(4, 10)
        assert check_payload(plane.read(h)).tolist() == list(range(4, 10))
        assert plane.lost_items == 4
    finally:
        plane.close()
        servers.shutdown()
