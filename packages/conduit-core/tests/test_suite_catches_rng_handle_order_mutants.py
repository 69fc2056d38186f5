"""The conformance suite catches RNG, handle and ordering mutants the earlier mutant files let through.

Each mutant below is core's reference endpoint (or one of its samplers) with one bug injected; it
passed every suite check before this review. The suite check that now guards the property is
called directly and must fail with a message naming the problem; a control runs the same checks
on the unmutated endpoints, so a failure comes from the injected bug, not the harness.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit.semantics import PrioritizedSampler
from conduit.storage.base import Storage
from conduit.testing import (
    CAP_CHECKPOINT,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    Draw,
    EndpointFactory,
    Minibatch,
)

sys.path.insert(0, str(Path(__file__).parent))
from _suite_mutants import (  # noqa: E402, I001  (the mutant tests' shared harness)
    FAILED,
    catches_mutants,
    concurrency_suite,
    controls_pass,
    freshness_suite,
    integration_module,
    mutant_id,
    mutant_replay,
    replay_suite,
)


# -- replay mutants -------------------------------------------------------------------------------
class PrioritizedIgnoresSeed(PrioritizedSampler):
    """Prioritized draws always start from seed 0 (uniform draws keep the endpoint's seed)."""

    def reset(self, storage: Storage, seed: int) -> None:
        super().reset(storage, 0)


class PrioritizedSharesOneRng(PrioritizedSampler):
    """Every prioritized buffer of the process draws from one generator, reseeded when a buffer is built."""

    shared = np.random.Generator(np.random.PCG64(0))

    def reset(self, storage: Storage, seed: int) -> None:
        super().reset(storage, seed)
        type(self).shared.bit_generator.state = np.random.Generator(np.random.PCG64(seed)).bit_generator.state
        self._rng = type(self).shared


class HandlesVoidedByEviction(CoreReplayEndpoint):
    """Stamps handles with a counter of evicting inserts and ignores every update whose stamp is older: an
    insert that evicts SOME items voids the handles of all items drawn before it, live ones included."""

    _BITS = 40

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._evictions = 0

    def insert(self, ids: np.ndarray) -> None:
        if len(self) + len(ids) > self.edp.capacity:
            self._evictions += 1
        super().insert(ids)

    def sample(self, n: int) -> Draw:
        d = super().sample(n)
        d.handles = d.handles.numpy() + (self._evictions << self._BITS)
        return d

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        h = np.asarray(handles)
        keep = (h >> self._BITS) == self._evictions
        super().update_priorities(h[keep] & ((1 << self._BITS) - 1), np.asarray(priorities)[keep])


class DropsLastRow(CoreReplayEndpoint):
    """Returns one item fewer than asked for (an off-by-one in the adapter's batch assembly)."""

    def sample(self, n: int) -> Draw:
        d = super().sample(n)
        return Draw(d.ids[:-1], d.handles[:-1], None if d.weights is None else d.weights[:-1])


class TicketHandles(CoreReplayEndpoint):
    """Hands out its own handles (tickets) mapped to core's in a table that ``state_dict`` does not save: after a
    restore, updates through handles drawn before the checkpoint are silently ignored."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._tickets: dict[int, int] = {}

    def sample(self, n: int) -> Draw:
        d = super().sample(n)
        first = len(self._tickets) + 1_000
        tickets = np.arange(first, first + n)
        self._tickets.update(zip(tickets.tolist(), np.asarray(d.handles).tolist(), strict=True))
        d.handles = tickets
        return d

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        keep = [i for i, t in enumerate(np.asarray(handles).tolist()) if t in self._tickets]
        core = np.array([self._tickets[int(np.asarray(handles)[i])] for i in keep], dtype=np.int64)
        super().update_priorities(core, np.asarray(priorities)[keep])


class ReversesBulkInserts(CoreReplayEndpoint):
    """Stores the items of an insert call of 500 or more in reverse order (a bulk path with a wrong stride);
    the replay suite's inserts are all smaller, so only the concurrency suite's producers take that path."""

    def insert(self, ids: np.ndarray) -> None:
        super().insert(ids[::-1].copy() if len(ids) >= 500 else ids)


class SwapsEachProducersCalls(CoreReplayEndpoint):
    """Two ingest workers: each producer's odd-numbered insert call is stored before its even-numbered one
    (a pool of writers that lets a thread's later batch overtake its earlier one)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._held: dict[int, np.ndarray] = {}

    def insert(self, ids: np.ndarray) -> None:
        me = threading.get_ident()
        held = self._held.pop(me, None)
        if held is None and len(ids) == 500:
            self._held[me] = ids
            return
        super().insert(ids)
        if held is not None:
            super().insert(held)


# -- on-policy mutants ----------------------------------------------------------------------------
class SplitsRolloutByIngestCall(CoreOnPolicyEndpoint):
    """Makes each ``ingest`` call of a rollout a rollout of its own when the rollout ends: a rollout ingested
    in parts is delivered as several small ones (M minibatches each), not as one."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._parts: list[tuple[np.ndarray, int]] = []

    def ingest(self, ids: np.ndarray, version: int) -> None:
        self._parts.append((np.asarray(ids), version))

    def end_rollout(self) -> None:
        for ids, version in self._parts:
            super().ingest(ids, version)
            super().end_rollout()
        self._parts = []


class ShufflesWithinIngestCalls(CoreOnPolicyEndpoint):
    """Delivers each epoch as the ingest calls' items in call order, each call's items shuffled among
    themselves only (the minibatch sizes and the per-epoch permutation stay right)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._calls: list[np.ndarray] = []

    def ingest(self, ids: np.ndarray, version: int) -> None:
        super().ingest(ids, version)
        self._calls.append(np.asarray(ids))

    def consume(self) -> list[Minibatch]:
        mbs = super().consume()
        rank = {int(i): k for k, c in enumerate(self._calls) for i in c.tolist()}
        self._calls = []
        out = []
        for e in sorted({m.epoch for m in mbs}):
            part = [m for m in mbs if m.epoch == e]
            ids = np.concatenate([m.ids for m in part])
            ids = ids[np.argsort([rank[int(i)] for i in ids], kind="stable")]
            cuts = np.cumsum([len(m.ids) for m in part])[:-1]
            out += [Minibatch(c, part[0].version, e) for c in np.split(ids, cuts)]
        return out


REPLAY_MUTANTS = [
    (mutant_replay(prioritized=PrioritizedIgnoresSeed), "test_deterministic_under_seed",
     "prioritized.*different seeds drew the same items"),
    (mutant_replay(prioritized=PrioritizedSharesOneRng), "test_deterministic_under_seed",
     "prioritized.*share an RNG"),
    (HandlesVoidedByEviction, "test_update_for_live_handle_drawn_before_an_eviction_is_applied",
     "item 7 .*was not applied"),
    (DropsLastRow, "test_uniform_draws_are_uniform", "sample\\(1000\\) returned 999 ids"),
    (DropsLastRow, "test_prioritized_frequency_proportional_to_priority_alpha", "returned 999 ids"),
    (TicketHandles, "test_checkpoint_round_trip", "handle drawn before state_dict\\(\\).*after load_state_dict"),
]

FRESHNESS_MUTANTS = [
    (SplitsRolloutByIngestCall, "test_rollout_ingested_in_several_calls_is_one_rollout",
     "ingested in 3 calls.*delivered as 10 of its 30 items"),
    (ShufflesWithinIngestCalls, "test_rollout_ingested_in_several_calls_is_one_rollout",
     "one call after another"),
]


test_control_replay_passes = controls_pass(replay_suite, CoreReplayEndpoint, REPLAY_MUTANTS)
test_control_freshness_passes = controls_pass(freshness_suite, CoreOnPolicyEndpoint, FRESHNESS_MUTANTS)
test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)
test_freshness_suite_catches_mutant = catches_mutants(freshness_suite, FRESHNESS_MUTANTS)


@pytest.mark.parametrize(("ep", "check"), [
    (HandlesVoidedByEviction, "test_update_for_evicted_handle_is_ignored"),
    (SplitsRolloutByIngestCall, "test_each_item_exactly_once_per_epoch"),
    (SplitsRolloutByIngestCall, "test_version_purity"),
    (ShufflesWithinIngestCalls, "test_each_item_exactly_once_per_epoch"),
], ids=mutant_id)
def test_mutant_passes_the_older_checks(ep: type, check: str) -> None:
    """Why the new checks are needed: each mutant passes the check that looked closest to catching it."""
    suite = replay_suite(ep) if issubclass(ep, CoreReplayEndpoint) else freshness_suite(ep)
    getattr(suite, check)()


@pytest.mark.parametrize("ep", [ReversesBulkInserts, SwapsEachProducersCalls], ids=mutant_id)
def test_concurrency_suite_catches_reordered_producer(ep: type) -> None:
    """Nothing is lost or duplicated, but a producer's items are stored out of its insertion order; the
    replay suite's FIFO check (small single-threaded inserts) passes. (The control, core's endpoint passing
    the same check, is test_conformance_catches_mutants.py's test_control_concurrency_passes.)"""
    replay_suite(ep).test_fifo_eviction_and_capacity()
    with pytest.raises(FAILED, match=r"producer \d's items were not stored in the order it inserted them"):
        concurrency_suite(ep).test_concurrent_producers_lose_and_duplicate_nothing()


# -- integration-tests: a capability an adapter stops declaring is not a silent skip ------------------
class NoConcurrentIngest(CoreReplayEndpoint):
    """An adapter's replay endpoint that does not declare CAP_CONCURRENT_INGEST: the concurrency suite skips."""

    capabilities = frozenset({CAP_PRIORITIZED, CAP_CHECKPOINT})


def test_integration_fails_for_an_adapter_whose_suite_tests_would_skip() -> None:
    """Before this review an adapter that stopped declaring a capability (or building an endpoint kind) still
    gave a green integration run, its conformance tests skipped; now that fails unless KNOWN_GAPS lists it."""
    mod = integration_module()
    full = EndpointFactory("full", make_replay=CoreReplayEndpoint, make_on_policy=CoreOnPolicyEndpoint)
    mod.test_no_conformance_test_is_skipped_unannounced(full)
    lacking = EndpointFactory("lacking", make_replay=NoConcurrentIngest, make_on_policy=CoreOnPolicyEndpoint)
    assert mod.untested(lacking) == {CAP_CONCURRENT_INGEST}
    with pytest.raises(AssertionError, match=r"adapter 'lacking' leaves \['concurrent_ingest'\] untested"):
        mod.test_no_conformance_test_is_skipped_unannounced(lacking)
    replay_only = EndpointFactory("replayonly", make_replay=CoreReplayEndpoint)
    with pytest.raises(AssertionError, match=r"adapter 'replayonly' leaves \['on_policy'\] untested"):
        mod.test_no_conformance_test_is_skipped_unannounced(replay_only)
    mod.KNOWN_GAPS["replayonly"] = {"on_policy"}
    mod.test_no_conformance_test_is_skipped_unannounced(replay_only)
