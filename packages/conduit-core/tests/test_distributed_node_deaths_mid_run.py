"""Nodes that die in the middle of a run, on the real local Ray cluster of ``conftest.py``, at points the other
fault tests leave out: a second node dying after the first one's items were re-replicated, a node dying during an
on-policy epoch after the first, while priority updates are under way, and between a checkpoint and its restore.

Each test adds its own victim nodes and kills them as a crash would (``LocalCluster.kill_node``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import OnPolicy, PrioritizedSampler, Replay  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.testing.lifecycle import eventually  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

#: seconds within which a killed node's shard must be reported lost (as in test_distributed_faults.py)
DETECTION_BOUND = 30.0


def _replica_shards(plane: DistributedDataPlane) -> dict[int, set[int]]:
    """The shards holding a copy of each item that can still be delivered, by handle (lost items left out)."""
    out: dict[int, set[int]] = {}
    for row in plane.index.live_rows():
        first, count, reps = plane.index.segment(row)
        for h in range(first, first + count if reps else first):
            out[h] = {s for s, _ in reps}
    return out


def _wait_for_losses(plane: DistributedDataPlane, n: int, work) -> None:
    """Keep the training loop going (``work()``) until ``n`` losses are reported."""
    t0 = time.monotonic()
    while len(plane.losses) < n:
        assert time.monotonic() - t0 < DETECTION_BOUND, f"loss {n} was not detected within the bound"
        work()


def _wait_dead(*nodes: str) -> None:
    """Return once Ray declares ``nodes`` dead (without asking the buffer)."""
    import ray

    deadline = time.monotonic() + 60
    while {n["NodeID"] for n in ray.nodes() if n.get("Alive")} & set(nodes):
        assert time.monotonic() < deadline, "Ray did not declare the killed nodes dead"
        time.sleep(0.2)


def test_real_cluster_a_second_node_dying_after_the_first_ones_items_were_re_replicated_loses_nothing(cluster):
    """Replication 2 on four nodes; one victim dies, its items are copied again; then the other victim dies:
    every item is still delivered, both reports count exactly the items that had a copy there, and each item
    ends with two copies on the two surviving nodes."""
    va, vb = cluster.add_node(), cluster.add_node()
    own = ShardServers([cluster.head, cluster.workers[0], va, vb])
    p = DistributedDataPlane(ID_SCHEMA, capacity=400, replication=2, servers=own, measure=False, health_period=0.2,
                             timeout=10.0, transport="object_store")
    try:
        for i, node in enumerate(own.nodes):
            p.ingest(id_batch(np.arange(1000 * i, 1000 * i + 50)), node=node)
        all_ids = set(check_payload(p.read(p.live_handles())).tolist())
        assert len(all_ids) == 200
        on_a = sum(2 in s for s in _replica_shards(p).values())
        assert on_a > 0

        cluster.kill_node(va)
        _wait_for_losses(p, 1, lambda: p.deliver(16))
        first = p.losses[0]
        assert first.shard == 2 and first.num_lost == 0
        assert first.recovered == first.re_replicated == on_a
        reps = _replica_shards(p)
        assert all(len(s) == 2 and 2 not in s for s in reps.values()), "replication 2 was not restored"
        on_b = sum(3 in s for s in reps.values())
        assert on_b > 0

        cluster.kill_node(vb)
        _wait_for_losses(p, 2, lambda: p.deliver(16))
        second = p.losses[1]
        assert second.shard == 3 and second.num_lost == 0 and p.lost_items == 0
        assert second.recovered == second.re_replicated == on_b
        assert all(s == {0, 1} for s in _replica_shards(p).values())
        assert p.under_replicated == 0 and len(p) == 200
        assert set(check_payload(p.read(p.live_handles())).tolist()) == all_ids
        for _ in range(5):  # the loop goes on
            assert set(check_payload(p.deliver(64)[0]).tolist()) <= all_ids
    finally:
        p.close()
        own.shutdown()


def test_real_cluster_a_node_dying_in_the_second_epoch_or_while_priorities_are_updated_keeps_both_buffers_exact(
        cluster):
    """One victim node holds a shard of two buffers, each with its own health monitor (one node started and killed
    for both: each buffer finds the loss on its own).

    On-policy, two epochs of four minibatches: the victim dies after the first epoch and a minibatch of the
    second. The report names exactly the victim's items; the rest of the second epoch delivers each survivor not
    yet delivered in it exactly once, and nothing of the victim.

    Prioritized replay on the same two nodes: a learner thread updates priorities of every item (both shards) while
    the victim dies and the monitor fences it. Afterwards the global total is exactly the sum of the surviving
    items' priorities: every lost item has priority 0, none was revived by an update that raced the loss."""
    victim = cluster.add_node()
    own = ShardServers([cluster.workers[0], victim])
    p = DistributedDataPlane(ID_SCHEMA, capacity=200, servers=own, health_period=0.2, timeout=10.0, measure=False,
                             transport="object_store", semantics=OnPolicy(num_minibatches=4, num_epochs=2, seed=5))
    q = DistributedDataPlane(ID_SCHEMA, capacity=256, servers=own, health_period=0.2, timeout=10.0, measure=False,
                             transport="object_store", semantics=Replay(PrioritizedSampler(alpha=1.0), seed=2))
    stop = threading.Event()
    errors: list[BaseException] = []
    try:
        # the on-policy buffer: the first epoch and a minibatch of the second before the death
        h_keep = p.ingest(id_batch(np.arange(0, 40)), version=0, node=cluster.workers[0])
        h_lost = p.ingest(id_batch(np.arange(100, 140)), version=0, node=victim)
        p.seal()
        epochs: dict[int, list[int]] = {}
        for _ in range(5):
            batch, info = p.deliver()
            epochs.setdefault(info.epoch, []).extend(check_payload(batch).tolist())
        assert sorted(epochs[0]) == [*range(40), *range(100, 140)] and len(epochs[1]) == 20

        # the prioritized buffer: its learner updates priorities while the victim dies
        h = torch.cat([q.ingest(id_batch(np.arange(0, 64)), node=cluster.workers[0]),
                       q.ingest(id_batch(np.arange(64, 128)), node=victim)])

        def learner() -> None:
            rng = np.random.default_rng(0)
            try:
                while not stop.is_set():
                    q.update_priorities(h, torch.from_numpy(rng.uniform(0.5, 2.0, h.shape[0])))
                    q.deliver(16)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        t = threading.Thread(target=learner)
        t.start()
        cluster.kill_node(victim)
        t0 = time.monotonic()
        while not (p.losses and q.losses):  # the on-policy learner waits for its monitor
            assert time.monotonic() - t0 < DETECTION_BOUND, "a loss was not detected within the bound"
            time.sleep(0.05)
        time.sleep(0.5)  # a few more priority updates after the loss
        stop.set()
        t.join(60)
        assert not t.is_alive() and not errors, errors

        # on-policy: exactly the victim's items reported; the second epoch goes on exactly once over the survivors
        rep = p.losses[0]
        assert rep.lost.tolist() == sorted(h_lost.tolist()) and rep.recovered == 0
        assert not set(rep.lost.tolist()) & set(h_keep.tolist())
        while True:
            batch, info = p.deliver()
            ids = check_payload(batch).tolist()
            assert info.epoch == 1 and not any(i >= 100 for i in ids), "a lost item was delivered after its report"
            epochs[1].extend(ids)
            if info.last:
                break
        second = [i for i in epochs[1] if i < 100]
        assert sorted(second) == list(range(40)), "each survivor is delivered exactly once in the second epoch"
        assert len(p) == 0
        p.set_policy_version(1)  # the next rollout goes on
        p.ingest(id_batch(np.arange(200, 210)), version=1, node=cluster.workers[0])
        p.seal()
        assert sorted(check_payload(p.read(p.live_handles())).tolist()) == list(range(200, 210))

        # prioritized: the total is exactly the survivors' priorities
        rep = q.losses[0]
        assert rep.num_lost == 64
        tree = q.semantics.sampler._tree
        live = q.live_handles()
        assert np.all(tree.get(rep.lost % q.capacity) == 0), "a lost item has a priority again"
        assert tree.total == pytest.approx(float(tree.get(live % q.capacity).sum()))
        assert q.update_priorities(h, torch.ones(h.shape[0])) == 64
        assert tree.total == pytest.approx(64.0)
        _, info = q.deliver(64)
        assert set(info.handles.tolist()) <= set(live.tolist())
    finally:
        stop.set()
        p.close()
        q.close()
        own.shutdown()


def test_real_cluster_a_checkpoint_or_health_check_after_a_node_died_and_a_node_that_comes_back(cluster):
    """One victim node holds a shard of three buffers without a monitor (one node started and killed for all
    three: each buffer finds the death on its own, by the call named below).

    A checkpoint is taken; the node dies before it is restored: the restore fences the dead shard, reports none
    of the checkpoint's items lost, and stores them all on the surviving shard; the loop goes on.

    The node dies and the next checkpoint is what finds it: the report names exactly that node's items, the
    checkpoint holds exactly the others, and it restores into the same buffer.

    As documented (``servers``): a lost shard is never used again, a node that joins adds no shard to the buffer,
    and a new buffer on servers that include the new node takes the old one's checkpoint."""
    from conduit.distributed import ClusterError

    victim = cluster.add_node()
    own = ShardServers([cluster.workers[0], victim])
    restored = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=own, health_period=None, timeout=10.0,
                                    measure=False, transport="object_store", semantics=Replay(seed=4))
    taken = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=own, health_period=None, timeout=10.0,
                                 measure=False, transport="object_store")
    p = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=own, health_period=None, timeout=10.0, measure=False,
                             transport="object_store")
    fresh = q = None
    try:
        restored.ingest(id_batch(np.arange(0, 20)), node=cluster.workers[0])
        restored.ingest(id_batch(np.arange(20, 40)), node=victim)
        state = restored.state_dict()
        taken.ingest(id_batch(np.arange(0, 20)), node=cluster.workers[0])
        h_lost = taken.ingest(id_batch(np.arange(20, 40)), node=victim)
        p.ingest(id_batch(np.arange(0, 20)), node=cluster.workers[0])
        p.ingest(id_batch(np.arange(20, 40)), node=victim)
        cluster.kill_node(victim)
        _wait_dead(victim)

        # a checkpoint taken before the death, restored after it
        restored.load_state_dict(state)
        assert len(restored.losses) == 1 and restored.losses[0].shard == 1 and restored.losses[0].num_lost == 0
        assert restored.alive_shards == [0] and len(restored) == 40
        assert sorted(check_payload(restored.read(restored.live_handles())).tolist()) == list(range(40))
        restored.ingest(id_batch(np.arange(40, 50)))
        assert sorted(check_payload(restored.read(restored.live_handles())).tolist()) == list(range(50))

        # a checkpoint taken after the death finds it
        taken_state = taken.state_dict()
        assert len(taken.losses) == 1 and taken.losses[0].lost.tolist() == h_lost.tolist()
        assert sorted(check_payload(taken.read(taken_state["handles"])).tolist()) == list(range(20))
        taken.load_state_dict(taken_state)
        assert len(taken) == 20 and sorted(check_payload(taken.read(taken.live_handles())).tolist()) == list(range(20))

        # a health check finds it; the node comes back
        (rep,) = p.check_health()
        assert rep.num_lost == 20
        back = cluster.add_node()  # the node comes back (a new node id, the same resources)
        p.ingest(id_batch(np.arange(40, 50)), node=cluster.workers[0])
        assert p.alive_shards == [0] and p.num_shards == 2  # it adds no shard to this buffer
        with pytest.raises(ClusterError, match="could not open its partition"):  # the old group has a fenced server
            DistributedDataPlane(ID_SCHEMA, capacity=64, servers=own, health_period=None, measure=False)
        fresh = ShardServers([cluster.workers[0], back])
        q = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=fresh, health_period=None, timeout=10.0,
                                 measure=False, transport="object_store")
        q.load_state_dict(p.state_dict())
        assert sorted(check_payload(q.read(q.live_handles())).tolist()) == [*range(20), *range(40, 50)]
        h = q.ingest(id_batch(np.arange(50, 60)), node=back)
        shard, _ = q.index.replicas(q.index.segments_of(h.numpy()), h.numpy())
        assert (shard[:, 0] == 1).all(), "the new node's server serves the new buffer"
    finally:
        for plane in (restored, taken, p, q):
            if plane is not None:
                plane.close()
        own.shutdown()
        if fresh is not None:
            fresh.shutdown()


def _partitions(group: ShardServers) -> list[int]:
    """How many buffer partitions each server of ``group`` holds."""
    import ray
    from conduit.distributed.server import ping

    return [int(ray.get(ping(info.actor), timeout=60)) for info in group.servers]


def test_real_cluster_the_partitions_of_a_learner_whose_node_died_are_dropped_when_another_buffer_opens(cluster):
    """A learner actor on its own node builds a buffer on shard servers this process started (shared, so they
    outlive it), then its node dies. Nothing of that learner can close its partitions any more; the next buffer
    opened on those servers (its replacement) drops them, and a buffer whose process lives keeps its own."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    victim = cluster.add_node()
    own = ShardServers([cluster.head, cluster.workers[0]])

    @ray.remote(num_cpus=0)
    class Learner:
        def start(self, group: ShardServers) -> int:
            self.plane = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=group, health_period=None,
                                              measure=False, transport="object_store")
            self.plane.ingest(id_batch(np.arange(100, 132)))
            return len(self.plane)

    kept = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=own, health_period=None, measure=False,
                                transport="object_store")
    renewed = None
    try:
        kept.ingest(id_batch(np.arange(16)))
        learner = Learner.options(scheduling_strategy=NodeAffinitySchedulingStrategy(victim, soft=False)).remote()
        assert ray.get(learner.start.remote(own), timeout=120) == 32
        assert _partitions(own) == [2, 2]
        cluster.kill_node(victim)
        _wait_dead(victim)
        # (Ray tells the servers of the learner's death some seconds after the node's: its open, or the health
        # checks of a buffer with a monitor, drop the partitions then)
        renewed = DistributedDataPlane(ID_SCHEMA, capacity=64, servers=own, health_period=0.2, measure=False,
                                       transport="object_store")
        assert eventually(lambda: _partitions(own) == [2, 2], timeout=60), \
            f"the dead learner's partitions are still held on the servers: {_partitions(own)}"
        assert sorted(check_payload(kept.read(kept.live_handles())).tolist()) == list(range(16))
        renewed.ingest(id_batch(np.arange(200, 210)))
        assert sorted(check_payload(renewed.read(renewed.live_handles())).tolist()) == list(range(200, 210))
    finally:
        kept.close()
        if renewed is not None:
            renewed.close()
        own.shutdown()


@pytest.mark.parametrize("gap_s", [0.0, 1.5])
def test_real_cluster_two_nodes_dying_one_right_after_the_other_count_each_item_once(cluster, gap_s):
    """Replication 2 on four nodes; one victim dies and the other ``gap_s`` after it, while the first one's items
    may still be copied (to or from the second). Whatever the order and timing, only items whose two copies were
    on the victims are lost, the reports name no item twice, each item is delivered or named lost, and every
    survivor ends with two copies on the surviving nodes. Both dead before either loss is found (no gap): the
    reports name lost exactly the items on both victims, and count each other item that had a copy there
    recovered exactly once."""
    va, vb = cluster.add_node(), cluster.add_node()
    own = ShardServers([cluster.head, cluster.workers[0], va, vb])
    # (the plan ranks the producer's node, then the learner's: items made on va get their copies on va and vb)
    p = DistributedDataPlane(ID_SCHEMA, capacity=400, replication=2, servers=own, measure=False, health_period=0.2,
                             timeout=10.0, transport="object_store", learner_node=vb)
    try:
        for i, node in enumerate(own.nodes):
            p.ingest(id_batch(np.arange(1000 * i, 1000 * i + 50)), node=node)
        reps = _replica_shards(p)
        on_both = {h for h, s in reps.items() if s == {2, 3}}
        on_one = {h for h, s in reps.items() if len(s & {2, 3}) == 1}
        assert on_both and on_one, "the plan put no item on both victims, or none on one of them"

        cluster.kill_node(va)
        time.sleep(gap_s)  # (about when Ray declares va dead: its items may be being copied when vb dies)
        cluster.kill_node(vb)
        _wait_for_losses(p, 2, lambda: time.sleep(0.05))
        assert sorted(r.shard for r in p.losses) == [2, 3]
        lost = np.concatenate([r.lost for r in p.losses]).tolist()
        assert len(set(lost)) == len(lost) == p.lost_items and set(lost) <= on_both
        assert sorted([*lost, *_replica_shards(p)]) == sorted(reps)
        if gap_s == 0:
            assert set(lost) == on_both, [str(r) for r in p.losses]
            assert sum(r.recovered for r in p.losses) == len(on_one), [str(r) for r in p.losses]
        survivors = sorted(_replica_shards(p))
        assert all(s == {0, 1} for s in _replica_shards(p).values()) and p.under_replicated == 0
        assert len(check_payload(p.read(survivors))) == len(survivors)
        p.deliver(32)
    finally:
        p.close()
        own.shutdown()
