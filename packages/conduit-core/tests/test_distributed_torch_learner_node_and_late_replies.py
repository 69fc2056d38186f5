"""The torch.distributed delivery transport on a real local Ray cluster (2 nodes, gloo on CPU): a learner node other
than this process's, and a server whose reply comes late or whose data thread is slow.

* The torch group delivers into this process (its rank 0), and its links are measured to this process's node. With
  ``learner_node`` on another node, ``transport="auto"`` chose the torch path per shard by comparing links to
  ``learner_node``: the shard on this process's node went over loopback TCP (priced as remote) and the shard on
  ``learner_node``, whose rows cross to this process, through the object store (priced as local);
  ``transport="torch"`` priced every shard as if the bytes went to ``learner_node``. Now ``"torch"`` is refused with
  such a ``learner_node`` (typed, before any group forms, saying what to do), and ``"auto"`` delivers through the
  object store.
* A torch delivery waited for the shard's Ray reply (the bytes it sent) after both messages had arrived: a reply
  later than the timeout turned rows in hand into a ``RemoteTimeoutError`` and retired a working group. Now rows that
  arrived whole are delivered. The group's link probes waited for their replies the same way; now they do not.
* By design (proved, unchanged): a shard whose data thread is slow (pings answer) fails the delivery with a typed
  ``RemoteTimeoutError`` within the timeout, loses nothing, retires the group, and its late send neither hangs its
  data thread nor adds or drops an item; a new torch buffer forms a new group and delivers the same bytes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit import ConfigurationError, Replay  # noqa: E402
from conduit.distributed import DistributedDataPlane, RemoteTimeoutError, ShardServers  # noqa: E402
from conduit.distributed.testing import ServerStandIn  # noqa: E402
from conduit.distributed.transport import TorchGroup  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _fill(p: DistributedDataPlane, head: str, worker: str) -> None:
    """Ids 0..9 produced on the head node (shard 0), 10..19 on the worker node (shard 1)."""
    p.ingest(id_batch(np.arange(10)), node=head)
    p.ingest(id_batch(np.arange(10, 20)), node=worker)


# -- 1. a learner node other than this process's -------------------------------------------------------------------
def test_a_learner_node_other_than_this_processs_refuses_torch_and_auto_goes_through_the_object_store(cluster):
    """One server group, fresh (nothing formed or measured on it), for both halves: ``transport="torch"`` with
    another ``learner_node`` is refused before a group forms, and ``"auto"`` with it delivers through the object
    store while a group formed for this process's node is left as it was."""
    head, worker = cluster.head, cluster.workers[0]
    group = ShardServers([head, worker])
    try:
        # torch with another learner node: refused before a group forms
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

        # auto with another learner node: through the object store (the group formed above is the one asked for)
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


# -- 2. a late reply, a slow server ------------------------------------------------------------------------------------
def _answer_late() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    def answer_late(answer: Any, seconds: float) -> Any:
        import time

        time.sleep(seconds)
        return answer

    return answer_late


class _RepliesLate(ServerStandIn):
    """The real server's ``method`` (``gather_send`` or ``probe_send``: it sends at once), whose reply reaches the
    caller ``delay`` seconds after the server returned it."""

    def __init__(self, servers: ShardServers, shard: int, delay: float, method: str = "gather_send") -> None:
        super().__init__(servers, shard)
        self._late = _answer_late()
        self._delay = delay
        self._method = method

    def __getattr__(self, name: str) -> Any:
        if name != self._method:
            return super().__getattr__(name)
        real, late, delay = getattr(self._real, name), self._late, self._delay

        class _Late:
            @staticmethod
            def remote(*args: Any) -> Any:
                return late.remote(real.remote(*args), delay)

        return _Late()


def test_rows_that_arrived_are_delivered_when_the_servers_reply_comes_late(cluster, servers):
    """(On the module's server group: the late reply is only delayed on its way back, and the test asserts the
    group's torch group is left unbroken.)"""
    head, worker = cluster.head, cluster.workers[0]
    group = servers
    with DistributedDataPlane(ID_SCHEMA, capacity=64, servers=group, transport="torch", measure=False,
                              health_period=None, timeout=10.0, semantics=Replay(seed=3)) as p:
        _fill(p, head, worker)
        late = _RepliesLate(group, 1, delay=10.0 + 3.0)  # later than the whole delivery's timeout
        try:
            b, info = p.deliver(64)
            ids = check_payload(b)
            assert sorted(set(ids.tolist())) == sorted(set(info.handles.tolist()))  # (handles are ids here)
            assert (ids >= 10).any(), "the late-replying shard's rows should be in the batch"
            assert p.transports == ["torch", "torch"], "a transfer that arrived retired the group"
            assert group.torch_group(create=False).broken is None
            assert not p.losses and len(p) == 20
        finally:
            late.restore()


def test_link_probes_whose_bytes_arrived_do_not_wait_for_the_servers_reply(cluster, servers):
    """(Failed before: ``TorchGroup.measure`` waited for each probe's Ray reply, so a reply later than the group's
    timeout raised RemoteTimeoutError and retired a group whose every probe had arrived.) On the module's server
    group: the probes' group is one of its own, torn down here, and the servers are left as they were."""
    head, worker = cluster.head, cluster.workers[0]
    group = servers
    g = TorchGroup(group, timeout=3.0, measure=False)
    late = _RepliesLate(group, 1, delay=3.0 + 2.0, method="probe_send")
    try:
        prof = g.measure(sizes=(1 << 12,), repeats=1)
        assert g.broken is None, g.broken
    finally:
        late.restore()
        g.tear_down()
    assert set(prof.links) == {(head, head), (worker, head)}
    assert all(ln.seconds(1 << 12) > 0 for ln in prof.links.values())


def _hold_data_thread(actor: Any, gate: str) -> Any:
    """Block a shard server's data calls until the file ``gate`` exists (its pings, on their own thread, answer)."""

    def wait_for_gate(_server: Any, path: str = gate) -> int:
        import os
        import time

        while not os.path.exists(path):
            time.sleep(0.02)
        return 1

    return actor.__ray_call__.remote(wait_for_gate)


def test_a_slow_server_fails_the_delivery_typed_and_its_late_send_changes_nothing(cluster, tmp_path):
    import ray

    head, worker = cluster.head, cluster.workers[0]
    group = ShardServers([head, worker])
    gate = str(tmp_path / "open")
    try:
        with DistributedDataPlane(ID_SCHEMA, capacity=64, servers=group, transport="torch", measure=False,
                                  health_period=None, timeout=2.5, semantics=Replay(seed=3)) as p:
            _fill(p, head, worker)
            g = group.torch_group(create=False)
            held = _hold_data_thread(group[1].actor, gate)
            with pytest.raises(RemoteTimeoutError, match=r"Shards \[1\] answer health checks.*within 2\.5 s"):
                p.deliver(64)
            assert not p.losses and p.alive_shards == [0, 1] and len(p) == 20
            assert g.broken and p.transports == ["object_store", "object_store"]
            with open(gate, "w"):
                pass  # the server now runs the delivery's send, long after the delivery gave up
            assert ray.get(held, timeout=60) == 1
            # its data thread is free again (the late send did not hang it), and every item reads back once
            assert ray.get(group[1].actor.__ray_call__.remote(lambda _server: os.getpid()), timeout=60) > 0
            assert sorted(check_payload(p.read(p.live_handles())).tolist()) == list(range(20))
            b, info = p.deliver(64)
            assert sorted(set(check_payload(b).tolist())) == sorted(set(info.handles.tolist()))
        # a new torch buffer forms a new group, and delivers the same bytes as the object store
        got = {}
        for transport in ("object_store", "torch"):
            with DistributedDataPlane(ID_SCHEMA, capacity=64, servers=group, transport=transport, measure=False,
                                      health_period=None, timeout=30.0, semantics=Replay(seed=9)) as p:
                _fill(p, head, worker)
                got[transport] = p.deliver(64)[0]
                assert p.transports == [transport] * 2
        assert group.torch_group(create=False) is not g
        assert all(bool((got["torch"][k] == got["object_store"][k]).all()) for k in ID_SCHEMA)
    finally:
        if not os.path.exists(gate):
            with open(gate, "w"):
                pass
        group.shutdown()
