"""Test helpers for the multi-node tier: a real local Ray cluster, and conformance endpoints.

:func:`local_cluster` starts a :class:`ray.cluster_utils.Cluster` of several nodes on this
machine (separate raylets and object stores on 127.0.0.1), connects this process to it
and tears everything down afterwards; :func:`kept_cluster` keeps one running between uses
(test modules connect to it in turn instead of each starting a cluster). The endpoints drive a
:class:`~conduit.distributed.DistributedDataPlane` for the conformance suites, spreading
ingestion over the producer nodes so every suite runs on a multi-node buffer.

Importing this module needs pytest (it uses ``conduit.testing``).
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, cast

import numpy as np

from conduit.distributed._ray import ray_module
from conduit.distributed.errors import ClusterError
from conduit.distributed.plane import DistributedDataPlane
from conduit.distributed.server import ping
from conduit.distributed.servers import ShardServers
from conduit.semantics import Semantics
from conduit.testing.endpoints import EndpointFactory
from conduit.testing.lifecycle import eventually
from conduit.testing.reference import ID_SCHEMA, CoreOnPolicyEndpoint, CoreReplayEndpoint, check_payload, id_batch

__all__ = ["LocalCluster", "local_cluster", "kept_cluster", "stop_kept_cluster", "ServerStandIn",
           "DistributedReplayEndpoint", "DistributedOnPolicyEndpoint", "FAST_FAILURE_DETECTION", "ENDPOINTS",
           "shared_servers", "shutdown_shared", "kill_server", "held_data_thread", "SHARED_CLUSTER_ENV"]

#: Ray settings that declare a dead node within about 1.5 s (defaults take tens of seconds)
FAST_FAILURE_DETECTION = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                          "health_check_failure_threshold": 3}


class LocalCluster:
    """A running local multi-node cluster: node ids, and nodes to add or kill."""

    def __init__(self, cluster: Any, node_args: dict[str, Any]) -> None:
        self.cluster = cluster
        self._node_args = node_args
        self._nodes: dict[str, Any] = {cluster.head_node.node_id: cluster.head_node}

    @property
    def head(self) -> str:
        """The head node (this process runs there)."""
        return str(self.cluster.head_node.node_id)

    @property
    def nodes(self) -> list[str]:
        """Every node started and not killed, head first."""
        return list(self._nodes)

    @property
    def workers(self) -> list[str]:
        return [n for n in self._nodes if n != self.head]

    def add_node(self, **kwargs: Any) -> str:
        """Start one more node; returns its id once it is alive."""
        node = _retry_startup(lambda: self.cluster.add_node(**{**self._node_args, **kwargs}))
        self.cluster.wait_for_nodes()
        self._nodes[str(node.node_id)] = node
        return str(node.node_id)

    def kill_node(self, node_id: str, *, graceful: bool = False) -> None:
        """Kill a worker node's processes (``graceful=False``: as in a crash, no drain)."""
        if node_id == self.head:
            raise ClusterError("The head node runs this process; kill a worker node.")
        node = self._nodes.pop(node_id)
        self.cluster.remove_node(node, allow_graceful=graceful)


class ServerStandIn:
    """Stands in for the actor handle of shard ``shard`` of ``servers`` until :meth:`restore`: every call goes to
    the real actor, except those a subclass intercepts (a test's way to delay, reorder or fail one kind of call)."""

    def __init__(self, servers: ShardServers, shard: int) -> None:
        self._info = servers[shard]
        self._real = self._info.actor
        self._info.actor = self

    def restore(self) -> None:
        """Put the real handle back."""
        self._info.actor = self._real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def kill_server(actor: Any, *, timeout: float = 60.0) -> None:
    """Kill a shard server's actor as a crash would (never restarted), and return once Ray reports it dead.

    ``ray.kill`` only asks for the kill: a call sent right after it may still be answered. A test that expects the
    death to be found next (by a health check or a failed call) kills through this.

    Raises:
        AssertionError: the actor still answers (or is only unavailable) after ``timeout`` seconds.
    """
    ray = ray_module()
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(ping(actor), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.RayActorError as e:
            if not isinstance(e, ray.exceptions.ActorUnavailableError):  # (unavailable proves no death yet)
                return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"the killed server still answers after {timeout:.0f} s")


@contextmanager
def held_data_thread(server: Any, group_id: str = "conduit-test-hold", *, release: bool = True) -> Iterator[None]:
    """Hold the data thread of ``server`` (a :class:`~conduit.distributed.servers.ShardServers` entry) until the block
    ends: its data calls queue behind, while its health checks (their own thread) still answer. A "stuck" shard made
    for real.

    The server joins a two-rank gloo group ``group_id`` (one per server held at once) whose other rank, this
    process, joins only on leaving the block. With ``release=False`` it never joins: for a server whose process the
    block kills (a server that outlives the block stays held until its join fails, at the latest after 240 s).
    """
    import datetime

    import torch.distributed as dist

    from conduit.distributed.transport import make_process_group

    ray = ray_module()
    host = str(ray.util.get_node_ip_address())
    store = dist.TCPStore(host, 0, 2, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    joined = server.actor.join_group.remote(group_id, host, int(store.port), 1, 2, "gloo", 240.0)
    try:
        yield
    finally:
        if release:
            # (kept until the server's join returns: a group dropped at once closes its sockets under the server's
            # connectFullMesh, which then fails with "Connection closed by peer")
            group = make_process_group("gloo", group_id, host, 0, 0, 2, 120.0, store=store)
            try:
                assert ray.get(joined, timeout=120) == 1
            finally:
                del group


@contextmanager
def local_cluster(num_nodes: int = 2, *, num_cpus: int = 1, object_store_memory: int = 80 << 20,
                  fast_failure_detection: bool = True) -> Iterator[LocalCluster]:
    """A local Ray cluster of ``num_nodes`` nodes, this process connected to it; shut down on exit.

    It runs no dashboard, no autoscaler and no log monitor: workers' output stays in the session's log files
    (``session_latest/logs`` under Ray's temp dir) and is not printed here.

    Keyword Args:
        num_cpus: logical CPUs per node (shard servers take none).
        object_store_memory: bytes of object store per node (keep it small on a shared machine).
        fast_failure_detection: declare dead nodes within ~1.5 s (:data:`FAST_FAILURE_DETECTION`).

    Raises:
        ClusterError: Ray is already initialised in this process.
    """
    ray = _not_connected()
    lc = _start_cluster(num_nodes, num_cpus, object_store_memory, fast_failure_detection)
    try:
        ray.init(address=lc.cluster.address, log_to_driver=False, configure_logging=False)
        yield lc
    finally:
        ray.shutdown()
        lc.cluster.shutdown()


#: the cluster :func:`kept_cluster` keeps between uses: ``{"shape": (...), "cluster": LocalCluster}``
_KEPT: dict[str, Any] = {}
_KEPT_LOCK = threading.Lock()
#: how long :func:`kept_cluster` waits for an earlier connection's actors to be gone before starting afresh
KEPT_IDLE_WAIT_S = 20.0


@contextmanager
def kept_cluster(num_nodes: int = 2, *, num_cpus: int = 1, object_store_memory: int = 80 << 20,
                 fast_failure_detection: bool = True, **connect: Any) -> Iterator[LocalCluster]:
    """:func:`local_cluster`, kept running between uses: on exit this process only disconnects, and the next call
    of the same shape connects to the same cluster (well under a second, against ~6 s of CPU to start one).

    Each use is a Ray job of its own: the actors and objects of the last one are gone when the block starts (it
    waits until no named actor is left and every CPU is free, and starts a fresh cluster if that takes over
    :data:`KEPT_IDLE_WAIT_S`). Nodes the block added and did not kill are stopped on exit; if a node the cluster
    had at the start died, the cluster is stopped instead of kept. One cluster is kept per process: a call of
    another shape stops it first. :func:`stop_kept_cluster` (and the process's exit) stops it.

    Keyword Args:
        num_cpus, object_store_memory, fast_failure_detection: as for :func:`local_cluster` (the shape).
        connect: more ``ray.init`` arguments for this connection only (``runtime_env``, ``logging_level``...).

    Raises:
        ClusterError: Ray is already initialised in this process, or ``connect`` asks for ``log_to_driver=True``
            (the cluster has no log monitor to forward workers' output).
    """
    ray = _not_connected()
    if connect.get("log_to_driver"):
        raise ClusterError("A kept cluster runs no log monitor, so log_to_driver=True would print nothing; read the "
                           "workers' output in the session's log files (ray/session_latest/logs under Ray's temp dir).")
    shape = (num_nodes, num_cpus, object_store_memory, fast_failure_detection)
    init = {"log_to_driver": False, "configure_logging": False, **connect}
    with _KEPT_LOCK:
        lc = _kept(shape)
        ray.init(address=lc.cluster.address, **init)
        if not _idle(ray):  # an earlier job's actors outlived it: start afresh rather than share with them
            ray.shutdown()
            _stop_kept()
            lc = _kept(shape)
            ray.init(address=lc.cluster.address, **init)
    first = set(lc.nodes)
    try:
        yield lc
    finally:
        with _KEPT_LOCK:
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            except Exception:  # noqa: BLE001 - a cluster that cannot answer is not kept
                alive = set()
            ray.shutdown()
            lost = first - set(lc.nodes) or first - alive  # killed through ``lc``, or found dead by Ray
            for node in set(lc.nodes) - first:
                lc.kill_node(node)
            if lost and _KEPT.get("cluster") is lc:
                _stop_kept()


def stop_kept_cluster() -> None:
    """Stop the cluster :func:`kept_cluster` keeps, if any (safe to call any time; not while connected to it)."""
    with _KEPT_LOCK:
        _stop_kept()


def _kept(shape: tuple[Any, ...]) -> LocalCluster:
    """The kept cluster of ``shape``, started now if none or another shape is kept (caller holds the lock)."""
    if _KEPT.get("shape") != shape:
        _stop_kept()
        _KEPT["cluster"] = _start_cluster(*shape)
        _KEPT["shape"] = shape
    return cast(LocalCluster, _KEPT["cluster"])


def _stop_kept() -> None:
    _KEPT.pop("shape", None)
    lc = _KEPT.pop("cluster", None)
    if lc is not None:
        lc.cluster.shutdown()


def _idle(ray: Any) -> bool:
    """Whether the connected cluster holds no named actor and no CPU of an earlier job (waits up to
    :data:`KEPT_IDLE_WAIT_S`)."""
    return eventually(lambda: not ray.util.list_named_actors(all_namespaces=True)
                      and ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0),
                      timeout=KEPT_IDLE_WAIT_S)


atexit.register(stop_kept_cluster)


def _not_connected() -> Any:
    """The ``ray`` module, in a process not connected to any Ray."""
    ray = ray_module(initialized=False)
    if ray.is_initialized():
        raise ClusterError("Ray is already initialised in this process; call ray.shutdown() first.")
    return ray


def _start_cluster(num_nodes: int, num_cpus: int, object_store_memory: int,
                   fast_failure_detection: bool) -> LocalCluster:
    """Start a local cluster of ``num_nodes`` nodes (this process not connected to it)."""
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": num_cpus, "object_store_memory": object_store_memory}
    # no dashboard, no autoscaler monitor (nothing to scale), and no log monitor: every connection here leaves workers'
    # output in the session's log files
    head_args: dict[str, Any] = {**node_args, "include_dashboard": False, "include_log_monitor": False,
                                 "no_monitor": True}
    if fast_failure_detection:
        head_args["_system_config"] = dict(FAST_FAILURE_DETECTION)
    cluster = _retry_startup(lambda: Cluster(initialize_head=True, head_node_args=head_args))
    try:
        lc = LocalCluster(cluster, node_args)
        for _ in range(num_nodes - 1):
            lc.add_node()
    except BaseException:
        cluster.shutdown()
        raise
    return lc


def _retry_startup(start: Any, attempts: int = 3) -> Any:
    """Run ``start`` again when Ray gives up on a slow node start (it waits a fixed 30 s for the raylet,
    which a heavily loaded machine can exceed); processes of a failed try are stopped at exit by Ray."""
    for i in range(attempts):
        try:
            return start()
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or i == attempts - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


class DistributedReplayEndpoint(CoreReplayEndpoint):
    """A replay :class:`DistributedDataPlane` whose inserts come from each server node in turn."""

    def __init__(self, servers: ShardServers, *, capacity: int, **kwargs: Any) -> None:
        self._servers = servers
        self._producers = itertools.cycle(sorted(set(servers.nodes)))
        self._cycle_lock = threading.Lock()
        super().__init__(capacity=capacity, **kwargs)
        self.plane: DistributedDataPlane = self.edp

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> DistributedDataPlane:
        return _plane(self._servers, capacity, semantics, kwargs)

    def insert(self, ids: np.ndarray) -> None:
        with self._cycle_lock:
            node = next(self._producers)
        self.plane.ingest(id_batch(ids), node=node)

    def contents(self) -> np.ndarray:
        self.plane.flush()
        h = self.plane.live_handles()
        if not h.size:
            return np.zeros(0, dtype=np.int64)
        return self.plane.read(h).tensor("id").numpy().copy()

    def verified_contents(self) -> np.ndarray:
        self.plane.flush()
        h = self.plane.live_handles()
        if not h.size:
            return np.zeros(0, dtype=np.int64)
        return check_payload(self.plane.read(h))


class DistributedOnPolicyEndpoint(CoreOnPolicyEndpoint):
    """An on-policy :class:`DistributedDataPlane` whose rollouts come from every server node."""

    def __init__(self, servers: ShardServers, **kwargs: Any) -> None:
        self._servers = servers
        self._nodes = sorted(set(servers.nodes))
        super().__init__(**kwargs)
        self.plane: DistributedDataPlane = self.edp

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> DistributedDataPlane:
        return _plane(self._servers, capacity, semantics, kwargs)

    def ingest(self, ids: np.ndarray, version: int) -> None:
        parts = np.array_split(np.asarray(ids), len(self._nodes))
        for node, part in zip(self._nodes, parts, strict=True):
            if part.size:
                self.plane.ingest(id_batch(part), version=version, node=node)


def _plane(servers: ShardServers, capacity: int, semantics: Semantics, kwargs: dict[str, Any]) -> DistributedDataPlane:
    """A test buffer on ``servers`` (no background health checks unless asked: the suites kill nothing)."""
    kwargs.setdefault("health_period", None)
    return DistributedDataPlane(ID_SCHEMA, capacity=capacity, semantics=semantics, servers=servers, **kwargs)


# -- the registered endpoints (``conduit.conformance``): one shared 2-node cluster per process -----------------------
_SHARED: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()
#: set in this process's environment while its shared cluster runs, to that cluster's address: a subprocess that
#: inherits it (the cross-process determinism check, :mod:`conduit.testing.crossprocess`) joins that cluster as a
#: job of its own instead of starting one (~25 s on two vCPUs)
SHARED_CLUSTER_ENV = "CONDUIT_SHARED_CLUSTER_ADDRESS"


def shared_servers() -> ShardServers:
    """Shard servers on both nodes of a 2-node :func:`kept_cluster` shared by this process (started on first use).

    The cluster has a small object store (80 MiB per node); :func:`shutdown_shared` stops the servers and
    disconnects from it (integration-tests/conftest.py does at the end of each test module; at exit otherwise).
    Where :data:`SHARED_CLUSTER_ENV` names a running cluster (a parent process's shared one), the servers are
    started there instead, in a job whose workers get this process's ``PYTHONHASHSEED``.

    Raises:
        ClusterError: Ray is already initialised in this process by someone else.
    """
    with _SHARED_LOCK:
        if "servers" not in _SHARED:
            stack = ExitStack()
            try:
                address = os.environ.get(SHARED_CLUSTER_ENV)
                if address:
                    _SHARED["servers"] = _joined_servers(address, stack)
                else:
                    lc = stack.enter_context(kept_cluster(2))
                    _SHARED["servers"] = ShardServers([lc.head, lc.workers[0]])
                    os.environ[SHARED_CLUSTER_ENV] = lc.cluster.address
                    stack.callback(os.environ.pop, SHARED_CLUSTER_ENV, None)
            except BaseException:
                stack.close()
                raise
            _SHARED["stack"] = stack
        return _SHARED["servers"]


def _joined_servers(address: str, stack: ExitStack) -> ShardServers:
    """Shard servers on the alive nodes of the running cluster at ``address`` (sorted by node id), this process
    connected to it until ``stack`` closes; the job's workers get this process's ``PYTHONHASHSEED``."""
    ray = _not_connected()
    seed = os.environ.get("PYTHONHASHSEED")
    ray.init(address=address, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONHASHSEED": seed}} if seed is not None else None)
    stack.callback(ray.shutdown)
    return ShardServers(sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]))


def shutdown_shared() -> None:
    """Stop the shared servers and disconnect from their cluster, if started (safe to call any time)."""
    with _SHARED_LOCK:
        servers = _SHARED.pop("servers", None)
        stack = _SHARED.pop("stack", None)
        if servers is not None:
            servers.shutdown()
        if stack is not None:
            stack.close()


atexit.register(shutdown_shared)


def _make_replay(**kwargs: Any) -> DistributedReplayEndpoint:
    return DistributedReplayEndpoint(shared_servers(), **kwargs)


def _make_on_policy(**kwargs: Any) -> DistributedOnPolicyEndpoint:
    return DistributedOnPolicyEndpoint(shared_servers(), **kwargs)


_HAS_RAY = importlib.util.find_spec("ray") is not None

#: the multi-node buffer for ``integration-tests/`` (no endpoints where Ray is not installed)
ENDPOINTS = EndpointFactory("distributed", make_replay=_make_replay if _HAS_RAY else None,
                            make_on_policy=_make_on_policy if _HAS_RAY else None)
