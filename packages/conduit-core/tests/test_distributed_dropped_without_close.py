"""A multi-node plane its owner drops without ``close()`` releases what it held, on a real local Ray cluster.

What a plane holds outside its own memory: a health monitor thread, the scheduler's worker
threads, the torch.distributed receive threads, its partition on every shard server (shared
servers keep running for other buffers), and the servers it started itself (Ray actors, with
their torch.distributed group's sockets). Before, the monitor thread held its plane for the
life of the process, so a dropped plane with the default ``health_period`` was never freed:
its thread pinged forever and the servers it started never stopped. A plane without a
monitor was freed, but its partitions stayed on the shared servers. A closed plane that had
started its own servers kept its torch.distributed group's sockets open while the caller held it.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit import Overlapped, Replay  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.distributed.server import ping  # noqa: E402
from conduit.testing.lifecycle import (  # noqa: E402
    eventually,
    live_workers,
    no_workers_beyond,
    open_fds,
    process_running,
    worker_threads,
)
from conduit.testing.reference import ID_SCHEMA, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _plane(servers: Any, **kwargs: Any) -> DistributedDataPlane:
    kwargs.setdefault("capacity", 400)
    kwargs.setdefault("measure", False)
    return DistributedDataPlane(ID_SCHEMA, servers=servers, semantics=kwargs.pop("semantics", Replay(seed=0)),
                                **kwargs)


def _use(plane: DistributedDataPlane) -> None:
    """Ingest from every server's node and deliver, so the plane's background work has run."""
    for i, node in enumerate(sorted(set(plane.servers.nodes))):
        plane.ingest(id_batch(np.arange(40 * i, 40 * i + 40)), node=node)
    plane.flush()
    for _ in range(3):
        plane.deliver(16)


def _conduit_threads() -> list[str]:
    """Every Conduit thread alive now (the scheduler's workers, health monitors, torch receivers), sorted."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("conduit"))


def _partitions(servers: ShardServers) -> list[int]:
    """The number of buffer partitions each server holds now."""
    import ray

    return [int(ray.get(ping(s.actor), timeout=60)) for s in servers.servers]


def _drop(make: Any) -> weakref.ref[DistributedDataPlane]:
    """Build and use a plane in a frame of its own, and return only a weak reference to it."""
    plane = make()
    _use(plane)
    return weakref.ref(plane)


# -- dropped without close -------------------------------------------------------------------------
def test_a_dropped_plane_with_a_health_monitor_is_freed_and_its_thread_ends(servers):
    threads, parts = _conduit_threads(), _partitions(servers)
    ref = _drop(lambda: _plane(servers, health_period=0.05))
    assert eventually(lambda: ref() is None, timeout=15), (
        "a plane dropped without close() is still alive (its health monitor thread holds it)")
    assert eventually(lambda: _conduit_threads() == threads, timeout=15), (
        f"threads of the dropped plane still run: {_conduit_threads()} (before: {threads})")
    assert eventually(lambda: _partitions(servers) == parts, timeout=15), (
        f"the shared servers still hold the dropped plane's partitions: {_partitions(servers)} (before: {parts})")


def test_a_dropped_plane_closes_its_partitions_on_shared_servers(servers):
    parts = _partitions(servers)
    ref = _drop(lambda: _plane(servers, health_period=None))
    assert eventually(lambda: ref() is None, timeout=15), "the dropped plane is still alive"
    assert eventually(lambda: _partitions(servers) == parts, timeout=15), (
        f"the shared servers still hold the dropped plane's partitions: {_partitions(servers)} (before: {parts})")
    assert all(process_running(s.pid) for s in servers.servers), "a dropped plane stopped servers it did not start"


def test_a_dropped_overlapped_plane_is_freed_and_its_workers_end(servers):
    threads, workers, parts = _conduit_threads(), live_workers(), _partitions(servers)

    def make() -> DistributedDataPlane:
        plane = _plane(servers, health_period=0.05, scheduler=Overlapped(g_ing=2, g_del=2))
        plane.ingest(id_batch(np.arange(500, 510)))  # possibly still queued when the plane is dropped
        return plane

    ref = _drop(make)
    assert eventually(lambda: ref() is None, timeout=15), "the dropped overlapped plane is still alive"
    assert eventually(lambda: no_workers_beyond(workers), timeout=15), (
        f"the scheduler's worker threads still run: {worker_threads()} (before: {sorted(t.name for t in workers)})")
    assert eventually(lambda: _conduit_threads() == threads, timeout=15), (
        f"threads of the dropped plane still run: {_conduit_threads()} (before: {threads})")
    assert eventually(lambda: _partitions(servers) == parts, timeout=15), (
        f"the shared servers still hold the dropped plane's partitions: {_partitions(servers)} (before: {parts})")


def test_a_dropped_plane_stops_the_servers_it_started(cluster):
    threads = _conduit_threads()
    pids: list[int] = []

    def make() -> DistributedDataPlane:
        plane = _plane([cluster.head, cluster.workers[0]])  # owned servers, default health monitor
        pids.extend(s.pid for s in plane.servers.servers)
        assert pids and all(process_running(p) for p in pids)  # (checked here: a dropped plane is freed at once)
        return plane

    ref = _drop(make)
    assert eventually(lambda: ref() is None, timeout=15), "the dropped plane is still alive"
    assert eventually(lambda: not any(process_running(p) for p in pids), timeout=60), (
        f"the shard servers the dropped plane started still run: pids {[p for p in pids if process_running(p)]}")
    assert eventually(lambda: _conduit_threads() == threads, timeout=15), (
        f"threads of the dropped plane still run: {_conduit_threads()} (before: {threads})")


# -- many planes in a row --------------------------------------------------------------------------
@pytest.mark.parametrize("ending", ["dropped", "closed"])
def test_planes_built_and_ended_in_a_row_leave_nothing_behind(servers, ending):
    def one() -> None:
        plane = _plane(servers, health_period=0.05, scheduler=Overlapped(g_ing=2, g_del=2))
        _use(plane)
        if ending == "closed":
            plane.close()

    threads, parts = _conduit_threads(), _partitions(servers)
    one()  # warm-up: Ray opens its connections on first use
    assert eventually(lambda: _conduit_threads() == threads, timeout=15), (
        f"a {ending} plane left threads running: {_conduit_threads()} (before: {threads})")
    fds = open_fds()
    for _ in range(12):
        one()
    gc.collect()
    assert eventually(lambda: _conduit_threads() == threads, timeout=20), (
        f"12 {ending} planes left threads running: {_conduit_threads()} (before: {threads})")
    assert eventually(lambda: _partitions(servers) == parts, timeout=20), (
        f"12 {ending} planes left partitions on the servers: {_partitions(servers)} (before: {parts})")
    assert eventually(lambda: open_fds() <= fds + 4, timeout=20), (
        f"12 {ending} planes left file descriptors open: {open_fds()} (before: {fds})")


def test_planes_with_their_own_torch_group_stop_their_servers_and_release_its_sockets(cluster):
    """Planes that start their own servers and torch group (no health monitor). A dropped one is freed, the servers
    it started stop and its receiver threads end. Three dropped, then three closed that the caller still holds
    (close() alone must release the sockets): neither three leaves file descriptors open. (One warm-up serves
    both counts: Ray opens its connections on first use; the dropped ones are checked for their servers and
    threads too.)"""
    threads = _conduit_threads()
    kept = []  # closed planes the caller still holds
    dropped: list[tuple[weakref.ref[DistributedDataPlane], list[int]]] = []

    def one(ending: str) -> None:
        plane = _plane([cluster.head, cluster.workers[0]], transport="torch", health_period=None)
        _use(plane)
        if ending == "closed":
            plane.close()
            kept.append(plane)
        else:
            dropped.append((weakref.ref(plane), [s.pid for s in plane.servers.servers]))

    one("dropped")  # warm-up: Ray opens its connections on first use
    gc.collect()
    fds = open_fds()
    for _ in range(3):
        one("dropped")
    assert eventually(lambda: open_fds() <= fds + 4, timeout=30), (
        f"3 dropped planes with their own torch group left file descriptors open: {open_fds()} (before: {fds})")
    pids = [p for _, ps in dropped for p in ps]
    assert len(dropped) == 4 and len(pids) == 8
    assert eventually(lambda: all(ref() is None for ref, _ in dropped), timeout=15), "a dropped torch plane is alive"
    assert eventually(lambda: not any(process_running(p) for p in pids), timeout=60), (
        f"the shard servers the dropped planes started still run: pids {[p for p in pids if process_running(p)]}")
    assert eventually(lambda: _conduit_threads() == threads, timeout=15), (
        f"threads of the dropped planes still run: {_conduit_threads()} (before: {threads})")

    gc.collect()
    fds = open_fds()
    for _ in range(3):
        one("closed")
    assert eventually(lambda: open_fds() <= fds + 4, timeout=30), (
        f"3 closed planes with their own torch group left file descriptors open: {open_fds()} (before: {fds})")


# -- close, again ----------------------------------------------------------------------------------
def test_close_twice_and_close_after_the_finalizer_ran_are_harmless(servers, cluster):
    parts = _partitions(servers)
    plane = _plane(servers, health_period=0.05)
    _use(plane)
    plane.close()
    plane.close()
    assert plane.closed and _partitions(servers) == parts
    del plane
    gc.collect()
    assert all(process_running(s.pid) for s in servers.servers), "dropping a closed plane stopped shared servers"
    assert _partitions(servers) == parts

    owned = _plane([cluster.head], health_period=0.05)
    pid = owned.servers[0].pid
    owned._release()  # what the garbage collector runs for a dropped plane  # type: ignore[attr-defined]
    assert eventually(lambda: not process_running(pid), timeout=60), "the finalizer did not stop the plane's own server"
    owned.close()
    owned.close()
    assert owned.closed


# -- after ray.shutdown() --------------------------------------------------------------------------
_AFTER_SHUTDOWN = """
import sys, time, numpy as np, ray
from conduit.distributed import DistributedDataPlane, ShardServers
from conduit.testing.lifecycle import eventually
from conduit.testing.reference import ID_SCHEMA, id_batch
address, head = sys.argv[1:3]
# a job of its own on the test module's cluster (its actors go when this process shuts Ray down; the cluster runs on,
# as a remote cluster would: starting one here took seconds of CPU)
ray.init(address=address, log_to_driver=False, configure_logging=False)
try:
    group = ShardServers([head])
    # timeout=5: a health check in flight when Ray goes down may wait that long for its pings (the default 30 s
    # would outlast the wait below on a loaded machine); a monitor ends at most one check after the shutdown
    # (a 30 s wait failed once in CI under load, with no trace: the wait is 60 s and a failure prints the stacks)
    shared = DistributedDataPlane(ID_SCHEMA, capacity=8, servers=group, measure=False, health_period=0.05,
                                  timeout=5)
    owned = DistributedDataPlane(ID_SCHEMA, capacity=8, servers=[head], measure=False, health_period=0.05,
                                 timeout=5)
    shared.ingest(id_batch(np.arange(4)))
    time.sleep(0.3)
finally:
    ray.shutdown()
ended = eventually(lambda: not shared._monitor.is_alive() and not owned._monitor.is_alive(), timeout=60)
if not ended:  # where a monitor still runs (the failure message shows it)
    import traceback
    from conduit.testing.lifecycle import thread_frame
    for t in (shared._monitor, owned._monitor):
        if t.is_alive():
            print("STACK", t.name, "".join(traceback.format_stack(thread_frame(t))).replace(chr(10), " | "))
errors = []
for plane in (shared, owned):
    for _ in range(2):
        try:
            plane.close()
        except Exception as e:
            errors.append(repr(e))
print("RESULT", ended, ray.is_initialized(), errors, flush=True)
"""


def test_after_ray_shutdown_monitors_end_without_starting_a_new_ray_and_close_is_harmless(cluster):
    """Planes still open when Ray is shut down: their monitors pinged on, and a ping through Ray's
    auto-init started a new local Ray in the learner's process; close() then raised ClusterError."""
    out = subprocess.run([sys.executable, "-c", _AFTER_SHUTDOWN, cluster.cluster.address, cluster.head],
                         capture_output=True, text=True, timeout=300)
    result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert result, f"the script failed: {out.stdout[-2000:]}{out.stderr[-3000:]}"
    stacks = [ln for ln in out.stdout.splitlines() if ln.startswith("STACK")]
    assert result[0] == "RESULT True False []", (
        f"want: monitors ended, Ray not started again, close() harmless; got {result[0]} "
        f"(monitors still running: {stacks}; stderr: {out.stderr[-1500:]})")


def test_refreshing_a_torch_group_makes_the_servers_leave_the_old_one(cluster):
    """Every ShardServers.torch_group(refresh=True) left the old group's gloo sockets open in each server process."""
    import ray

    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        first = group.torch_group(timeout=60)
        group.torch_group(timeout=60, refresh=True)  # warm-up: the servers' own connections to Ray are open now
        before = [len(_server_fds(info.pid)) for info in group.servers]
        olds = []
        for _ in range(3):
            olds.append(group.torch_group(timeout=60))
            group.torch_group(timeout=60, refresh=True)
        assert first.broken == "closed" and all(g.broken == "closed" for g in olds), "an old group stays open here"
        left = [ray.get(info.actor.leave_group.remote(g.group_id), timeout=60) for info in group.servers for g in olds]
        assert not any(left), "a server was still in a group its owner had replaced"
        pids = [info.pid for info in group.servers]
        assert eventually(lambda: all(len(_server_fds(p)) <= b + 4 for p, b in zip(pids, before, strict=True)),
                          timeout=30), (f"servers' open fds grew with each refresh: "
                                        f"{[len(_server_fds(p)) for p in pids]} (before: {before})")
    finally:
        group.shutdown()


def _server_fds(pid: int) -> list[str]:
    """The open file descriptors of process ``pid`` (a shard server on this machine)."""
    import os

    return os.listdir(f"/proc/{pid}/fd")
