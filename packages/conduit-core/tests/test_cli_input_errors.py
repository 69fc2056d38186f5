"""What a user typing bad numbers into ``conduit`` sees: one line that names the option they typed and says what
to give, before anything runs (no table header, no "calibrating ..."), never a traceback.

Each test here failed before: the refusals named the library's parameters (``num_minibatches (M)``,
``g_ing_max``, ``obs_dim``, ``batch (1000) exceeds capacity (100)``) instead of the option, came after the run had
started printing, blamed ``--gpus`` for a huge ``--obs-dim``, or ended in an ``OverflowError`` traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conduit.cli import main

#: the smallest synthetic loop (as in test_cli_error_lines_help_and_outputs.py)
TINY = ["--no-baseline", "--trace", "", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64",
        "--iterations", "1", "--warmup", "0"]

#: ``conduit schedule calibrate`` at its smallest (every count given, so only the one under test is wrong)
CALIBRATE = ["schedule", "calibrate", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64",
             "--warmup", "28", "--iterations", "1"]

HUGE = str(10**20)  # past int64


def _refused(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Run ``argv``: exit 2, one ``error:`` line naming ``flag`` and saying what to give, no traceback."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, f"{argv} exited {rc}; stderr: {err[-800:]}"
    assert err.startswith("error: ") and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, f"not one line: {err!r}"
    assert re.search(rf"(^|\s){re.escape(flag)}(\s|$|[,.;)])", err), f"the message does not name {flag}: {err}"
    assert re.search(r"\b(give|lower|raise|use)\b", err, re.IGNORECASE), f"the message does not say what to do: {err}"
    return out, err


# -- conduit plan ------------------------------------------------------------------------------------------------


def test_plan_batch_above_capacity_names_both_options(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "batch (1000) exceeds capacity (100).": neither option, nothing to do."""
    _, err = _refused(["plan", "--topology", "h200x1", "--obs-dim", "10", "--capacity", "100", "--batch", "1000"],
                      "--batch", capsys)
    assert "--capacity" in err and "lower --batch or raise --capacity" in err, err


# -- conduit schedule ranges -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flag"), [
    (["-M", "0"], "-M"),
    (["--on-policy", "-M", "-3"], "-M"),
    (["--g-ing-max", "0"], "--g-ing-max"),
    (["--g-del-max", "-1"], "--g-del-max"),
    (["--batch-bytes", "-100", "--memory-budget", "10"], "--batch-bytes"),
    (["--batch-bytes", "100", "--memory-budget", "-10"], "--memory-budget"),
])
def test_schedule_ranges_counts_below_their_bound_name_the_option(argv: list[str], flag: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, err = _refused(["schedule", "ranges", *argv], flag, capsys)
    assert "or more" in err, err


def test_schedule_ranges_says_that_m_bounds_nothing_off_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """``schedule ranges -M 4`` (--on-policy forgotten) printed the off-policy ranges as if -M had been used: a
    cap given with --on-policy is refused as ignored, but -M without it was ignored without a word."""
    assert main(["schedule", "ranges", "-M", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("off-policy: "), out
    assert err.startswith("note: -M 4 bounds on-policy granularities only") and "--on-policy" in err, err
    assert main(["schedule", "ranges", "--on-policy", "-M", "4"]) == 0
    assert capsys.readouterr().err == "", "a note for an on-policy job's M"


def test_schedule_ranges_a_budget_too_small_names_both_options(capsys: pytest.CaptureFixture[str]) -> None:
    """Delivery buffers over the budget at g_del = 1 were refused as "over memory_budget=10 bytes": the library's
    parameter, not the options typed."""
    _, err = _refused(["schedule", "ranges", "--batch-bytes", "100", "--memory-budget", "10"], "--memory-budget",
                      capsys)
    assert err.startswith("error: --batch-bytes 100 with --memory-budget 10: "), err
    assert "raise the budget" in err, err


# -- conduit schedule calibrate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "value"), [("--obs-dim", "0"), ("--obs-dim", HUGE), ("--batch", "0"),
                                             ("--batch", HUGE), ("--rollout", "0"), ("--capacity", "-5"),
                                             ("--warmup", "-1"), ("--iterations", "-1"), ("--g-del-max", "0")])
@pytest.mark.timeout(60)
def test_schedule_calibrate_bad_counts_are_refused_before_it_starts(flag: str, value: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """They were refused by the loop after "calibrating on the synthetic loop: d=0, ...", as ``obs_dim`` etc."""
    out, _ = _refused([*CALIBRATE, flag, value], flag, capsys)
    assert "calibrating" not in out, out


@pytest.mark.timeout(60)
def test_schedule_calibrate_a_rollout_above_capacity_is_refused_before_it_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It was refused by the loop after "calibrating on the synthetic loop: ...", as "lower rollout or raise
    capacity": the loop's parameters, not the options typed."""
    out, err = _refused([*CALIBRATE, "--rollout", "100", "--capacity", "64"], "--rollout", capsys)
    assert "--capacity 64" in err and "lower --rollout or raise --capacity" in err, err
    assert "calibrating" not in out, out


def test_schedule_calibrate_help_describes_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    """``--obs-dim``, ``--batch``, ``--rollout``, ``--updates``, ``--capacity``, ``--overlap`` and ``--iterations``
    were listed with no description and no default."""
    helps = _option_help(["schedule", "calibrate", "--help"], capsys)
    for flag in ("--obs-dim", "--batch", "--rollout", "--updates", "--capacity", "--overlap", "--iterations",
                 "--warmup", "--g-ing-max", "--g-del-max"):
        assert helps.get(flag), f"{flag} has no help text: {helps}"
        assert "default" in helps[flag], f"{flag}'s help states no default: {helps[flag]!r}"


# -- conduit demo --synthetic ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flag"), [
    (["--obs-dim", "0"], "--obs-dim"),
    (["--obs-dim", HUGE], "--obs-dim"),
    (["--rollout", "0"], "--rollout"),
    (["--capacity", "0"], "--capacity"),
    (["--batch", HUGE], "--batch"),
    (["--scheduler", "sequential", "--g-ing", "0"], "--g-ing"),
    (["--scheduler", "overlapped", "--g-del", "-1"], "--g-del"),
])
@pytest.mark.timeout(60)
def test_demo_bad_counts_are_refused_before_the_table(argv: list[str], flag: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """They were refused by the loop after its header, as ``obs_dim``, ``g_ing``, ``capacity`` ... or, for a huge
    --batch, as "A delivery of ... items is more than one call draws", naming no option."""
    out, _ = _refused(["demo", "--synthetic", *TINY, *argv], flag, capsys)
    assert "synthetic loop" not in out and "iter" not in out, out


@pytest.mark.parametrize("argv", [["--rollout", "100"], ["--capacity", "8"]])
@pytest.mark.timeout(60)
def test_demo_a_rollout_above_capacity_is_refused_before_the_table(argv: list[str],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """It was refused by the loop after the header and the table's column names, as "lower rollout or raise
    capacity": the loop's parameters, not the options typed."""
    out, err = _refused(["demo", "--synthetic", *TINY, *argv], "--rollout", capsys)
    assert "--capacity" in err and "lower --rollout or raise --capacity" in err, err
    assert "synthetic loop" not in out and "iter" not in out, out


@pytest.mark.timeout(60)
def test_demo_a_fifo_as_the_trace_is_refused_before_the_run_not_waited_on(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The check that the trace can be written opened the FIFO and waited for a reader, forever (and a device such
    as /dev/null, opened at once, was replaced by a regular file when the trace was renamed over it)."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    out, err = _refused(["demo", "--synthetic", *TINY, "--trace", str(fifo)], "--trace", capsys)
    assert "not a regular file" in err, err
    assert "synthetic loop" not in out, out


@pytest.mark.timeout(120)
def test_demo_a_trace_in_a_folder_that_takes_no_new_file_is_refused_before_the_run(tmp_path: Path) -> None:
    """A file the user may write, in a folder where they may not create files: the trace is written beside it and
    renamed over it, so the run went to its end and then failed with a PermissionError traceback. (Run as a
    process of its own; as root, without the capability that overrides file permissions.)"""
    folder = tmp_path / "read-only"
    folder.mkdir()
    trace = folder / "trace.json"
    trace.write_text("")
    trace.chmod(0o666)
    folder.chmod(0o555)
    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: no way to make a folder root cannot write into")
        drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    code = "import sys; from conduit.cli import main; sys.exit(main(sys.argv[1:]))"
    try:
        done = subprocess.run([*drop, sys.executable, "-c", code, "demo", "--synthetic", *TINY, "--trace",
                               str(trace)], capture_output=True, text=True, timeout=100)
    finally:
        folder.chmod(0o755)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    assert "--trace" in done.stderr and "Permission denied" in done.stderr, done.stderr
    assert "synthetic loop" not in done.stdout, done.stdout
    assert trace.read_text() == "", "the file was changed"


@pytest.mark.timeout(60)
def test_demo_a_trace_with_a_long_file_name_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A name of 220 characters or more (a file name may have 255) was refused only after the run, by an OSError
    traceback: the temporary file beside it took the whole name plus the process and thread ids."""
    trace = tmp_path / ("t" * 240 + ".json")
    assert main(["demo", "--synthetic", *TINY, "--trace", str(trace)]) == 0, capsys.readouterr().err
    assert json.loads(trace.read_text())["traceEvents"], "the trace holds no events"
    assert [p.name for p in tmp_path.iterdir()] == [trace.name], "a temporary file was left beside the trace"


@pytest.mark.timeout(60)
def test_demo_a_huge_granularity_is_an_error_line_not_an_overflow_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    """With as many iterations, --g-del 10**20 passed the "more than the run takes" check and the first delivery
    raised "OverflowError: cannot fit 'int' into an index-sized integer"."""
    _, err = _refused(["demo", "--synthetic", *TINY, "--scheduler", "sequential", "--iterations", HUGE,
                       "--g-del", HUGE], "--g-del", capsys)
    assert "at most 10000" in err, err


def test_demo_help_describes_every_count(capsys: pytest.CaptureFixture[str]) -> None:
    """``--iterations``, ``--batch``, ``--capacity`` and ``--scheduler`` were listed with no description."""
    helps = _option_help(["demo", "--synthetic", "--help"], capsys)
    for flag in ("--obs-dim", "--iterations", "--warmup", "--rollout", "--batch", "--updates", "--capacity",
                 "--hidden", "--scheduler"):
        assert helps.get(flag), f"{flag} has no help text: {helps}"
        assert "default" in helps[flag], f"{flag}'s help states no default: {helps[flag]!r}"


# -- conduit simulate --------------------------------------------------------------------------------------------


def test_simulate_obs_dim_past_int64_is_an_argument_error_not_blamed_on_gpus(
        capsys: pytest.CaptureFixture[str]) -> None:
    """It said "error: --gpus 8 (a100): Field shape (1000...) has ... elements per item, ...; give a smaller
    shape": the wrong option, and the right one not named."""
    with pytest.raises(SystemExit) as done:
        main(["simulate", "--scenario", "a100", "--gpus", "8", "--obs-dim", HUGE])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "argument --obs-dim" in err and "2**63 - 1" in err and "--gpus" not in err.splitlines()[-1], err


@pytest.mark.parametrize(("argv", "named"), [(["--capacity", "100"], "--capacity 100"),
                                             (["--replay-ratio", "1e-9"], "--replay-ratio 1e-09"),
                                             (["--capacity", "1000", "--replay-ratio", "0.5"],
                                              "--capacity 1000, --replay-ratio 0.5")])
def test_simulate_a_scenario_refused_for_its_sizes_names_the_options_that_set_them(
        argv: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "error: replay_ratio 1 would ingest 2048 items per iteration into a buffer of capacity 100 ...",
    naming the scenario's fields, and not --capacity, the option that was typed."""
    out_dir = tmp_path / "out"
    _, err = _refused(["simulate", "--scenario", "a100", "--gpus", "8", *argv, "--out", str(out_dir)],
                      argv[0], capsys)
    assert err.startswith(f"error: {named} (a100): "), err
    assert not out_dir.exists(), "the output directory was made for a refused command"


# -- an option the subcommand does not take -----------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "prog"), [(["profile", "--bogus"], "conduit profile"),
                                            (["plan", "--topology", "h200x1", "--obs-dim", "1", "--capacity", "1",
                                              "--batch", "1", "--bogus"], "conduit plan"),
                                            (["schedule", "ranges", "--bogus"], "conduit schedule ranges"),
                                            (["schedule", "calibrate", "--bogus"], "conduit schedule calibrate"),
                                            (["simulate", "--bogus"], "conduit simulate")])
def test_an_unknown_option_is_refused_with_the_subcommands_usage(argv: list[str], prog: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """It was refused by the top-level parser, whose usage (``conduit [-h] {demo,profile,...} ...``) lists none of
    the subcommand's options."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} "), err
    assert err.strip().splitlines()[-1] == f"{prog}: error: unrecognized arguments: --bogus", err


def _option_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``--help``'s options section as {long option: its description} (argparse's layout: the option at two spaces,
    its description after it on the same line or on the lines indented below)."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    text = capsys.readouterr().out.split("options:", 1)[1]
    helps: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m:
            longs = re.findall(r"--[\w-]+", m.group(1))
            current = longs[-1] if longs else m.group(1)
            helps[current] = m.group(2) or ""
        elif current and line.startswith("    "):
            helps[current] = (helps[current] + " " + line.strip()).strip()
    return helps
