"""``conduit simulate``'s float options refuse non-finite and absurd values as argument errors (exit status 2,
the option and its bounds named), before anything is simulated or written.

``--rpc-us 1e300`` was taken: every latency of the table was the fetch cost alone, printed as a 300-digit number
of milliseconds, and matplotlib overflowed drawing the plot.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
from conduit.cli import main
from conduit.commands import finite_number


@pytest.mark.parametrize("value", ["1e300", "1e7", "1000000.5"])
def test_simulate_an_absurd_remote_fetch_cost_is_an_argument_error(value: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--scenario", "a100", "--gpus", "16", "--out", str(tmp_path / "o"), "--rpc-us", value])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    line = err.strip().splitlines()[-1]
    assert f"argument --rpc-us: {value!r} is too large: give a finite number >= 0 and at most 1e+06" in line, line
    assert "one second" in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(300)
def test_simulate_a_remote_fetch_cost_of_one_second_is_taken(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--scenario", "a100", "--gpus", "16", "--out", str(tmp_path), "--rpc-us", "1e6"]) == 0
    capsys.readouterr()
    assert "remote fetch cost replaced: --rpc-us 1e+06" in (tmp_path / "scale-a100.json").read_text()


def test_finite_number_bounds() -> None:
    parse = finite_number(0.0, inclusive=True, most=10.0, meaning="ten at most")
    assert parse("0") == 0.0 and parse("10") == 10.0 and parse("1e-300") == 1e-300
    for bad in ("nan", "inf", "-inf", "-1e-9", "10.000001", "1e300"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert finite_number(0.0, inclusive=False)("1e300") == 1e300  # unbounded above unless told
    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number > 0$"):
        finite_number(0.0, inclusive=False)("0")
    assert math.isfinite(finite_number(-1.0, inclusive=True)("-1"))
