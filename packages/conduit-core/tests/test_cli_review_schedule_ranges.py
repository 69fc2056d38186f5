"""``conduit schedule ranges --on-policy`` without ``-M`` says what it assumed, in the user's terms."""

from __future__ import annotations

import pytest
from conduit.cli import main


def test_on_policy_without_m_does_not_print_python_none(capsys: pytest.CaptureFixture[str]) -> None:
    """It printed ``on-policy (M=None): ...``: a Python value the user never typed. It now says M was not given
    (whole rollouts only)."""
    assert main(["schedule", "ranges", "--on-policy"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out, out
    assert "M not given" in out and "whole rollouts" in out, out
    assert "g_ing in {1}, g_del in {1}" in out, out  # the ranges themselves are unchanged


def test_on_policy_with_m_still_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "ranges", "--on-policy", "-M", "4"]) == 0
    assert capsys.readouterr().out.strip() == "on-policy (M=4): g_ing in {1/4, 1/2, 3/4, 1}, g_del in {1/4}"
