"""Shared harness for the tests that prove the conformance suites fail broken ("mutant") endpoints.

A mutant test file defines endpoint classes that each inject one bug, lists them in tables of
:data:`Mutant` rows ``(endpoint class, suite check name, regex)``, and builds its tests from the tables
with :func:`catches_mutants` (the check, bound to the mutant, must fail with a message matching the regex)
and :func:`controls_pass` (the same checks pass on an unmutated endpoint, so a failure comes from the
injected bug, not the harness)::

    test_control_replay_passes = controls_pass(replay_suite, CoreReplayEndpoint, REPLAY_MUTANTS)
    test_replay_suite_catches_mutant = catches_mutants(replay_suite, REPLAY_MUTANTS)

Test files import this module as they import sibling test modules (``sys.path`` holds the tests dir).
It is not collected itself: its name does not start with ``test_``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from conduit.testing import ConcurrencySuite, FreshnessSuite, ReplaySuite

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
