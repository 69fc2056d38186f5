"""Measured links between Ray nodes: per-call overhead and bandwidth, the shard plan's input.

Nothing here is assumed: :func:`measure_links` moves probe payloads through Ray's object
store between every pair of nodes that hold shard servers (and this process's node, where
the learner is): a tiny payload gives the per-call overhead, larger ones the effective
bandwidth at each size. Each directed pair becomes a placement
:class:`~conduit.placement.LinkCost` (``overhead + bytes / bandwidth(bytes)``), the same
link type the placement cost model prices devices with. Same-node pairs measure the
shared-memory path, cross-node pairs the object manager's transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from conduit.distributed._ray import check_seconds, current_node_id, ray_module
from conduit.distributed.errors import ClusterError, RemoteTimeoutError
from conduit.errors import ConfigurationError
from conduit.placement.profile import LinkCost, _median_seconds

if TYPE_CHECKING:
    from conduit.distributed.servers import ShardServers

__all__ = ["LinkProfile", "measure_links", "check_probes"]


def check_probes(sizes: Sequence[int], repeats: int, timeout: float) -> tuple[int, ...]:
    """``sizes`` as ints, once the probe settings are checked (before anything is sent).

    Raises:
        ConfigurationError: no size, a size that is not a positive int, a size given twice (one bandwidth point
            per size), ``repeats`` < 1, or a ``timeout`` that is not a finite number > 0 (a profile without a
            bandwidth point would price every transfer as free).
    """
    try:
        sz = tuple(sizes)
    except TypeError:  # (one int: a size, not sizes)
        sz = ()
    if not sz or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x <= 0 for x in sz):
        raise ConfigurationError(f"Link probe sizes must be one or more positive ints (bytes), got {sizes!r}; e.g. "
                                 f"sizes=(1 << 18, 1 << 22).")
    if len(set(int(x) for x in sz)) < len(sz):
        raise ConfigurationError(f"Link probe sizes must be distinct (one bandwidth point per size), got {sizes!r}; "
                                 f"give each size once.")
    if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise ConfigurationError(f"Link probe repeats must be an int >= 1, got {repeats!r}.")
    check_seconds("Link probe timeout", timeout)
    return tuple(int(x) for x in sz)


@dataclass
class LinkProfile:
    """Measured links between nodes, keyed by (source node, destination node)."""

    links: dict[tuple[str, str], LinkCost] = field(default_factory=dict)
    #: the node the profile was measured from (where the learner runs)
    learner_node: str = ""
    #: probe sizes and repeats used
    sizes: tuple[int, ...] = ()
    repeats: int = 0
    #: the delivery path measured: ``"object_store"`` (Ray) or ``"torch"`` (torch.distributed)
    transport: str = "object_store"

    def link(self, src: str, dst: str) -> LinkCost:
        """The link from ``src`` to ``dst``.

        Raises:
            ClusterError: the pair was not measured.
        """
        try:
            return self.links[(src, dst)]
        except KeyError:
            raise ClusterError(f"No measured link {src[:8]} -> {dst[:8]}; measure again with the servers of both "
                               f"nodes (ShardServers.links(refresh=True)).") from None

    def seconds(self, src: str, dst: str, nbytes: float) -> float:
        return self.link(src, dst).seconds(nbytes)

    def table(self) -> list[dict[str, Any]]:
        """One row per link (node ids shortened), for reports: a ``MBps@<size>`` column per bandwidth point, its size
        named exactly (see :func:`_size_label`), so distinct probe sizes get distinct columns."""
        return [{"src": s[:8], "dst": d[:8], "same_node": s == d, "overhead_ms": ln.overhead_s * 1e3,
                 **{f"MBps@{_size_label(b)}": bw / 1e6 for b, bw in ln.points}}
                for (s, d), ln in sorted(self.links.items())]


def _size_label(nbytes: float) -> str:
    """``nbytes`` named exactly and readably: ``"256KiB"`` for a whole number of KiB, else ``"1500B"`` (or the
    float's repr for a fraction of a byte, e.g. a declared point). Distinct sizes get distinct labels."""
    b = float(nbytes)
    if b.is_integer():
        n = int(b)
        return f"{n >> 10}KiB" if n and n % 1024 == 0 else f"{n}B"
    return f"{b!r}B"


def measure_links(servers: ShardServers, *, sizes: Sequence[int] = (1 << 18, 1 << 22), repeats: int = 3,
                  timeout: float = 60.0) -> LinkProfile:
    """Measure every directed link between the servers' nodes and this process's node.

    Args:
        servers: one server per node is used as that node's probe.

    Keyword Args:
        sizes: probe payload sizes in bytes for the bandwidth points (the per-call overhead
            comes from an 8-byte probe).
        repeats: timed transfers per size (the median is used), after one warm-up.
        timeout: seconds for one probe transfer.

    Raises:
        ConfigurationError: bad probe settings (see :func:`check_probes`); nothing is sent.
        RemoteTimeoutError: a probe did not finish within ``timeout``.
        ClusterError: a server is gone (its actor or its node died).
    """
    sizes = check_probes(sizes, repeats, timeout)
    ray = ray_module()

    here = current_node_id()
    probe: dict[str, Any] = {}
    for s in servers.servers:
        probe.setdefault(s.node_id, s.actor)
    node_of = {s.actor._actor_id.hex(): s.node_id for s in servers.servers}  # to name the node of a dead server

    def get(ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise RemoteTimeoutError(f"A link probe did not finish within {timeout:g} s; the cluster is "
                                     f"overloaded or a node is unreachable.") from e
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            node = node_of.get(str(getattr(e, "actor_id", None)), "?")
            raise ClusterError(f"The shard server on node {node[:8]} is gone ({type(e).__name__}), so the links "
                               f"to it cannot be measured; start the ShardServers again on alive nodes "
                               f"(alive_nodes()).") from e

    pairs: dict[tuple[str, str], Callable[[int], Callable[[], Any]]] = {}
    for a, actor_a in probe.items():
        for b, actor_b in probe.items():
            def server_to_server(x: int, pa: Any = actor_a, pb: Any = actor_b) -> Callable[[], Any]:
                return lambda: get(pb.sink.remote(pa.probe.remote(x)))

            pairs[(a, b)] = server_to_server
    payloads = {x: np.ones(x, dtype=np.uint8) for x in sizes}
    for a, actor_a in probe.items():
        if a == here:  # same-node links are measured one way on every node (server to server), comparably
            continue

        def server_to_here(x: int, pa: Any = actor_a) -> Callable[[], Any]:
            return lambda: get(pa.probe.remote(x))

        def here_to_server(x: int, pa: Any = actor_a) -> Callable[[], Any]:
            return lambda: get(pa.sink.remote(ray.put(payloads[x])))

        pairs[(a, here)] = server_to_here
        pairs[(here, a)] = here_to_server
    payloads[8] = np.ones(8, dtype=np.uint8)
    prof = LinkProfile(learner_node=here, sizes=tuple(sizes), repeats=repeats)
    for key, make in pairs.items():
        samples = []
        for x in (8, *sizes):
            samples.append((x, _median_seconds(make(x), reps=repeats, warmup=1, min_total=0)))
        prof.links[key] = LinkCost.fit_or_bound(samples[1:], samples[0][1])
    return prof
