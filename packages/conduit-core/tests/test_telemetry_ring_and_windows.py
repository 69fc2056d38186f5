"""Telemetry keeps its calls where the garbage collector stops walking them, every reader hands out
``CallRecord``s, and :meth:`Telemetry.during` returns the calls that overlap a window."""

from __future__ import annotations

import gc
import math

import pytest
from conduit.errors import ConfigurationError
from conduit.telemetry import CallRecord, Telemetry, thread_id


def test_recorded_calls_do_not_stay_tracked_by_the_garbage_collector() -> None:
    # A full collection walks every tracked object; 64k recorded calls kept tracked would make each one slower
    # (they were, as CallRecords: the collector untracks plain tuples of numbers, never a tuple subclass).
    tel = Telemetry(maxlen=65536)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(20_000):
        tel.record("ingest", 1, 8, float(i), float(i) + 0.5)
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < 5_000, f"recording 20000 calls left {grown} more objects tracked by the collector"
    assert len(tel.records) == 20_000


def test_every_reader_returns_call_records_with_the_recorded_fields() -> None:
    tel = Telemetry(fold_every=3)
    tel.record("ingest", 2, 16, 1.0, 2.0)
    tel.record("deliver", 4, 32, 3.0, 5.0)
    me = thread_id()
    first = CallRecord("ingest", 2, 16, 1.0, 2.0, me)
    second = CallRecord("deliver", 4, 32, 3.0, 5.0, me)
    mark = 0
    reads = {
        "records": list(tel.records),
        "snapshot": list(tel.snapshot(mark)[0]),
        "calls_since": tel.calls_since(mark)[0],
        "since": tel.since(0.0),
        "during": tel.during(0.0, 10.0),
    }
    for name, got in reads.items():
        assert got == [first, second], f"{name} returned {got}"
        assert all(type(r) is CallRecord for r in got), f"{name} returned {[type(r) for r in got]}"
    recent = tel.recent("deliver", 5)
    assert recent == [second] and type(recent[0]) is CallRecord
    assert recent[0].seconds == 2.0 and recent[0].thread == me
    totals = tel.totals
    assert (totals["ingest"].calls, totals["ingest"].items, totals["ingest"].nbytes) == (1, 2, 16)
    assert totals["deliver"].seconds == 2.0


def test_during_returns_the_calls_that_overlap_the_window() -> None:
    tel = Telemetry()
    spans = {"before": (0.0, 1.0), "into": (0.5, 1.5), "inside": (1.2, 1.8), "over": (0.0, 3.0),
             "out of": (1.9, 2.5), "after": (2.0, 3.0)}
    for kind, (start, end) in spans.items():
        tel.record(kind, 0, 0, start, end)
    got = [r.kind for r in tel.during(1.0, 2.0)]
    # a call that ended exactly at the window's start or started exactly at its end does not overlap it
    assert got == ["into", "inside", "over", "out of"]
    assert tel.during(5.0, 6.0) == []


@pytest.mark.parametrize("window", [(math.nan, 1.0), (0.0, math.nan), ("0", 1.0), (0.0, None)])
def test_during_refuses_a_time_that_is_not_a_number(window: tuple[object, object]) -> None:
    tel = Telemetry()
    tel.record("ingest", 1, 8, 0.5, 0.6)
    with pytest.raises(ConfigurationError, match=r"Telemetry\.during"):
        tel.during(*window)  # type: ignore[arg-type]
    assert len(tel.records) == 1
