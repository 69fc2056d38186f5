"""conduit-core's README, "The conformance suite": "Each failing suite test says what it saw; its docstring says what
it checks and, under "Troubleshooting", the usual cause." An adapter author reads those docstrings when a suite test
fails, so every test a suite runs has one."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from conduit.testing import ConcurrencySuite, FreshnessSuite, ReplaySuite

ROOT = Path(__file__).resolve().parents[3]


def _without_troubleshooting(suite: type) -> list[str]:
    """The suite's tests (its own and inherited checks) whose docstring lacks a Troubleshooting part."""
    missing = []
    for name in sorted(n for n in dir(suite) if n.startswith("test_") and n != "test_no_overrides_DO_NOT_OVERRIDE"):
        doc = inspect.getdoc(getattr(suite, name)) or ""
        what, _, cause = doc.partition("Troubleshooting")
        if not what.strip() or not cause.strip(" :\n"):
            missing.append(name)
    return missing


def test_the_readme_says_so() -> None:
    readme = " ".join((ROOT / "packages/conduit-core/README.md").read_text().split())
    assert 'its docstring says what it checks and, under "Troubleshooting", the usual cause' in readme


@pytest.mark.parametrize("suite", [ReplaySuite, FreshnessSuite, ConcurrencySuite], ids=lambda s: s.__name__)
def test_every_suite_test_says_what_it_checks_and_the_usual_cause(suite: type) -> None:
    assert sum(n.startswith("test_") for n in dir(suite)) >= 2
    missing = _without_troubleshooting(suite)
    assert not missing, f"{suite.__name__}: no Troubleshooting in {missing}"


def test_the_check_catches_a_test_without_troubleshooting() -> None:
    class Planted(ReplaySuite):  # (a class body only: never collected, never run)
        def test_planted(self) -> None:
            """Checks something, but says nothing of the usual cause."""

        def test_planted_empty(self) -> None:
            """Checks something.

            Troubleshooting:
            """

    assert _without_troubleshooting(Planted) == ["test_planted", "test_planted_empty"]
