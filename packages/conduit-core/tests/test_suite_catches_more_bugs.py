"""The conformance suite fails broken endpoints (mutation testing): more of them than test_suite_catches_bugs.py.

``MiniReplay`` is a small, correct, pure-NumPy replay endpoint (slot-based ring, handles
stamped with their insertion index); each mutant breaks one semantic. The on-policy
mutants post-process the core endpoint's deliveries.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit.testing import (
    CAP_CHECKPOINT,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    Draw,
    Minibatch,
    ReplaySuite,
)

sys.path.insert(0, str(Path(__file__).parent))
from _suite_mutants import (  # noqa: E402, I001  (the mutant tests' shared harness)
    FAILED,
    MiniReplay,
    catches_mutants,
    concurrency_suite,
    freshness_suite,
    replay_suite,
)


# -- replay mutants -----------------------------------------------------------------------
class SamplesEmptySlots(MiniReplay):
    """Uniform draws over every slot of the ring, live or not (fine once full)."""

    def _slots(self, n: int) -> np.ndarray:
        return super()._slots(n) if self.prioritized else self.rng.integers(0, self.cap, n)


class NewestHalf(MiniReplay):
    """Uniform draws over the newer half of the live items only."""

    def _slots(self, n: int) -> np.ndarray:
        if self.prioritized:
            return super()._slots(n)
        k = len(self) // 2 + self.rng.integers(0, len(self) - len(self) // 2, n)
        return (self.oldest + k) % self.cap


class ReseedsOnLoad(MiniReplay):
    """The checkpoint keeps the seed, not the RNG state: a restored buffer restarts the stream."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.seed = kw.get("seed", 0)

    def state_dict(self) -> Any:
        s = super().state_dict()
        s["rng"] = self.seed
        return s

    def load_state_dict(self, state: Any) -> None:
        s = dict(state)
        self.seed = s.pop("rng")
        s["rng"] = np.random.default_rng(self.seed).bit_generator.state
        super().load_state_dict(s)


class ReseedsOnLoadUniformOnly(ReseedsOnLoad):
    """As ReseedsOnLoad, for an endpoint without prioritized sampling."""

    capabilities = frozenset({CAP_CHECKPOINT})


class LosesWriteCursor(MiniReplay):
    """The checkpoint drops the ring's write cursor: after restore the next insert evicts the wrong items."""

    def state_dict(self) -> Any:
        s = super().state_dict()
        s["size"] = len(self)
        del s["next"]
        return s

    def load_state_dict(self, state: Any) -> None:
        s = dict(state)
        s["next"] = s.pop("size")
        super().load_state_dict(s)


class GlobalRng(MiniReplay):
    """Draws from NumPy's global RNG, seeded at construction: shared by every endpoint of the process."""

    def _make_rng(self, seed: int) -> Any:
        np.random.seed(seed)
        return self

    def integers(self, lo: int, hi: int, n: int) -> np.ndarray:
        return np.random.randint(lo, hi, n)

    def choice(self, k: int, n: int, p: np.ndarray) -> np.ndarray:
        return np.random.choice(k, n, p=p)


class IgnoresSeed(MiniReplay):
    def _make_rng(self, seed: int) -> Any:
        return np.random.default_rng(0)


class OffByOneGeneration(MiniReplay):
    """Accepts an update for the most recently evicted handle (``>= oldest - 1``)."""

    def _live(self, h: np.ndarray) -> np.ndarray:
        return (h >= self.oldest - 1) & (h < self.next)


class AllOrNothingUpdates(MiniReplay):
    """Drops a whole update call when any of its handles was evicted."""

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        if self._live(np.asarray(handles)).all():
            super().update_priorities(handles, priorities)


class WeightsOffByConstant(MiniReplay):
    def sample(self, n: int) -> Draw:
        d = super().sample(n)
        if d.weights is not None:
            d.weights = d.weights * 0.9
        return d


class DuplicatesUnderConcurrency(CoreReplayEndpoint):
    """Re-inserts the last item of a call whenever the call before it came from another thread.

    (Several producers switch threads at least once whatever the interleaving, so the bug always
    shows; a mutant that needed two calls to overlap in time missed it on a loaded machine.)
    """

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._last: int | None = None
        self._lk = threading.Lock()

    def insert(self, ids: np.ndarray) -> None:
        me = threading.get_ident()
        with self._lk:
            switched = self._last is not None and self._last != me
            self._last = me
        super().insert(ids)
        if switched:
            super().insert(ids[-1:])


# -- on-policy mutants --------------------------------------------------------------------
def _recut(mbs: list[Minibatch], cut: Any) -> list[Minibatch]:
    out = []
    for e in sorted({m.epoch for m in mbs}):
        part = [m for m in mbs if m.epoch == e]
        ids = np.concatenate([m.ids for m in part])
        out += [Minibatch(c, part[0].version, e) for c in cut(ids, len(part), e)]
    return out


class ShortLastMinibatch(CoreOnPolicyEndpoint):
    """Cuts minibatches of ceil(N/M) items: the last one comes short (N=102, M=4: 26, 26, 26, 24)."""

    def consume(self) -> list[Minibatch]:
        def cut(ids: np.ndarray, m: int, e: int) -> list[np.ndarray]:
            s = -(-len(ids) // m)
            return [ids[i:i + s] for i in range(0, len(ids), s)]
        return _recut(super().consume(), cut)


class SamePartitionEveryEpoch(CoreOnPolicyEndpoint):
    """Permutes once per rollout; later epochs reorder the same minibatches instead of reshuffling."""

    def consume(self) -> list[Minibatch]:
        first: list[np.ndarray] = []

        def cut(ids: np.ndarray, m: int, e: int) -> list[np.ndarray]:
            if e == 0:
                first.extend(np.array_split(ids, m))
                return list(first)
            return [first[(i + e) % m][::-1] for i in range(m)]
        return _recut(super().consume(), cut)


REPLAY_TESTS = [n for n in dir(ReplaySuite) if n.startswith("test_")]


@pytest.mark.parametrize("name", REPLAY_TESTS)
def test_mini_replay_conforms(name: str) -> None:
    """The mutants' base is correct: any failure below comes from the injected bug (the replay mutants' control,
    over every check of the suite)."""
    getattr(replay_suite(MiniReplay), name)()


REPLAY_MUTANTS = [
    # (mutant endpoint, suite check, what the message must say)
    # gaps the suite let through before this review
    (SamplesEmptySlots, "test_uniform_draws_are_uniform", "not live|chi-square"),
    (ReseedsOnLoad, "test_checkpoint_round_trip", "draws differently"),
    (ReseedsOnLoadUniformOnly, "test_checkpoint_round_trip", "draws differently"),
    (LosesWriteCursor, "test_checkpoint_round_trip", "after an insert"),
    (GlobalRng, "test_deterministic_under_seed", "interleaved"),
    (IgnoresSeed, "test_deterministic_under_seed", "different seeds"),
    (OffByOneGeneration, "test_update_for_evicted_handle_is_ignored", "stale update"),
    (AllOrNothingUpdates, "test_update_for_evicted_handle_is_ignored", "live handle"),
    # already caught (kept as regression)
    (NewestHalf, "test_uniform_draws_are_uniform", "chi-square"),
    (WeightsOffByConstant, "test_importance_weights", "importance weights"),
]

FRESHNESS_MUTANTS = [
    (ShortLastMinibatch, "test_each_item_exactly_once_per_epoch", "minibatch sizes"),
    (SamePartitionEveryEpoch, "test_each_item_exactly_once_per_epoch", "same minibatches"),
]

test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)
test_freshness_suite_catches_mutant = catches_mutants(freshness_suite, FRESHNESS_MUTANTS)


def test_duplicate_under_concurrency_fails() -> None:
    suite = concurrency_suite(DuplicatesUnderConcurrency, per_thread=20_000)
    with pytest.raises(FAILED, match="stored|duplicates"):
        suite.test_concurrent_producers_lose_and_duplicate_nothing()
