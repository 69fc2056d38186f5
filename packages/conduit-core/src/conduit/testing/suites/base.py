"""Shared machinery: the no-weakening guard and helpers."""

from __future__ import annotations

import inspect
from collections.abc import Container

import numpy as np
import pytest

__all__ = ["SuiteBase", "chi_square_p", "needs"]


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value of ``observed`` counts against ``expected`` counts."""
    from scipy import stats

    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def needs(endpoint: object, capability: str) -> None:
    """Skip (with a reason) when the endpoint does not declare ``capability``."""
    caps: Container[str] = getattr(endpoint, "capabilities", frozenset())
    if capability not in caps:
        pytest.skip(f"{type(endpoint).__name__} does not declare {capability!r}")


#: the suites' size settings: a subclass may raise them, never lower them (fewer draws, threads or items)
STRENGTH_SETTINGS = ("draws", "threads", "items_per_thread", "payload_draws_per_item")


class SuiteBase:
    """Base of every suite: a subclass may not override a suite test without marking it xfail, nor lower
    a size setting (:data:`STRENGTH_SETTINGS`)."""

    def test_no_overrides_DO_NOT_OVERRIDE(self) -> None:
        """Suite tests are not weakened: an override must carry ``@pytest.mark.xfail(reason=...)``, and the
        suite's sizes (draws of the chi-square tests, producer threads and items) are not lowered.

        Troubleshooting: remove the override, or mark it xfail with the reason it cannot pass; remove a
        setting that lowers a size.
        """
        suite_classes = [c for c in type(self).__mro__ if c.__module__.startswith("conduit.testing.suites")]
        for attr in STRENGTH_SETTINGS:
            declared = next((c.__dict__[attr] for c in suite_classes if attr in c.__dict__), None)
            value = getattr(type(self), attr, None)
            if declared is not None and value is not None:
                assert value >= declared, (
                    f"{type(self).__name__}.{attr} = {value} weakens the conformance suite, which runs "
                    f"{attr} = {declared}; remove the setting.")
        for name, member in inspect.getmembers(type(self)):
            if not name.startswith("test_") or name == "test_no_overrides_DO_NOT_OVERRIDE":
                continue
            owner = next(c for c in type(self).__mro__ if name in c.__dict__)
            if owner in suite_classes:
                continue
            if any(name in c.__dict__ for c in suite_classes):
                marks = [m.name for m in getattr(member, "pytestmark", [])]
                assert "xfail" in marks, (
                    f"{type(self).__name__}.{name} overrides a conformance test without "
                    f"@pytest.mark.xfail(reason=...); conformance tests may not be weakened.")
