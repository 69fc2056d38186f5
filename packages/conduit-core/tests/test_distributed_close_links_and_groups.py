"""The multi-node tier: closes beside reads and health checks, link measurements, torch groups, producer nodes.

The first tests use the in-process harness of ``test_distributed_bookkeeping`` (real shard server
bodies; a call is held at an exact point); the last ones run on the real local Ray cluster of
``conftest.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit.distributed import ClusterError, DistributedDataPlane, RemoteTimeoutError, ShardServers
from conduit.distributed.faults import LossReport
from conduit.distributed.testing import kill_server
from conduit.errors import ConfigurationError
from conduit.semantics import Replay
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import _Actor, _Ref, _servers, fake_ray  # noqa: E402, F401, I001
from test_core_regressions_checkpoints_and_locks import _SignalsCheck  # noqa: E402, I001  (OnPolicy that signals its caller-side check)

pytestmark = pytest.mark.timeout(300)


class _HeldActor(_Actor):
    """A shard server whose next ``held`` call waits until ``release`` is set (it then runs as usual: a
    server stopped meanwhile answers it as dead)."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.entered = threading.Event()
        self.release = threading.Event()

    def call(self, name: str, args: tuple[Any, ...]) -> _Ref:
        if name == self.held and not self.release.is_set():
            self.entered.set()
            self.release.wait(30)
        return super().call(name, args)


def _close_during(plane: DistributedDataPlane, actor: _HeldActor, work: Any) -> tuple[dict[str, Any], bool]:
    """Run ``work()`` on a thread, close ``plane`` while its remote call is held, then let the call go on.

    Returns what ``work`` returned or raised, and whether close() was still waiting when the call went on.
    """
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            out["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    assert actor.entered.wait(10), "the call never reached the shard"
    closer = threading.Thread(target=plane.close)
    closer.start()
    closer.join(0.5)  # (a close that does not wait for the call under way has stopped the shards by now)
    waited = closer.is_alive()
    actor.release.set()
    worker.join(30)
    closer.join(30)
    assert not worker.is_alive() and not closer.is_alive()
    return out, waited


@pytest.mark.parametrize("call", ["deliver", "ingest"])
def test_closing_while_another_thread_reads_or_writes_reports_no_loss(fake_ray, call):  # noqa: F811
    """A learner thread is part way through a delivery (or a producer through an ingestion) when the main
    thread closes the buffer. close() stopped the servers under the call (it took no lock): the call's
    remote read failed, the buffer declared its own shards lost, recorded loss reports for items nobody
    lost and called on_loss with them (an alert for a loss that never happened). close() must let the
    call under way finish first; every call after it is refused as closed."""
    group = _servers(["a", "b"])
    held = _HeldActor("gather" if call == "deliver" else "append")
    group.servers[1] = type(group.servers[1])(held, "b", 0)
    reports: list[LossReport] = []
    plane = DistributedDataPlane(ID_SCHEMA, capacity=32, servers=group, learner_node="a", measure=False,
                                 health_period=None, transport="object_store", on_loss=reports.append,
                                 semantics=Replay(seed=0))
    plane._owns_servers = True  # as a buffer that started its servers: close() stops them
    if call == "deliver":
        held.release.set()
        plane.ingest(id_batch(np.arange(8)), node="b")
        held.release.clear()
        out, waited = _close_during(plane, held, lambda: plane.deliver(16))
    else:
        out, waited = _close_during(plane, held, lambda: plane.ingest(id_batch(np.arange(8)), node="b"))
    assert not plane.losses and not reports, f"close() made the buffer report a loss: {plane.losses}"
    assert waited, "close() did not wait for the call under way"
    assert "error" not in out, f"the call under way failed: {out.get('error')!r}"
    if call == "deliver":
        assert set(check_payload(out["value"][0]).tolist()) <= set(range(8))
    else:
        assert out["value"].tolist() == list(range(8))
    assert plane.closed
    with pytest.raises(ConfigurationError, match="closed"):
        plane.deliver(4)


def test_a_health_check_that_meets_a_close_reports_no_loss(fake_ray):  # noqa: F811
    """check_health() from a user thread pings the shards; close() on another thread stops them while the
    ping is on its way. The failed ping made the closed buffer report its own shards lost."""
    group = _servers(["a", "b"])
    held = _HeldActor("ping")
    group.servers[1] = type(group.servers[1])(held, "b", 0)
    reports: list[LossReport] = []
    plane = DistributedDataPlane(ID_SCHEMA, capacity=32, servers=group, learner_node="a", measure=False,
                                 health_period=None, transport="object_store", on_loss=reports.append)
    plane._owns_servers = True
    plane.ingest(id_batch(np.arange(8)), node="b")
    out, _ = _close_during(plane, held, plane.check_health)
    assert "error" not in out, repr(out.get("error"))
    assert out["value"] == [] and not plane.losses and not reports, f"a closed buffer reported {plane.losses}"


# -- on the real local cluster -------------------------------------------------------------------------
def test_real_cluster_closing_while_a_learner_thread_delivers_reports_no_loss(cluster):
    """A learner thread delivers in a loop while the main thread closes the buffer (which started its own
    servers). The loss-free buffer must record no loss report: the delivery under way ends first, the next
    one is refused as closed."""
    reports: list[LossReport] = []
    plane = DistributedDataPlane(ID_SCHEMA, capacity=4096, servers=[cluster.head, cluster.workers[0]],
                                 measure=False, health_period=None, timeout=30.0, transport="object_store",
                                 on_loss=reports.append, semantics=Replay(seed=1))
    plane.ingest(id_batch(np.arange(2048)), node=cluster.head)
    plane.ingest(id_batch(np.arange(2048, 4096)), node=cluster.workers[0])
    got: dict[str, Any] = {"batches": 0}
    started = threading.Event()

    def learner() -> None:
        try:
            while True:
                b, _ = plane.deliver(2048)
                assert set(check_payload(b).tolist()) <= set(range(4096))
                got["batches"] += 1
                started.set()
        except BaseException as e:  # noqa: BLE001 - the loop ends with the refusal after close()
            got["error"] = e
            started.set()

    th = threading.Thread(target=learner)
    th.start()
    assert started.wait(60)
    for _ in range(3):  # let a few more deliveries go out, then close in the middle of one
        n = got["batches"]
        while got["batches"] == n and "error" not in got:
            time.sleep(0.001)
    plane.close()
    th.join(60)
    assert not th.is_alive()
    assert not plane.losses and not reports, f"closing made the buffer report losses: {plane.losses}"
    assert isinstance(got.get("error"), ConfigurationError) and "closed" in str(got["error"]), repr(got.get("error"))


def test_real_cluster_measuring_links_to_a_dead_server_is_a_typed_error(cluster):
    """A server of a shared group dies before the first buffer on the group measures the links: the buffer
    raised Ray's own ActorDiedError out of the link probe, not a ConduitError saying what to do."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        kill_server(group[1].actor)  # (returns once Ray reports it dead: ray.kill only asks for the kill)
        with pytest.raises(ClusterError, match="ShardServers") as e:
            DistributedDataPlane(ID_SCHEMA, capacity=10, servers=group, measure=True, health_period=None,
                                 timeout=10.0)
        assert group[1].node_id[:8] in str(e.value)
    finally:
        group.shutdown()


def test_real_cluster_forming_a_torch_group_with_a_dead_server_names_that_server(cluster):
    """A server of a group dies before its torch.distributed group is formed. The refusal named the first
    server whose join failed: a live one, whose join had only timed out waiting for the dead one, with the advice
    to check that the nodes reach each other over TCP. It names the dead server and says to start the servers
    again."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        kill_server(group[1].actor)  # (returns once Ray reports it dead: ray.kill only asks for the kill)
        with pytest.raises(ClusterError, match=r"Shard server 1 .* is gone.*alive_nodes") as e:
            group.torch_group(timeout=3.0)
        assert group[1].node_id[:8] in str(e.value) and "over TCP" not in str(e.value)
        assert group.torch_group(create=False) is None
    finally:
        group.shutdown()


def test_real_cluster_measuring_torch_links_to_a_dead_server_names_that_server(cluster):
    """A server dies after its torch.distributed group formed; measuring the group's links raised
    RemoteTimeoutError "the cluster is overloaded or a node is unreachable" (the object-store measurement names
    the dead server): the user looked for load instead of a dead node. It is a ClusterError naming the server and
    its node, and the group is retired (a failed transfer over it)."""
    from conduit.distributed.transport import TorchGroup

    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        g = TorchGroup(group, timeout=20.0, measure=False)
        kill_server(group[1].actor)  # (returns once Ray reports it dead: ray.kill only asks for the kill)
        with pytest.raises(ClusterError, match=r"Shard server 1 .* is gone.*alive_nodes") as e:
            g.measure()
        assert group[1].node_id[:8] in str(e.value) and "overloaded" not in str(e.value)
        assert g.broken is not None, "a failed probe retires the group, as a failed delivery does"
        g.close()
    finally:
        group.shutdown()


def test_real_cluster_measuring_links_to_a_hung_server_is_bounded_by_the_buffers_timeout(cluster):
    """A server stops answering (SIGSTOP) before the first buffer on its group measures the links; the
    buffer's timeout is 3 s, but each link probe waited the measurement's own 60 s default before the
    RemoteTimeoutError: ``timeout`` did not bound every remote call the buffer makes."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    pid = group[1].pid
    try:
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(RemoteTimeoutError) as e:
            DistributedDataPlane(ID_SCHEMA, capacity=10, servers=group, measure=True, health_period=None,
                                 timeout=3.0)
        assert "within 3 s" in str(e.value), str(e.value)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        group.shutdown()


def test_real_cluster_a_torch_buffer_on_servers_whose_group_was_retired_forms_a_new_one(cluster):
    """One buffer's torch.distributed group was retired (closed, or broken by a failed transfer); a new
    buffer built with ``transport="torch"`` on the same servers took the retired group and silently
    delivered through the object store (``transports`` said so, nothing else did)."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        with DistributedDataPlane(ID_SCHEMA, capacity=64, servers=group, measure=False, health_period=None,
                                  transport="torch", timeout=30.0) as first:
            assert first.transports == ["torch", "torch"]
            old = group.torch_group()
            old.close()  # retired: this buffer goes on through the object store
            first.ingest(id_batch(np.arange(8)))
            assert first.transports == ["object_store", "object_store"]
            assert sorted(check_payload(first.read(first.live_handles())).tolist()) == list(range(8))
        with DistributedDataPlane(ID_SCHEMA, capacity=64, servers=group, measure=False, health_period=None,
                                  transport="torch", timeout=30.0, semantics=Replay(seed=3)) as p:
            assert p.transports == ["torch", "torch"], "transport='torch' took the retired group"
            p.ingest(id_batch(np.arange(16)), node=cluster.head)
            p.ingest(id_batch(np.arange(16, 32)), node=cluster.workers[0])
            b, _ = p.deliver(64)
            assert set(check_payload(b).tolist()) <= set(range(32))
            assert p.transports == ["torch", "torch"] and group.torch_group() is not old
    finally:
        group.shutdown()


@pytest.mark.parametrize("overlapped", [False, True])
def test_real_cluster_a_producer_node_that_is_no_node_of_the_cluster_is_refused_typed(cluster, servers, overlapped):
    """``ingest(..., node=...)`` names the producer's node, which routes the batch to that node's shard. A
    value that is no node id of the cluster (a host name, an address, a shortened id, a number) was taken
    silently: the batch was routed as if produced on some unknown far node, with no word to the user.
    (On the module's shared servers: the buffer has a partition of its own on them, so it starts empty.)"""
    from conduit.scheduling import Overlapped

    assert servers.nodes == [cluster.head, cluster.workers[0]]  # shard 1 is the worker's
    with DistributedDataPlane(ID_SCHEMA, capacity=16, servers=servers, measure=False, health_period=None,
                              transport="object_store",
                              scheduler=Overlapped(g_ing=1, g_del=1) if overlapped else None) as p:
        for bad in ("worker-1", "127.0.0.1", cluster.workers[0][:8], 3, ""):
            with pytest.raises(ConfigurationError, match="node"):
                p.ingest(id_batch(np.arange(4)), node=bad)  # type: ignore[arg-type]
        p.flush()
        assert len(p) == 0 and p.index.next_handle == 0, "a refused ingestion stored items"
        p.ingest(id_batch(np.arange(4)), node=cluster.workers[0])
        p.flush()
        h = p.live_handles()
        rows = p.index.segments_of(h)
        shard, _ = p.index.replicas(rows, h)
        assert shard[:, 0].tolist() == [1, 1, 1, 1], "the worker's batch did not go to the worker's shard"
        assert sorted(check_payload(p.read(h)).tolist()) == [0, 1, 2, 3]


def test_an_older_version_checked_before_a_newer_one_was_stored_is_refused_on_shards(fake_ray):  # noqa: F811
    """Two producers of an on-policy sharded buffer: version 3 passes ingest()'s order check (before the lock),
    then version 5 is stored first. The write of 3 must be refused under the lock (versions never go backwards),
    nothing of it stored, and the rollout of 5 delivered whole."""
    sem = _SignalsCheck(3, num_minibatches=1)
    plane = DistributedDataPlane(ID_SCHEMA, capacity=32, servers=_servers(["a", "b"]), learner_node="a",
                                 measure=False, health_period=None, transport="object_store", semantics=sem)
    errors: list[BaseException] = []

    def old_producer() -> None:
        try:
            plane.ingest(id_batch(np.arange(4)), version=3)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    older = threading.Thread(target=old_producer, daemon=True)

    def newer_stored_first() -> None:  # holds the buffer's lock: the old producer's write waits for it
        older.start()
        assert sem.passed.wait(30), "the old producer never passed its checks"
        plane.ingest(id_batch(np.arange(10, 16)), version=5)

    plane.read_locked(newer_stored_first)
    older.join(30)
    assert not older.is_alive(), "the old producer's ingest did not return"
    assert len(errors) == 1 and isinstance(errors[0], ConfigurationError), errors
    assert "backwards" in str(errors[0])
    assert len(plane) == 6, f"the refused write stored items: {len(plane)} held"
    plane.seal()
    batch, info = plane.deliver()
    assert info.version == 5
    check_payload(batch)
    assert sorted(batch.tensor("id").tolist()) == list(range(10, 16))
    plane.close()


def test_real_cluster_a_shut_down_group_refuses_new_work_at_once(cluster):
    """After ``ShardServers.shutdown()`` the closed torch group stayed attached: ``torch_group()`` handed it out,
    and a new ``transport="torch"`` buffer renewed it, waiting out its whole timeout for servers that were gone
    before a ClusterError. A shut-down group now refuses new groups, link measurements and buffers at once, and
    shutting it down again is harmless."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        formed = group.torch_group(timeout=60.0)
    finally:
        group.shutdown()
    assert group.closed and formed.broken is not None  # (the group it had formed was closed with it)
    for call in (lambda: group.torch_group(timeout=60.0), lambda: group.torch_group(create=False),
                 lambda: group.links(), lambda: DistributedDataPlane(ID_SCHEMA, capacity=10, servers=group,
                                                                      transport="torch", health_period=None,
                                                                      timeout=60.0)):
        with pytest.raises(ClusterError, match="shut down; start new ones"):
            call()
    group.shutdown()
