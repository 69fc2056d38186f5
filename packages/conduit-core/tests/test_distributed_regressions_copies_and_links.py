"""Multi-node re-replication copies, torch groups, ``wait_all`` and declared links, on a real local Ray cluster.

* a re-replication copy whose target answers health probes but never stores the copy is sent again to another
  target (bounded), and counted under-replicated when none takes it;
* a torch.distributed group whose link measurement fails is torn down (no server keeps it; a retry starts afresh);
* ``wait_all`` given one ObjectRef under several keys answers every key;
* declared links (what makes the plan test of ``test_distributed.py`` independent of measurement noise) are checked.

A "stuck" shard is made for real: its data thread is held in a torch.distributed rendezvous that this process
completes only when the test says so, while its health checks (their own thread) still answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit import ConfigurationError  # noqa: E402
from conduit.distributed import DistributedDataPlane, LinkProfile, ShardServers  # noqa: E402
from conduit.distributed._ray import wait_all  # noqa: E402
from conduit.distributed.errors import DistributedError  # noqa: E402
from conduit.distributed.testing import held_data_thread, kill_server  # noqa: E402
from conduit.distributed.transport import TorchGroup  # noqa: E402
from conduit.placement.profile import LinkCost  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _span(plane: DistributedDataPlane, shard: int) -> tuple[int, int]:
    import ray

    return tuple(ray.get(plane.servers[shard].actor.span.remote(plane.buffer_id), timeout=60))


def _replicas(plane: DistributedDataPlane, handles: Any) -> set[int]:
    h = np.asarray(handles)
    shard, _ = plane.index.replicas(plane.index.segments_of(h), h)
    return set(shard[shard >= 0].tolist())


def _plane(servers: ShardServers) -> DistributedDataPlane:
    return DistributedDataPlane(ID_SCHEMA, capacity=20, servers=servers, replication=2, measure=False,
                                health_period=None, timeout=5.0, transport="object_store")


# -- 1. a re-replication copy that never lands ---------------------------------------------------------------------
def test_a_copy_a_live_target_never_stores_is_sent_to_another_target(cluster):
    """Shard 1's loss leaves every item with one copy (on shard 0); the copy goes first to shard 2, which answers
    health checks but whose data thread is held: the copy is sent again, to shard 3, and replication is restored."""
    servers = ShardServers([cluster.head, cluster.workers[0], cluster.workers[0], cluster.workers[0]])
    plane = _plane(servers)
    try:
        h = plane.ingest(id_batch(np.arange(10)))
        assert _replicas(plane, h) == {0, 1}
        with held_data_thread(servers[2]):
            kill_server(servers[1].actor)  # (returns once Ray reports it dead)
            found = plane.check_health()
            assert [r.shard for r in found] == [1]
            assert found[0].num_lost == 0 and found[0].recovered == 10
            assert found[0].re_replicated == 10, "the copy was not sent again after its target did not store it"
            assert plane.under_replicated == 0
            assert _replicas(plane, h) == {0, 3}
            assert sorted(check_payload(plane.read(h)).tolist()) == list(range(10))
        # the late copy ran once shard 2 was free, and was discarded: it holds nothing the index does not name
        assert _span(plane, 2) == (0, 0)
        assert len(plane.alive_shards) == 3
    finally:
        plane.close()
        servers.shutdown()


def test_a_copy_no_live_target_stores_is_counted_under_replicated(cluster):
    """The only other node's shard is held: the copy fails there, no other target exists, so the items stay
    readable with one copy and are counted in ``under_replicated`` (the stuck shard is not declared lost)."""
    servers = ShardServers([cluster.head, cluster.workers[0], cluster.workers[0]])
    plane = _plane(servers)
    try:
        h = plane.ingest(id_batch(np.arange(10)))
        assert _replicas(plane, h) == {0, 1}
        with held_data_thread(servers[2]):
            kill_server(servers[1].actor)  # (returns once Ray reports it dead)
            found = plane.check_health()
            assert [r.shard for r in found] == [1]
            assert found[0].recovered == 10 and found[0].re_replicated == 0
            assert plane.under_replicated == 10
            assert _replicas(plane, h) == {0}
            assert plane.alive_shards == [0, 2]
            assert sorted(check_payload(plane.read(h)).tolist()) == list(range(10))
        assert _span(plane, 2) == (0, 0)
    finally:
        plane.close()
        servers.shutdown()


# -- 2. a torch group whose measurement fails ----------------------------------------------------------------------
def test_a_torch_group_whose_measurement_fails_is_torn_down_and_a_retry_forms_a_new_one(cluster):
    """Server 1 leaves the group once it is formed, so the link probe from it fails (the server's own refusal is
    raised: it is in no such group): the group is closed here and server 0 leaves it too (nothing is kept), nothing
    is cached, and forming again gives a new, working group."""
    import ray

    servers = ShardServers([cluster.head, cluster.workers[0]])
    formed: list[TorchGroup] = []

    class LeavesBeforeMeasuring(TorchGroup):
        def measure(self, *args: Any, **kwargs: Any) -> Any:
            formed.append(self)
            assert ray.get(self._servers[1].actor.leave_group.remote(self.group_id), timeout=60)
            return super().measure(*args, **kwargs)

    try:
        with pytest.raises(DistributedError, match="not in torch.distributed group"):
            LeavesBeforeMeasuring(servers, timeout=15.0)
        old = formed[0]
        assert old.broken is not None and old.pg is None
        # server 0 was asked to leave before this call (calls from one process run in order)
        assert ray.get(servers[0].actor.leave_group.remote(old.group_id), timeout=60) is False
        assert servers.torch_group(create=False) is None
        g = servers.torch_group(timeout=30.0)
        assert g.group_id != old.group_id and g.broken is None and g.links is not None
    finally:
        servers.shutdown()


# -- 3. wait_all with one ObjectRef under several keys ---------------------------------------------------------------
def test_wait_all_answers_every_key_of_a_repeated_ref(cluster):
    import ray

    ref, other = ray.put(41), ray.put(42)
    outs = wait_all({"a": ref, "b": ref, "c": other}, 30.0)
    assert {k: (o.ok, o.value) for k, o in outs.items()} == {"a": (True, 41), "b": (True, 41), "c": (True, 42)}
    by_pos = wait_all([ref, other, ref], 30.0)
    assert [by_pos[i].value for i in range(3)] == [41, 42, 41] and all(o.ok for o in by_pos.values())


# -- 4. declared links -------------------------------------------------------------------------------------------
def test_declared_links_that_miss_a_link_or_are_no_profile_are_refused_typed(cluster):
    nodes = [cluster.head, cluster.workers[0]]
    full = {(a, b): LinkCost.constant(10.0 if a == b else 1.0) for a in nodes for b in nodes}
    with pytest.raises(ConfigurationError, match="LinkProfile"):
        DistributedDataPlane(ID_SCHEMA, capacity=8, servers=nodes, links=full, health_period=None)
    servers = ShardServers(nodes)
    try:
        partial = LinkProfile({k: v for k, v in full.items() if k != (cluster.workers[0], cluster.head)})
        with pytest.raises(ConfigurationError, match="declare every directed link"):
            DistributedDataPlane(ID_SCHEMA, capacity=8, servers=servers, links=partial, health_period=None)
        with DistributedDataPlane(ID_SCHEMA, capacity=8, servers=servers, links=LinkProfile(full),
                                  health_period=None, reuse=8.0) as p:
            assert p.plan.order(cluster.workers[0], 1 << 22)[0] == 0  # pulled to the learner's node
            assert p.plan.transfer_seconds(cluster.workers[0], cluster.head, 1e9) == pytest.approx(1.0)
    finally:
        servers.shutdown()
