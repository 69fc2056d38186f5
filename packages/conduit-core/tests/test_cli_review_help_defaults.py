"""Every ``conduit`` subcommand's --help states the defaults it really runs with."""

from __future__ import annotations

import argparse

from conduit.cli import build_parser
from conduit.simulation.cluster import SCENARIOS


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {a.option_strings[-1]: a.help or "" for a in parser._actions if a.option_strings}


def _subparser(*names: str) -> argparse.ArgumentParser:
    p = build_parser()
    for name in names:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[name]
    return p


def test_every_option_with_a_default_states_it_in_its_help() -> None:
    """``simulate --scenario`` (all), ``simulate --baseline`` (rank-order) and ``plan --learners`` (1) ran with a
    default their help did not state."""
    missing = []
    for names in (("plan",), ("profile",), ("simulate",), ("schedule", "ranges"), ("schedule", "calibrate")):
        p = _subparser(*names)
        for a in p._actions:
            if a.option_strings and a.default not in (None, False, argparse.SUPPRESS) \
                    and f"default {a.default}" not in (a.help or "") and f"default: {a.default}" not in (a.help or ""):
                missing.append(f"conduit {' '.join(names)} {a.option_strings[-1]} (default {a.default!r}): {a.help!r}")
    assert not missing, "\n".join(missing)


def test_simulate_replay_ratio_help_states_the_scenarios_default() -> None:
    """--replay-ratio has no parser default (the scenario's applies): its help said none."""
    ratio = {sc.replay_ratio for sc in SCENARIOS.values()}
    assert len(ratio) == 1
    assert f"default {ratio.pop():g}" in _helps(_subparser("simulate"))["--replay-ratio"]
