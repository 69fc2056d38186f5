"""Delivery over torch.distributed: shard servers send gathered rows straight to the learner.

The default path moves a shard's rows to the learner through Ray's object store (NumPy
columns, read without a copy on the same node, one object-manager transfer across nodes).
Where the learner's process and the shard servers have joined one torch.distributed
process group (:class:`TorchGroup`: gloo over TCP on CPU, NCCL where both ends have CUDA),
a shard can instead ``send`` its rows to the learner, which ``recv``\\ s them into one
buffer: two point-to-point messages per shard and delivery (the ragged lengths, when the
schema has ragged fields, then every column's bytes back to back, see
:func:`~conduit.distributed.wire.pack_rows`). The Ray call that asks for the rows carries
only local handles and a message tag.

The learner is rank 0 of the group, server ``i`` of a :class:`ShardServers` group is
rank ``i + 1``. The group is built once per learner process and server group
(:meth:`ShardServers.torch_group`) and shared by every buffer on those servers. Every
receive is bounded by the group's timeout: a peer that dies mid-transfer breaks its
connection (the receive fails at once), a peer that hangs makes it fail after the timeout;
either way the buffer then treats the shard as it treats any failed call (see
:class:`~conduit.distributed.DistributedDataPlane`).

:attr:`TorchGroup.links` holds the measured links of this transport (a
:class:`~conduit.distributed.LinkProfile` with ``transport="torch"``), taken like the
object store's: an 8-byte probe for the per-call overhead, larger ones for bandwidth.
"""

from __future__ import annotations

import datetime
import itertools
import statistics
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from conduit.distributed._ray import check_seconds, current_node_id, ray_module, wait_all
from conduit.distributed.errors import ClusterError, RemoteTimeoutError
from conduit.distributed.links import LinkProfile, check_probes
from conduit.errors import ConduitError, ConfigurationError
from conduit.placement.profile import LinkCost

if TYPE_CHECKING:
    from conduit.distributed.servers import ShardServers

__all__ = ["TorchGroup", "OBJECT_STORE", "TORCH", "TRANSPORTS", "make_process_group", "wire_device"]

#: delivery through Ray's object store
OBJECT_STORE = "object_store"
#: delivery through a torch.distributed process group
TORCH = "torch"
#: what ``DistributedDataPlane(transport=...)`` takes
TRANSPORTS = ("auto", OBJECT_STORE, TORCH)


def _backend_ok(backend: str) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigurationError("This torch build has no torch.distributed; use transport='object_store'.")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ConfigurationError("This torch build has no gloo backend; use transport='object_store'.")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ConfigurationError("The nccl backend needs CUDA and a torch build with NCCL on both ends; use "
                                 "backend='gloo' or transport='object_store'.")
    if backend not in ("gloo", "nccl"):
        raise ConfigurationError(f"Unknown torch.distributed backend {backend!r}; use 'gloo' or 'nccl'.")


def wire_device(backend: str) -> torch.device:
    """Where tensors must be to travel over ``backend`` (NCCL: the current CUDA device)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def make_process_group(backend: str, group_id: str, host: str, port: int, rank: int, world: int,
                       timeout: float, store: Any = None) -> Any:
    """Join the process group ``group_id`` (blocks until all ``world`` ranks have joined).

    The group is a standalone ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a TCP store,
    not torch's default group: a learner already in a training group keeps it, and one
    process can be in several such groups.
    """
    import torch.distributed as dist

    _backend_ok(backend)
    td = datetime.timedelta(seconds=timeout)
    if store is None:
        store = dist.TCPStore(host, port, world, False, timeout=td)
    prefixed = dist.PrefixStore(f"conduit/{group_id}", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, td)


class TorchGroup:
    """A torch.distributed process group of this process (the learner, rank 0) and a group of shard servers.

    Args:
        servers: the shard servers (server ``i`` becomes rank ``i + 1``).

    Keyword Args:
        backend: ``"gloo"`` (CPU, TCP) or ``"nccl"`` (CUDA on every rank).
        timeout: seconds to form the group, and the bound on every send and receive.
        measure: measure the links of this transport once formed (:attr:`links`).

    Raises:
        ConfigurationError: torch.distributed or the backend is missing here, or ``timeout`` is not a finite
            number > 0 (nothing is formed).
        ClusterError: a server could not join within ``timeout``, or is gone (named first; the group is not
            formed, or is torn down as below when the server died while its links were measured).
        RemoteTimeoutError: measuring the links failed (the group formed, and is torn down: closed here and
            left by every server; forming it again starts afresh).
    """

    def __init__(self, servers: ShardServers, *, backend: str = "gloo", timeout: float = 60.0,
                 measure: bool = True) -> None:
        import torch.distributed as dist

        check_seconds("timeout", timeout)  # (checked before the store opens or any server is asked to join)
        _backend_ok(backend)
        ray = ray_module()
        self.backend = backend
        self.timeout = float(timeout)
        self.group_id = uuid.uuid4().hex
        self.device = wire_device(backend)
        self.learner_node = current_node_id()
        self.nodes = servers.nodes
        self._servers = servers
        self._tags = itertools.count(2, 2)
        self._tag_lock = threading.Lock()
        #: why the group stopped being used (a transfer failed between live peers); None while usable
        self.broken: str | None = None
        world = len(servers) + 1
        host = str(ray.util.get_node_ip_address())
        td = datetime.timedelta(seconds=self.timeout)
        self._store: Any = dist.TCPStore(host, 0, world, True, timeout=td, wait_for_workers=False)
        joins = {i: s.actor.join_group.remote(self.group_id, host, int(self._store.port), i + 1, world, backend,
                                              self.timeout) for i, s in enumerate(servers.servers)}
        try:
            self.pg = make_process_group(backend, self.group_id, host, 0, 0, world, self.timeout, store=self._store)
        except Exception as e:  # noqa: BLE001 - a server that never joins times the rendezvous out
            bad = wait_all(joins, 1.0)
            # the cause first: a server that is gone, then one that did not answer; the others' joins only time
            # out waiting for it (naming one of them sent the user looking for a network fault)
            failed = sorted((i for i, o in bad.items() if not o.ok), key=lambda i: (not bad[i].lost,
                                                                                      bad[i].unconfirmed, i))
            first = bad[failed[0]] if failed else None
            if first is not None and first.lost and not first.unconfirmed:
                raise ClusterError(f"Shard server {failed[0]} on node {servers[failed[0]].node_id[:8]} is gone "
                                   f"({type(first.error).__name__}), so no torch.distributed group can be formed "
                                   f"with it; start the ShardServers again on alive nodes (alive_nodes()).") from e
            why = f"server {failed[0]}: {first.error}" if first is not None else str(e)
            raise ClusterError(f"The shard servers could not form a torch.distributed {backend} group with this "
                               f"process within {self.timeout:g} s ({why}); check that the nodes reach "
                               f"{host} over TCP, or use transport='object_store'.") from e
        outs = wait_all(joins, self.timeout)
        bad = {i: o for i, o in outs.items() if not o.ok}
        self.links: LinkProfile | None = None
        try:
            if bad:
                i, o = next(iter(bad.items()))
                raise ClusterError(f"Shard server {i} failed to join the torch.distributed group ({o.error}); use "
                                   f"transport='object_store'.")
            if measure:
                self.links = self.measure()
        except BaseException:
            # a group that failed after it formed is torn down: closed here, and every server asked to leave it,
            # so nothing keeps it and a retry forms a new one
            self.tear_down()
            raise

    def __repr__(self) -> str:
        return f"TorchGroup({self.backend}, ranks={len(self.nodes) + 1}, broken={self.broken is not None})"

    def rank(self, server: int) -> int:
        """The rank of server ``server``."""
        return server + 1

    def tags(self) -> int:
        """A fresh pair of message tags (``t`` and ``t + 1``) for one transfer."""
        with self._tag_lock:
            return next(self._tags)

    def recv(self, buf: torch.Tensor, server: int, tag: int) -> Any:
        """Post a receive of ``buf`` from server ``server``; returns the work to ``wait()`` on."""
        return self.pg.recv([buf], self.rank(server), tag)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    # -- measurement ------------------------------------------------------------------------------
    def measure(self, sizes: Sequence[int] = (1 << 18, 1 << 22), repeats: int = 3) -> LinkProfile:
        """Measure server -> learner over this group (one server per node), like :func:`measure_links`.

        Each probe is one Ray call asking the server to send ``nbytes`` and the matching
        receive here, timed from the call to the end of the receive. As in a delivery, the call's
        answer is not waited for once the bytes arrived whole (a late answer adds nothing to a
        transfer that completed; waiting for it failed the probe and retired a working group).

        A probe that fails retires the group (:attr:`broken`), as a failed delivery does.

        Raises:
            ConfigurationError: bad probe settings (see :func:`~conduit.distributed.links.check_probes`).
            ClusterError: a server is gone (its actor or its node died; named), as in
                :func:`~conduit.distributed.links.measure_links`.
            DistributedError: a server refused the probe (e.g. it left the group: form it again).
            RemoteTimeoutError: a probe did not finish within the group's timeout.
        """
        sizes = check_probes(sizes, repeats, self.timeout)
        probe: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            probe.setdefault(node, i)
        prof = LinkProfile(learner_node=self.learner_node, sizes=tuple(sizes), repeats=repeats, transport=TORCH)

        def once(server: int, nbytes: int) -> float:
            tag = self.tags()
            buf = self.empty((nbytes,), torch.uint8)
            t0 = time.perf_counter()
            ref = self._servers[server].actor.probe_send.remote(self.group_id, nbytes, tag)
            try:
                self.recv(buf, server, tag).wait()
            except Exception as e:  # noqa: BLE001 - gloo and Ray raise plain errors
                self.broken = self.broken or f"a link probe from server {server} failed: {e}"
                # the server's own call tells a dead server (its receive here fails at once: the connection
                # closed) from a refusal or a slow one; only the last is a matter of load
                out = wait_all({0: ref}, max(1.0, self.timeout - (time.perf_counter() - t0)))[0]
                if out.lost and not out.unconfirmed:
                    node = self.nodes[server]
                    raise ClusterError(f"Shard server {server} on node {node[:8]} is gone "
                                       f"({type(out.error).__name__}), so the torch.distributed links to it cannot "
                                       f"be measured; start the ShardServers again on alive nodes "
                                       f"(alive_nodes()).") from e
                if isinstance(out.error, ConduitError):
                    raise out.error from e
                raise RemoteTimeoutError(f"A torch.distributed link probe from server {server} failed ({e}); the "
                                         f"cluster is overloaded or a node is unreachable.") from e
            return time.perf_counter() - t0

        for node, server in probe.items():
            samples = []
            for x in (8, *sizes):
                once(server, x)  # warm-up
                samples.append((x, statistics.median(once(server, x) for _ in range(repeats))))
            prof.links[(node, self.learner_node)] = LinkCost.fit_or_bound(samples[1:], samples[0][1])
        return prof

    def tear_down(self) -> None:
        """:meth:`close` here, and ask every server to leave the group (without waiting: a server may still be
        stuck in it; it runs the request after what it is doing). Servers Ray cannot reach are skipped (they hold
        no group any more); calling it again only asks the servers again."""
        self.close()
        for info in self._servers.servers:
            try:
                info.actor.leave_group.remote(self.group_id)
            except Exception:  # noqa: BLE001 - a server Ray cannot reach holds no group any more
                pass

    def close(self) -> None:
        """Leave the group here and close this process's sockets of it: the group's connections and its
        store (the servers keep their side until they are shut down). A closed group is :attr:`broken`
        (buffers deliver through the object store); closing it again does nothing."""
        self.broken = self.broken or "closed"
        self.pg = None
        self._store = None
