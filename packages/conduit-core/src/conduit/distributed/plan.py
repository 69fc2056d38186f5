"""Where ingested items go: the shard plan, costed from measured links.

For a batch of ``B`` bytes produced on node ``P``, storing it in a shard on node ``S``
moves it ``P -> S`` once at ingestion and ``S -> L`` (``L``: the learner's node) ``reuse``
times on average at delivery (replay: how often an item is sampled; on-policy: the number
of epochs)::

    cost(P, S) = B / bandwidth(P, S) + reuse * B / bandwidth(S, L)

with each link's measured effective bandwidth at that size. Per-call overheads are left
out on purpose: one ingestion is one call wherever it goes, and a delivery calls every
shard that holds sampled items, so where one batch goes does not change the number of
calls, only the bytes each link carries (and the measured overheads of a busy machine are
noise that would make the choice random).

Shards are tried cheapest first, subject to room; costs within ``tie`` (relative) or
``tie_seconds`` (absolute) of the cheapest count as equal, and then the producer's node wins (its ingestion call returns
soonest), then the learner's node. So small batches and ``reuse`` near 1 stay on the
producer's node; with a high ``reuse`` large batches are pulled to the learner's node
while it has room. Replicas of one item always go to distinct nodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from conduit.distributed.errors import ClusterError
from conduit.distributed.links import LinkProfile
from conduit.errors import ConfigurationError

__all__ = ["ShardPlan", "Chunk", "pools_needed"]


@dataclass
class Chunk:
    """Rows ``[start, start + count)`` of a batch and the shards holding their replicas."""

    start: int
    count: int
    shards: list[int]


class ShardPlan:
    """Routes ingestion over shards.

    Args:
        shard_nodes: the node of each shard (index = shard number).
        learner_node: where delivered batches go.

    Keyword Args:
        links: measured links (None: count node crossings instead, one at ingestion and ``reuse``
            at delivery). Deliveries are priced from the links to ``learner_node``, so they must name the link from
            every shard's node to it (measured to that node, or declared); ingestion from a producer node they do
            not name is priced as the slowest measured link of its kind.
        reuse: expected deliveries per stored item.
        tie: relative cost difference below which two shards count as equally cheap.
        tie_seconds: absolute cost difference below which two shards count as equally cheap.

    Raises:
        ClusterError: ``reuse`` < 0.
        ConfigurationError: ``links`` name no link from a shard's node to ``learner_node`` (deliveries would be
            priced from other nodes' links).
    """

    def __init__(self, shard_nodes: Sequence[str], learner_node: str, *, links: LinkProfile | None = None,
                 reuse: float = 1.0, tie: float = 0.1, tie_seconds: float = 1e-3) -> None:
        if reuse < 0:
            raise ClusterError(f"reuse must be >= 0, got {reuse}.")
        if links is not None:
            missing = [n for n in dict.fromkeys(shard_nodes) if (n, learner_node) not in links.links]
            if missing:
                raise ConfigurationError(
                    f"The links name no link to the learner's node {learner_node[:8]} from the shards' node(s) "
                    f"{[n[:8] for n in missing]}, so deliveries cannot be priced (links measured from node "
                    f"{links.learner_node[:8]} reach only the servers' nodes and that one); measure them to the "
                    f"learner's node, declare them, or pass links=None to rank shards by locality.")
        self.shard_nodes = list(shard_nodes)
        self.learner_node = learner_node
        self.links = links
        self.reuse = float(reuse)
        self.tie = float(tie)
        self.tie_seconds = float(tie_seconds)

    def transfer_seconds(self, src: str, dst: str, nbytes: float) -> float:
        """Seconds the link ``src -> dst`` spends moving ``nbytes`` (its per-call overhead excluded)."""
        assert self.links is not None
        if nbytes <= 0:
            return 0.0
        ln = self.links.links.get((src, dst))
        if ln is not None:
            return nbytes / ln.bandwidth(nbytes)
        same = [v for (a, b), v in self.links.links.items() if (a == b) == (src == dst)]
        if not same:
            return 0.0 if src == dst else float("inf")
        return max(nbytes / v.bandwidth(nbytes) for v in same)  # an unmeasured pair: the slowest of its kind

    def cost(self, producer: str, shard: int, nbytes: float) -> float:
        """Predicted seconds to ingest ``nbytes`` from ``producer`` into ``shard`` and deliver them ``reuse`` times."""
        node = self.shard_nodes[shard]
        if self.links is None:
            return float(node != producer) + self.reuse * float(node != self.learner_node)
        return (self.transfer_seconds(producer, node, nbytes)
                + self.reuse * self.transfer_seconds(node, self.learner_node, nbytes))

    def order(self, producer: str, nbytes: float, shards: Sequence[int] | None = None) -> list[int]:
        """Shards cheapest first (ties: producer's node, then learner's node, then shard number)."""
        cand = list(range(len(self.shard_nodes))) if shards is None else list(shards)
        if not cand:
            return []
        costs = {s: self.cost(producer, s, nbytes) for s in cand}
        best = min(costs.values())
        band = best + max(abs(best) * self.tie, self.tie_seconds)

        def key(s: int) -> tuple[int, int, int, float, int]:
            node = self.shard_nodes[s]
            return (costs[s] > band, node != producer, node != self.learner_node, costs[s], s)

        return sorted(cand, key=key)

    def split(self, n: int, producer: str, nbytes: float, rooms: Mapping[int, int], replication: int
              ) -> tuple[list[Chunk], int]:
        """Assign ``n`` rows to shards, ``replication`` copies each on distinct nodes, within ``rooms``.

        Returns:
            (chunks, missing replicas): rows whose extra replicas found no room on another
            node are stored with fewer copies, and counted.

        Raises:
            ClusterError: not even one copy of every row fits in the live shards.
        """
        room = dict(rooms)
        order = self.order(producer, nbytes, list(room))
        chunks = [Chunk(0, n, [])]
        missing = 0
        for level in range(replication):
            placed: list[Chunk] = []
            for ch in chunks:
                used = {self.shard_nodes[s] for s in ch.shards}
                pos, left = ch.start, ch.count
                for s in order:
                    if not left:
                        break
                    if self.shard_nodes[s] in used or room[s] <= 0:
                        continue
                    take = min(room[s], left)
                    room[s] -= take
                    placed.append(Chunk(pos, take, [*ch.shards, s]))
                    pos, left = pos + take, left - take
                if left:
                    if level == 0:
                        total = sum(max(0, r) for r in rooms.values())
                        raise ClusterError(f"{n} items do not fit in the live shards (room for {total}); a shard "
                                           f"was lost or shard_capacity is too small. Raise shard_capacity or add "
                                           f"shard servers.")
                    placed.append(Chunk(pos, left, list(ch.shards)))
                    missing += left
            chunks = placed
        return chunks, missing


def pools_needed(lengths: Any, pool: int) -> int:
    """A lower bound on the ragged pools of ``pool`` elements that items of ``lengths`` elements need, even empty:
    an item is never split between pools, so no placement fits them in fewer (Martello and Toth's bound ``L2``).

    For each ``t`` (0, and every length of at most ``pool / 2``): the items longer than ``pool - t`` need a pool
    each, shared with no item of ``t`` or more; those longer than ``pool / 2`` (and at most ``pool - t``) need one
    each too, and the items of ``t`` to ``pool / 2`` that do not fit in what those leave free need further pools.
    With ``t = 0`` this is at least ``ceil(total / pool)``. Items longer than ``pool`` are counted as one pool each
    (refuse them first).
    """
    w = np.sort(np.asarray(lengths, dtype=np.int64).reshape(-1))
    if not w.size:
        return 0
    cap, half = int(pool), int(pool) // 2  # (an int w is > pool / 2 exactly when w > pool // 2)
    prefix = np.concatenate([[0], np.cumsum(w)])
    n = int(w.size)
    ts = np.unique(np.concatenate([[0], w[w <= half]]))
    above_half = np.searchsorted(w, half, side="right")  # items up to pool // 2 come before it
    big = np.searchsorted(w, cap - ts, side="right")  # items up to pool - t come before it
    n1 = n - big
    n2 = big - above_half
    s2 = prefix[big] - prefix[above_half]
    s3 = prefix[above_half] - prefix[np.searchsorted(w, ts, side="left")]
    rest = s3 - (n2 * cap - s2)
    bound = n1 + n2 + np.where(rest > 0, -(-rest // max(cap, 1)), 0)
    return int(bound.max())
