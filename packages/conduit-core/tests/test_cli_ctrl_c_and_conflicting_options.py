"""The ``conduit`` command line, as a user at a terminal: Ctrl-C, options that cannot apply
together, and a summary of nothing.

Each case was a bug: Ctrl-C during any command printed a 20-40 line KeyboardInterrupt traceback (from deep inside
torch or the simulator) instead of one line; ``conduit schedule ranges --on-policy`` silently ignored the
off-policy caps given with it; ``conduit schedule calibrate --iterations 0`` printed medians of no iterations as
0.00 ms measurements.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conduit.cli import INTERRUPTED, main
from conduit.testing.lifecycle import ctrl_c_enabled

CONDUIT = str(Path(sys.executable).with_name("conduit"))
TINY = ["--obs-dim", "8", "--batch", "8", "--rollout", "8", "--capacity", "64"]


def _interrupt_after(argv: list[str], stream: str, marker: str, settle_s: float = 0.0) -> tuple[int, str]:
    """Start ``conduit *argv`` in its own process group, wait until ``marker`` appears on ``stream`` (the command is
    running its work by then) and ``settle_s`` more, send it SIGINT as Ctrl-C would; its exit status and stderr.
    The bounds below are reached only on a hang."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([CONDUIT, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=ctrl_c_enabled)
    watched = proc.stdout if stream == "stdout" else proc.stderr
    other = proc.stderr if stream == "stdout" else proc.stdout
    assert watched is not None and other is not None
    other_text: list[str] = []
    drain = threading.Thread(target=lambda: other_text.append(other.read()), daemon=True)  # (no pipe fills up)
    drain.start()
    seen: list[str] = []
    try:
        for line in watched:
            seen.append(line)
            if marker in line:
                break
        else:
            pytest.fail(f"the command ended before {marker!r}: {''.join(seen)[-2000:]}")
        time.sleep(settle_s)
        proc.send_signal(signal.SIGINT)
        rest = watched.read()  # until the process closes it (exits)
        rc = proc.wait(timeout=60)
        drain.join(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with pytest.raises(ProcessLookupError):  # nothing it started is left running in its process group
        os.killpg(proc.pid, 0)
    err = "".join(seen) + rest if stream == "stderr" else other_text[0]
    return rc, err


def _assert_one_interrupted_line(rc: int, err: str) -> None:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note:")]
    assert lines and lines[-1].startswith("interrupted"), err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert rc == INTERRUPTED == 130, (rc, err[-3000:])


# -- Ctrl-C: one line and exit status 130, no traceback, nothing left running -----------------------------------


@pytest.mark.parametrize("scheduler", ["overlapped", "auto"])
@pytest.mark.timeout(240)
def test_ctrl_c_during_the_synthetic_demo_says_one_line_and_writes_no_trace(scheduler: str, tmp_path: Path) -> None:
    """The overlapped and automatic schedulers run worker threads: they are stopped with the buffer."""
    trace = tmp_path / "trace.json"
    rc, err = _interrupt_after(["demo", "--synthetic", *TINY, "--warmup", "0", "--iterations", "100000000",
                                "--scheduler", scheduler, "--trace", str(trace)], "stdout", " iter ")
    _assert_one_interrupted_line(rc, err)
    assert list(tmp_path.iterdir()) == [], "an interrupted demo left a trace (or a half-written one) behind"


@pytest.mark.timeout(240)
def test_ctrl_c_during_schedule_calibrate_says_one_line() -> None:
    rc, err = _interrupt_after(["schedule", "calibrate", *TINY, "--warmup", "28", "--iterations", "100000000"],
                               "stdout", "calibrating on the synthetic loop")
    _assert_one_interrupted_line(rc, err)


@pytest.mark.timeout(240)
def test_ctrl_c_during_simulate_says_one_line_and_leaves_no_output_directory(tmp_path: Path) -> None:
    """4096 GPUs take the simulator tens of seconds (it builds a fetch per pair of nodes): Ctrl-C comes first.
    The stderr note on ``--samples`` is printed just before the output directory is made and the simulation
    starts; Ctrl-C comes 2 s later, inside the simulation (an interrupt between the two -- while the directory
    is probed -- leaves the directory: see the round-28 report)."""
    out = tmp_path / "sim"
    rc, err = _interrupt_after(["simulate", "--scenario", "a100", "--gpus", "4096", "--baseline", "rank-order",
                                "--samples", "1", "--out", str(out)], "stderr", "note: --samples", settle_s=2.0)
    _assert_one_interrupted_line(rc, err)
    assert not out.exists(), "the output directory the interrupted command made is still there"


# -- conduit schedule ranges --on-policy: off-policy caps given with it are refused, not silently ignored --------


#: a child that presses Ctrl-C on itself as soon as torch starts to load, then runs the console script's entry
_CTRL_C_WHILE_LOADING = textwrap.dedent("""
    import os, signal, sys

    class CtrlCOnTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt inside the import chain
            return None

    sys.meta_path.insert(0, CtrlCOnTorch())
    import conduit_entry
    assert "torch" not in sys.modules
    sys.exit(conduit_entry.main())
""")


def test_ctrl_c_while_the_command_line_loads_says_one_line() -> None:
    """Ctrl-C while ``conduit`` was still importing torch (the package's ``__init__``, a second or more) printed a
    KeyboardInterrupt traceback from inside torch: ``conduit.cli.main`` had not started. The console script's
    entry (``conduit_entry``, outside the package) catches it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_LOADING, "plan"], capture_output=True, text=True,
                          env=env, timeout=240, preexec_fn=ctrl_c_enabled)
    _assert_one_interrupted_line(proc.returncode, proc.stderr)
    assert "while conduit was starting" in proc.stderr


def test_the_console_script_enters_through_conduit_entry() -> None:
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.name == "conduit"}
    assert scripts == {"conduit": "conduit_entry:main"}, scripts
    # the entry reads its Ctrl-C status (the one conduit.cli imports) without loading torch: a Ctrl-C while torch
    # loads must still be answerable
    probe = ("import sys, conduit_entry; "
             "print(conduit_entry.INTERRUPTED, 'torch' in sys.modules, 'conduit' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(INTERRUPTED), "False", "False"], proc.stdout


@pytest.mark.parametrize("caps", [["--g-ing-max", "2"], ["--g-del-max", "2"],
                                  ["--batch-bytes", "100", "--memory-budget", "1000"],
                                  ["--g-ing-max", "8"]])  # (even the default's value, when given, is refused)
def test_schedule_ranges_on_policy_refuses_off_policy_caps(caps: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--on-policy -M 4 --g-ing-max 2`` printed g_ing in {1/4, 1/2, 3/4, 1}: the cap the user asked for was
    dropped without a word (the help says the caps are off-policy)."""
    assert main(["schedule", "ranges", "--on-policy", "-M", "4", *caps]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for flag in caps[::2]:
        assert flag in err, err
    assert "--on-policy" in err, err


def test_schedule_ranges_caps_still_apply_off_policy_and_default_to_8(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "ranges", "--g-ing-max", "2", "--g-del-max", "3"]) == 0
    assert capsys.readouterr().out.strip() == "off-policy: g_ing in {1, 2}, g_del in {1, 2, 3}"
    assert main(["schedule", "ranges"]) == 0
    assert capsys.readouterr().out.strip() == ("off-policy: g_ing in {1, 2, 3, 4, 5, 6, 7, 8}, "
                                               "g_del in {1, 2, 3, 4, 5, 6, 7, 8}")
    assert main(["schedule", "ranges", "--on-policy", "-M", "2"]) == 0
    assert capsys.readouterr().out.strip() == "on-policy (M=2): g_ing in {1/2, 1}, g_del in {1/2}"


# -- conduit schedule calibrate --iterations 0: no made-up medians ------------------------------------------------


@pytest.mark.timeout(240)
def test_calibrate_with_no_iterations_after_it_prints_no_zero_medians(capsys: pytest.CaptureFixture[str]) -> None:
    """It printed "after calibration: iteration 0.00 ms, exposed experience path 0.000 ms" -- medians of nothing,
    shown as measurements (``conduit demo --synthetic --iterations 0`` says "no iterations")."""
    assert main(["schedule", "calibrate", *TINY, "--warmup", "80", "--iterations", "0"]) == 0
    out = capsys.readouterr().out
    assert "measured in the confirm phase" in out, out  # the choice is still explained
    assert "0.00 ms" not in out.split("after calibration")[-1], out
    assert "after calibration: no iterations measured (--iterations 0)" in out, out


def test_synthetic_demo_with_no_iterations_runs_no_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    """``--iterations 0`` still ran the synchronous baseline loop (its warm-up too) and printed its "no iterations"
    summary: work whose figures nothing could be compared with."""
    assert main(["demo", "--synthetic", *TINY, "--warmup", "1", "--iterations", "0", "--trace", ""]) == 0
    out = capsys.readouterr().out
    assert "baseline: not run (--iterations 0 accounts no iteration to compare)" in out, out
    assert "synchronous scheduling of the same loop" not in out, out
    assert out.count("no iterations") == 1, out  # the overlapped run's summary only
