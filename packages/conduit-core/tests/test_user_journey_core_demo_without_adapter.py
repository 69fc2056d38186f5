"""A user who installed conduit-core alone and runs ``conduit demo``, which the README calls "the main job: RLlib
DQN": no adapter registers a demo (conduit-rllib does, under ``conduit.demos``), so core runs its synthetic loop.
That it does so, and how to get the RLlib demo, is said on stderr; before, the synthetic loop ran silently and the
RLlib demo's options were refused as unknown options of ``conduit demo --synthetic``, which the user never typed."""
from __future__ import annotations

from typing import Any

import conduit.cli
import pytest
from conduit.cli import main

TINY = ["--no-baseline", "--trace", "", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64",
        "--iterations", "1", "--warmup", "0"]


@pytest.fixture
def core_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """An install with no adapter demo registered (conduit-rllib not installed)."""
    monkeypatch.setattr(conduit.cli, "entry_points", lambda **_: ())


def test_demo_without_an_adapter_says_it_runs_the_synthetic_loop_and_how_to_get_rllibs(
        core_alone: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY]) == 0
    out, err = capsys.readouterr()
    assert "synthetic loop" in out
    assert "conduit-rllib" in err and "conduit demo --synthetic" in err, err


def test_an_rllib_demo_option_without_the_adapter_is_explained(core_alone: Any,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["demo", "--uniform"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "conduit-rllib" in err and "unrecognized arguments: --uniform" in err, err


def test_demo_synthetic_asked_for_says_nothing_extra(core_alone: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--synthetic", *TINY]) == 0
    assert "conduit-rllib" not in capsys.readouterr().err
