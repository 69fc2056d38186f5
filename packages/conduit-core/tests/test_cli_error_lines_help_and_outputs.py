"""The command line's error lines, help and outputs: what a user following ``conduit <cmd> --help`` and the README sees.

Huge sizes are refused with a one-line error (never a traceback or a hang), files are written whole or not
at all, ``conduit profile`` only says it cached the profile when it did, and the demo's summary prints no
sum that does not add up."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conduit.cli import main
from conduit.demo import LoopResult, _summary
from conduit.exposure import IterationExposure
from conduit.placement import profile as profile_module

#: the smallest synthetic loop (as in test_placement_and_cli_refusals.py)
TINY = ["--no-baseline", "--trace", "", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64",
        "--iterations", "1", "--warmup", "0"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv``: it must exit 2 with a one-line ``error: ...`` and no traceback; returns that line."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, f"{argv} exited {rc}; stderr: {err}"
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, f"not one line: {err!r}"
    return err


# -- conduit profile: "cached at" only when it was -------------------------------------------------------------


@pytest.mark.timeout(120)
def test_profile_whose_cache_cannot_be_written_is_an_error_before_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """It measured, printed a RuntimeWarning with a source line, said "cached at <path>" and exited 0."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(blocker))
    rc = main(["profile", "--quick"])
    out, err = capsys.readouterr()
    assert rc == 2, f"exit {rc}, out: {out[:300]}"
    assert "cached at" not in out, "it claims to have cached a profile it could not write"
    assert err.startswith("error: ") and "CONDUIT_CACHE_DIR" in err and "Traceback" not in err, err
    assert "bandwidth profile of machine" not in out, "it measured before finding the cache unwritable"
    assert blocker.read_text() == ""


@pytest.mark.timeout(180)
def test_profile_json_names_the_file_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path / "new" / "cache"))  # created on the way
    assert main(["profile", "--quick", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert Path(shown["path"]) == profile_module.profile_path()
    assert json.loads(Path(shown["path"]).read_text())["created"] == shown["created"]


def test_profile_cached_and_quick_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--quick (how to measure) was silently ignored by --cached (which does not measure)."""
    with pytest.raises(SystemExit) as e:
        main(["profile", "--cached", "--quick"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--cached" in err and "--quick" in err and "Traceback" not in err, err


# -- conduit simulate: a write that fails keeps the previous files whole and is an error line ------------------

_SIMULATE_UNDER_A_FILE_SIZE_LIMIT = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from conduit.cli import main
    out = Path(sys.argv[1])
    args = ["simulate", "--scenario", "a100", "--samples", "1", "--out", str(out)]
    assert main([*args, "--gpus", "1"]) == 0
    old = (out / "scale-a100.json").read_text()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(old) + 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    print("rc", main([*args, "--gpus", "1,2,4,8,16"]))
    print("old kept" if (out / "scale-a100.json").read_text() == old else "old lost")
""")


@pytest.mark.timeout(300)
def test_simulate_a_failed_write_leaves_the_previous_json_whole_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "o"
    run = subprocess.run([sys.executable, "-c", _SIMULATE_UNDER_A_FILE_SIZE_LIMIT, str(out)], capture_output=True,
                         text=True, timeout=280, check=False)
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    lines = run.stdout.split("\n")
    assert "rc 2" in lines and "old kept" in lines, run.stdout[-500:]
    assert "error: " in run.stderr and str(out) in run.stderr, run.stderr[-1000:]
    json.loads((out / "scale-a100.json").read_text())  # still whole
    left = sorted(p.name for p in out.iterdir())
    assert left == ["scale-a100.json", "scale-a100.md", "scale.png"] or left == ["scale-a100.json", "scale-a100.md"], \
        f"temporary files left behind: {left}"


# -- conduit demo --synthetic: huge sizes, the summary, the help --------------------------------------------------


@pytest.mark.parametrize("capacity", ["100000000000000000", "99999999999999999999"])
@pytest.mark.timeout(120)
def test_demo_huge_capacity_is_an_error_line_not_a_traceback(capacity: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """numpy's _ArrayMemoryError / "ValueError: Maximum allowed dimension exceeded" reached the user."""
    err = _refused(["demo", "--synthetic", *TINY, "--capacity", capacity], capsys)
    assert "capacity" in err, err


@pytest.mark.timeout(120)
def test_demo_a_network_too_large_for_memory_is_an_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """torch's "RuntimeError: [enforce fail at alloc_cpu.cpp] ... can't allocate memory" reached the user."""
    err = _refused(["demo", "--synthetic", *TINY, "--hidden", "99999999999999"], capsys)
    assert "hidden" in err, err


@pytest.mark.parametrize("command", [["demo", "--synthetic", *TINY],
                                     ["schedule", "calibrate", *TINY[3:], "--warmup", "28"]])
@pytest.mark.timeout(120)
def test_a_rollout_larger_than_the_capacity_names_both_options(command: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """It said "A batch of 16 items is larger than the capacity (4); split it", naming neither option."""
    err = _refused([*command, "--capacity", "4"], capsys)
    assert "rollout" in err and "capacity" in err and "split it" not in err, err


@pytest.mark.timeout(120)
def test_demo_zero_obs_dim_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "Field shape (0,) has a non-positive dimension", which names no option of the demo."""
    err = _refused(["demo", "--synthetic", *TINY, "--obs-dim", "0"], capsys)
    assert "obs_dim" in err, err


@pytest.mark.timeout(120)
def test_demo_auto_says_when_its_figures_include_calibration(capsys: pytest.CaptureFixture[str]) -> None:
    """With the default --warmup 3 the automatic scheduler is still probing granularities in every accounted
    iteration: the demo printed those figures as the scheduler's, and no word that it never decided."""
    assert main(["demo", "--synthetic", *TINY, "--scheduler", "auto", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "automatic configuration" not in out, "the scheduler decided within 2 iterations: the test needs fewer"
    assert "still calibrating in 2 of the 2 accounted iterations" in out and "--warmup" in out, out


def test_demo_summary_prints_no_sum_that_does_not_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    """Medians of hidden and exposed do not add up to the median experience path: it printed
    "experience path 2.00 ms = hidden 0.00 + exposed 1.00"."""
    res = LoopResult(4, "s", "p")
    for total, exposed, hidden in ((1e-3, 1e-3, 0.0), (2e-3, 0.0, 2e-3), (10e-3, 10e-3, 0.0)):
        res.iterations.append(IterationExposure(0.0, 0.02, total, exposed, hidden, 0.0, 0.0))
    _summary(res)
    line = capsys.readouterr().out.strip()
    nums = {k: float(v) for k, v in re.findall(r"(experience path|hidden|exposed) (\d+\.\d+)", line)}
    assert nums == {"experience path": 2.0, "hidden": 0.0, "exposed": 1.0}, line
    assert "=" not in line or nums["experience path"] == nums["hidden"] + nums["exposed"], line


def test_demo_help_says_where_the_trace_goes_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["demo", "--synthetic", "--help"])
    assert e.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # (argparse may wrap the name at a hyphen)
    assert "(defaultconduit-synthetic-trace.json" in text, "the help does not say where the trace is written by default"


# -- conduit schedule ranges: huge caps are refused, not enumerated for hours; a budget needs a batch size ------


@pytest.mark.parametrize("argv", [["--on-policy", "-M", "1000000000000"], ["--g-ing-max", "1000000000000"],
                                  ["--g-del-max", "1000000000000"]])
@pytest.mark.timeout(30)
def test_schedule_ranges_huge_counts_are_refused_quickly(argv: list[str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["schedule", "ranges", *argv], capsys)
    assert argv[-2] in err, err


@pytest.mark.parametrize(("given", "missing"), [("--memory-budget", "--batch-bytes"),
                                                ("--batch-bytes", "--memory-budget")])
def test_schedule_ranges_a_memory_cap_needs_both_sizes(given: str, missing: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """One without the other was silently ignored: the ranges printed were not capped at all."""
    err = _refused(["schedule", "ranges", given, "100"], capsys)
    assert missing in err, err


_UNDER_A_MEMORY_LIMIT = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    from conduit.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("flag", ["--g-ing-max", "--g-del-max"])
@pytest.mark.timeout(120)
def test_schedule_calibrate_huge_caps_are_refused_before_running(flag: str) -> None:
    """The automatic scheduler enumerated every granularity up to the cap: the machine ran out of memory (run
    here under an 8 GiB address-space limit, so that a regression fails instead of taking the machine down)."""
    argv = ["schedule", "calibrate", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64",
            "--warmup", "28", "--iterations", "1", flag, "1000000000000"]
    run = subprocess.run([sys.executable, "-c", _UNDER_A_MEMORY_LIMIT, *argv], capture_output=True, text=True,
                         timeout=110, check=False)
    assert run.returncode == 2, (run.returncode, run.stderr[-1500:])
    assert run.stderr.startswith("error: ") and flag in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert "calibrating" not in run.stdout, "the loop started before the cap was refused"


def test_demo_help_names_the_synthetic_loop_beside_an_adapters_options(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import entry_points

    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    if list(entry_points(group="conduit.demos")):  # an adapter's demo prints its own options: the note says more
        assert "conduit demo --synthetic" in out, out[:400]
    else:  # core alone: the synthetic loop's own help
        assert "--scheduler" in out, out[:400]


# -- python -m conduit -------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_python_dash_m_conduit_runs_the_command_line() -> None:
    """``python -m conduit`` failed ("No module named conduit.__main__") where the console script was not on PATH
    (e.g. a venv not activated); it runs the same command line, with its exit codes."""
    ok = subprocess.run([sys.executable, "-m", "conduit", "simulate", "--help"], capture_output=True, text=True,
                        timeout=110)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("usage: conduit simulate"), ok.stdout[:200]
    bad = subprocess.run([sys.executable, "-m", "conduit", "simulate", "--gpus", "12"], capture_output=True,
                         text=True, timeout=110)
    assert bad.returncode == 2 and "multiple of 8" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
