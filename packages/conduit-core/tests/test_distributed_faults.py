"""Shard faults on a real local Ray cluster: a node dies (or hangs) in the middle of a run.

The module's cluster (the tests' shared 2-node ``cluster``, see conftest.py) has a head node and one stable
worker; each test adds its own victim node, places a shard server there, and kills it. Ray is
configured to declare a dead node within ~1.5 s (``FAST_FAILURE_DETECTION``); Conduit's
health monitor pings every 0.2 s, so losses are found within a few seconds, and the
bound asserted below (``DETECTION_BOUND``) is generous for a loaded 2-core machine.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import OnPolicy, Replay  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers, TransferError, stage  # noqa: E402
from conduit.testing.lifecycle import eventually  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

#: seconds within which a killed node's shard must be reported lost (health_period + timeout + Ray's detection)
DETECTION_BOUND = 30.0


def _ids_of(plane, handles) -> set[int]:
    return set(check_payload(plane.read(handles)).tolist()) if len(handles) else set()


def _shard_of(plane, handles) -> np.ndarray:
    h = np.asarray(handles)
    shard, _ = plane.index.replicas(plane.index.segments_of(h), h)
    return shard


def _wait_for_loss(plane, t0: float, work) -> float:
    """Keep the training loop going (``work()``) until a loss is reported; returns seconds since ``t0``."""
    while not plane.losses:
        assert time.monotonic() - t0 < DETECTION_BOUND, "the loss was not detected within the bound"
        work()
    return time.monotonic() - t0


def test_a_killed_node_is_found_by_every_buffer_with_a_shard_there(cluster):
    """One victim node, killed once as a crash, holds a shard of three buffers, each with its own health monitor
    (one node started and killed for the three: each buffer finds the loss on its own, within the bound):

    * replication 1, producers on both nodes and the learner sampling: the loss reaches ``on_loss``, the report
      names exactly the items the dead shard held, and the loop goes on on the survivor (nothing lost is delivered,
      no survivor is missing, new items go to the live shard);
    * replication 2 over three nodes: every item is recovered and again has two copies, on the two surviving nodes;
    * on-policy, mid rollout: the 40 victim items (none consumed yet) are reported lost, and the rest of the
      rollout delivers each survivor exactly once per epoch."""
    victim = cluster.add_node()
    servers = ShardServers([cluster.workers[0], victim])  # replication 1 and on-policy: shard 1 on the victim
    servers3 = ShardServers([cluster.head, cluster.workers[0], victim])  # replication 2: shard 2 on the victim
    reports = []
    plane = DistributedDataPlane(ID_SCHEMA, capacity=5000, servers=servers, semantics=Replay(seed=1),
                                 health_period=0.2, timeout=10.0, measure=False, on_loss=reports.append)
    replicated = DistributedDataPlane(ID_SCHEMA, capacity=3000, servers=servers3, replication=2, health_period=0.2,
                                      timeout=10.0, measure=False)
    on_policy = DistributedDataPlane(ID_SCHEMA, capacity=1000, servers=servers, health_period=0.2, timeout=10.0,
                                     measure=False, semantics=OnPolicy(num_minibatches=4, num_epochs=2, seed=3))
    try:
        # replication 1: the run, producers on both nodes, the learner sampling
        id_of_handle: dict[int, int] = {}
        nxt = 0
        for _ in range(5):
            for node in (cluster.workers[0], victim):
                ids = np.arange(nxt, nxt + 100)
                nxt += 100
                h = plane.ingest(id_batch(ids), node=node)
                id_of_handle.update(zip(h.tolist(), ids.tolist(), strict=True))
            plane.deliver(64)
        on_victim = {id_of_handle[h] for h in plane.live_handles().tolist()
                     if _shard_of(plane, [h])[0, 0] == 1}
        assert len(on_victim) == 500

        # replication 2
        for i, node in enumerate(servers3.nodes):
            replicated.ingest(id_batch(np.arange(1000 * i, 1000 * i + 300)), node=node)
        shard = _shard_of(replicated, replicated.live_handles())
        assert (shard >= 0).all() and (shard[:, 0] != shard[:, 1]).all()
        had_copy_on_victim = int((shard == 2).any(axis=1).sum())
        assert had_copy_on_victim > 0
        all_ids = set(check_payload(replicated.read(replicated.live_handles())).tolist())

        # on-policy: the first minibatch of the rollout before the death
        on_policy.ingest(id_batch(np.arange(0, 40)), version=0, node=cluster.workers[0])
        on_policy.ingest(id_batch(np.arange(100, 140)), version=0, node=victim)
        on_policy.seal()
        first, info = on_policy.deliver()
        before = check_payload(first)
        assert info.epoch == 0 and info.minibatch == 0

        t0 = time.monotonic()
        cluster.kill_node(victim)
        delivered_after: list[np.ndarray] = []

        def step() -> None:
            delivered_after.append(check_payload(plane.deliver(64)[0]))
            ids = np.arange(nxt + 10_000 + 10 * len(delivered_after), nxt + 10_000 + 10 * len(delivered_after) + 10)
            plane.ingest(id_batch(ids), node=cluster.workers[0])  # the surviving producer keeps producing

        detected = _wait_for_loss(plane, t0, step)
        assert detected < DETECTION_BOUND
        _wait_for_loss(replicated, t0, lambda: replicated.deliver(32))
        while not on_policy.losses:  # the on-policy learner waits for the monitor before its next step
            assert time.monotonic() - t0 < DETECTION_BOUND
            time.sleep(0.05)

        # replication 1
        rep = plane.losses[0]
        # (a loss the health monitor found is in .losses before the monitor thread has called on_loss)
        assert eventually(lambda: len(reports) > 0, timeout=60), "on_loss was not called with the loss"
        assert reports == [rep]
        assert rep.shard == 1 and rep.node_id == victim and rep.recovered == 0
        lost_ids = {id_of_handle[h] for h in rep.lost.tolist()}
        assert lost_ids == on_victim, "the report must name exactly the items the dead shard held"
        assert plane.lost_items == 500 and plane.alive_shards == [0]
        # the loop continues on the survivors: nothing lost is delivered, nothing survivor is missing
        survivors = set(check_payload(plane.read(plane.live_handles())).tolist())
        assert survivors.isdisjoint(on_victim) and len(plane) == len(survivors)
        assert set(range(nxt)) - on_victim <= survivors
        for _ in range(20):
            got = set(check_payload(plane.deliver(500)[0]).tolist())
            assert got <= survivors
        h = plane.ingest(id_batch(np.arange(90_000, 90_010)))
        assert (_shard_of(plane, h)[:, 0] == 0).all()

        # replication 2
        rep = replicated.losses[0]
        assert rep.shard == 2 and rep.num_lost == 0 and replicated.lost_items == 0
        assert rep.recovered == had_copy_on_victim and rep.re_replicated == had_copy_on_victim
        assert set(check_payload(replicated.read(replicated.live_handles())).tolist()) == all_ids
        assert len(replicated) == 900
        shard = _shard_of(replicated, replicated.live_handles())
        assert (shard >= 0).all() and not (shard == 2).any() and (shard[:, 0] != shard[:, 1]).all(), \
            "every item should again have two copies, on the two surviving nodes"
        for _ in range(10):
            assert set(check_payload(replicated.deliver(300)[0]).tolist()) <= all_ids

        # on-policy
        rep = on_policy.losses[0]
        assert sorted(rep.lost.tolist()) == list(range(40, 80)), "all 40 victim items were live (not yet consumed)"
        epochs: dict[int, list[int]] = {0: before.tolist()}
        while True:
            batch, info = on_policy.deliver()
            ids = check_payload(batch)
            assert not (ids >= 100).any(), "a lost item was delivered after its loss was reported"
            assert info.handles.shape[0] == ids.shape[0]
            epochs.setdefault(info.epoch, []).extend(ids.tolist())
            if info.last:
                break
        alive = list(range(40))
        assert sorted(i for i in epochs[0] if i < 100) == alive
        assert sorted(epochs[1]) == alive
        assert len(on_policy) == 0
    finally:
        plane.close()
        replicated.close()
        on_policy.close()
        servers.shutdown()
        servers3.shutdown()


def test_hung_shard_times_out_is_fenced_and_nothing_hangs(cluster):
    """A shard that stops answering (SIGSTOP) is lost after ``timeout``; the delivery returns meanwhile."""
    servers = ShardServers([cluster.workers[0], cluster.workers[0]])
    hung_pid = servers[1].pid
    plane = DistributedDataPlane(ID_SCHEMA, capacity=200, shard_capacity=100, servers=servers, health_period=None,
                                 measure=False, timeout=3.0, semantics=Replay(seed=2))
    try:
        h = plane.ingest(id_batch(np.arange(200)))
        shard = _shard_of(plane, h)[:, 0]
        assert (shard == 0).sum() == 100 and (shard == 1).sum() == 100
        on_hung = set(np.arange(200)[shard == 1].tolist())
        os.kill(hung_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        batch, _ = plane.deliver(400)
        took = time.monotonic() - t0
        assert took < 3 * plane.timeout + 10, f"a delivery hung for {took:.1f} s"
        assert set(check_payload(batch).tolist()).isdisjoint(on_hung)
        rep = plane.losses[0]
        assert rep.shard == 1 and "no answer" in rep.reason
        assert set(rep.lost.tolist()) == on_hung
    finally:
        try:
            os.kill(hung_pid, signal.SIGKILL)  # the stopped server process this test started
        except ProcessLookupError:
            pass
        plane.close()
        servers.shutdown()


def test_experience_staged_on_a_dead_node_is_a_typed_error_not_a_hang(cluster, servers):
    """The producer's node dies, not a server's: the module's shared servers serve it (no fresh ones needed)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    victim = cluster.add_node()

    @ray.remote(num_cpus=0)
    class Producer:
        def produce(self, ids):
            return stage(id_batch(ids), ID_SCHEMA)

    producer = Producer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(victim, soft=False)).remote()
    ref = ray.get(producer.produce.remote(np.arange(50)), timeout=120)
    plane = DistributedDataPlane(ID_SCHEMA, capacity=100, servers=servers, health_period=None, timeout=5.0,
                                 measure=False)
    try:
        cluster.kill_node(victim)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            plane.ingest(ref)
        assert time.monotonic() - t0 < 3 * plane.timeout + 10
        assert len(plane) == 0 and not plane.losses, "the shard is fine: only the producer's data is gone"
        plane.ingest(id_batch(np.arange(10)))
        assert sorted(check_payload(plane.deliver(100)[0]).tolist()) != [] and len(plane) == 10
        assert torch.equal(plane.read(plane.live_handles())["id"], torch.arange(10))
    finally:
        plane.close()


def _hold_data_thread(actor, gate: str):
    """Block a shard server's data calls (its default thread) until the file ``gate`` exists; pings still answer."""

    def wait_for_gate(_server, path=gate):
        import os
        import time

        while not os.path.exists(path):
            time.sleep(0.02)
        return 1

    return actor.__ray_call__.remote(wait_for_gate)


def test_a_shard_whose_data_calls_hang_gives_typed_errors_naming_the_timeout_and_changes_nothing(
        cluster, servers, tmp_path):
    """A shard's data thread hangs (its pings answer): a delivery raises RemoteTimeoutError and an ingestion
    TransferError, each after the timeout, and their messages name it as set: 2.5 s read "within 2 s" (rounded,
    sub-second timeouts read "0 s"). Each refused call is recorded as the caller's wait, with no items. Nothing is
    lost, and once the hang ends every item reads back. (The hang ends and nothing is fenced: the module's shared
    servers serve it.)"""
    import ray
    from conduit.distributed import RemoteTimeoutError

    plane = DistributedDataPlane(ID_SCHEMA, capacity=100, servers=servers, health_period=None, timeout=2.5,
                                 measure=False, semantics=Replay(seed=4))
    gate = tmp_path / "open"
    try:
        plane.ingest(id_batch(np.arange(20)), node=cluster.head)
        plane.ingest(id_batch(np.arange(20, 40)), node=cluster.workers[0])
        assert (_shard_of(plane, plane.live_handles())[:, 0] == 1).sum() == 20
        held = _hold_data_thread(servers[1].actor, str(gate))
        with pytest.raises(RemoteTimeoutError, match=r"within 2\.5 s"):
            plane.deliver(100)
        with pytest.raises(TransferError, match=r"within 2\.5 s"):
            plane.ingest(id_batch(np.arange(40, 50)), node=cluster.workers[0])
        assert not plane.losses and len(plane) == 40 and plane.alive_shards == [0, 1]
        # the caller waited the timeout in each refused call: its time is recorded, with no items
        waits = [(r.kind, r.items, r.end - r.start) for r in plane.telemetry.records if r.kind.endswith("_wait")]
        assert [(k, i) for k, i, _ in waits[-2:]] == [("deliver_wait", 0), ("ingest_wait", 0)], waits
        assert all(d >= 2.0 for _, _, d in waits[-2:]), waits  # (each waited out the timeout)
        gate.touch()
        assert ray.get(held, timeout=120) == 1
        assert _ids_of(plane, plane.live_handles()) == set(range(40))
        assert set(check_payload(plane.deliver(200)[0]).tolist()) == set(range(40))
    finally:
        gate.touch()
        plane.close()


def test_a_shard_whose_data_thread_stays_stuck_is_fenced_and_the_loop_goes_on(cluster, tmp_path):
    """A shard answers pings but its data thread never finishes a call: every call touching it would fail after the
    timeout for as long as the hang lasts. The health monitor fences it once its no-op on the data thread has waited
    ``stuck_after``: its items are reported lost exactly (replication 1) or recovered (2), and deliveries and
    ingestion go on without it. (The two buffers, one per replication, run side by side on server groups of their
    own: each fences its own stuck server, so both wait out ``stuck_after`` once.)"""
    import ray

    groups: list[ShardServers] = []
    cases: list[tuple[int, ShardServers, DistributedDataPlane]] = []
    gate = tmp_path / "open"
    try:
        for replication in (1, 2):
            servers = ShardServers([cluster.head, cluster.workers[0]])
            groups.append(servers)
            plane = DistributedDataPlane(ID_SCHEMA, capacity=100, servers=servers, replication=replication,
                                         health_period=0.2, timeout=2.0, stuck_after=3.0, measure=False,
                                         semantics=Replay(seed=5))
            cases.append((replication, servers, plane))
            assert plane.stuck_after == 3.0
            plane.ingest(id_batch(np.arange(20)), node=cluster.head)
            plane.ingest(id_batch(np.arange(20, 40)), node=cluster.workers[0])
        on_one, held = {}, {}
        for replication, _, plane in cases:
            shard = _shard_of(plane, plane.live_handles())
            on_one[replication] = {i for i, row in zip(range(40), shard, strict=True) if 1 in row.tolist()}
            assert on_one[replication] and not plane.losses
        t0 = time.monotonic()
        for replication, servers, _ in cases:
            held[replication] = _hold_data_thread(servers[1].actor, str(gate))
        for replication, _, plane in cases:
            while not plane.losses:
                assert time.monotonic() - t0 < DETECTION_BOUND, "the stuck shard was not fenced within the bound"
                time.sleep(0.05)
            rep = plane.losses[0]
            assert rep.shard == 1 and "data thread" in rep.reason and "stuck_after=3 s" in rep.reason, rep.reason
            assert time.monotonic() - t0 >= 3.0, "fenced before its probe had waited stuck_after"
            assert plane.alive_shards == [0]
            if replication == 1:
                assert rep.num_lost == len(on_one[1]) == 20 and rep.recovered == 0
                survivors = set(range(40)) - on_one[1]
            else:
                assert rep.num_lost == 0 and rep.recovered == len(on_one[2]) == 40
                survivors = set(range(40))
            assert _ids_of(plane, plane.live_handles()) == survivors
            # the loop goes on, on the live shard only
            assert set(check_payload(plane.deliver(1000)[0]).tolist()) == survivors
            h = plane.ingest(id_batch(np.arange(100, 110)))
            assert (_shard_of(plane, h)[:, 0] == 0).all()
            with pytest.raises(Exception):  # noqa: B017,PT011 - the fenced server was killed (any of Ray's errors)
                ray.get(held[replication], timeout=60)
    finally:
        gate.touch()
        for _, _, plane in cases:
            plane.close()
        for servers in groups:
            servers.shutdown()


def test_a_data_thread_busy_for_less_than_stuck_after_is_not_fenced(cluster, servers, tmp_path):
    """A data call that runs long but ends before ``stuck_after`` loses nothing: the probe waits behind it, answers,
    and the next checks send new ones. (Nothing is fenced: the module's shared servers serve it.)"""
    import ray

    plane = DistributedDataPlane(ID_SCHEMA, capacity=100, servers=servers, health_period=0.2, timeout=2.0,
                                 stuck_after=60.0, measure=False, semantics=Replay(seed=6))
    gate = tmp_path / "open"
    try:
        plane.ingest(id_batch(np.arange(20)), node=cluster.head)
        plane.ingest(id_batch(np.arange(20, 40)), node=cluster.workers[0])
        held = _hold_data_thread(servers[1].actor, str(gate))
        time.sleep(3.0)  # longer than timeout + several health periods: only stuck_after may fence it
        assert not plane.losses
        gate.touch()
        assert ray.get(held, timeout=60) == 1
        sent = plane._ticks[1][1]
        assert eventually(lambda: plane._ticks.get(1, (None, sent))[1] > sent, timeout=60), \
            "the monitor sent no new probe once the data thread answered"
        assert not plane.losses and plane.alive_shards == [0, 1]
        assert set(check_payload(plane.deliver(1000)[0]).tolist()) == set(range(40))
    finally:
        gate.touch()
        plane.close()


def test_stuck_after_must_be_a_positive_number_of_seconds(cluster):
    from conduit import ConfigurationError

    for bad in (0, -1.0, float("nan"), "10", True):
        with pytest.raises(ConfigurationError, match="stuck_after must be a finite number of seconds"):
            DistributedDataPlane(ID_SCHEMA, capacity=10, servers=[cluster.head], stuck_after=bad, measure=False)
