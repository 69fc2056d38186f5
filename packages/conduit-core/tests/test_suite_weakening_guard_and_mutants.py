"""The conformance suite's weakening guard: broken buffers and weakened suites the earlier rounds let through.

Each mutant is core's reference endpoint (or one of its samplers) with one bug injected, or an adapter's
suite subclass that weakens a check without overriding a test. Each passed every suite check before this
review (``test_mutant_passes_the_older_checks`` and the ``older`` calls below keep that visible), or failed
without saying what was wrong (a bare IndexError or EmptyBufferError escaping the check, or pytest's "DID NOT
RAISE"); the check that now guards the property is called directly and must fail with a message naming the
problem. Controls run the same checks on the unmutated endpoints, so a failure comes from the injected bug,
not the harness.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit.errors import EmptyBufferError, PriorityError, StaleExperienceError
from conduit.semantics import PrioritizedSampler
from conduit.storage.base import AppendResult
from conduit.testing import (
    CAP_CHECKPOINT,
    CAP_CHECKPOINT_BETWEEN_ROLLOUTS,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    ConcurrencySuite,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    Draw,
    EndpointFactory,
    Minibatch,
    ReplaySuite,
)

sys.path.insert(0, str(Path(__file__).parent))
from _suite_mutants import (  # noqa: E402, I001  (the mutant tests' shared harness)
    FAILED,
    OneDrawBehind,
    catches_mutants,
    controls_pass,
    freshness_suite,
    integration_module,
    mutant_id,
    mutant_replay,
    replay_suite,
)


# -- replay mutants -------------------------------------------------------------------------------
class NewItemsGetLiveMax(PrioritizedSampler):
    """New items get the largest priority among the items live now, not the largest ever set: once the item
    holding the top priority is evicted (or lowered), new items come in at the lower live maximum. (What a
    buffer that reads the default from a max-tree over the current priorities does.)"""

    def on_append(self, result: AppendResult, priorities: torch.Tensor | None) -> None:
        st = self.storage
        old = np.arange(max(st.oldest, result.evicted_to), result.first, dtype=np.int64) % st.capacity
        live = self._tree.get(old) if len(old) else np.zeros(0)
        self._max_priority = float(live.max()) ** (1 / self.alpha) if len(live) and live.max() > 0 else 1.0
        super().on_append(result, priorities)


class RestoresEmptySlots(CoreReplayEndpoint):
    """Restores a checkpoint of a partly filled buffer as a full one: the ring's empty slots come back as
    (zero) items. An adapter that saves its whole ring array and sets its size to the capacity on load."""

    def load_state_dict(self, state: Any) -> None:
        st = state["storage"]
        n, cap = st["next"] - st["oldest"], st["capacity"]
        if n < cap:
            st = {**st, "next": st["oldest"] + cap,
                  "data": {k: torch.cat([v, torch.zeros((cap - n, *v.shape[1:]), dtype=v.dtype)])
                           for k, v in st["data"].items()}}
            state = {**state, "storage": st}
        super().load_state_dict(state)


class DeclaresNegativeStaleness(OneDrawBehind):
    """Delivers draws one update late (as OneDrawBehind) and declares ``priority_staleness = -1``: the
    staleness check then looks only at its last draw, which is already fresh."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.priority_staleness = -1


class EmptySampleRaisesIndexError(CoreReplayEndpoint):
    """Sampling an empty buffer raises IndexError (an unguarded ``randint(0, 0)``), not a Conduit error."""

    def sample(self, n: int) -> Draw:
        if len(self) == 0:
            raise IndexError("index 0 is out of bounds for axis 0 with size 0")
        return super().sample(n)


# -- on-policy mutants ----------------------------------------------------------------------------
class FreshEndpointHoldsAnEmptyRollout(CoreOnPolicyEndpoint):
    """A new endpoint delivers one empty rollout (M empty minibatches) before anything was ingested."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._fresh = True

    def consume(self) -> list[Minibatch]:
        if self._fresh:
            self._fresh = False
            return [Minibatch(np.zeros(0, np.int64), 0, 0)]
        return super().consume()


class StaleRaisesEmpty(CoreOnPolicyEndpoint):
    """With ``on_stale="raise"`` a too-stale rollout raises EmptyBufferError (as if nothing were waiting), not
    StaleExperienceError; the rollout stays."""

    def consume(self) -> list[Minibatch]:
        try:
            return super().consume()
        except StaleExperienceError as e:
            raise EmptyBufferError(str(e)) from e


REPLAY_MUTANTS = [
    # (mutant endpoint, suite check, what the message must say)
    (mutant_replay(prioritized=NewItemsGetLiveMax), "test_new_items_get_the_largest_priority_ever_set",
     "after the item holding the largest priority was evicted.*largest priority ever set"),
    (RestoresEmptySlots, "test_checkpoint_round_trip_of_a_partly_filled_buffer",
     "restored buffer .*holds 32 items, the saved one 20"),
    (DeclaresNegativeStaleness, "test_prefetched_priorities_at_most_declared_staleness",
     "priority_staleness = -1.*non-negative"),
    (EmptySampleRaisesIndexError, "test_sampling_empty_buffer_raises", "raised IndexError.*ConduitError"),
]

FRESHNESS_MUTANTS = [
    (FreshEndpointHoldsAnEmptyRollout, "test_endpoint_is_fresh", "new endpoint delivered 1 minibatch"),
    (StaleRaisesEmpty, "test_staleness_bound_raise", "raised EmptyBufferError.*StaleExperienceError"),
]


test_control_replay_passes = controls_pass(replay_suite, CoreReplayEndpoint, REPLAY_MUTANTS)
test_control_freshness_passes = controls_pass(freshness_suite, CoreOnPolicyEndpoint, FRESHNESS_MUTANTS)
test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)
test_freshness_suite_catches_mutant = catches_mutants(freshness_suite, FRESHNESS_MUTANTS)


@pytest.mark.parametrize(("ep", "check"), [
    (mutant_replay(prioritized=NewItemsGetLiveMax), "test_prioritized_frequency_proportional_to_priority_alpha"),
    (mutant_replay(prioritized=NewItemsGetLiveMax), "test_checkpoint_round_trip"),
    (RestoresEmptySlots, "test_checkpoint_round_trip"),
], ids=mutant_id)
def test_mutant_passes_the_older_checks(ep: type, check: str) -> None:
    """Why the new checks are needed: each mutant passes the check that looked closest to catching it."""
    getattr(replay_suite(ep), check)()


# -- the no-weakening guard: an adapter's subclass that weakens a check without overriding a test -----
def _core_replay(self: object, **kw: Any) -> CoreReplayEndpoint:
    return CoreReplayEndpoint(**kw)


def _no_op(self: object, *args: Any) -> None:
    """A helper override that checks nothing."""


@pytest.mark.parametrize(("suite", "attrs", "match"), [
    (ConcurrencySuite, {"_check_producer_order": _no_op},
     r"TestWeak._check_producer_order replaces ConcurrencySuite._check_producer_order, a helper"),
    (ConcurrencySuite, {"_check_payloads": _no_op}, r"replaces ConcurrencySuite._check_payloads"),
    (ReplaySuite, {"_counts": lambda self, ep, n: np.full(n, 1000)}, r"replaces ReplaySuite._counts"),
    (ReplaySuite, {"_set_priorities": _no_op}, r"replaces ReplaySuite._set_priorities"),
    (ConcurrencySuite, {"chunk": 100_000}, r"TestWeak.chunk = 100000 weakens .* chunk = 500 \(the setting raises it\)"),
    (ReplaySuite, {"chunk": 60_000}, r"TestWeak.chunk = 60000 weakens .* chunk = 1000"),
], ids=["producer-order", "payloads", "counts", "set-priorities", "concurrency-chunk", "replay-chunk"])
def test_weakening_without_overriding_a_test_fails_the_guard(suite: type, attrs: dict[str, Any], match: str) -> None:
    """Before this review the guard looked only at ``test_*`` overrides and at sizes that may not be lowered: a
    subclass could replace the helper that makes a test's check (the producer-order or payload check, the draw
    counts, the priority setup) or insert 8 x 1 call of 1e5 items instead of 8 x 200 interleaved calls, and
    pass green."""
    weak = type("TestWeak", (suite,), {"make_replay": _core_replay, **attrs})
    with pytest.raises(AssertionError, match=match):
        weak().test_no_overrides_DO_NOT_OVERRIDE()


def test_the_guard_lets_adapters_add_their_own_helpers_and_smaller_chunks() -> None:
    """What adapters do today stays allowed: their own fixtures and helpers (names the suites do not define),
    a smaller chunk (more interleaved calls), a larger size."""

    @pytest.fixture(autouse=True)
    def _servers(self: object) -> None:
        """An adapter's own fixture (the distributed tests' ``_servers``)."""

    fine = type("TestFine", (ConcurrencySuite,), {"make_replay": _core_replay, "_servers": _servers,
                                                 "chunk": 100, "items_per_thread": 200_000})
    fine().test_no_overrides_DO_NOT_OVERRIDE()
    finer = type("TestFineReplay", (ReplaySuite,), {"make_replay": _core_replay, "chunk": 999})
    finer().test_no_overrides_DO_NOT_OVERRIDE()


def test_distribution_tests_draw_all_their_draws_whatever_the_chunk() -> None:
    """``draws`` is the number of draws: a chunk that does not divide it (allowed: it is smaller) used to cut the
    distribution tests to ``draws // chunk * chunk`` draws (99,900 with chunk 999)."""
    suite = type("TestOddChunk", (ReplaySuite,), {"make_replay": _core_replay, "chunk": 999})()
    with suite.replay(capacity=10, seed=0) as ep:
        ep.insert(np.arange(10))
        assert int(suite._counts(ep, 10).sum()) == suite.draws == 100_000


# -- a refused priority update that still changed state -------------------------------------------
class AppliesUpToTheBadPriority(PrioritizedSampler):
    """Sets priorities one by one and raises at the first bad one (NaN, negative, or no priority left for a
    handle): the updates named before it stay applied. (A per-item ``for h, p in zip(...)`` loop that checks
    as it goes.)"""

    def update(self, handles: torch.Tensor | np.ndarray, priorities: torch.Tensor | np.ndarray) -> int:
        h, p = np.asarray(handles).reshape(-1), np.asarray(priorities, dtype=np.float64).reshape(-1)
        for i, handle in enumerate(h.tolist()):
            if i >= len(p) or not (np.isfinite(p[i]) and p[i] >= 0):
                raise PriorityError(f"bad priority for handle {handle}")
            super().update(np.array([handle]), p[i:i + 1])
        return len(h)


def test_suite_catches_a_refused_update_that_applied_its_first_priorities() -> None:
    """Bad input gets a typed error and leaves the buffer unchanged: the mutant raises PriorityError as it
    should, so only the draws after the refused call show the priorities it set first."""
    ep = mutant_replay(prioritized=AppliesUpToTheBadPriority)
    replay_suite(ep).test_update_for_evicted_handle_is_ignored()  # the mutant passes the older update checks
    replay_suite(ep).test_prioritized_frequency_proportional_to_priority_alpha()
    replay_suite(CoreReplayEndpoint).test_refused_priority_update_changes_nothing()  # control
    with pytest.raises(FAILED, match=r"three refused update_priorities calls .* no longer uniform"):
        replay_suite(ep).test_refused_priority_update_changes_nothing()


# -- integration-tests: a capability only the uniform endpoint declares ----------------------------
class UniformOnlyCheckpoint(CoreReplayEndpoint):
    """Declares CAP_CHECKPOINT only when built uniform: the checkpoint tests run their uniform half, then skip
    at the prioritized half (``needs`` on the prioritized endpoint), and the run reads green with a skip."""

    def __init__(self, *, prioritized: bool = False, **kw: Any) -> None:
        super().__init__(prioritized=prioritized, **kw)
        if prioritized:
            self.capabilities = frozenset({CAP_PRIORITIZED, CAP_CONCURRENT_INGEST})


def test_integration_counts_a_capability_only_both_endpoint_kinds_declare() -> None:
    """The gap check built the default (uniform) endpoint only, so it saw the checkpoint declared and let the
    prioritized checkpoint checks skip unannounced."""
    with pytest.raises(pytest.skip.Exception, match="does not declare 'checkpoint'"):
        replay_suite(UniformOnlyCheckpoint).test_checkpoint_round_trip()
    mod = integration_module()
    f = EndpointFactory("halfcheckpoint", make_replay=UniformOnlyCheckpoint, make_on_policy=CoreOnPolicyEndpoint)
    assert mod.untested(f) == {CAP_CHECKPOINT}
    with pytest.raises(AssertionError, match=r"adapter 'halfcheckpoint' leaves \['checkpoint'\] untested"):
        mod.test_no_conformance_test_is_skipped_unannounced(f)
    full = EndpointFactory("full", make_replay=CoreReplayEndpoint, make_on_policy=CoreOnPolicyEndpoint)
    assert mod.untested(full) == set()


class OnPolicyWithoutCheckpoint(CoreOnPolicyEndpoint):
    capabilities: frozenset[str] = frozenset()


class OnPolicyCheckpointBetweenRollouts(CoreOnPolicyEndpoint):
    capabilities = frozenset({CAP_CHECKPOINT_BETWEEN_ROLLOUTS})


def test_integration_counts_the_on_policy_checkpoint_capabilities() -> None:
    """An on-policy endpoint that stops declaring its checkpoint (both checkpoint tests skip), or declares only the
    one between rollouts (the restore with rollouts waiting goes untested), fails the gap check unless KNOWN_GAPS
    lists what goes untested."""
    mod = integration_module()
    both = [mod.ON_POLICY_CHECKPOINT, mod.ON_POLICY_CHECKPOINT_BETWEEN_ROLLOUTS]
    for endpoint, gaps in ((OnPolicyWithoutCheckpoint, both), (OnPolicyCheckpointBetweenRollouts, both[:1])):
        f = EndpointFactory("onpolicygap", make_replay=CoreReplayEndpoint, make_on_policy=endpoint)
        assert sorted(mod.untested(f)) == gaps
        with pytest.raises(AssertionError, match=rf"adapter 'onpolicygap' leaves {re.escape(str(gaps))} untested"):
            mod.test_no_conformance_test_is_skipped_unannounced(f)
        mod.KNOWN_GAPS["onpolicygap"] = set(gaps)
        mod.test_no_conformance_test_is_skipped_unannounced(f)
        del mod.KNOWN_GAPS["onpolicygap"]


# -- on-policy: a staleness bound of more than one version -----------------------------------------
class StalenessCappedAtOne(CoreOnPolicyEndpoint):
    """Maps max_staleness onto an on/off switch: any bound of 1 or more allows exactly one version of lag."""

    def __init__(self, *, max_staleness: int = 0, **kw: Any) -> None:
        super().__init__(max_staleness=min(max_staleness, 1), **kw)


def test_suite_catches_a_staleness_bound_capped_at_one_version() -> None:
    """Every earlier staleness check used max_staleness 0 or 1 (or a bound no rollout reached), so a bound
    capped at one version passed them all."""
    for check in ("test_staleness_bound_drop", "test_staleness_bound_raise", "test_version_purity",
                  "test_prefetch_never_crosses_a_policy_version"):
        getattr(freshness_suite(StalenessCappedAtOne), check)()
    freshness_suite(CoreOnPolicyEndpoint).test_staleness_bound_of_several_versions()  # control
    with pytest.raises(FAILED, match=r"max_staleness=3 .* are \[\]"):
        freshness_suite(StalenessCappedAtOne).test_staleness_bound_of_several_versions()
