"""Shared harness for the tests that prove the conformance suites fail broken ("mutant") endpoints.

A mutant test file defines endpoint classes that each inject one bug, lists them in tables of
:data:`Mutant` rows ``(endpoint class, suite check name, regex)``, and builds its tests from the tables
with :func:`catches_mutants` (the check, bound to the mutant, must fail with a message matching the regex)
and :func:`controls_pass` (the same checks pass on an unmutated endpoint, so a failure comes from the
injected bug, not the harness)::

    test_control_replay_passes = controls_pass(replay_suite, CoreReplayEndpoint, REPLAY_MUTANTS)
    test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)

It also holds the mutants and helpers that more than one mutant file uses (:class:`MutantReplay` /
:func:`mutant_replay`, :class:`OneDrawBehind`, :func:`integration_module`, :class:`MiniReplay`), so no test
module imports another (pytest would load a second copy of it).

Test files import this module as they import sibling test modules (``sys.path`` holds the tests dir).
It is not collected itself: its name does not start with ``test_``.
"""

from __future__ import annotations

import copy
import importlib.util
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from conduit.errors import EmptyBufferError, PriorityError
from conduit.semantics import PrioritizedSampler, Replay, Semantics, UniformSampler
from conduit.testing import (
    CAP_CHECKPOINT,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    ConcurrencySuite,
    CoreReplayEndpoint,
    Draw,
    FreshnessSuite,
    ReplaySuite,
)

#: what a failing suite check raises: a plain assertion, or pytest.fail's exception
FAILED = (AssertionError, pytest.fail.Exception)

#: one row of a mutant table: (mutant endpoint class, suite check it must fail, regex its message must match);
#: the class is typed Any because mypy joins a table's mixed endpoint classes to ``object``
Mutant = tuple[Any, str, str]

#: a binder: an endpoint class in, a suite instance whose ``make_*`` builds that endpoint out
Binder = Callable[[type], Any]


def replay_suite(ep: type) -> ReplaySuite:
    """A :class:`ReplaySuite` whose ``make_replay(**kw)`` returns ``ep(**kw)``; call one check on it directly."""

    class Bound(ReplaySuite):
        def make_replay(self, **kw: Any) -> Any:
            return ep(**kw)

    return Bound()


def freshness_suite(ep: type) -> FreshnessSuite:
    """A :class:`FreshnessSuite` whose ``make_on_policy(**kw)`` returns ``ep(**kw)``."""

    class Bound(FreshnessSuite):
        def make_on_policy(self, **kw: Any) -> Any:
            return ep(**kw)

    return Bound()


def concurrency_suite(ep: type, per_thread: int | None = None) -> ConcurrencySuite:
    """A :class:`ConcurrencySuite` whose ``make_replay(**kw)`` returns ``ep(**kw)``; ``per_thread`` (when given)
    replaces ``items_per_thread``, for a mutant whose bug shows with fewer items than the suite inserts."""

    class Bound(ConcurrencySuite):
        if per_thread is not None:
            items_per_thread = per_thread

        def make_replay(self, **kw: Any) -> Any:
            return ep(**kw)

    return Bound()


def mutant_id(v: Any) -> str:
    """Test id part for a mutant table value: the injected sampler or semantics class for an endpoint that only
    swaps one in (its ``uniform``, ``prioritized`` or ``semantics`` attribute), else the class name; strings (the
    check and the regex) cut to 30 characters."""
    if isinstance(v, type):
        extra = [s.__name__ for k in ("uniform", "prioritized", "semantics") if (s := v.__dict__.get(k)) is not None]
        return extra[0] if extra else v.__name__
    return str(v)[:30]


def controls_pass(suite: Binder, control: type, mutants: Sequence[Mutant]) -> Callable[[str], None]:
    """A test, parametrized over the checks ``mutants`` names (each once), that runs each check of ``suite``
    bound to the unmutated ``control`` endpoint and expects it to pass. Assign it to a ``test_*`` name."""

    @pytest.mark.parametrize("check", sorted({c for _, c, _ in mutants}))
    def test(check: str) -> None:
        getattr(suite(control), check)()

    return test


def catches_mutants(suite: Binder, mutants: Sequence[Mutant]) -> Callable[[type, str, str], None]:
    """A test, parametrized over ``mutants``, that runs each row's check of ``suite`` bound to the row's mutant
    and expects it to fail (:data:`FAILED`) with a message matching the row's regex. Assign it to a ``test_*``
    name."""

    @pytest.mark.parametrize(("ep", "check", "match"), mutants, ids=mutant_id)
    def test(ep: type, check: str, match: str) -> None:
        with pytest.raises(FAILED, match=match):
            getattr(suite(ep), check)()

    return test


# -- mutants and helpers shared by several mutant files -------------------------------------------
class MutantReplay(CoreReplayEndpoint):
    """Core's replay endpoint with its sampler swapped for ``uniform`` / ``prioritized`` subclasses: a
    prioritized endpoint gets ``prioritized(alpha=, beta=, max_from_ingest=)`` with the settings it was built
    with, a uniform one gets ``uniform()``; the seed is kept. Unmutated (as here) it behaves as
    :class:`CoreReplayEndpoint` and serves as the control. Build mutants with :func:`mutant_replay`."""

    uniform: type[UniformSampler] = UniformSampler
    prioritized: type[PrioritizedSampler] = PrioritizedSampler

    def _build(self, capacity: int, semantics: Semantics, **kwargs: Any) -> Any:
        assert isinstance(semantics, Replay)
        s = semantics.sampler
        sampler = (self.prioritized(alpha=s.alpha, beta=s.beta, max_from_ingest=s.max_from_ingest)
                   if isinstance(s, PrioritizedSampler) else self.uniform())
        return super()._build(capacity, Replay(sampler, seed=semantics.seed), **kwargs)


def mutant_replay(**samplers: type) -> type:
    """A :class:`MutantReplay` subclass whose ``uniform`` and/or ``prioritized`` sampler class is replaced, e.g.
    ``mutant_replay(prioritized=WeightsOffByFactor)``; named after the injected samplers (which
    :func:`mutant_id` also uses for the test id)."""
    return type("Mutant" + "".join(s.__name__ for s in samplers.values()), (MutantReplay,), samplers)


class OneDrawBehind(CoreReplayEndpoint):
    """Prefetches one draw ahead but declares priority_staleness 0."""

    _ahead: Draw | None = None

    def sample(self, n: int) -> Draw:
        if self._ahead is None or len(self._ahead.ids) != n:
            self._ahead = super().sample(n)
        d, self._ahead = self._ahead, super().sample(n)
        return d


def integration_module() -> ModuleType:
    """A fresh copy of ``integration-tests/test_conformance_all_adapters.py`` (the run that puts every adapter
    through every suite), loaded from the repository under a private name, so a test may change its
    module-level tables (``KNOWN_GAPS``) without touching the real run's."""
    path = Path(__file__).resolve().parents[3] / "integration-tests" / "test_conformance_all_adapters.py"
    spec = importlib.util.spec_from_file_location("_conformance_all_adapters_under_test", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class MiniReplay:
    """A small, correct, pure-NumPy replay endpoint (slot-based ring, handles stamped with their insertion index),
    the base of replay mutants: it passes the whole ReplaySuite (test_suite_catches_more_bugs's
    test_mini_replay_conforms)."""

    capabilities = frozenset({CAP_PRIORITIZED, CAP_CHECKPOINT, CAP_CONCURRENT_INGEST})
    priority_staleness = 0

    def __init__(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                 seed: int = 0) -> None:
        self.cap, self.prioritized, self.alpha, self.beta = capacity, prioritized, alpha, beta
        self.data = np.zeros(capacity, dtype=np.int64)
        self.prio = np.zeros(capacity)  # p^alpha per slot, 0 for empty slots
        self.next = 0  # handle of the next insert; handle h lives in slot h % cap
        self.max_p = 1.0
        self.rng = self._make_rng(seed)
        self.lock = threading.Lock()

    def _make_rng(self, seed: int) -> Any:
        return np.random.default_rng(seed)

    @property
    def oldest(self) -> int:
        return max(0, self.next - self.cap)

    def __len__(self) -> int:
        return self.next - self.oldest

    def insert(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        with self.lock:
            h = np.arange(self.next, self.next + len(ids))[-self.cap:]
            self.data[h % self.cap] = ids[-self.cap:]
            self.prio[h % self.cap] = self.max_p ** self.alpha
            self.next += len(ids)

    def _slots(self, n: int) -> np.ndarray:
        if self.prioritized:
            return self.rng.choice(self.cap, n, p=self.prio / self.prio.sum())
        return self.rng.integers(0, len(self), n)  # slots 0..len-1 are live (full ring: all of them)

    def sample(self, n: int) -> Draw:
        if len(self) == 0:
            raise EmptyBufferError("empty")
        slots = self._slots(n)
        handles = self.oldest + (slots - self.oldest) % self.cap
        w = None
        if self.prioritized:
            probs = self.prio / self.prio.sum()
            live = probs[np.arange(self.oldest, self.next) % self.cap]
            w = (len(self) * probs[slots]) ** (-self.beta) / (len(self) * live.min()) ** (-self.beta)
        return Draw(self.data[slots].copy(), handles, w)

    def _live(self, h: np.ndarray) -> np.ndarray:
        return (h >= self.oldest) & (h < self.next)

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        h, p = np.asarray(handles), np.asarray(priorities, dtype=np.float64)
        if h.shape != p.shape or not np.isfinite(p).all():
            raise PriorityError("pass one finite priority per handle")
        ok = self._live(h)
        self.prio[h[ok] % self.cap] = p[ok] ** self.alpha
        self.max_p = max(self.max_p, float(p.max(initial=0)))

    def contents(self) -> np.ndarray:
        return self.data[np.arange(self.oldest, self.next) % self.cap].copy()

    def state_dict(self) -> Any:
        return copy.deepcopy({"data": self.data, "prio": self.prio, "next": self.next, "max_p": self.max_p,
                              "rng": self.rng.bit_generator.state})

    def load_state_dict(self, state: Any) -> None:
        s = copy.deepcopy(state)
        self.data, self.prio, self.next, self.max_p = s["data"], s["prio"], s["next"], s["max_p"]
        self.rng.bit_generator.state = s["rng"]

    def close(self) -> None:
        pass
