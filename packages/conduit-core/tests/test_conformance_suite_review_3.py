"""The conformance suite is honest (review 3): checks that let a broken buffer through before this review.

Each mutant is a real core part (sampler, semantics or endpoint) subclassed to inject one bug; the
suite check that guards the broken property must fail on it with a message that names the problem.
A control runs every check used here on the unmutated parts, through the same harness.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from conduit.semantics import PrioritizedSampler, Replay, Semantics, UniformSampler
from conduit.semantics.base import Selection
from conduit.storage.base import AppendResult
from conduit.testing import (
    ConcurrencySuite,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    FreshnessSuite,
    Minibatch,
    ReplaySuite,
)

#: what a failing suite check raises: a plain assertion, or pytest.fail's exception
FAILED = (AssertionError, pytest.fail.Exception)


# -- harness ---------------------------------------------------------------------------------
class SwappedSampler(CoreReplayEndpoint):
    """Core's replay endpoint with its sampler swapped for ``uniform`` / ``prioritized`` subclasses."""

    uniform: type[UniformSampler] = UniformSampler
    prioritized: type[PrioritizedSampler] = PrioritizedSampler

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> Any:
        assert isinstance(semantics, Replay)
        s = semantics.sampler
        sampler = (self.prioritized(alpha=s.alpha, beta=s.beta, max_from_ingest=s.max_from_ingest)
                   if isinstance(s, PrioritizedSampler) else self.uniform())
        return super()._build(capacity, Replay(sampler, seed=semantics.seed), **kwargs)


def replay_suite(ep: type) -> ReplaySuite:
    class Bound(ReplaySuite):
        def make_replay(self, **kw: Any) -> Any:
            return ep(**kw)
    return Bound()


def freshness_suite(ep: type) -> FreshnessSuite:
    class Bound(FreshnessSuite):
        def make_on_policy(self, **kw: Any) -> Any:
            return ep(**kw)
    return Bound()


def concurrency_suite(ep: type, per_thread: int = 20_000) -> ConcurrencySuite:
    class Bound(ConcurrencySuite):
        items_per_thread = per_thread

        def make_replay(self, **kw: Any) -> Any:
            return ep(**kw)
    return Bound()


# -- mutants ---------------------------------------------------------------------------------
class WithoutReplacement(UniformSampler):
    """Draws without replacement whenever the buffer holds enough items (the endpoint promises replacement)."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        size = self.storage.next_handle - self.storage.oldest
        return super().sample(n, replace=replace and n > size, beta=beta)


class RoundRobin(UniformSampler):
    """Cycles through the live items from a seeded start: perfectly even counts, no randomness after the start."""

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        import torch
        from conduit.semantics.base import SampleInfo

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
        import torch

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


def _swap(**samplers: type) -> type:
    return type(next(iter(samplers.values())).__name__, (SwappedSampler,), samplers)


REPLAY_MUTANTS = [
    (_swap(uniform=WithoutReplacement), "test_uniform_draws_are_uniform", "with replacement"),
    (_swap(uniform=RoundRobin), "test_uniform_draws_are_uniform", "with replacement"),
    (_swap(prioritized=RunningMinWeights), "test_importance_weights", "after the least likely item was evicted"),
    (DropsWhatWrapsTheRing, "test_fifo_eviction_and_capacity", "wrapped around the ring's end"),
]
FRESHNESS_MUTANTS = [
    (EpochsInterleaved, "test_each_item_exactly_once_per_epoch", "epoch order"),
    (LastEpochLabelled, "test_each_item_exactly_once_per_epoch", "minibatches"),
]


def _id(v: Any) -> str:
    return v.__name__ if isinstance(v, type) else str(v)[:32]


# -- controls --------------------------------------------------------------------------------
@pytest.mark.parametrize("check", sorted({c for _, c, _ in REPLAY_MUTANTS}))
def test_control_replay_passes(check: str) -> None:
    getattr(replay_suite(SwappedSampler), check)()
    getattr(replay_suite(CoreReplayEndpoint), check)()


@pytest.mark.parametrize("check", sorted({c for _, c, _ in FRESHNESS_MUTANTS}))
def test_control_freshness_passes(check: str) -> None:
    getattr(freshness_suite(CoreOnPolicyEndpoint), check)()


def test_control_concurrency_passes() -> None:
    concurrency_suite(CoreReplayEndpoint).test_concurrent_producers_lose_and_duplicate_nothing()


# -- mutants fail, with a message that names the problem -------------------------------------
@pytest.mark.parametrize(("ep", "check", "match"), REPLAY_MUTANTS, ids=_id)
def test_replay_suite_catches_mutant(ep: type, check: str, match: str) -> None:
    with pytest.raises(FAILED, match=match):
        getattr(replay_suite(ep), check)()


@pytest.mark.parametrize(("ep", "check", "match"), FRESHNESS_MUTANTS, ids=_id)
def test_freshness_suite_catches_mutant(ep: type, check: str, match: str) -> None:
    with pytest.raises(FAILED, match=match):
        getattr(freshness_suite(ep), check)()


def test_concurrency_suite_names_an_id_no_producer_made() -> None:
    """A stored id outside the produced range is reported as such (it read "0 duplicates, 0 lost")."""
    with pytest.raises(FAILED, match=r"1 ids? that no producer made.*1000000007.*1 lost"):
        concurrency_suite(ForeignIdOnce).test_concurrent_producers_lose_and_duplicate_nothing()


# -- integration-tests: every adapter runs every suite, or the report says why not -----------
def _integration_module() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "integration-tests" / "test_conformance_all_adapters.py"
    spec = importlib.util.spec_from_file_location("_conformance_all_adapters_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_integration_runs_every_suite_and_skips_a_missing_kind_with_a_reason() -> None:
    """A factory without an on-policy (or replay) endpoint gets a skipped test naming it, as EndpointFactory
    documents, instead of nothing; one with a replay endpoint gets the concurrency suite too."""
    from conduit.testing import EndpointFactory

    mod = _integration_module()
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
    mod = _integration_module()
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


class GlobalRngShuffle(CoreOnPolicyEndpoint):
    """Shuffles each epoch with torch's global RNG: the endpoint's seed is ignored."""

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> Any:
        import torch
        from conduit.semantics import OnPolicy

        class Global(OnPolicy):
            def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
                return torch.randperm(n)

        assert isinstance(semantics, OnPolicy)
        s = semantics
        sem = Global(num_minibatches=s.num_minibatches, num_epochs=s.num_epochs, max_staleness=s.max_staleness,
                     on_stale=s.on_stale, seed=s.seed)
        return super()._build(capacity, sem, **kwargs)


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
