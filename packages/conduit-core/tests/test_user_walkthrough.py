"""What a new user meets walking through the docs' commands: documented variants run, and wrong
inputs end with a typed one-line error (exit 2), found before any long run, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conduit.cli import main


def test_synthetic_demo_runs_with_the_automatic_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    """``--scheduler auto`` is a documented choice; the header named the scheduler with a repr that
    only works once it is attached to a buffer (AttributeError: no attribute '_phase')."""
    rc = main(["demo", "--synthetic", "--scheduler", "auto", "--obs-dim", "8", "--iterations", "1", "--warmup", "0",
               "--rollout", "32", "--batch", "16", "--capacity", "256", "--no-baseline", "--trace", ""])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "scheduler Automatic(g_ing_max=8, g_del_max=8, overlap=auto)" in out, out
    assert "median: iteration" in out, out


def test_synthetic_demo_names_the_synchronous_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--synthetic", "--scheduler", "sync", "--obs-dim", "8", "--iterations", "1", "--warmup", "0",
               "--rollout", "32", "--batch", "16", "--capacity", "256", "--trace", ""])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "scheduler Synchronous() (ms per iteration)" in out, out
    assert " object at 0x" not in out, out


def test_schedule_calibrate_refuses_zero_updates(capsys: pytest.CaptureFixture[str]) -> None:
    """Without learner updates there are no deliveries to calibrate on; the old message told the
    user to raise --warmup, which never helps."""
    rc = main(["schedule", "calibrate", "--updates", "0", "--obs-dim", "8", "--rollout", "32", "--batch", "16",
               "--capacity", "256", "--warmup", "2", "--iterations", "1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--updates must be >= 1" in err, err
    assert "--warmup" not in err, err


def _unwritable_directory(tmp_path: Path) -> Path:
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        d = tmp_path / "read-only"
        d.mkdir()
        d.chmod(0o555)
        return d
    proc = Path("/proc")  # root may write anywhere but into procfs
    if not proc.is_dir():
        pytest.skip("running as root without /proc: no directory this user cannot write into")
    return proc


def test_simulate_refuses_an_existing_directory_it_cannot_write(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``--out`` naming an existing directory without write access raised a bare PermissionError
    from the table writer, after the simulation ran."""
    out_dir = _unwritable_directory(tmp_path)
    try:
        rc = main(["simulate", "--scenario", "a100", "--gpus", "1", "--samples", "1", "--out", str(out_dir)])
    finally:
        if out_dir.is_relative_to(tmp_path):
            out_dir.chmod(0o755)
    captured = capsys.readouterr()
    assert rc == 2, captured
    assert f"Cannot use --out {str(out_dir)!r}" in captured.err, captured.err
    assert "SIMULATION" not in captured.out, "the simulation ran before the output directory was checked"


# -- conduit-rllib's ``conduit demo``: refusals happen before Ray starts, so they are fast ------------------------

def _rllib_demo_refuses(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    pytest.importorskip("conduit_rllib.demo")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--no-progress", "--obs-dim", "4", "--iterations", "2", "--steps", "1", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2, (exc.value.code, err)
    assert "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flag", ["--batch", "--capacity", "--hidden"])
def test_rllib_demo_refuses_non_positive_sizes(flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--batch 0`` trained on empty batches and reported numbers; ``--capacity 0`` and ``--hidden 0``
    failed inside RLlib with a bare AssertionError."""
    monkeypatch.chdir(tmp_path)  # a demo that is not refused writes its plot into the working directory
    err = _rllib_demo_refuses([flag, "0"], capsys)
    assert f"{flag} must be >= 1, got 0" in err, err


def test_rllib_demo_refuses_a_directory_as_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--out DIR`` ran for minutes, wrote ``DIR.png`` next to the directory and printed ``plot: DIR``."""
    err = _rllib_demo_refuses(["--out", str(tmp_path)], capsys)
    assert "is a directory" in err, err
    assert not tmp_path.with_name(tmp_path.name + ".png").exists()


def test_rllib_demo_refuses_an_unwritable_plot_before_running(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The plot was written last: an unwritable ``--out`` ended minutes of training in a traceback."""
    target = _unwritable_directory(tmp_path) / "plot.png"
    try:
        err = _rllib_demo_refuses(["--out", str(target)], capsys)
    finally:
        if target.parent.is_relative_to(tmp_path):
            target.parent.chmod(0o755)
    assert f"cannot write the plot to {str(target)!r}" in err, err
    assert "RLlib DQN on LargeObsCartPole" not in capsys.readouterr().out


def test_rllib_demo_refuses_a_format_matplotlib_cannot_write(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    err = _rllib_demo_refuses(["--out", str(tmp_path / "plot.xyz")], capsys)
    assert "cannot write '.xyz' files" in err and ".png" in err, err


def test_rllib_demo_plot_without_suffix_is_reported_as_written(tmp_path: Path) -> None:
    """matplotlib appends ``.png`` to a name without a suffix; the demo printed the name without it."""
    demo = pytest.importorskip("conduit_rllib.demo")
    path = demo._plot_path(argparse.ArgumentParser(), tmp_path / "sub" / "plot")
    assert path == tmp_path / "sub" / "plot.png", path
    assert not path.exists(), "the writability probe left a file behind"


def test_rllib_demo_help_points_to_the_synthetic_demo(capsys: pytest.CaptureFixture[str]) -> None:
    """The README says ``--help`` lists the options and ``--synthetic`` runs core's loop instead."""
    pytest.importorskip("conduit_rllib.demo")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "--synthetic" in out, out


def test_output_piped_into_a_reader_that_stops_early_ends_quietly() -> None:
    """``conduit profile --json | head`` printed a BrokenPipeError traceback once ``head`` had exited."""
    proc = subprocess.Popen([sys.executable, "-m", "conduit.cli", "schedule", "ranges", "--g-ing-max", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command writes anything
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=60)
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    assert rc == 1, (rc, err)


def test_schedule_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """``conduit schedule --help`` printed the module docstring's reST (````x````, ``:class:``) run together."""
    with pytest.raises(SystemExit) as exc:
        main(["schedule", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert "``" not in out and ":class:" not in out, out
    assert "\n  conduit schedule ranges --on-policy -M 4" in out, out


def test_schedulers_describe_themselves_before_they_are_attached() -> None:
    from conduit import Automatic, Synchronous

    assert repr(Synchronous()) == "Synchronous()"
    assert repr(Automatic(g_ing_max=4, overlap=True)) == "Automatic(g_ing_max=4, g_del_max=8, overlap=on)"


def test_a_memory_budget_refusal_shows_the_sizes_it_compared() -> None:
    from conduit.errors import ConfigurationError
    from conduit.scheduling.granularity import safe_ranges

    with pytest.raises(ConfigurationError) as e:
        safe_ranges(on_policy=False, batch_bytes=1000, memory_budget=10)
    msg = str(e.value)
    assert "memory_budget=10 bytes" in msg and " 0 MiB" not in msg, msg


def test_a_simulation_over_other_gpu_counts_is_titled_with_them(tmp_path) -> None:  # noqa: ANN001
    from conduit.cli import main

    assert main(["simulate", "--scenario", "a100", "--gpus", "1,2", "--samples", "1", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "scale-a100.md").read_text()
    assert "A100 cluster, 1-2 GPUs" in md and "1-16" not in md.splitlines()[0], md.splitlines()[0]
