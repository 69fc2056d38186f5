"""Multi-node losses found around ``close()`` and a retired torch group replaced once, on a real local Ray cluster.

* A health check that had pinged the shards and passed ``check_health``'s "closed?" check before ``close()`` ran
  still declared a dead shard lost afterwards: the loss was recorded and ``on_loss`` called on a closed buffer (on
  the monitor thread while ``close()`` joined it, or on a thread calling ``check_health`` after ``close()`` had
  returned). ``_lose`` now checks ``closed`` under the buffer's lock, which ``close()`` sets it under, so a check
  that is still under way when ``close()`` runs reports nothing; and ``close()`` waits for an ``on_loss``
  callback that is running on another thread (a loss recorded before it), so none runs once it returned.
* Two buffers built at once with ``transport="torch"`` on servers whose group was retired both found it retired
  and each formed a new one: the second formation tore down the first's group, so the first buffer (built a moment
  ago to use torch) silently delivered through the object store. ``ShardServers.torch_group(replace_broken=True)``
  decides under the group lock: the first caller forms the new group, the others get it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit.distributed import DistributedDataPlane, LossReport, ShardServers  # noqa: E402
from conduit.distributed.testing import kill_server  # noqa: E402
from conduit.testing.lifecycle import wait_until  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)



def _gate_lose(plane: DistributedDataPlane) -> tuple[threading.Event, threading.Event]:
    """Hold every ``_lose`` of ``plane`` at its entry (before the buffer's lock) until ``go`` is set; ``entered`` says
    one arrived. A health check held there has pinged the shards and passed its "closed?" check."""
    entered, go = threading.Event(), threading.Event()
    real = plane._lose

    def gated(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert go.wait(60), "the test never released the gate"
        return real(*args, **kwargs)

    plane._lose = gated  # type: ignore[method-assign]
    return entered, go


# -- 1. a health check under way when close() runs -----------------------------------------------------------------
def test_a_check_health_past_its_closed_check_reports_no_loss_once_close_returned(cluster: Any) -> None:
    """``check_health`` on a thread of the user's: the shard it pinged is dead, and it is held after its "closed?"
    check. ``close()`` runs and returns; then the check goes on. It must record no loss and call no ``on_loss``."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    calls: list[LossReport] = []
    plane = DistributedDataPlane(ID_SCHEMA, capacity=20, servers=servers, measure=False, health_period=None,
                                 timeout=10.0, transport="object_store", on_loss=calls.append)
    try:
        plane.ingest(id_batch(np.arange(6)), node=cluster.head)
        plane.ingest(id_batch(np.arange(6, 12)), node=cluster.workers[0])
        entered, go = _gate_lose(plane)
        kill_server(servers[1].actor)
        found: list[Any] = []
        checker = threading.Thread(target=lambda: found.append(plane.check_health()), daemon=True)
        checker.start()
        assert entered.wait(60), "the health check never found the dead shard"
        plane.close()
        go.set()
        checker.join(60)
        assert not checker.is_alive(), "check_health hung"
        assert found == [[]], "a check under way when close() ran reported a loss after it"
        assert plane.losses == [] and calls == [], "a loss was recorded / on_loss called after close() returned"
        assert plane.lost_items == 0
    finally:
        plane.close()
        servers.shutdown()


def test_the_monitors_check_under_way_when_close_runs_reports_no_loss(cluster: Any) -> None:
    """The health monitor's check found a dead shard and is held after its "closed?" check; ``close()`` starts on
    another thread (it marks the buffer closed, then joins the monitor), and the check goes on. No loss may be
    recorded and no ``on_loss`` called: close() fences the check out."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    calls: list[LossReport] = []
    plane = DistributedDataPlane(ID_SCHEMA, capacity=20, servers=servers, measure=False, health_period=0.2,
                                 timeout=10.0, transport="object_store", on_loss=calls.append)
    closer = None
    try:
        plane.ingest(id_batch(np.arange(6)), node=cluster.workers[0])
        entered, go = _gate_lose(plane)
        kill_server(servers[1].actor)
        assert entered.wait(60), "the monitor never found the dead shard"
        closer = threading.Thread(target=plane.close, daemon=True)
        closer.start()
        wait_until(lambda: plane.closed, "close() marked the buffer closed", timeout=60)
        go.set()
        closer.join(60)
        assert not closer.is_alive(), "close() hung"
        assert plane.losses == [] and calls == [], "the monitor recorded a loss / called on_loss during close()"
        assert plane.lost_items == 0
    finally:
        if closer is not None:
            closer.join(60)
        plane.close()
        servers.shutdown()


def test_close_returns_only_after_an_on_loss_callback_running_on_another_thread(cluster: Any) -> None:
    """A loss was recorded before ``close()`` (by ``check_health`` on a thread of the user's), and its ``on_loss``
    callback is still running there when ``close()`` is called on another thread. ``close()`` must not return
    before that callback did (no callback runs once close() returned)."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    order: list[str] = []
    mu = threading.Lock()
    in_callback, go = threading.Event(), threading.Event()

    def on_loss(report: LossReport) -> None:
        in_callback.set()
        assert go.wait(60), "the test never released the callback"
        with mu:
            order.append(f"on_loss {report.shard}")

    plane = DistributedDataPlane(ID_SCHEMA, capacity=20, servers=servers, measure=False, health_period=None,
                                 timeout=10.0, transport="object_store", on_loss=on_loss)
    # close() waiting for the callback is seen through the callbacks' wait (absent before the fix: then close()
    # just returns, and the order below says so)
    waiting = threading.Event()
    real_wait = getattr(plane._callbacks, "wait_idle", None)
    if real_wait is not None:
        def wait_idle(*args: Any, **kwargs: Any) -> Any:
            waiting.set()
            return real_wait(*args, **kwargs)

        plane._callbacks.wait_idle = wait_idle  # type: ignore[method-assign]
    checker = closer = None
    try:
        h = plane.ingest(id_batch(np.arange(6)), node=cluster.workers[0])
        assert h is not None
        kill_server(servers[1].actor)
        checker = threading.Thread(target=plane.check_health, daemon=True)
        checker.start()
        assert in_callback.wait(60), "the loss was never handed to on_loss"

        def close() -> None:
            plane.close()
            with mu:
                order.append("close returned")

        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        wait_until(lambda: waiting.is_set() or not closer.is_alive(), "close() returned or waits for on_loss",
                   timeout=60)
        go.set()
        closer.join(60)
        checker.join(60)
        assert not closer.is_alive() and not checker.is_alive(), "close() or check_health hung"
        assert order == ["on_loss 1", "close returned"], f"on_loss ran after close() returned: {order}"
        assert [r.shard for r in plane.losses] == [1]
        assert sorted(plane.losses[0].lost.tolist()) == sorted(h.tolist())
    finally:
        go.set()
        for t in (checker, closer):
            if t is not None:
                t.join(60)
        plane.close()
        servers.shutdown()


# -- 2. two buffers renewing a retired torch group at once ----------------------------------------------------------
def test_two_buffers_built_at_once_on_a_retired_torch_group_share_one_new_group(cluster: Any) -> None:
    """The servers' torch group was retired. Two buffers are built at once with ``transport="torch"``; both are
    held until both looked at the group (a caller that got the retired group waits for the other one to have got
    it too, as two threads can). They must end up on one new, usable group, both delivering over torch; the first
    buffer's group must not be torn down by the second's formation."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    planes: list[DistributedDataPlane] = []
    try:
        old = servers.torch_group(timeout=30.0)
        old.close()  # retired (as a failed transfer retires it)
        both_saw_it = threading.Barrier(2)
        real = servers.torch_group

        def torch_group(**kwargs: Any) -> Any:
            g = real(**kwargs)
            if g is old:  # a caller that got the retired group: held until the other one got it too
                both_saw_it.wait(60)
            return g

        servers.torch_group = torch_group  # type: ignore[method-assign]
        results: dict[str, Any] = {}

        def build(name: str) -> None:
            try:
                results[name] = DistributedDataPlane(ID_SCHEMA, capacity=40, servers=servers, measure=False,
                                                     health_period=None, timeout=20.0, transport="torch")
            except BaseException as e:  # noqa: BLE001 - reported by the assertions below
                results[name] = e

        threads = [threading.Thread(target=build, args=(n,), daemon=True) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "building the buffers hung"
        del servers.torch_group
        planes = [p for p in results.values() if isinstance(p, DistributedDataPlane)]
        errors = {k: v for k, v in results.items() if not isinstance(v, DistributedDataPlane)}
        assert not errors, f"a buffer built at the same time as another failed: {errors!r}"
        pa, pb = results["a"], results["b"]
        assert pa._torch is pb._torch, "two groups were formed (one buffer's group was torn down by the other's)"
        assert pa._torch is servers.torch_group(create=False) and pa._torch is not old
        assert pa._torch.broken is None
        for i, p in enumerate((pa, pb)):
            ids = np.arange(10 * i, 10 * i + 10)
            p.ingest(id_batch(ids), node=cluster.workers[0])
            assert p.transports == ["torch", "torch"]
            batch, _ = p.deliver(8)
            assert set(check_payload(batch).tolist()) <= set(ids.tolist())
            assert p.transports == ["torch", "torch"], "a delivery over the group failed"
    finally:
        servers.__dict__.pop("torch_group", None)
        for p in planes:
            p.close()
        servers.shutdown()
