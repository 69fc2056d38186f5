"""The conformance suites fail a sampler that draws per shard and an on-policy buffer that lets an older version
follow a newer one (mutation testing).

The replay mutants put each insert call on one of two "shards" in turn, as the multi-node endpoint puts each call on
one node, and pick a shard before an item. Before ``test_draws_are_over_the_union_of_insert_calls`` the suite saw them
only through side effects (the share of items inserted later, on the other shard); that check names the bug.

The on-policy mutant keeps items of a version below the last ended rollout's in a rollout of their own, delivered after
the others. Without a checkpoint (verl's endpoint declares none) it passed every suite test before
``test_no_rollout_of_an_older_version_after_a_newer_one``; so did core's ``OnPolicy`` with its check of the last sealed
version removed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from conduit.errors import EmptyBufferError
from conduit.testing import CoreOnPolicyEndpoint, Minibatch

sys.path.insert(0, str(Path(__file__).parent))
from _suite_mutants import (  # noqa: E402, I001  (the mutant tests' shared harness)
    MiniReplay,
    catches_mutants,
    controls_pass,
    freshness_suite,
    replay_suite,
)


class PerShardSampler(MiniReplay):
    """Insert calls go to shard 0, 1, 0, 1, ...; a draw picks a shard evenly among those holding items, then an
    item within it (uniformly, or in proportion to p^alpha within the shard)."""

    by_count = False

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.shard = np.zeros(self.cap, dtype=np.int64)
        self.calls = 0

    def insert(self, ids: np.ndarray) -> None:
        with self.lock:
            h = np.arange(self.next, self.next + len(ids))[-self.cap:]
            self.shard[h % self.cap] = self.calls % 2
            self.calls += 1
        super().insert(ids)

    def _slots(self, n: int) -> np.ndarray:
        live = np.arange(self.oldest, self.next) % self.cap
        shards = [live[self.shard[live] == s] for s in (0, 1)]
        shards = [s for s in shards if len(s)]
        odds = np.array([len(s) for s in shards], dtype=np.float64) if self.by_count else np.ones(len(shards))
        pick = self.rng.choice(len(shards), n, p=odds / odds.sum())
        out = np.empty(n, dtype=np.int64)
        for k, slots in enumerate(shards):
            rows = pick == k
            w = self.prio[slots] if self.prioritized else np.ones(len(slots))
            out[rows] = self.rng.choice(slots, int(rows.sum()), p=w / w.sum())
        return out


class PerShardByCount(PerShardSampler):
    """As :class:`PerShardSampler`, picking a shard in proportion to its items: uniform draws are right, prioritized
    ones ignore the shards' priority totals (no global total)."""

    by_count = True


class LateVersionDeliveredLast(CoreOnPolicyEndpoint):
    """Items ingested with a version below the last ended rollout's go to a rollout of their own (their version),
    delivered once the others are: experience of an older policy reaches the learner after a newer one's. (No
    checkpoint: its state would leave the late rollout out.)"""

    capabilities: frozenset[str] = frozenset()

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._late = CoreOnPolicyEndpoint(**kw)
        self._ended: int | None = None
        self._open: int | None = None

    def ingest(self, ids: np.ndarray, version: int) -> None:
        if self._ended is not None and version < self._ended:
            self._late.ingest(ids, version)
            return
        super().ingest(ids, version)
        self._open = version

    def end_rollout(self) -> None:
        super().end_rollout()
        self._late.end_rollout()
        self._ended = self._open if self._open is not None else self._ended

    def set_policy_version(self, version: int) -> None:
        super().set_policy_version(version)
        self._late.set_policy_version(version)

    def consume(self) -> list[Minibatch]:
        try:
            return super().consume()
        except EmptyBufferError:
            return self._late.consume()

    def close(self) -> None:
        self._late.close()
        super().close()


REPLAY_MUTANTS = [
    (PerShardSampler, "test_draws_are_over_the_union_of_insert_calls", "prioritized=False.*chi-square"),
    (PerShardByCount, "test_draws_are_over_the_union_of_insert_calls", "prioritized=True.*chi-square"),
]
FRESHNESS_MUTANTS = [
    (LateVersionDeliveredLast, "test_no_rollout_of_an_older_version_after_a_newer_one", "delivered after it"),
]

test_control_replay_passes = controls_pass(replay_suite, MiniReplay, REPLAY_MUTANTS)
test_control_freshness_passes = controls_pass(freshness_suite, CoreOnPolicyEndpoint, FRESHNESS_MUTANTS)
test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)
test_freshness_suite_catches_mutant = catches_mutants(freshness_suite, FRESHNESS_MUTANTS)

