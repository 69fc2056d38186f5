"""Shared machinery: the no-weakening guard and helpers."""

from __future__ import annotations

import inspect
from collections.abc import Container
from numbers import Integral

import numpy as np
import pytest

from conduit.testing.endpoints import Draw, ReplayEndpoint

__all__ = ["SuiteBase", "chi_square_p", "draw", "needs", "staleness"]


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value of ``observed`` counts against ``expected`` counts."""
    from scipy import stats

    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def draw(ep: ReplayEndpoint, n: int) -> Draw:
    """``ep.sample(n)``, checked to hold exactly ``n`` items: ``n`` ids, and ``n`` handles and weights where given.

    A draw with importance weights (a prioritized draw) must carry handles: the suite updates priorities through
    them (without the check a draw with ``handles=None`` failed later, inside a test, with a ``TypeError`` on None).

    (Without the count check a draw one row short passes the distribution tests: their expected counts scale
    with what was drawn.)
    """
    d = ep.sample(n)
    assert d.weights is None or d.handles is not None, (
        f"sample({n}) returned importance weights but handles=None: a prioritized draw carries one handle per "
        f"item (Draw.handles, what update_priorities takes to name the item; see ReplayEndpoint.sample)")
    got = {"ids": len(d.ids)}
    if d.handles is not None:
        got["handles"] = len(d.handles)
    if d.weights is not None:
        got["weights"] = len(d.weights)
    wrong = [f"{v} {k}" for k, v in got.items() if v != n]
    assert not wrong, (f"sample({n}) returned {', '.join(wrong)}: a draw holds exactly n = {n} items, with one "
                       f"handle and one importance weight per item")
    return d


def needs(endpoint: object, capability: str) -> None:
    """Skip (with a reason) when the endpoint does not declare ``capability``."""
    caps: Container[str] = getattr(endpoint, "capabilities", frozenset())
    if capability not in caps:
        pytest.skip(f"{type(endpoint).__name__} does not declare {capability!r}")


def staleness(endpoint: object) -> int:
    """The endpoint's declared ``priority_staleness``, checked to be an integer >= 0.

    The suites draw (and drop) that many batches after a priority update, and the staleness check
    accepts that many stale draws; a negative or fractional value would make it check fewer draws
    than the endpoint delivers late.
    """
    k = getattr(endpoint, "priority_staleness", 0)
    assert isinstance(k, Integral) and not isinstance(k, bool) and int(k) >= 0, (
        f"{type(endpoint).__name__}.priority_staleness = {k!r}: declare a non-negative integer, the number of "
        f"update_priorities calls a draw may precede (0 when every draw sees every update)")
    return int(k)


#: the suites' size settings: a subclass may raise them, never lower them (fewer draws, threads or items)
STRENGTH_SETTINGS = ("draws", "threads", "items_per_thread", "payload_draws_per_item", "sampling_items_per_thread")
#: settings a subclass may lower, never raise: items per insert call of the concurrent producers (fewer, larger
#: calls leave fewer interleavings to race on) and draws per sample call of the distribution tests
CEILING_SETTINGS = ("chunk",)
#: what a subclass provides; every other method of a suite is the suite's own and may not be replaced
PROVIDED_BY_ADAPTER = ("make_replay", "make_on_policy")


class SuiteBase:
    """Base of every suite: a subclass may not override a suite test without marking it xfail, nor replace
    a helper the tests call, nor lower a size setting (:data:`STRENGTH_SETTINGS`) or raise a ceiling
    (:data:`CEILING_SETTINGS`)."""

    def test_no_overrides_DO_NOT_OVERRIDE(self) -> None:
        """Suite tests are not weakened: an override must carry ``@pytest.mark.xfail(reason=...)``; the
        suite's helpers (``_check_payloads``, ``_set_priorities``, ...) are not replaced; its sizes (draws of
        the chi-square tests, producer threads and items) are not lowered, nor its per-call chunks raised.

        Troubleshooting: remove the override, or mark it xfail with the reason it cannot pass; remove a
        helper override or a setting that lowers a size or raises a chunk.
        """
        suite_classes = [c for c in type(self).__mro__ if c.__module__.startswith("conduit.testing.suites")]
        for attrs, weaker, word in ((STRENGTH_SETTINGS, lambda v, d: v < d, "lowers"),
                                    (CEILING_SETTINGS, lambda v, d: v > d, "raises")):
            for attr in attrs:
                declared = next((c.__dict__[attr] for c in suite_classes if attr in c.__dict__), None)
                value = getattr(type(self), attr, None)
                if declared is not None and value is not None:
                    assert not weaker(value, declared), (
                        f"{type(self).__name__}.{attr} = {value} weakens the conformance suite, which runs "
                        f"{attr} = {declared} (the setting {word} it); remove the setting.")
        for name, member in inspect.getmembers(type(self)):
            if name.startswith("__") or name == "test_no_overrides_DO_NOT_OVERRIDE" or name in PROVIDED_BY_ADAPTER:
                continue
            owner = next((c for c in type(self).__mro__ if name in c.__dict__), None)
            suite_owner = next((c for c in suite_classes if name in c.__dict__), None)
            if owner is None or owner in suite_classes or suite_owner is None:
                continue
            if name.startswith("test_"):
                marks = [m.name for m in getattr(member, "pytestmark", [])]
                assert "xfail" in marks, (
                    f"{type(self).__name__}.{name} overrides a conformance test without "
                    f"@pytest.mark.xfail(reason=...); conformance tests may not be weakened.")
            elif callable(suite_owner.__dict__[name]) or isinstance(suite_owner.__dict__[name], property):
                raise AssertionError(
                    f"{type(self).__name__}.{name} replaces {suite_owner.__name__}.{name}, a helper the conformance "
                    f"tests call: the checks it makes would be skipped or changed. Remove the override (a suite "
                    f"subclass provides only {' / '.join(PROVIDED_BY_ADAPTER)}).")
