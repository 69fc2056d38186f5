"""A group of shard servers pinned to nodes: start them, address them, fence them."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from conduit.checks import is_int
from conduit.distributed._ray import check_seconds, current_node_id, ray_module, wait_all, without_auto_init
from conduit.distributed.errors import ClusterError
from conduit.distributed.server import server_class

__all__ = ["ShardServers", "ServerInfo", "alive_nodes"]


def alive_nodes() -> list[str]:
    """Ids of the alive nodes of the connected Ray cluster (the caller's node first)."""
    ray = ray_module()
    here = current_node_id()
    ids = [str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")]
    return sorted(ids, key=lambda i: (i != here, i))


@dataclass
class ServerInfo:
    """One started server: its actor handle, node and process."""

    actor: Any
    node_id: str
    pid: int


class ShardServers:
    """Shard servers pinned to nodes (node affinity, not soft: a server never moves).

    One group can serve several buffers at once (each buffer opens its own partition on
    every server), so tests and jobs that build many buffers start servers once.

    Args:
        nodes: a list of node ids to place servers on (default: every alive node); repeat a node for
            several servers on it. One id as a bare string is refused (write ``[node_id]``).

    Keyword Args:
        start_timeout: seconds to wait for the servers to come up (a finite number > 0).

    Raises:
        ClusterError: Ray is not initialised, a node is unknown or dead, ``nodes`` is one string or no list at all
            (e.g. a count of servers), or a server did not start in time.
        ConfigurationError: ``start_timeout`` is not a finite number > 0 (no server is started).
    """

    #: :meth:`shutdown` was called: the servers are gone, and the group refuses new work (ClusterError)
    closed: bool = False

    def __init__(self, nodes: Sequence[str] | None = None, *, start_timeout: float = 120.0) -> None:
        ray = ray_module()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # (checked before any server starts: a wait that fails on it would leave them running)
        check_seconds("start_timeout", start_timeout)
        if isinstance(nodes, (str, bytes)):  # (a list of its characters would be refused as unknown nodes)
            raise ClusterError(f"nodes must be a list of node ids, got one string {nodes!r}; pass [node_id] for one "
                               f"server on that node, or alive_nodes() for one on every node.")
        if nodes is not None and not isinstance(nodes, Iterable):  # (e.g. a count of servers: ``servers=2``)
            raise ClusterError(f"nodes must be a list of node ids, got {nodes!r}; pass alive_nodes() for one server "
                               f"on every node, or repeat a node id ([node_id] * 2) for several servers on it.")
        alive = alive_nodes()
        wanted = list(nodes) if nodes is not None else alive
        if not wanted:
            raise ClusterError("No node to place shard servers on; pass node ids, e.g. alive_nodes().")
        unknown = [n for n in wanted if n not in alive]
        if unknown:
            raise ClusterError(f"Nodes {unknown} are not alive members of this Ray cluster; pick from {alive}.")
        cls = server_class()
        actors = [cls.options(num_cpus=0, max_restarts=0,
                              scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote()
                  for n in wanted]
        outcomes = wait_all([a.ready.remote() for a in actors], start_timeout)
        failed = [i for i, o in outcomes.items() if not o.ok]
        if failed:
            for a in actors:
                ray.kill(a, no_restart=True)
            raise ClusterError(f"Shard servers on nodes {[wanted[i] for i in failed]} did not start within "
                               f"{start_timeout:g} s ({outcomes[failed[0]].error}); check the nodes' health and "
                               f"memory, or raise start_timeout.")
        self.servers = []
        for i, a in enumerate(actors):
            node, pid = outcomes[i].value
            if node != wanted[i]:  # pragma: no cover - node affinity with soft=False guarantees this
                raise ClusterError(f"Server {i} landed on node {node}, not {wanted[i]}.")
            self.servers.append(ServerInfo(a, node, pid))
        self._links: Any = None
        self._torch: Any = None
        #: held while a torch group is formed (see :meth:`torch_group`)
        self._torch_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (e.g. into a learner actor): the measured links and the torch group belong to this
        process (its node, its sockets), so the copy measures and forms its own."""
        return {**self.__dict__, "_links": None, "_torch": None, "_torch_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._torch_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, i: int) -> ServerInfo:
        return self.servers[i]

    @property
    def nodes(self) -> list[str]:
        """The node of each server."""
        return [s.node_id for s in self.servers]

    def links(self, *, refresh: bool = False, **kwargs: Any) -> Any:
        """The measured :class:`~conduit.distributed.links.LinkProfile` between these servers' nodes and
        this process's node (measured once, then cached; ``refresh`` measures again, and so do probe
        ``sizes`` or ``repeats`` other than the cached profile's).

        Keyword Args:
            kwargs: probe settings for :func:`~conduit.distributed.links.measure_links`.

        Raises:
            ConfigurationError: a ``timeout`` that is not a finite number of seconds > 0 (refused even when the
                cached profile is returned: nothing would be measured with it).
            ClusterError: the servers were shut down (:meth:`shutdown`).
        """
        self.check_running()
        if "timeout" in kwargs:  # (a cached profile is returned without a probe: check the setting here too)
            check_seconds("Link probe timeout", kwargs["timeout"])
        if isinstance(kwargs.get("sizes"), list):
            kwargs["sizes"] = tuple(kwargs["sizes"])
        cached = self._links
        other = cached is not None and any(
            k in kwargs and not (type(kwargs[k]) is type(getattr(cached, k)) and kwargs[k] == getattr(cached, k))
            for k in ("sizes", "repeats"))
        if cached is None or refresh or other:
            from conduit.distributed.links import measure_links

            self._links = measure_links(self, **kwargs)
        return self._links

    def torch_group(self, *, backend: str = "gloo", timeout: float = 60.0, refresh: bool = False,
                    replace_broken: bool = False, create: bool = True) -> Any:
        """The torch.distributed group of this process (rank 0) and these servers, formed on first use.

        One group is formed at a time: a thread that asks while another forms one waits for it (at most that
        formation's ``timeout`` and link measurement) and gets that group. (Two formed at once could deadlock the
        servers, whose data calls run one at a time: one server joining the first group while another joins
        the second, each waiting for the other until both formations time out.)

        Keyword Args:
            backend: ``"gloo"`` or ``"nccl"`` (used when the group is formed).
            timeout: seconds to form it, and the bound on every transfer over it: a finite number > 0.
            refresh: form a new group even when one exists (e.g. after it broke); the old one is closed here
                and the servers are asked to leave it (without waiting: a server may still be stuck in it).
            replace_broken: form a new group (as ``refresh``) only when the existing one is retired
                (:attr:`~conduit.distributed.transport.TorchGroup.broken`); decided under the same lock, so of
                threads that find it retired at once the first forms the new group and the others get that one
                (with ``refresh`` each would form its own, tearing down the one formed just before).
            create: False returns the existing group or None (what ``transport="auto"`` uses).

        Returns:
            A :class:`~conduit.distributed.transport.TorchGroup` (or None, see ``create``).

        Raises:
            ConfigurationError: ``timeout`` is not a finite number of seconds > 0 (checked first: nothing is
                started or torn down).
            ClusterError: the servers were shut down (:meth:`shutdown`), even with ``create=False``: their group
                went with them.
        """
        check_seconds("timeout", timeout)
        self.check_running()
        if not create:
            return self._torch
        with self._torch_lock:
            if self._torch is None or refresh or (replace_broken and self._torch.broken is not None):
                from conduit.distributed.transport import TorchGroup

                old = self._torch
                self._torch = TorchGroup(self, backend=backend, timeout=timeout)
                if old is not None:
                    self._leave(old)
            return self._torch

    def check_running(self) -> None:
        """:class:`ClusterError` after :meth:`shutdown` (a group handed out then was closed, and forming one would
        wait out its whole timeout for servers that are gone)."""
        if self.closed:
            raise ClusterError("These shard servers were shut down; start new ones (ShardServers(...)) for new "
                               "buffers or torch groups.")

    def _leave(self, group: Any) -> None:
        """Close ``group`` here and ask every server to leave it (fire and forget; a dead server left it already)."""
        group.tear_down()

    def kill(self, i: int) -> None:
        """Fence server ``i``: it is killed and never restarts (a lost server must not come back).

        Does nothing when it is dead already, or when Ray was shut down (its actors went with it).

        Raises:
            ClusterError: there is no server ``i`` in this group (nothing is killed).
        """
        if not is_int(i) or not -len(self.servers) <= i < len(self.servers):
            raise ClusterError(f"There is no shard server {i!r}: this group has {len(self.servers)} (0 to "
                               f"{len(self.servers) - 1}); nothing was killed.")
        try:
            with without_auto_init():  # (Ray shut down meanwhile: raise, never start a new Ray)
                ray_module().kill(self.servers[i].actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead (or Ray shut down) is fine
            pass

    def shutdown(self) -> None:
        """Kill every server, and close this process's side of their torch.distributed group (its sockets).

        After ``ray.shutdown()`` (the servers went with it) this starts no new Ray. From then on the group refuses
        new work (:meth:`torch_group`, :meth:`links`, a new buffer on it) with :class:`ClusterError`; calling this
        again is harmless."""
        self.closed = True
        with without_auto_init():
            if self._torch is not None:
                self._torch.close()
                self._torch = None
            for i in range(len(self.servers)):
                self.kill(i)
