"""The telemetry's totals and Chrome trace on spans recorded with misused clocks.

* A call recorded with a NaN time, an end before its start or an infinite duration went into the running totals
  as NaN / negative / infinite seconds: one such call made ``totals[kind].seconds`` (and ``summary()``) NaN or
  infinite for the rest of the run, or silently subtracted time. It now adds no seconds (it still counts as a
  call), as :func:`~conduit.exposure.measure_iteration` and the trace already treat it.
* A call with finite but huge times (a clock misread by many orders of magnitude) overflowed the trace's
  microsecond ``ts`` / ``dur`` to infinity, and the file held ``Infinity``: not JSON, no viewer opens it. Such a
  call cannot be placed on the timeline and is left out; the others keep their places.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conduit.telemetry import Telemetry


def _strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN / Infinity (which Python writes by default, and no trace viewer reads)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("fold_every", [0, 1, 1024], ids=["fold-each", "fold-one", "fold-on-read"])
def test_a_call_with_a_misread_clock_adds_no_seconds_to_the_totals(fold_every: int) -> None:
    tel = Telemetry(fold_every=fold_every)
    tel.record("ingest", 2, 16, 1.0, 1.5)
    tel.record("ingest", 1, 8, 5.0, math.nan)  # NaN end
    tel.record("ingest", 1, 8, math.nan, 5.0)  # NaN start
    tel.record("ingest", 1, 8, 5.0, 3.0)  # ends before it starts
    tel.record("ingest", 1, 8, 0.0, math.inf)  # never ends
    tel.record("ingest", 1, 8, -1e308, 1e308)  # finite times, infinite duration
    tel.record("ingest", 2, 16, 2.0, 2.25)
    t = tel.totals["ingest"]
    assert (t.calls, t.items, t.nbytes) == (7, 9, 72), "every recorded call still counts, with its items and bytes"
    assert t.seconds == pytest.approx(0.75), (
        f"the calls that cannot be timed must add no seconds (never NaN, negative or infinite): {t.seconds}")
    assert tel.summary()["ingest"]["seconds"] == pytest.approx(0.75)
    assert t.bandwidth == pytest.approx(72 / 0.75) and t.per_call == pytest.approx(0.75 / 7)
    tel.record("ingest", 1, 8, 3.0, 3.25)  # a later well-timed call still adds its time
    assert tel.totals["ingest"].seconds == pytest.approx(1.0)


def test_a_trace_with_huge_finite_span_times_is_still_json_and_keeps_the_other_spans(tmp_path: Path) -> None:
    tel = Telemetry(fold_every=1)
    tel.record("update", 1, 8, 1.0, 2.0)
    tel.record("ingest", 1, 8, 0.0, 1e303)  # its dur in microseconds overflows
    tel.record("deliver", 1, 8, -1e303, -1e303)  # would push every other span's ts to infinity
    tel.record("stage", 1, 8, -1e308, 1e308)  # its duration in seconds already overflows
    tel.record("rollout", 1, 8, 2.5, 3.0)
    path = tmp_path / "trace.json"
    returned = tel.chrome_trace(path)
    written = _strict_json(path.read_text())  # raised on Infinity before the fix
    spans = [e for e in written["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["update", "rollout"], f"only placeable spans, the others kept: {spans}"
    assert [e["ts"] for e in spans] == pytest.approx([0.0, 1.5e6]) and [e["dur"] for e in spans] == pytest.approx(
        [1e6, 0.5e6])
    assert all(math.isfinite(e["ts"]) and math.isfinite(e["dur"]) for e in returned["traceEvents"] if e["ph"] == "X")
    assert written == _strict_json(json.dumps(returned)), "the returned trace is the one written"
    meta = [e for e in written["traceEvents"] if e["ph"] == "M"]
    assert {e["tid"] for e in meta} == {e["tid"] for e in spans}, "every lane keeps its thread_name event"
    assert tel.totals["ingest"].calls == 1, "the totals still count the call left out of the trace"
