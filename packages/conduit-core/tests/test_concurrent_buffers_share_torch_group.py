"""Buffers built at once on shared shard servers share one torch group, on a real local Ray cluster.

* Two buffers built at once (two threads) on one shared ``ShardServers`` group with ``transport="torch"`` each
  formed a torch.distributed group: the servers run data calls one at a time, so when server 0 got the first
  group's join before the second's and server 1 the other way round, each server waited in one rendezvous for a
  peer stuck in the other, until both formations timed out (both buffers failed with ``ClusterError`` after
  ``timeout``). ``ShardServers.torch_group`` now forms one group at a time; the second caller gets the first's.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.distributed.testing import ServerStandIn  # noqa: E402
from conduit.testing.lifecycle import start_bounded  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class _JoinsCrossed(ServerStandIn):
    """Stands in for a server's actor handle: the first ``join_group`` sent through it is held back until a second
    one was sent (at most ``hold`` seconds), so this server gets the joins in the other order than a server whose
    handle sends them as they come. Every other call goes to the real actor."""

    def __init__(self, servers: ShardServers, shard: int, hold: float) -> None:
        super().__init__(servers, shard)
        self._hold = hold
        self._mu = threading.Lock()
        self._sent = 0
        self.first_waiting = threading.Event()
        self._second_sent = threading.Event()

    @property
    def join_group(self) -> Any:
        proxy = self

        class _Join:
            @staticmethod
            def remote(*args: Any) -> Any:
                with proxy._mu:
                    proxy._sent += 1
                    nth = proxy._sent
                if nth == 1:
                    proxy.first_waiting.set()
                    proxy._second_sent.wait(proxy._hold)
                ref = proxy._real.join_group.remote(*args)
                if nth == 2:
                    proxy._second_sent.set()
                return ref

        return _Join()


def test_two_buffers_built_at_once_on_shared_servers_share_one_torch_group(cluster: Any) -> None:
    """Buffer A's group join reaches server 0 first; server 1's is held back until buffer B's joins were sent, so
    server 1 gets B's first (the order two threads' sends can take). Both buffers must be built (not time out in
    crossed rendezvous), over one group, and deliver what they stored."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    crossed = _JoinsCrossed(servers, 1, hold=5.0)
    results: dict[str, Any] = {}

    def build(name: str) -> None:
        try:
            results[name] = DistributedDataPlane(ID_SCHEMA, capacity=40, servers=servers, measure=False,
                                                 health_period=None, timeout=10.0, transport="torch")
        except BaseException as e:  # noqa: BLE001 - reported by the assertions below
            results[name] = e

    planes: list[DistributedDataPlane] = []
    try:
        a, _ = start_bounded(build, "a", name="build-a")
        assert crossed.first_waiting.wait(60), "buffer A never sent its group join to server 1"
        b, _ = start_bounded(build, "b", name="build-b")
        a.join(120)
        b.join(120)
        assert not a.is_alive() and not b.is_alive(), "building the buffers hung"
        crossed.restore()
        planes = [p for p in results.values() if isinstance(p, DistributedDataPlane)]
        errors = {k: v for k, v in results.items() if not isinstance(v, DistributedDataPlane)}
        assert not errors, f"a buffer built at the same time as another failed: {errors!r}"
        pa, pb = results["a"], results["b"]
        assert pa._torch is pb._torch is servers.torch_group(create=False), "two groups were formed"
        assert pa._torch.broken is None
        for i, p in enumerate((pa, pb)):
            ids = np.arange(10 * i, 10 * i + 10)
            h = p.ingest(id_batch(ids))
            assert p.transports == ["torch", "torch"]
            assert sorted(check_payload(p.read(h)).tolist()) == ids.tolist()
            batch, _ = p.deliver(8)
            assert set(check_payload(batch).tolist()) <= set(ids.tolist())
        # the group is this process's: a pickled copy (e.g. into a learner actor) forms its own
        copy = pickle.loads(pickle.dumps(servers))
        assert copy.torch_group(create=False) is None and len(copy) == 2
    finally:
        crossed.restore()
        for p in planes:
            p.close()
        servers.shutdown()
