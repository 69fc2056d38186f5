"""Leftovers in the CLI, the telemetry and the scale simulator.

* :meth:`Telemetry.chrome_trace` did not say how many calls the ring dropped: a trace of a long run silently
  missed its oldest spans. The trace now states it (``otherData.dropped_calls``).
* A garbage-collector callback that recorded during a thread's very first ``Telemetry.record()`` gave that
  thread a second id, so a trace showed it on two lanes.
* ``conduit simulate --replay-ratio 1e-9`` never finished (one ingestion call simulated per 1e-9 of a batch);
  a replay ratio that ingests more than the buffer holds per iteration is now refused with its range.
* The ``all-gpus`` baseline was simulated (and reported as a latency) where the node's GPUs cannot hold the
  buffer; such a row now says it does not fit.
* ``conduit plan --topology local`` with an unwritable profile cache printed a RuntimeWarning with a Python
  source line; the CLI now prints one clean line (library callers still get the warning).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conduit.cli import main
from conduit.errors import ConfigurationError, PlacementError
from conduit.simulation import SCENARIOS, run_scenario, simulate_scale
from conduit.telemetry import Telemetry

# -- 1. the trace says how many calls the ring dropped ------------------------------------------------------


def test_chrome_trace_says_how_many_calls_the_ring_dropped(tmp_path: Path) -> None:
    tel = Telemetry(maxlen=4, fold_every=0)
    for i in range(10):
        tel.record("ingest", 1, 8, float(i), i + 0.5)
    path = tmp_path / "trace.json"
    trace = tel.chrome_trace(path)
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == 4
    assert trace.get("otherData", {}).get("dropped_calls") == 6, (
        f"the ring kept 4 of 10 calls: the trace should say 6 were dropped, got {trace.get('otherData')!r}")
    written = json.loads(path.read_text())  # valid JSON (no NaN), the same statement in the file
    assert written["otherData"]["dropped_calls"] == 6
    assert isinstance(written["traceEvents"], list) and written["displayTimeUnit"] == "ms"
    # a window that starts after every dropped call ended misses none of them
    assert tel.chrome_trace(since=5.6)["otherData"]["dropped_calls"] == 0
    assert tel.chrome_trace(since=5.4)["otherData"]["dropped_calls"] == 6
    tel.reset()  # what reset forgets is not "dropped"
    assert tel.chrome_trace()["otherData"]["dropped_calls"] == 0
    tel.record("ingest", 1, 8, 20.0, 21.0)
    assert tel.chrome_trace()["otherData"]["dropped_calls"] == 0


def test_chrome_trace_of_a_ring_that_dropped_nothing_says_zero() -> None:
    tel = Telemetry(maxlen=8, fold_every=3)
    for i in range(8):
        tel.record("deliver", 1, 8, float(i), i + 0.5)
    assert tel.chrome_trace()["otherData"]["dropped_calls"] == 0
    tel.record("deliver", 1, 8, 9.0, 9.5)
    assert tel.chrome_trace()["otherData"]["dropped_calls"] == 1


def test_chrome_trace_counts_calls_dropped_within_one_fold() -> None:
    """More calls folded at once than the ring holds: the ones pushed straight through count too."""
    tel = Telemetry(maxlen=2, fold_every=100)
    for i in range(7):
        tel.record("update", 0, 0, float(i), i + 0.5)
    trace = tel.chrome_trace()
    assert trace["otherData"]["dropped_calls"] == 5
    assert tel.chrome_trace(since=4.6)["otherData"]["dropped_calls"] == 0
    assert [e["args"]["items"] for e in trace["traceEvents"] if e["ph"] == "X"] == [0, 0]


# -- 2. a GC callback recording during a thread's first record keeps one lane -------------------------------


def _first_record_with_a_gc_callback_recording(k: int) -> tuple[bool, set[int], bool]:
    """On a new thread, the first ``tel.record`` with the collector run at (nearly) every allocation and a
    callback that records once, on the ``k``-th collection on that thread. Returns (the callback recorded,
    the thread ids recorded, the thread finished)."""
    tel = Telemetry(fold_every=0)
    state: dict[str, object] = {"thread": None, "n": 0, "fired": False}

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and state["thread"] is threading.current_thread() and not state["fired"]:
            state["n"] = int(state["n"]) + 1  # type: ignore[call-overload]
            if state["n"] == k:
                state["fired"] = True
                tel.record("gc", 0, 0, 1.0, 2.0)

    def work() -> None:
        state["thread"] = threading.current_thread()
        old = gc.get_threshold()
        gc.set_threshold(1)
        try:
            tel.record("work", 1, 8, 0.0, 1.0)
        finally:
            gc.set_threshold(*old)
            state["thread"] = None

    gc.callbacks.append(callback)
    try:
        t = threading.Thread(target=work, name=f"gc-worker-{k}", daemon=True)
        t.start()
        t.join(20)
    finally:
        gc.callbacks.remove(callback)
    return bool(state["fired"]), {r.thread for r in tel.records}, not t.is_alive()


def test_a_gc_callback_recording_during_a_threads_first_record_gives_it_one_lane() -> None:
    fired_any = False
    for k in range(1, 9):  # the k-th collection falls at a different point of the first record
        fired, threads, finished = _first_record_with_a_gc_callback_recording(k)
        assert finished, f"the first record() hung when a GC callback recorded at collection {k} (a deadlock)"
        fired_any |= fired
        assert len(threads) == 1, (f"one thread was recorded under {len(threads)} ids {sorted(threads)} when a GC "
                                   f"callback recorded at collection {k} of its first record(): a trace shows it "
                                   f"on that many lanes")
    assert fired_any, "no collection ran during the first record(): the check did not exercise anything"


def test_a_gc_callback_recording_during_a_threads_first_record_shows_one_named_lane() -> None:
    fired, threads, finished = _first_record_with_a_gc_callback_recording(1)
    assert finished and fired
    assert len(threads) == 1, f"two lanes for one thread: {threads}"


# -- 3. a replay ratio near 0 is refused (it never finished) ------------------------------------------------


def test_simulate_refuses_a_replay_ratio_that_ingests_more_than_the_buffer_per_iteration(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "conduit.cli", "simulate", "--scenario", "a100", "--gpus", "1", "--samples", "1",
           "--replay-ratio", "1e-9", "--out", str(tmp_path / "out")]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("`conduit simulate --replay-ratio 1e-9` ran for 5 minutes without finishing")
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr
    err = res.stderr.strip()
    assert err.startswith("error:") and "replay_ratio" in err and "0.002048" in err, (
        f"the refusal should name the allowed range (>= total batch / capacity = 0.002048): {err!r}")
    assert len(err.splitlines()) == 1, err


def test_scenario_replay_ratio_bound_is_total_batch_over_capacity() -> None:
    sc = SCENARIOS["a100"]
    lowest = sc.total_batch / sc.capacity
    with pytest.raises(ConfigurationError, match=r"replay_ratio >= .*= 0\.002048"):
        dataclasses.replace(sc, replay_ratio=1e-9)
    with pytest.raises(ConfigurationError, match="replay_ratio"):
        dataclasses.replace(sc, replay_ratio=math.nextafter(lowest, 0.0))
    ok = dataclasses.replace(sc, replay_ratio=lowest, gpus=(1,), obs_dim=64)  # exactly a buffer per iteration
    [point] = simulate_scale(ok, 1)
    assert math.isfinite(point.latency_s) and point.latency_s > 0


# -- 4. the all-gpus baseline where the GPUs cannot hold the buffer -----------------------------------------


def test_all_gpus_baseline_that_does_not_fit_is_not_reported_as_a_latency() -> None:
    # 5e6 transitions of d=20000 (about 745 GiB) do not fit 8 x 80 GB; host memory (2 TiB) holds them
    sc = dataclasses.replace(SCENARIOS["a100"], capacity=5_000_000, gpus=(8,))
    with pytest.raises(PlacementError, match="does not fit"):
        simulate_scale(sc, 8, adaptive=False, baseline="all-gpus")
    [row] = run_scenario(sc, baseline="all-gpus")
    assert row["sim_non_adaptive_ms"] is None and row["gain"] is None, (
        f"a baseline whose buffer does not fit in the GPUs was reported as {row['sim_non_adaptive_ms']} ms "
        f"(gain {row['gain']})")
    assert "does not fit" in row["non_adaptive_placement"], row["non_adaptive_placement"]
    assert math.isfinite(row["sim_ms"]) and row["placement"] == "host", row  # the adaptive planner still plans
    json.dumps(row, allow_nan=False)  # the JSON file stays valid


def test_cli_all_gpus_baseline_table_says_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["simulate", "--scenario", "a100", "--gpus", "1,8", "--capacity", "5e6", "--baseline", "all-gpus",
               "--samples", "1", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 8 |")]
    assert len(rows) == 2, text
    for line in rows:
        assert "does not fit" in line, f"the all-gpus baseline cannot hold the buffer, yet the row says {line!r}"
    data = json.loads((out / "scale-a100.json").read_text())
    assert all(r["sim_non_adaptive_ms"] is None for r in data["rows"]), data["rows"]


def test_all_gpus_baseline_that_fits_is_still_simulated() -> None:
    sc = dataclasses.replace(SCENARIOS["a100"], gpus=(8,))  # 1e6 x 160 kB over 8 x 80 GB fits
    [row] = run_scenario(sc, baseline="all-gpus")
    assert row["sim_non_adaptive_ms"] is not None and row["sim_non_adaptive_ms"] > 0, row
    assert row["non_adaptive_placement"].startswith("sharded[cuda:0"), row


# -- 5. plan --topology local with an unwritable profile cache: one clean line ------------------------------


def test_plan_local_with_an_unwritable_cache_prints_one_clean_warning_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {**os.environ, "CONDUIT_CACHE_DIR": str(blocker / "cache"), "PYTHONWARNINGS": ""}
    res = subprocess.run([sys.executable, "-m", "conduit.cli", "plan", "--topology", "local", "--obs-dim", "8",
                          "--capacity", "100", "--batch", "4"], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert "chosen:" in res.stdout, res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{res.stderr}"
    [line] = lines
    assert "RuntimeWarning" not in line and "profile_machine(" not in line and ".py:" not in line, line
    assert line.startswith("warning:") and "not cached" in line and "CONDUIT_CACHE_DIR" in line, line


def test_profile_machine_still_warns_library_callers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conduit.placement.profile import profile_machine

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="not cached"):
        profile_machine(quick=True)


# -- 1b. the demo says when its trace misses calls ---------------------------------------------------------------
def test_demo_says_when_its_trace_misses_calls_the_ring_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A buffer whose telemetry ring is smaller than the run's calls: the demo counts and prints what its trace
    lacks (a real Telemetry with a small ring, built where the buffer builds its own; one that holds an iteration's
    calls, about 16 here: the demo gives a ring too small for that a larger one)."""
    import functools

    import conduit.edp
    from conduit.demo import run_loop, run_synthetic

    monkeypatch.setattr(conduit.edp, "Telemetry", functools.partial(Telemetry, maxlen=100, fold_every=0))
    path = tmp_path / "trace.json"
    res = run_loop(obs_dim=4, iterations=8, warmup=0, rollout=8, batch=8, updates=4, capacity=64, trace=path)
    written = json.loads(path.read_text())["otherData"]["dropped_calls"]
    assert res.trace_dropped_calls == written > 0, (res.trace_dropped_calls, written)
    assert run_synthetic(["--iterations", "8", "--warmup", "0", "--obs-dim", "4", "--rollout", "8", "--batch",
                          "8", "--capacity", "64", "--no-baseline", "--trace", str(tmp_path / "t2.json")]) == 0
    out = capsys.readouterr().out
    assert "note: the trace misses" in out and "calls that the telemetry ring dropped" in out, out
