"""Telemetry's trace file names and the argument checks of its readers and of ``measure_iteration``.

Each case was a known defect:

* the temporary file of :func:`~conduit.telemetry.write_atomically` kept the first 200 *characters* of the target's
  name, so a valid name of more than about 220 bytes in non-ASCII characters (80 CJK characters: 240 bytes) gave a
  temporary name past a file name's 255 bytes: ``Telemetry.chrome_trace(path)`` raised ``OSError: File name too
  long``, and ``conduit demo --synthetic --trace NAME`` (whose probe writes the name itself) ran the whole loop and
  then ended in that traceback, writing no trace;
* ``measure_iteration(loop_threads=...)`` took any iterable of hashables: a str such as ``"12"`` (its characters
  matched no thread, so the loop's whole experience path was reported hidden and none exposed), or bools and
  floats, where ``ExposureLog(loop_threads=...)`` refuses them and the docstring promises a ``ConfigurationError``;
* the time arguments of ``Telemetry.since``, ``during`` and ``chrome_trace(since=...)`` were checked for NaN with
  ``math.isnan``, which raised a bare ``OverflowError`` for an int past a float's range (a number they take:
  every recorded call started before it);
* ``conduit demo --synthetic`` (:func:`~conduit.demo.run_loop`) accounted its iterations on the buffer's default
  telemetry ring (65536 calls): with ``--updates`` of about 22000 or more an iteration records more calls than that,
  so after running the whole iteration it stopped with a CapacityError telling the user to raise the Telemetry's
  maxlen, which the command has no option for. It now sizes the ring for the iterations it runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conduit.cli import main
from conduit.demo import make_scheduler, run_loop
from conduit.errors import ConfigurationError
from conduit.exposure import ExposureLog, measure_iteration
from conduit.telemetry import CallRecord, Telemetry

#: a valid file name of 245 bytes (85 characters): each CJK character is 3 bytes in UTF-8
LONG_NAME = "轨迹" * 40 + ".json"


def _long_names_work(folder: Path) -> bool:
    try:
        (folder / LONG_NAME).write_text("")
    except OSError:  # (a file system that takes no such name: nothing to check there)
        return False
    (folder / LONG_NAME).unlink()
    return True


def test_a_trace_is_written_to_a_valid_name_of_many_multibyte_characters(tmp_path: Path) -> None:
    assert len(os.fsencode(LONG_NAME)) <= 255
    if not _long_names_work(tmp_path):
        pytest.skip("this file system does not take a 245-byte file name")
    tel = Telemetry()
    tel.record("deliver", 4, 64, 1.0, 2.0)
    trace = tel.chrome_trace(tmp_path / LONG_NAME)
    assert json.loads((tmp_path / LONG_NAME).read_text()) == trace
    assert os.listdir(tmp_path) == [LONG_NAME], "a temporary file was left behind"


def test_demo_writes_its_trace_to_a_valid_name_of_many_multibyte_characters(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not _long_names_work(tmp_path):
        pytest.skip("this file system does not take a 245-byte file name")
    out = tmp_path / LONG_NAME
    rc = main(["demo", "--synthetic", "--obs-dim", "4", "--iterations", "1", "--warmup", "0", "--rollout", "4",
               "--batch", "4", "--capacity", "16", "--no-baseline", "--trace", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert any(e["ph"] == "X" for e in json.loads(out.read_text())["traceEvents"])
    assert os.listdir(tmp_path) == [LONG_NAME]


#: the loop (thread 12) waits 1 s for a delivery, then rolls out for 1 s
_LOOP = [CallRecord("deliver_wait", 1, 0, 0.0, 1.0, 12), CallRecord("rollout", 0, 0, 1.0, 2.0, 12)]


@pytest.mark.parametrize("bad", ["12", b"\x0c", [12.0], [True], [12, "13"], 12, [[12]]],
                         ids=["str", "bytes", "float", "bool", "mixed", "int", "unhashable"])
def test_measure_iteration_refuses_loop_threads_that_are_no_thread_ids_typed(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="loop_threads"):
        measure_iteration(_LOOP, 0.0, 2.0, loop_threads=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="loop_threads"):
        ExposureLog(Telemetry(), loop_threads=bad)  # type: ignore[arg-type]


def test_measure_iteration_takes_the_thread_ids_it_documents() -> None:
    np = pytest.importorskip("numpy")
    for given in ({12}, [12, 13], (t for t in [12]), [np.int64(12)], frozenset({12})):
        e = measure_iteration(_LOOP, 0.0, 2.0, loop_threads=given)
        assert (e.exposed_s, e.hidden_s) == (1.0, 0.0)
    e = measure_iteration(_LOOP, 0.0, 2.0, loop_threads=[])  # no loop thread: the work counts as done elsewhere
    assert (e.exposed_s, e.hidden_s) == (0.0, 0.0)  # (a wait is no work: hidden counts work spans only)


def test_the_time_readers_take_an_int_past_a_floats_range() -> None:
    tel = Telemetry()
    tel.record("deliver", 4, 64, 1.0, 2.0)
    huge = 10**400  # (later than every call: compares exactly with the recorded floats)
    assert tel.since(huge) == []
    assert tel.since(-huge) == list(tel.records)
    assert tel.during(-huge, huge) == list(tel.records)
    assert tel.during(huge, huge + 1) == []
    trace = tel.chrome_trace(since=huge)
    assert [e for e in trace["traceEvents"] if e["ph"] == "X"] == []
    assert len([e for e in tel.chrome_trace(since=-huge)["traceEvents"] if e["ph"] == "X"]) == 1
    with pytest.raises(ConfigurationError, match="not NaN"):
        tel.since(float("nan"))
    np = pytest.importorskip("numpy")
    with pytest.raises(ConfigurationError, match="not NaN"):
        tel.chrome_trace(since=np.float32("nan"))


@pytest.mark.parametrize("kind", ["sync", "overlapped"])
def test_the_demo_loop_sizes_the_telemetry_ring_for_the_calls_of_its_iterations(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the buffer's default ring shrunk from 65536 to 50 calls, so that a few dozen updates per iteration outgrow it
    # as 22000 do with the real default (every other part is the real loop)
    monkeypatch.setattr(Telemetry.__init__, "__defaults__", (50, 1024))
    assert Telemetry().maxlen == 50
    res = run_loop(obs_dim=4, scheduler=make_scheduler(kind), iterations=2, warmup=1, rollout=8, batch=4, updates=40,
                   capacity=64, hidden=2)
    assert len(res.iterations) == 2 and all(i.total_s > 0 and i.update_s > 0 for i in res.iterations)
