"""Honest conformance tests: every suite check fails, with a readable message, on a buffer that breaks it.

Each mutant is a real core object (sampler, on-policy semantics or endpoint) subclassed to
inject one bug. The suite class is bound to the mutant and the one check that guards the
broken property is called directly; it must raise an assertion (or ``pytest.fail``) whose
message names the problem. A control runs the same checks through the same harness on the
unmutated parts, so a failure below comes from the injected bug, not from the harness.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit.edp import ExperienceDataPlane
from conduit.errors import ConfigurationError, StaleExperienceError
from conduit.semantics import OnPolicy, PrioritizedSampler, Semantics, UniformSampler
from conduit.semantics.base import SampleInfo, Selection
from conduit.storage.base import AppendResult
from conduit.testing import (
    CAP_PRIORITIZED,
    ConcurrencySuite,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    Draw,
    EndpointFactory,
    FreshnessSuite,
    Minibatch,
    ReplaySuite,
    assert_deterministic_across_processes,
    draws_in_subprocess,
)
from conduit.testing.reference import ID_SCHEMA

sys.path.insert(0, str(Path(__file__).parent))
from _suite_mutants import (  # noqa: E402, I001  (the mutant tests' shared harness)
    FAILED,
    MutantReplay,
    OneDrawBehind,
    catches_mutants,
    concurrency_suite,
    controls_pass,
    freshness_suite,
    integration_module,
    mutant_replay,
    replay_suite,
)


# -- harness (MutantReplay / mutant_replay are in _suite_mutants) ----------------------------
class MutantOnPolicy(CoreOnPolicyEndpoint):
    """Core's on-policy endpoint with its semantics swapped for a subclass of :class:`OnPolicy`."""

    semantics: type[OnPolicy] = OnPolicy

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> Any:
        assert isinstance(semantics, OnPolicy)
        s = semantics
        sem = self.semantics(num_minibatches=s.num_minibatches, num_epochs=s.num_epochs,
                             max_staleness=s.max_staleness, on_stale=s.on_stale, seed=s.seed)
        return super()._build(capacity, sem, **kwargs)


# -- uniform sampler mutants -----------------------------------------------------------------
class NeverNewest(UniformSampler):
    """Draws from [oldest, next_handle - 1): the newest item is never drawn."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        st = self.storage
        handles = torch.randint(st.oldest, max(st.oldest + 1, st.next_handle - 1), (n,), generator=self._gen)
        return Selection(self._slots(handles), SampleInfo(handles=handles))


class SlotZeroTwice(UniformSampler):
    """The item in ring slot 0 is drawn about twice as often as any other."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        sel = super().sample(n, replace=replace, beta=beta)
        st = self.storage
        size = st.next_handle - st.oldest
        slot0 = st.oldest + (-st.oldest) % st.capacity  # the live handle in slot 0
        hit = torch.rand(n, generator=self._gen) < 1.0 / size
        handles = torch.where(hit, torch.tensor(slot0), sel.info.handles)
        sel.info.handles = handles
        return Selection(self._slots(handles), sel.info)


class UniformDropsRng(UniformSampler):
    """A checkpoint without the RNG state: the restored buffer keeps drawing from its own seed."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# -- prioritized sampler mutants -------------------------------------------------------------
class WeightsOffByFactor(PrioritizedSampler):
    """Importance weights twice what they should be."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        sel = super().sample(n, replace=replace, beta=beta)
        assert sel.info.weights is not None
        sel.info.weights = sel.info.weights * 2
        return sel


class WeightsNormalisedPerBatch(PrioritizedSampler):
    """Importance weights normalised by the largest weight in the batch, not the largest possible one."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        sel = super().sample(n, replace=replace, beta=beta)
        assert sel.info.weights is not None
        sel.info.weights = sel.info.weights / sel.info.weights.max()
        return sel


class PriorityWithoutAlpha(PrioritizedSampler):
    """Stores p instead of p^alpha on updates."""

    def update(self, handles: Any, priorities: Any) -> int:
        p = self.check(priorities)
        return super().update(handles, p ** (1.0 / self.alpha))


class NewItemsGetOne(PrioritizedSampler):
    """New items get priority 1.0 instead of the largest priority seen so far."""

    def on_append(self, result: AppendResult, priorities: torch.Tensor | None) -> None:
        seen, self._max_priority = self._max_priority, 1.0
        try:
            super().on_append(result, priorities)
        finally:
            self._max_priority = max(seen, self._max_priority)


class UpdatesEvictedOccupants(PrioritizedSampler):
    """Applies an update for an evicted handle to the slot's new occupant (no generation check)."""

    def update(self, handles: Any, priorities: Any) -> int:
        p, h = self.check(priorities), self.check_handles(handles)
        self._tree.set(h % self.storage.capacity, p ** self.alpha)
        self._max_priority = max(self._max_priority, float(p.max(initial=0.0)))
        return int(h.size)


class UnseededAfterUpdate(PrioritizedSampler):
    """Draws from a generator the OS seeds once priorities were updated: the endpoint's seed decides the draws only
    until the first update (every earlier determinism call drew without updating, so all of them passed)."""

    def update(self, handles: Any, priorities: Any) -> int:
        out = super().update(handles, priorities)
        self._rng = np.random.default_rng()
        return out


class PrioritizedDropsRng(PrioritizedSampler):
    """A checkpoint that keeps the priorities but not the RNG state."""

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        del state["rng"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({**state, "rng": self._rng.bit_generator.state})


class DropsMaxPriority(PrioritizedSampler):
    """A checkpoint that forgets the largest priority seen: items ingested after a restore get 1.0."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({**state, "max_priority": 1.0})


# -- endpoint mutants ------------------------------------------------------------------------
class EvictsNewest(CoreReplayEndpoint):
    """When full, the incoming items are discarded instead of the oldest ones."""

    def insert(self, ids: np.ndarray) -> None:
        room = self.edp.capacity - len(self)
        if room > 0:
            super().insert(ids[:room])


class TwoDrawsBehind(OneDrawBehind):
    """Prefetches two draws ahead but declares priority_staleness 1."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.priority_staleness = 1
        self._queue: list[Draw] = []

    def sample(self, n: int) -> Draw:
        while len(self._queue) < 3:
            self._queue.append(CoreReplayEndpoint.sample(self, n))
        return self._queue.pop(0)


class HandlesAreSlots(PrioritizedSampler):
    """Returns ring slots as handles: after the ring wraps, updates for live items look evicted."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        sel = super().sample(n, replace=replace, beta=beta)
        sel.info.handles = sel.slots.clone()
        return sel


class LosesOneIn1e5(CoreReplayEndpoint):
    """A concurrent insert path that loses one item in 10^5."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._lock = threading.Lock()
        self._seen = 0

    def insert(self, ids: np.ndarray) -> None:
        with self._lock:
            before, self._seen = self._seen, self._seen + len(ids)
        lost = (100_000 - before % 100_000) % 100_000  # index in ids of the item that is number k * 1e5
        if lost < len(ids):
            ids = np.delete(ids, lost)
        super().insert(ids)


class TornWriteOneIn1e5(LosesOneIn1e5):
    """Loses one item in 10^5 and stores its neighbour twice (the count stays right)."""

    def insert(self, ids: np.ndarray) -> None:
        with self._lock:
            before, self._seen = self._seen, self._seen + len(ids)
        torn = (100_000 - before % 100_000) % 100_000
        if torn < len(ids) > 1:
            ids = ids.copy()
            ids[torn] = ids[torn - 1 if torn else 1]
        CoreReplayEndpoint.insert(self, ids)


# -- on-policy mutants -----------------------------------------------------------------------
class RepeatsOneItem(OnPolicy):
    """Each epoch serves its first item twice and skips another."""

    def _start_epoch(self) -> None:
        super()._start_epoch()
        assert self._perm is not None
        self._perm = self._perm.clone()
        self._perm[-1] = self._perm[0]


class SameOrderEveryEpoch(OnPolicy):
    """Every epoch of a rollout visits the items in the same order (no reshuffle)."""

    def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))


class MixesVersions(OnPolicy):
    """Items of a new version join the open rollout instead of sealing it."""

    def on_append(self, result: AppendResult, *, version: int | None, priorities: torch.Tensor | None) -> None:
        v = self._open.version if self._open is not None else version
        super().on_append(result, version=v, priorities=priorities)


class IgnoresStaleness(OnPolicy):
    """Delivers every rollout, however stale."""

    def stale(self, version: int) -> bool:
        return False


class StalenessOffByOne(OnPolicy):
    """Allows one version more staleness than max_staleness."""

    def stale(self, version: int) -> bool:
        return self.policy_version - version > self.max_staleness + 1


class ReportsPolicyVersion(OnPolicy):
    """Reports the learner's policy version instead of the rollout's."""

    def select(self, n: int | None = None, **kw: Any) -> Selection:
        sel = super().select(n, **kw)
        sel.info.version = self.policy_version
        return sel


class DropsThenRaises(OnPolicy):
    """on_stale="raise" raises, but drops the stale rollout first (a refused call that changed state)."""

    def select(self, n: int | None = None, **kw: Any) -> Selection:
        try:
            return super().select(n, **kw)
        except StaleExperienceError:
            if self._sealed:
                self._drop(self._sealed.popleft())
            raise


class DropsAllPending(OnPolicy):
    """on_stale="drop" drops every waiting rollout once one of them is stale."""

    def select(self, n: int | None = None, **kw: Any) -> Selection:
        if self.on_stale == "drop" and any(self.stale(r.version) for r in self._sealed):
            while self._sealed:
                self._drop(self._sealed.popleft())
        return super().select(n, **kw)


class NewestRolloutFirst(OnPolicy):
    """Delivers the newest sealed rollout first."""

    def select(self, n: int | None = None, **kw: Any) -> Selection:
        if self._cur is None:
            self._sealed.reverse()
            try:
                return super().select(n, **kw)
            finally:
                self._sealed.reverse()
        return super().select(n, **kw)


class DeliversOpenRollout(OnPolicy):
    """Delivers the open rollout when no sealed one is waiting (before end_rollout)."""

    def select(self, n: int | None = None, **kw: Any) -> Selection:
        if self._cur is None and not self._sealed:
            self.seal()
        return super().select(n, **kw)


class PrefetchesNextRollout(CoreOnPolicyEndpoint):
    """Prepares the next rollout while delivering one, checking staleness only when preparing."""

    _ready: list[Minibatch] | None = None

    def consume(self) -> list[Minibatch]:
        out = self._ready if self._ready is not None else super().consume()
        try:
            self._ready = super().consume()
        except Exception:  # noqa: BLE001 - nothing to prefetch
            self._ready = None
        return out


# -- mutants found by a later review of the suite ----------------------------------------------
class WithoutReplacement(UniformSampler):
    """Draws without replacement whenever the buffer holds enough items (the endpoint promises replacement)."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        size = self.storage.next_handle - self.storage.oldest
        return super().sample(n, replace=replace and n > size, beta=beta)


class RoundRobin(UniformSampler):
    """Cycles through the live items from a seeded start: perfectly even counts, no randomness after the start."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        st = self.storage
        size = st.next_handle - st.oldest
        start = int(torch.randint(0, size, (1,), generator=self._gen))
        handles = st.oldest + (start + torch.arange(n)) % size
        return Selection(self._slots(handles), SampleInfo(handles=handles))


class RunningMinWeights(PrioritizedSampler):
    """Normalises importance weights by the smallest priority ever stored, kept as a running minimum that an
    evicted item's priority never leaves."""

    def reset(self, storage: Any, seed: int) -> None:
        super().reset(storage, seed)
        self._run_min = np.inf

    def on_append(self, result: AppendResult, priorities: Any) -> None:
        super().on_append(result, priorities)
        self._run_min = min(self._run_min, self._tree.min)

    def update(self, handles: Any, priorities: Any) -> int:
        out = super().update(handles, priorities)
        self._run_min = min(self._run_min, self._tree.min)
        return out

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        sel = super().sample(n, replace=replace, beta=beta)
        leaf = self._tree.get(sel.slots.numpy())
        b = self.beta if beta is None else float(beta)
        sel.info.weights = torch.from_numpy(((self._run_min / leaf) ** b).astype(np.float32))
        return sel


class ForeignIdOnce(CoreReplayEndpoint):
    """One insert (of all threads') stores an id that no producer made in place of its first id."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._lk = threading.Lock()
        self._done = False

    def insert(self, ids: np.ndarray) -> None:
        with self._lk:
            hit, self._done = not self._done, True
        if hit:
            ids = ids.copy()
            ids[0] = 10**9 + 7
        super().insert(ids)


class EpochsInterleaved(CoreOnPolicyEndpoint):
    """Delivers the minibatches of all epochs interleaved (epoch 0's first, epoch 1's first, ...)."""

    def consume(self) -> list[Minibatch]:
        mbs = super().consume()
        epochs = sorted({m.epoch for m in mbs})
        per = [[m for m in mbs if m.epoch == e] for e in epochs]
        return [m for group in zip(*per, strict=True) for m in group]


class LastEpochLabelled(CoreOnPolicyEndpoint):
    """Reports every minibatch's epoch as the last one."""

    def consume(self) -> list[Minibatch]:
        mbs = super().consume()
        last = max(m.epoch for m in mbs)
        return [Minibatch(m.ids, m.version, last) for m in mbs]


class DropsWhatWrapsTheRing(CoreReplayEndpoint):
    """A batch that crosses the ring's end is cut there: the items that would wrap to slot 0 are lost."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._cap, self._written = kw["capacity"], 0

    def insert(self, ids: np.ndarray) -> None:
        pos = self._written % self._cap
        ids = ids[:self._cap - pos]
        self._written += len(ids)
        super().insert(ids)


class LosesFirstItemOfNewVersion(CoreOnPolicyEndpoint):
    """An ingest of a new version that closes the open rollout loses its first item (an off-by-one where the new
    rollout starts): every rollout opened by ``end_rollout`` is whole, so only the version change shows it."""

    _open_version: int | None = None

    def ingest(self, ids: np.ndarray, version: int) -> None:
        if self._open_version is not None and version != self._open_version:
            ids = ids[1:]
        self._open_version = version
        super().ingest(ids, version)

    def end_rollout(self) -> None:
        self._open_version = None
        super().end_rollout()


class LiveRangeFixedAtFirstDraw(UniformSampler):
    """Draws over the live range it read at its first draw (as an index cached once): items inserted later are never
    drawn (every other uniform check inserts before its first draw)."""

    _range: tuple[int, int] | None = None

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        st = self.storage
        if self._range is None:
            self._range = (st.oldest, st.next_handle)
        lo, hi = max(self._range[0], st.oldest), min(self._range[1], st.next_handle)
        if hi <= lo:
            lo, hi = st.oldest, st.next_handle
        handles = torch.randint(lo, hi, (n,), generator=self._gen)
        return Selection(self._slots(handles), SampleInfo(handles=handles))


class WrappedTailKeepsEvictedPriority(PrioritizedSampler):
    """An insert that runs past the ring's end sets the largest priority seen only up to the end: the items written
    into slots 0.. keep the evicted items' priorities (every other prioritized insert stays within the ring's end)."""

    def on_append(self, result: AppendResult, priorities: torch.Tensor | None) -> None:
        cap = self.storage.capacity
        start = result.first % cap
        if priorities is None and start + result.count > cap:
            self._tree.set(np.arange(start, cap), np.full(cap - start, self._max_priority ** self.alpha))
        else:
            super().on_append(result, priorities)


class DropsOneStaleRolloutPerDelivery(OnPolicy):
    """Drops the first stale rollout it meets, then delivers the next one without judging it (an ``if`` where a loop
    belongs): one stale rollout behind another is served (every other staleness check has one stale rollout)."""

    _dropped = False

    def select(self, n: int | None = None, **unknown: Any) -> Selection:
        self._dropped = False
        return super().select(n, **unknown)

    def _drop(self, r: Any) -> None:
        super()._drop(r)
        self._dropped = True

    def stale(self, version: int) -> bool:
        return not self._dropped and super().stale(version)


class OlderVersionJoinsOpenRollout(OnPolicy):
    """Adds items of a version older than the open rollout's (a late producer) to that rollout, under its version,
    where they should be refused (or kept apart): no suite check ingested a version lower than the one before."""

    def check_version_order(self, version: int) -> None:
        pass

    def on_append(self, result: AppendResult, *, version: int | None, priorities: torch.Tensor | None) -> None:
        if self._open is not None and version is not None and version < self._open.version:
            version = self._open.version
        super().on_append(result, version=version, priorities=priorities)


class _ColumnByColumnReads(ExperienceDataPlane):
    """Reads a draw's ids and its payload in two holds of the lock, 2 ms apart."""

    def deliver_now(self, n: int | None = None, **kwargs: Any) -> Any:
        with self._lock:
            sel = self.semantics.select(n, **kwargs)
            batch = self.storage.gather(sel.slots)
        time.sleep(0.002)
        with self._lock:
            batch["obs"].copy_(self.storage.gather(sel.slots)["obs"])
            self.semantics.after_gather(sel)
        return batch, sel.info


class ReadsColumnByColumn(CoreReplayEndpoint):
    """Releases the buffer's lock between reading a draw's ids and reading its payload: an insert that evicts in
    between leaves items with another item's payload (a torn read). Every draw of the other checks is made while
    nothing is inserted, so they all pass."""

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> Any:
        return _ColumnByColumnReads(ID_SCHEMA, capacity=capacity, semantics=semantics, **kwargs)


class GlobalRngOrder(OnPolicy):
    """Shuffles each epoch with torch's global RNG: the endpoint's seed is ignored."""

    def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
        return torch.randperm(n)


def mutant_on_policy(sem: type[OnPolicy]) -> type:
    return type(f"Mutant{sem.__name__}", (MutantOnPolicy,), {"semantics": sem})


# -- on-policy checkpoint mutants: the restore loses one part of the saved state ------------------------------------
class RestoresWithoutOpenRollout(OnPolicy):
    """Restores the ended rollouts but not the open one: its items from before the save are never delivered."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(dict(state, open=None))


class RestoresWithPolicyZero(OnPolicy):
    """Restores everything but the policy version (back to 0): a rollout stale at the saved version is delivered."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(dict(state, policy_version=0))


class RestoresWithoutLastSealed(OnPolicy):
    """Forgets the version of the last ended rollout: after the restore an older version is taken again."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(dict(state, last_sealed=None))


class RestoresWithItsOwnRng(OnPolicy):
    """Keeps its own (seeded) shuffle RNG instead of the saved one."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng = self._gen.get_state()
        super().load_state_dict(state)
        self._gen.set_state(rng)


class SealsOpenRolloutOnRestore(OnPolicy):
    """Ends the open rollout on restore: what is ingested after it becomes a rollout of its own."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.seal()


GlobalRngShuffle = mutant_on_policy(GlobalRngOrder)


# -- mutants that draw the same twice in one process, and differently in the next (PYTHONHASHSEED) ----------------
class HashSeededUniform(UniformSampler):
    """Seeds its generator from ``hash()`` of a string made of the endpoint's seed: the same seed gives the same
    draws within a process, other draws in a process with another ``PYTHONHASHSEED``."""

    def reset(self, storage: Any, seed: int) -> None:
        super().reset(storage, hash(f"uniform-{seed}") % 2**31)


class HashSeededPrioritized(PrioritizedSampler):
    """:class:`HashSeededUniform`'s bug in the prioritized sampler."""

    def reset(self, storage: Any, seed: int) -> None:
        super().reset(storage, hash(f"prioritized-{seed}") % 2**31)


class SetOrderedQuarters(OnPolicy):
    """Cuts each epoch's seeded permutation into quarters and visits them in the iteration order of a set of
    strings (the quarters' names): stable within a process, another order under another ``PYTHONHASHSEED``."""

    def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
        quarters = {f"quarter-{k}": q for k, q in enumerate(super().epoch_order(n, epoch).chunk(4))}
        return torch.cat([quarters[name] for name in set(quarters)])


#: an endpoint factory whose draws follow the process's string hashes: replay seeded through ``hash()``, on-policy
#: ordered by a set of strings; the cross-process checks rebuild it in subprocesses as
#: ``test_conformance_catches_mutants:HASH_DEPENDENT``
HASH_DEPENDENT = EndpointFactory(
    "hash-dependent", make_replay=mutant_replay(uniform=HashSeededUniform, prioritized=HashSeededPrioritized),
    make_on_policy=mutant_on_policy(SetOrderedQuarters))
HASH_DEPENDENT_SPEC = f"{Path(__file__).stem}:HASH_DEPENDENT"


def _refuse(**kwargs: Any) -> Any:
    raise ConfigurationError("no on-policy endpoint here")


#: core's replay endpoint, and an on-policy endpoint that cannot be built (for the subprocess's error report)
REFUSES_ON_POLICY = EndpointFactory("refuses-on-policy", make_replay=CoreReplayEndpoint, make_on_policy=_refuse)


class LeavesAThreadRunning(CoreReplayEndpoint):
    """``close()`` leaves a non-daemon thread running: a process that used the endpoint never exits."""

    def close(self) -> None:
        super().close()
        threading.Thread(target=threading.Event().wait, name="left-running-by-close", daemon=False).start()


def _crash_in_native_code(**kwargs: Any) -> Any:
    """A replay endpoint whose construction crashes the process (a segmentation fault in native code)."""
    import ctypes

    return ctypes.string_at(0)


#: endpoints that leave the subprocess running after its report, or crash it (the cross-process check's reports)
LEAVES_A_THREAD = EndpointFactory("leaves-a-thread", make_replay=LeavesAThreadRunning)
CRASHES = EndpointFactory("crashes", make_replay=_crash_in_native_code)


class PrioritizedUnderHashSeedOne(CoreReplayEndpoint):
    """Declares CAP_PRIORITIZED only in a process with PYTHONHASHSEED=1 (a capability read from something hash()
    changes): the two processes of the cross-process check make different entries."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        if os.environ.get("PYTHONHASHSEED") != "1":
            self.capabilities = self.capabilities - {CAP_PRIORITIZED}


CAPS_FOLLOW_HASH_SEED = EndpointFactory("caps-follow-hash-seed", make_replay=PrioritizedUnderHashSeedOne)


REPLAY_MUTANTS = [
    # (mutant endpoint, suite check, what the message must say)
    (mutant_replay(uniform=NeverNewest), "test_uniform_draws_are_uniform", "chi-square"),
    (mutant_replay(uniform=SlotZeroTwice), "test_uniform_draws_are_uniform", "chi-square"),
    (mutant_replay(uniform=UniformDropsRng), "test_checkpoint_round_trip", "draws differently"),
    (mutant_replay(prioritized=WeightsOffByFactor), "test_importance_weights", "importance weights"),
    (mutant_replay(prioritized=WeightsOffByFactor), "test_prefetched_priorities_at_most_declared_staleness",
     "importance weights"),
    (mutant_replay(prioritized=WeightsNormalisedPerBatch), "test_importance_weights", "normalised over the batch"),
    (mutant_replay(prioritized=PriorityWithoutAlpha), "test_prioritized_frequency_proportional_to_priority_alpha",
     "p\\^alpha"),
    (mutant_replay(prioritized=NewItemsGetOne), "test_prioritized_frequency_proportional_to_priority_alpha",
     "largest priority seen"),
    (mutant_replay(prioritized=UpdatesEvictedOccupants), "test_update_for_evicted_handle_is_ignored",
     "stale update"),
    (mutant_replay(prioritized=PrioritizedDropsRng), "test_checkpoint_round_trip", "draws differently"),
    (mutant_replay(prioritized=UnseededAfterUpdate), "test_deterministic_under_seed",
     "prioritized=True: two endpoints with the same seed drew different items"),
    (mutant_replay(prioritized=DropsMaxPriority), "test_checkpoint_round_trip", "largest priority seen was not"),
    (EvictsNewest, "test_fifo_eviction_and_capacity", "newest 10"),
    (OneDrawBehind, "test_prefetched_priorities_at_most_declared_staleness", "old priorities"),
    (TwoDrawsBehind, "test_prefetched_priorities_at_most_declared_staleness", "old priorities"),
    (mutant_replay(prioritized=HandlesAreSlots), "test_update_for_evicted_handle_is_ignored",
     "live item 105 .* was not applied"),
    (mutant_replay(uniform=WithoutReplacement), "test_uniform_draws_are_uniform", "with replacement"),
    (mutant_replay(uniform=RoundRobin), "test_uniform_draws_are_uniform", "with replacement"),
    (mutant_replay(prioritized=RunningMinWeights), "test_importance_weights",
     "after the least likely item was evicted"),
    (DropsWhatWrapsTheRing, "test_fifo_eviction_and_capacity", "wrapped around the ring's end"),
    (mutant_replay(uniform=LiveRangeFixedAtFirstDraw), "test_uniform_draws_follow_inserts",
     "filled the buffer .* fail chi-square"),
    (mutant_replay(prioritized=WrappedTailKeepsEvictedPriority),
     "test_new_items_crossing_the_ring_end_get_the_largest_priority", "ran past the ring's end"),
]

FRESHNESS_MUTANTS = [
    (mutant_on_policy(RepeatsOneItem), "test_each_item_exactly_once_per_epoch", "not a permutation"),
    (mutant_on_policy(SameOrderEveryEpoch), "test_each_item_exactly_once_per_epoch", "not reshuffled"),
    (mutant_on_policy(MixesVersions), "test_version_purity", "minibatch of version 0 holds ids"),
    (mutant_on_policy(IgnoresStaleness), "test_staleness_bound_drop", "only version 1"),
    (mutant_on_policy(IgnoresStaleness), "test_staleness_bound_raise", "StaleExperienceError"),
    (mutant_on_policy(IgnoresStaleness), "test_prefetch_never_crosses_a_policy_version", "stale rollout"),
    (mutant_on_policy(StalenessOffByOne), "test_staleness_bound_drop", "only version 1"),
    (mutant_on_policy(ReportsPolicyVersion), "test_version_purity", "expected version 1"),
    (mutant_on_policy(ReportsPolicyVersion), "test_staleness_bound_drop", "expected the rollout's version 1"),
    (mutant_on_policy(DropsThenRaises), "test_staleness_bound_raise", "changed by the failed delivery"),
    (mutant_on_policy(DropsThenRaises), "test_prefetch_never_crosses_a_policy_version",
     "changed by the failed delivery"),
    (PrefetchesNextRollout, "test_prefetch_never_crosses_a_policy_version", "stale rollout"),
    (mutant_on_policy(DropsAllPending), "test_staleness_bound_drop", "dropped with the stale one"),
    (mutant_on_policy(NewestRolloutFirst), "test_version_purity", "expected version 0"),
    (mutant_on_policy(DeliversOpenRollout), "test_version_purity", "delivered before end_rollout"),
    (EpochsInterleaved, "test_each_item_exactly_once_per_epoch", "epoch order"),
    (LastEpochLabelled, "test_each_item_exactly_once_per_epoch", "minibatches"),
    (LosesFirstItemOfNewVersion, "test_version_purity",
     "epoch 0 of version 1's rollout .*opened by that ingest.* 1 missing \\(e.g. \\[1000\\]\\)"),
    (mutant_on_policy(DropsOneStaleRolloutPerDelivery), "test_staleness_drop_skips_every_stale_rollout",
     "versions 0 and 1 are both stale"),
    (mutant_on_policy(OlderVersionJoinsOpenRollout), "test_items_of_an_older_version_never_join_a_newer_rollout",
     "delivered under another version"),
    (mutant_on_policy(RestoresWithoutOpenRollout), "test_checkpoint_with_rollouts_waiting",
     r"restored: the delivered rollouts .* \(3, \[311, 312, 313, 314\]\)\], expected .*\(3, \[300, 301"),
    (mutant_on_policy(RestoresWithPolicyZero), "test_checkpoint_between_rollouts",
     r"restored: the delivered rollouts .* are \[\(2, \[200, .*no stale rollout"),
    (mutant_on_policy(RestoresWithoutLastSealed), "test_checkpoint_between_rollouts",
     "restored endpoint took an ingest of a version older"),
    (mutant_on_policy(RestoresWithItsOwnRng), "test_checkpoint_between_rollouts",
     "restored endpoint .* delivers differently"),
    (mutant_on_policy(SealsOpenRolloutOnRestore), "test_checkpoint_with_rollouts_waiting",
     r"restored: the delivered rollouts .* \(3, \[300, 301, 302, 303\]\), \(3, \[311, 312"),
]

CONCURRENCY_MUTANTS = [
    (LosesOneIn1e5, "test_concurrent_producers_lose_and_duplicate_nothing", "stored"),
    (TornWriteOneIn1e5, "test_concurrent_producers_lose_and_duplicate_nothing", "duplicates"),
    (ReadsColumnByColumn, "test_sampling_while_producers_insert_draws_whole_items",
     "the learner raised AssertionError: payload does not match its id"),
]


# -- controls: the harness passes on the unmutated parts -------------------------------------
test_control_replay_passes = controls_pass(replay_suite, MutantReplay, REPLAY_MUTANTS)
test_control_freshness_passes = controls_pass(freshness_suite, MutantOnPolicy, FRESHNESS_MUTANTS)
test_control_concurrency_passes = controls_pass(concurrency_suite, CoreReplayEndpoint, CONCURRENCY_MUTANTS)

# -- mutants: the suite fails with a message that names the problem --------------------------
test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)
test_freshness_suite_catches_mutant = catches_mutants(freshness_suite, FRESHNESS_MUTANTS)
test_concurrency_suite_catches_mutant = catches_mutants(concurrency_suite, CONCURRENCY_MUTANTS)


# -- found by a later review of the suite: messages, integration-tests, the no-weakening guard ---------
def test_concurrency_suite_names_an_id_no_producer_made() -> None:
    """A stored id outside the produced range is reported as such (it read "0 duplicates, 0 lost")."""
    with pytest.raises(FAILED, match=r"1 ids? that no producer made.*1000000007.*1 lost"):
        concurrency_suite(ForeignIdOnce, per_thread=20_000).test_concurrent_producers_lose_and_duplicate_nothing()


# -- integration-tests: every adapter runs every suite, or the report says why not -----------
def test_integration_runs_every_suite_and_skips_a_missing_kind_with_a_reason() -> None:
    """A factory without an on-policy (or replay) endpoint gets a skipped test naming it, as EndpointFactory
    documents, instead of nothing; one with a replay endpoint gets the concurrency suite too."""
    from conduit.testing import EndpointFactory

    mod = integration_module()
    classes = mod.suite_classes([EndpointFactory("replayonly", make_replay=CoreReplayEndpoint),
                                 EndpointFactory("onpolicyonly", make_on_policy=CoreOnPolicyEndpoint)])
    assert issubclass(classes["TestReplay_replayonly"], ReplaySuite)
    assert issubclass(classes["TestConcurrency_replayonly"], ConcurrencySuite), sorted(classes)
    assert issubclass(classes["TestFreshness_onpolicyonly"], FreshnessSuite)
    for name, kind in (("TestOnPolicy_replayonly", "on_policy"), ("TestReplay_onpolicyonly", "replay")):
        assert name in classes, f"no test reports that the adapter has no {kind} endpoint: {sorted(classes)}"
        with pytest.raises(pytest.skip.Exception, match=f"registers no {kind} endpoint"):
            classes[name]().test_not_provided()


def test_integration_fails_for_a_package_that_is_not_registered(tmp_path: Any) -> None:
    """A package that registers no conformance endpoints, or whose registration is not installed, is an
    error, not an adapter that silently goes untested."""
    mod = integration_module()
    for name, body in (("conduit-ok", '[project.entry-points."conduit.conformance"]\nok = "x:Y"\n'),
                       ("conduit-none", '[project]\nname = "conduit-none"\n'),
                       ("conduit-gone", '[project.entry-points."conduit.conformance"]\n"gone" = "x:Y"\n[tool.x]\n')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pyproject.toml").write_text(body)
    problems = mod.unregistered_packages(tmp_path, ["ok"])
    assert len(problems) == 2, problems
    assert "conduit-gone registers ['gone']" in problems[0] and "not discovered" in problems[0], problems
    assert "conduit-none registers no endpoints" in problems[1], problems


@pytest.mark.parametrize(("suite", "attr", "value"), [(ReplaySuite, "draws", 2_000),
                                                      (ConcurrencySuite, "items_per_thread", 1_000),
                                                      (ConcurrencySuite, "threads", 1)])
def test_lowering_a_suite_size_fails_the_no_weakening_guard(suite: type, attr: str, value: int) -> None:
    """An adapter's subclass that runs fewer draws, threads or items than the suite is caught, like an
    overridden test without xfail; raising a size is allowed."""
    weak = type("TestWeak", (suite,), {attr: value, "make_replay": lambda self, **kw: CoreReplayEndpoint(**kw)})
    with pytest.raises(AssertionError, match=f"TestWeak.{attr} = {value} weakens the conformance suite"):
        weak().test_no_overrides_DO_NOT_OVERRIDE()
    strong = type("TestStrong", (suite,), {attr: getattr(suite, attr) * 2,
                                            "make_replay": lambda self, **kw: CoreReplayEndpoint(**kw)})
    strong().test_no_overrides_DO_NOT_OVERRIDE()


def test_freshness_suite_catches_an_unseeded_shuffle() -> None:
    """On-policy epochs are "a fresh seeded permutation": a shuffle that ignores the seed fails the suite."""
    freshness_suite(CoreOnPolicyEndpoint).test_deterministic_under_seed()  # control
    with pytest.raises(FAILED, match="same seed delivered different minibatches"):
        freshness_suite(GlobalRngShuffle).test_deterministic_under_seed()


def test_two_adapters_with_one_factory_name_are_refused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second installed distribution registering a factory named like another (here: core's) is an error:
    integration-tests names its generated classes by factory name, so one adapter would silently go untested."""
    import importlib
    import sys

    from conduit.errors import ConfigurationError
    from conduit.testing import discover_endpoints

    dist = tmp_path / "conduit_copycat-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: conduit-copycat\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[conduit.conformance]\ncopycat = conduit.testing.reference:ENDPOINTS\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    importlib.invalidate_caches()
    with pytest.raises(ConfigurationError, match=r"'copycat' .* both register an EndpointFactory named 'core'"):
        discover_endpoints()


# -- determinism across processes (PYTHONHASHSEED) ------------------------------------------------------------------
@pytest.mark.parametrize(("suite", "kind", "entry"), [(replay_suite, "replay", "replay/uniform"),
                                                      (freshness_suite, "on_policy", "on_policy")])
def test_cross_process_check_catches_hash_dependent_draws(suite: Any, kind: str, entry: str) -> None:
    """An endpoint whose draws follow ``hash()`` of strings (a seed derived from it; an order from iterating a set
    of strings) passes the in-process determinism test, and fails the cross-process one, with a message naming
    the adapter, the kind and the first differing position."""
    make = HASH_DEPENDENT.make_replay if kind == "replay" else HASH_DEPENDENT.make_on_policy
    assert make is not None
    suite(make).test_deterministic_under_seed()  # the bug is invisible inside one process
    with pytest.raises(FAILED, match=rf"adapter 'hash-dependent', {entry}: the same seed and calls drew "
                                     rf"differently in two processes \(PYTHONHASHSEED=1 and 2\), first at "
                                     rf"(position|minibatch) \d+"):
        assert_deterministic_across_processes(HASH_DEPENDENT_SPEC, kind)


def test_cross_process_check_reports_a_subprocess_error_with_its_stderr() -> None:
    """What fails in the subprocess fails the check with the error and the end of the subprocess's stderr, not a
    bare exit status: an endpoint that cannot be built there (the other kinds are still drawn), a factory that
    cannot be resolved, and a subprocess that outlives its timeout (killed)."""
    got = draws_in_subprocess(f"{Path(__file__).stem}:REFUSES_ON_POLICY", hash_seed=1)
    assert got.entries("replay") == ["replay/uniform", "replay/prioritized"] and got.get("replay/uniform"), got
    with pytest.raises(AssertionError, match=r"(?s)adapter 'refuses-on-policy' .*on_policy: the determinism calls "
                                             r"failed .*PYTHONHASHSEED=1: ConfigurationError: no on-policy endpoint "
                                             r"here.*stderr tail.*Traceback"):
        got.get("on_policy")
    with pytest.raises(AssertionError, match=r"(?s)'conduit.testing.reference:ID_SCHEMA'.*exit status 1.*stderr "
                                             r"tail.*is of type ExperienceSchema, not a conduit.testing.Endpoint"):
        draws_in_subprocess("conduit.testing.reference:ID_SCHEMA", hash_seed=1)
    with pytest.raises(AssertionError, match=r"PYTHONHASHSEED=1 did not finish within the timeout \(killed\)"):
        draws_in_subprocess("core", hash_seed=1, timeout=0.2)


def test_cross_process_check_reports_a_subprocess_that_hangs_or_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subprocess that reported its draws and then does not exit (its endpoints left a non-daemon thread
    running) is killed EXIT_GRACE_S later, and the report says so, with the stacks of its threads; it read "did
    not finish within the timeout ... if the endpoint is that slow to build, raise TIMEOUT_S" after the whole
    timeout (300 s by default). One that crashes in native code names the signal and shows where it crashed (the
    report held "exit status -11" and an empty stderr tail)."""
    import conduit.testing.crossprocess as crossprocess

    monkeypatch.setattr(crossprocess, "EXIT_GRACE_S", 1.0)
    with pytest.raises(AssertionError, match=r"(?s)'test_conformance_catches_mutants:LEAVES_A_THREAD' .*reported its "
                                             r"draws, then did not exit .*outlives their close\(\).*stderr tail.*"
                                             r"in _shutdown"):
        draws_in_subprocess(f"{Path(__file__).stem}:LEAVES_A_THREAD", hash_seed=1, timeout=240)
    with pytest.raises(AssertionError, match=r"(?s)killed by signal SIGSEGV.*stderr tail.*Segmentation fault.*"
                                             r"in _crash_in_native_code"):
        draws_in_subprocess(f"{Path(__file__).stem}:CRASHES", hash_seed=1)


def test_cross_process_check_compares_every_entry_of_every_process() -> None:
    """The comparison cannot pass vacuously: fewer than two different hash seeds compare nothing (it passed), and
    processes that made different entries (one declared CAP_PRIORITIZED, the other not) fail naming them: the
    entries came from the first process alone, so that process's seed decided between a KeyError and a pass that
    left the prioritized draws uncompared."""
    for seeds in ((1,), (2, 2)):
        with pytest.raises(ValueError, match="at least two different PYTHONHASHSEED values"):
            assert_deterministic_across_processes("core", hash_seeds=seeds)
    spec = f"{Path(__file__).stem}:CAPS_FOLLOW_HASH_SEED"
    for seeds in ((1, 2), (2, 1)):
        a, b = seeds
        with pytest.raises(AssertionError, match=rf"'caps-follow-hash-seed': the process with PYTHONHASHSEED={a} "
                                                 rf"made \[.*\], the one with PYTHONHASHSEED={b} \[.*\]: the "
                                                 rf"endpoints declare other capabilities"):
            assert_deterministic_across_processes(spec, "replay", hash_seeds=seeds)
