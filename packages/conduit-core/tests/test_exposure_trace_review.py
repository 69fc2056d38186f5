"""Exposure accounting and Chrome traces on malformed spans, typed refusals of bad arguments, and the demo's trace
of the accounted iterations.

* A span recorded with its end before its start (or a NaN time) counted as *negative* experience-path time in
  :func:`measure_iteration` (exposed / hidden / total below zero); it now counts as no time.
* A span with a non-finite time made :meth:`Telemetry.chrome_trace` write ``NaN`` / ``Infinity`` into the file,
  which is not JSON: no viewer opens it (and one ending before it starts got a negative ``dur``). Such spans are
  left out of the trace; the others stay.
* A trace's ``tid`` was ``threading.get_ident()`` (a 47-bit address) and its ``pid`` 0: Perfetto reads both as
  32-bit ids and put every thread on one lane (the idle thread's). Threads other than the main one now get
  small ids; the main thread's lane is a 32-bit number of its own; ``pid`` is the process's.
* A temporary trace file left by a killed writer with the same pid and thread ident made every later trace to
  that path fail with FileExistsError.
* Bad arguments to the telemetry's readers, to ``chrome_trace`` and to ``measure_iteration`` / ``ExposureLog``
  raised a raw TypeError from deep inside (or were silently taken: ``recent(kind, -1)``); they are refused with
  :class:`ConfigurationError` saying what to pass, and nothing changes.
* ``run_loop(iterations=0, trace=...)`` wrote the warm-up and prefill spans into "a Chrome trace of the
  accounted iterations"; with none accounted it is empty.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conduit.errors import ConfigurationError
from conduit.exposure import ExposureLog, measure_iteration
from conduit.telemetry import CallRecord, Telemetry

LOOP, WORKER = 1, 2


def _strict_json(text: str) -> Any:
    """``json.loads`` that refuses what JSON does not have (Python writes NaN/Infinity by default)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON: a trace viewer cannot open this file")

    return json.loads(text, parse_constant=refuse)


# -- the union arithmetic on malformed spans ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", [(0.6, 0.4), (0.5, math.nan), (math.nan, 0.5)],
                         ids=["end-before-start", "nan-end", "nan-start"])
def test_a_span_with_its_end_before_its_start_or_a_nan_time_counts_as_no_time(bad: tuple[float, float]) -> None:
    a, b = bad
    recs = [CallRecord("rollout", 0, 0, 0.0, 1.0, LOOP),
            CallRecord("deliver_wait", 0, 0, 0.1, 0.2, LOOP),  # 0.1 s exposed
            CallRecord("ingest", 0, 0, a, b, LOOP),  # malformed, on the loop
            CallRecord("stage", 0, 0, 0.7, 0.8, WORKER),  # 0.1 s hidden
            CallRecord("stage", 0, 0, a, b, WORKER)]  # malformed, in the background
    it = measure_iteration(recs, 0.0, 1.0)
    assert it.exposed_s == pytest.approx(0.1) and it.hidden_s == pytest.approx(0.1), (
        f"a span ending before it starts must add no time (never negative time): exposed {it.exposed_s}, "
        f"hidden {it.hidden_s}, expected 0.1 each")
    assert it.total_s == pytest.approx(0.2) and it.rollout_s == pytest.approx(1.0)


# -- the Chrome trace ----------------------------------------------------------------------------------------------
def test_a_trace_with_non_finite_span_times_is_still_json_and_keeps_the_other_spans(tmp_path: Path) -> None:
    tel = Telemetry(fold_every=1)
    tel.record("ingest", 1, 8, 0.0, math.nan)
    tel.record("deliver", 1, 8, math.inf, math.inf)
    tel.record("stage", 1, 8, -math.inf, 2.0)
    tel.record("rollout", 1, 8, 3.0, 2.5)  # ends before it starts: no place on the timeline either
    tel.record("update", 1, 8, 1.0, 2.0)
    path = tmp_path / "trace.json"
    returned = tel.chrome_trace(path)
    written = _strict_json(path.read_text())
    spans = [e for e in written["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["update"], f"only the span with finite times can be placed: {spans}"
    assert spans[0]["ts"] == 0.0 and spans[0]["dur"] == pytest.approx(1e6)
    assert written == _strict_json(json.dumps(returned)), "the returned trace is the one written"
    assert tel.totals["ingest"].calls == 1, "the totals still count every recorded call"


def test_a_trace_written_while_threads_record_has_every_field_a_viewer_needs(tmp_path: Path) -> None:
    """Open the file with json.load: every 'X' event has name/ph/ts/dur/pid/tid, every lane a thread_name."""
    tel = Telemetry(maxlen=5000, fold_every=3)
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            with tel.span("ingest", 1, 8):
                pass

    threads = [threading.Thread(target=work, name=f"recorder-{k}") for k in range(3)]
    for t in threads:
        t.start()
    try:
        # written while they record, once they have recorded (on a loaded machine they may get the CPU late)
        deadline = time.monotonic() + 60
        while not tel.records:
            assert time.monotonic() < deadline, "the recorder threads recorded nothing in 60 s"
            time.sleep(0.001)
        for k in range(5):
            tel.chrome_trace(tmp_path / "trace.json")
            with open(tmp_path / "trace.json") as f:
                trace = json.load(f)
            events = trace["traceEvents"]
            spans = [e for e in events if e["ph"] == "X"]
            meta = [e for e in events if e["ph"] == "M"]
            assert spans, "the recorders' spans are in the trace"
            for e in spans:
                missing = {"name", "ph", "ts", "dur", "pid", "tid"} - set(e)
                assert not missing, f"a complete ('X') event lacks {missing}: {e}"
                assert e["dur"] >= 0 and e["ts"] >= 0
            assert all(e["name"] == "thread_name" and isinstance(e["args"]["name"], str) and {"pid", "tid"} <= set(e)
                       for e in meta), meta
            assert {e["tid"] for e in meta} == {e["tid"] for e in spans}, "every lane needs its thread_name event"
            assert {e["args"]["name"] for e in meta} <= {f"recorder-{k}" for k in range(3)}
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"], "no temporary file is left behind"


def test_a_temporary_file_left_by_a_killed_writer_does_not_block_later_traces(tmp_path: Path) -> None:
    """The temporary file is named by process id and thread: a writer killed mid-write (OOM, SIGKILL) leaves it
    behind, and a later process that gets the same pid (containers start at 1) and thread ident found it in the
    way: every later trace to that path failed with FileExistsError."""
    import os

    path = tmp_path / "trace.json"
    stale = tmp_path / f".trace.json.{os.getpid()}.{threading.get_ident()}.tmp"
    stale.write_text('{"traceEvents": [')  # half a trace, as a killed writer leaves it
    tel = Telemetry()
    tel.record("ingest", 1, 8, 0.0, 1.0)
    tel.chrome_trace(path)
    assert [e["name"] for e in _strict_json(path.read_text())["traceEvents"]] == ["ingest", "thread_name"]
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"], "the stale temporary file is gone"


# -- typed refusals --------------------------------------------------------------------------------------------------
def _tel() -> Telemetry:
    tel = Telemetry(maxlen=4, fold_every=1)
    for i in range(6):  # the ring has dropped two calls
        tel.record("ingest", 1, 8, float(i), i + 0.5)
    return tel


REFUSED: list[tuple[str, Callable[[Telemetry, Path], object], str]] = [
    ("trace-since-str", lambda tel, p: tel.chrome_trace(p, since="0"), "since"),  # type: ignore[arg-type]
    ("trace-since-nan", lambda tel, p: tel.chrome_trace(p, since=math.nan), "since"),
    ("trace-path-int", lambda tel, p: tel.chrome_trace(7), "path"),  # type: ignore[arg-type]
    ("recent-str", lambda tel, p: tel.recent("ingest", "3"), "recent"),  # type: ignore[arg-type]
    ("recent-negative", lambda tel, p: tel.recent("ingest", -1), "recent"),
    ("recent-float", lambda tel, p: tel.recent("ingest", 2.5), "recent"),  # type: ignore[arg-type]
    ("since-str", lambda tel, p: tel.since("1.0"), "since"),  # type: ignore[arg-type]
    ("snapshot-str", lambda tel, p: tel.snapshot("0"), "mark"),  # type: ignore[arg-type]
    ("snapshot-none", lambda tel, p: tel.snapshot(None), "mark"),  # type: ignore[arg-type]
    ("snapshot-negative", lambda tel, p: tel.snapshot(-1), "mark"),
    ("calls-since-float", lambda tel, p: tel.calls_since(1.5), "mark"),  # type: ignore[arg-type]
    ("measure-str-window", lambda tel, p: measure_iteration(tel.records, "0", "9"), "window"),  # type: ignore[arg-type]
    ("measure-loop-int", lambda tel, p: measure_iteration(tel.records, 0.0, 9.0, loop_threads=5),  # type: ignore[arg-type]
     "loop_threads"),
    ("log-not-telemetry", lambda tel, p: ExposureLog(p), "Telemetry"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("call, match", [(c, m) for _, c, m in REFUSED], ids=[i for i, _, _ in REFUSED])
def test_bad_arguments_are_refused_typed_and_change_nothing(call: Callable[[Telemetry, Path], object], match: str,
                                                            tmp_path: Path) -> None:
    tel = _tel()
    path = tmp_path / "trace.json"
    before = (tel.records, tel.summary(), tel.snapshot(0))
    with pytest.raises(ConfigurationError, match=match):
        call(tel, path)
    assert (tel.records, tel.summary(), tel.snapshot(0)) == before, "a refused call changed the telemetry"
    assert not path.exists(), "a refused trace must write nothing"


def test_the_arguments_the_refusals_leave_alone_still_work(tmp_path: Path) -> None:
    """Control for the refusals: ints for times, infinities for a window's bounds, a zero count, a mark."""
    import numpy as np

    tel = _tel()
    assert tel.recent("ingest", 0) == [] and len(tel.recent("ingest", 2)) == 2
    assert len(tel.since(4)) == 2 and len(tel.since(np.float64(4.0))) == 2
    assert tel.snapshot(0)[1] == 2 and tel.calls_since(np.int64(5))[0][0].start == 5.0
    assert [e["name"] for e in tel.chrome_trace(str(tmp_path / "t.json"), since=5)["traceEvents"]] == \
        ["ingest", "thread_name"]
    assert tel.chrome_trace(since=math.inf)["traceEvents"] == []
    it = measure_iteration(tel.records, -math.inf, math.inf, loop_threads=iter([0]))
    assert it.hidden_s == pytest.approx(2.0), it  # four background half-second spans, 2 s in all
    assert measure_iteration(tel.records, 2, 4).start == 2


# -- the demo's trace ------------------------------------------------------------------------------------------------
def test_a_loop_without_accounted_iterations_writes_a_trace_without_spans(tmp_path: Path) -> None:
    from conduit.demo import run_loop

    path = tmp_path / "trace.json"
    res = run_loop(obs_dim=4, iterations=0, warmup=1, rollout=8, batch=8, updates=1, capacity=64, trace=path)
    assert res.iterations == []
    spans = [e["name"] for e in _strict_json(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert spans == [], f"the trace of the accounted iterations (none) holds warm-up and prefill spans: {spans}"


# -- trace lanes: the 32-bit thread ids viewers read ---------------------------------------------------------------
def test_every_lane_of_a_trace_is_a_32_bit_id_so_perfetto_keeps_threads_apart() -> None:
    """Perfetto reads a JSON trace's pid and tid as 32-bit unsigned ints and puts any larger one on the pid's lane
    (tid 0, the idle thread, with pid 0): lanes named by ``threading.get_ident()`` (a 47-bit address on Linux) all
    merged into one, whose improperly nested spans it then drops."""
    tel = Telemetry(fold_every=1)
    together = threading.Barrier(2)  # both workers alive at once: two different threads

    def work(kind: str) -> None:
        together.wait()
        tel.record(kind, 1, 8, 1.0, 2.0)
        together.wait()

    workers = [threading.Thread(target=work, args=(k,), name=f"{k}-worker") for k in ("ingest", "deliver")]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert threading.current_thread() is threading.main_thread()
    tel.record("update", 1, 8, 0.5, 3.0)
    events = tel.chrome_trace()["traceEvents"]
    ids = {(e["name"], e["pid"], e["tid"]) for e in events}
    assert all(0 < pid < 2**31 and 0 < tid < 2**31 for _, pid, tid in ids), (
        f"pid and tid must fit the 32-bit ids trace viewers read (0 is the idle thread): {sorted(ids)}")
    lanes = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert len(set(lanes.values())) == 3, f"three threads, three lanes: {lanes}"
    assert {k: names[v] for k, v in lanes.items()} == {"ingest": "ingest-worker", "deliver": "deliver-worker",
                                                       "update": threading.main_thread().name}


@pytest.mark.parametrize("window", [(0.0, 1.0), (0, 1)], ids=["float-window", "int-window"])
def test_an_iteration_without_spans_reports_every_field_as_a_float(window):
    """measure_iteration summed an empty list of intervals, so an iteration with no experience-path (or no
    rollout/update) spans reported exposed_s, rollout_s and update_s as the int 0 (and an int window's start and
    end as ints), though the fields are floats: a consumer's formatting or type checks saw an int."""
    it = measure_iteration([], *window)
    for f in dataclasses.fields(it):
        assert type(getattr(it, f.name)) is float, (f.name, getattr(it, f.name))
    assert (it.total_s, it.exposed_s, it.hidden_s, it.rollout_s, it.update_s) == (0.0,) * 5
    assert it.iteration_s == 1.0
