"""Every count-like option of ``conduit demo --synthetic`` and ``conduit schedule`` reads ``1e6`` and
``1_000_000`` as ``conduit plan`` and ``conduit simulate`` do (one parser, :func:`conduit.commands.whole_number`).

They were declared ``type=int``: ``--capacity 1e6`` was refused with "invalid int value: '1e6'", while the
other commands took it.
"""

from __future__ import annotations

import argparse

import pytest
from conduit.cli import main
from conduit.commands import count, whole_number

#: the smallest synthetic loop, every count written in the forms a user may type
TINY = ["--no-baseline", "--trace", "", "--obs-dim", "4e0", "--batch", "8", "--rollout", "1.6e1", "--capacity",
        "6.4e1", "--iterations", "1", "--warmup", "0", "--updates", "1_0", "--hidden", "1.6e1"]


@pytest.mark.timeout(120)
def test_synthetic_demo_takes_counts_written_as_1e6(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--synthetic", *TINY]) == 0
    out = capsys.readouterr().out
    assert "d=4, rollout 16, 10 updates of batch 8 per iteration, MLP hidden 16" in out, out


@pytest.mark.timeout(60)
def test_schedule_calibrate_reads_1e6_as_a_million(capsys: pytest.CaptureFixture[str]) -> None:
    """Read, then refused for what the numbers mean (the rollout does not fit), both options named as typed."""
    rc = main(["schedule", "calibrate", "--obs-dim", "4", "--capacity", "1e6", "--rollout", "2e6"])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid" not in err, err
    assert "2000000" in err and "1000000" in err, err


def test_schedule_ranges_takes_byte_counts_written_as_1e9(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "ranges", "--batch-bytes", "1e6", "--memory-budget", "1e9", "--g-del-max", "1_6"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv", [["demo", "--synthetic", "--capacity", "2.5"],
                                  ["schedule", "calibrate", "--capacity", "1e400"],
                                  ["schedule", "ranges", "--g-del-max", "nan"]])
def test_a_count_that_is_no_whole_number_is_an_argument_error(argv: list[str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}" in err.splitlines()[-1] and "whole number" in err, err


def test_count_is_whole_number_bounded() -> None:
    assert whole_number("1e6") == count("1e6") == 10**6
    assert whole_number("-3") == -3 and whole_number("0") == 0 and whole_number(str(10**20)) == 10**20
    assert whole_number("123456789012345678901") == 123456789012345678901  # written out: exact, not via a float
    for bad in ("0", "-1", str(2**63)):
        with pytest.raises(argparse.ArgumentTypeError):
            count(bad)
