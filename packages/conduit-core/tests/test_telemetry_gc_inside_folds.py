"""Telemetry called by a garbage-collector callback that interrupted this thread's own fold.

A fold runs under the telemetry's lock and allocates; a collection can start inside it and run callbacks on
the same thread. Whatever such a callback calls on the same telemetry (a record, a reader, a reset) must not
wait for the fold it interrupted (a deadlock), must not see part of it, and must lose or double nothing.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

from conduit.errors import ConfigurationError
from conduit.telemetry import Telemetry
from conduit.testing.lifecycle import HANG_S


def _record_with_collections_inside_folds(tel: Telemetry, kinds: int, inside: Callable[[], None]) -> int:
    """Record one call of each of ``kinds`` new kinds on a new thread, with the collector run at (nearly) every
    allocation, and call ``inside()`` from a GC callback each time a collection interrupts that thread's own
    fold (never re-entered). A new kind per call makes each fold allocate its totals, so collections fall
    inside folds. Returns how many times ``inside`` ran; fails the test if the thread hangs or ``inside``
    never ran (the check would have exercised nothing)."""
    state: dict[str, object] = {"thread": None, "inside": False, "runs": 0}

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase != "start" or state["thread"] is not threading.current_thread() or state["inside"]:
            return
        if tel._lock.locked():  # this thread only records: the lock held means the collector interrupted a fold
            state["inside"] = True
            state["runs"] = int(state["runs"]) + 1  # type: ignore[call-overload]
            try:
                inside()
            finally:
                state["inside"] = False

    def work() -> None:
        state["thread"] = threading.current_thread()
        old = gc.get_threshold()
        gc.set_threshold(1)
        try:
            for i in range(kinds):
                tel.record(f"k{i}", 1, 8, 0.0, 1.0)
        finally:
            gc.set_threshold(*old)
            state["thread"] = None

    gc.callbacks.append(callback)
    try:
        t = threading.Thread(target=work, name="gc-inside-folds", daemon=True)
        t.start()
        t.join(HANG_S)
    finally:
        gc.callbacks.remove(callback)
    assert not t.is_alive(), "a telemetry call from a GC callback inside this thread's own fold waited for it for ever"
    runs = int(state["runs"])  # type: ignore[call-overload]
    assert runs > 0, "no collection fell inside a fold: the check exercised nothing"
    return runs


def test_a_record_from_inside_a_fold_neither_hangs_nor_loses_calls() -> None:
    tel = Telemetry(fold_every=8)

    def record_a_fold_worth() -> None:
        for _ in range(8):  # enough to reach fold_every: record() folds
            tel.record("gc", 0, 0, 1.0, 2.0)

    runs = _record_with_collections_inside_folds(tel, 200, record_a_fold_worth)
    totals = tel.totals
    assert sum(totals[f"k{i}"].calls for i in range(200)) == 200
    assert totals["gc"].calls == 8 * runs
    assert len(tel.records) == 200 + 8 * runs


def _read_all(tel: Telemetry) -> tuple[int, int, int, int, int]:
    """Every reader once: (calls in the totals, in the summary, in the ring, in a snapshot, since mark 0), after
    checking that the mark agrees with them (a view that shows part of a fold would not)."""
    totals = sum(t.calls for t in tel.totals.values())
    summary = sum(int(v["calls"]) for v in tel.summary().values())
    ring = len(tel.records)
    snap, dropped = tel.snapshot(0)
    since, dropped_since = tel.calls_since(0)
    mark = tel.mark()
    assert dropped == dropped_since == 0
    assert [r.kind for r in since] == [r.kind for r in snap]
    assert len(tel.chrome_trace()["traceEvents"]) >= len(snap)
    assert len(tel.since(-1.0)) == len(snap)
    assert tel.recent("k0", 1) == [r for r in snap if r.kind == "k0"][-1:]
    assert mark == totals, f"mark {mark} but {totals} calls in the totals: the reader saw part of a fold"
    return totals, summary, ring, len(snap), len(since)


def test_readers_from_inside_a_fold_return_what_earlier_folds_left() -> None:
    tel = Telemetry(fold_every=8)
    views: list[tuple[int, ...]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            views.append(_read_all(tel))
        except Exception as e:  # noqa: BLE001 - a GC callback's exception is only printed: keep it
            errors.append(e)

    _record_with_collections_inside_folds(tel, 200, read)
    assert not errors, errors
    for view in views:  # whole folds only: a multiple of fold_every, the same count in every reader
        assert len(set(view)) == 1 and view[0] % 8 == 0, view
    assert _read_all(tel) == (200,) * 5  # nothing lost or counted twice
    assert [r.kind for r in tel.records] == [f"k{i}" for i in range(200)]


def test_a_reset_from_inside_a_fold_is_refused_typed_and_loses_nothing() -> None:
    tel = Telemetry(fold_every=8)
    refused: list[str] = []
    other: list[object] = []

    def reset() -> None:
        try:
            tel.reset()
        except ConfigurationError as e:
            refused.append(str(e))
        except Exception as e:  # noqa: BLE001
            other.append(e)
        else:
            other.append("reset() inside a fold was not refused")

    _record_with_collections_inside_folds(tel, 100, reset)
    assert not other, other
    assert refused and all("outside" in m for m in refused), refused
    assert sum(t.calls for t in tel.totals.values()) == 100 == len(tel.records)
