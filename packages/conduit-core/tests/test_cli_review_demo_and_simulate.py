"""``conduit demo --synthetic`` and ``conduit simulate``, run through the command line (:func:`conduit.cli.main`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conduit.cli import main

#: the synthetic loop, as small as it goes: a few ms per iteration
TINY = ["--synthetic", "--no-baseline", "--trace", "", "--obs-dim", "4", "--batch", "8", "--rollout", "16",
        "--capacity", "64", "--hidden", "4", "--scheduler", "auto"]


@pytest.mark.timeout(300)
def test_demo_auto_names_the_warmup_that_holds_its_calibration_at_the_updates_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--updates 1`` the calibration takes ~130 iterations: given ``--warmup 28``, the note told the user to
    raise --warmup because "`conduit schedule calibrate` uses 28", the value they had given. It now names the
    warm-up that holds the calibration at this --updates, and that warm-up is enough."""
    assert main(["demo", *TINY, "--updates", "1", "--warmup", "28", "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "still calibrating in 1 of the 1 accounted iterations" in out, out
    assert "uses 28" not in out, out
    m = re.search(r"give --warmup (\d+) or more", out)
    assert m and int(m.group(1)) > 28, out
    # what it names is enough: the scheduler has decided before the first accounted iteration
    assert main(["demo", *TINY, "--updates", "1", "--warmup", m.group(1), "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "still calibrating" not in out and "automatic configuration" in out, out


@pytest.mark.timeout(120)
def test_demo_auto_without_updates_says_no_warmup_helps(capsys: pytest.CaptureFixture[str]) -> None:
    """``--updates 0`` gives the scheduler no delivery to calibrate on: raising --warmup, as the note said, never
    helps."""
    assert main(["demo", *TINY, "--updates", "0", "--warmup", "2", "--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "still calibrating" in out and "--updates 0 gives it none" in out, out
    assert "--warmup" not in out.split("note:", 1)[1], out


def test_simulate_refused_after_making_its_output_folders_removes_all_it_made(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run refused once the output folder was made (no placement fits: found while simulating) removed only
    the deepest folder of ``--out a/b``: ``a``, which the command had made too, stayed behind, empty."""
    out = tmp_path / "a" / "b"
    keep = tmp_path / "kept"
    keep.mkdir()
    for target in (out, keep / "c"):
        assert main(["simulate", "--scenario", "a100", "--gpus", "1", "--obs-dim", "1e12", "--out", str(target)]) == 2
        assert "No placement" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # a folder that was there is kept
    assert not any(keep.iterdir())


def test_simulate_keeps_folders_that_hold_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only empty folders go: a parent that held a file before the run stays, with its file."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("mine")
    assert main(["simulate", "--scenario", "a100", "--gpus", "1", "--obs-dim", "1e12", "--out",
                 str(tmp_path / "a" / "b" / "c")]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["notes.txt"]


@pytest.mark.timeout(300)
def test_calibrate_medians_after_calibration_leave_out_iterations_it_was_still_calibrating_in(
        capsys: pytest.CaptureFixture[str]) -> None:
    """With a --warmup shorter than the calibration, Automatic went on calibrating in the measured iterations, and
    ``conduit schedule calibrate`` printed "after calibration: ..." medians over all of them, probes included. Now
    the iterations that ended still calibrating are left out, and it says how many and what --warmup would do."""
    small = ["--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64"]
    assert main(["schedule", "calibrate", *small, "--warmup", "0", "--iterations", "40"]) == 0
    out = capsys.readouterr().out
    line = out.split("after calibration:", 1)[1]
    m = re.search(r"medians of (\d+) iterations\) \((\d+) of the 40 measured iterations ended with the calibration "
                  r"still running; give --warmup (\d+) or more", line)
    assert m, out
    kept, left_out, warmup = (int(x) for x in m.groups())
    assert left_out > 0 and kept + left_out == 40 and warmup > left_out, out
    # a warm-up that holds the calibration: every measured iteration counts, and nothing is said
    assert main(["schedule", "calibrate", *small, "--iterations", "3"]) == 0
    out = capsys.readouterr().out
    assert "(medians of 3 iterations)" in out and "still running" not in out, out


@pytest.mark.timeout(300)
def test_calibrate_that_did_not_finish_names_the_warmup_that_would(capsys: pytest.CaptureFixture[str]) -> None:
    """"raise --warmup" said no value; the command computes the one that holds the calibration (its default)."""
    small = ["--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64", "--updates", "8"]
    assert main(["schedule", "calibrate", *small, "--warmup", "2", "--iterations", "1"]) == 2
    err = capsys.readouterr().err
    m = re.search(r"calibration did not finish; raise --warmup to (\d+) or more", err)
    assert m, err
    assert main(["schedule", "calibrate", *small, "--warmup", m.group(1), "--iterations", "1"]) == 0
    assert "(medians of 1 iterations)" in capsys.readouterr().out
