"""The conformance suite fails on broken buffers: each test below breaks one semantic on purpose."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit.semantics.replay import PrioritizedSampler
from conduit.testing import CoreOnPolicyEndpoint, CoreReplayEndpoint, Draw, Minibatch, ReplaySuite

sys.path.insert(0, str(Path(__file__).parent))
from _suite_mutants import catches_mutants, freshness_suite, replay_suite  # noqa: E402, I001  (the shared harness)


class HalfBlind(CoreReplayEndpoint):
    """Draws only from the older half of the buffer."""

    def sample(self, n: int) -> Draw:
        d = super().sample(n)
        live = np.sort(self.contents())
        d.ids = live[d.ids % (len(live) // 2)]
        return d


class IgnoresAlpha(CoreReplayEndpoint):
    """Samples proportionally to p instead of p^alpha."""

    def __init__(self, **kw: Any) -> None:
        kw["alpha"] = 1.0
        super().__init__(**kw)


class NoGenerationCheck(PrioritizedSampler):
    """Applies updates to whatever sits in the slot now."""

    def update(self, handles: torch.Tensor, priorities: torch.Tensor) -> int:
        p = self.check(priorities)
        slots = handles.numpy() % self.storage.capacity
        self._tree.set(slots, p ** self.alpha)
        return len(slots)


class StaleUpdates(CoreReplayEndpoint):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        if kw.get("prioritized"):
            sem = self.edp.semantics
            old = sem.sampler  # type: ignore[attr-defined]
            sem.sampler = NoGenerationCheck(alpha=old.alpha, beta=old.beta)  # type: ignore[attr-defined]
            sem.bind(self.edp.storage)


class WithReplacement(CoreOnPolicyEndpoint):
    """Cuts minibatches from draws with replacement."""

    def consume(self) -> list[Minibatch]:
        mbs = super().consume()
        rng = np.random.default_rng(0)
        pool = np.concatenate([m.ids for m in mbs])
        return [Minibatch(rng.choice(pool, len(m.ids)), m.version, m.epoch) for m in mbs]


REPLAY_MUTANTS = [
    (HalfBlind, "test_uniform_draws_are_uniform", "chi-square"),
    (IgnoresAlpha, "test_prioritized_frequency_proportional_to_priority_alpha", "p\\^alpha"),
    (StaleUpdates, "test_update_for_evicted_handle_is_ignored", "stale update"),
]
FRESHNESS_MUTANTS = [
    (WithReplacement, "test_each_item_exactly_once_per_epoch", "not a permutation"),
]

test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)
test_freshness_suite_catches_mutant = catches_mutants(freshness_suite, FRESHNESS_MUTANTS)


def test_overriding_a_suite_test_without_xfail_fails() -> None:
    class S(ReplaySuite):
        def make_replay(self, **kw: Any) -> CoreReplayEndpoint:
            return CoreReplayEndpoint(**kw)

        def test_uniform_draws_are_uniform(self) -> None:  # weakened
            pass

    with pytest.raises(AssertionError, match="without @pytest.mark.xfail"):
        S().test_no_overrides_DO_NOT_OVERRIDE()
