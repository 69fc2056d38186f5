"""Telemetry's record of the calls its ring dropped stays bounded over a long run of resets, and its counts exact.

Each cycle below folds 5 calls into a ring of 2 (3 pushed out), then resets (the 2 kept are removed, never counted
as dropped). Before the fix every such cycle added one [from, to) range to ``Telemetry._drops`` for the life of the
telemetry, and every fold that dropped a call copied the whole list (a run's folds grew quadratically slower).
"""

from __future__ import annotations

from conduit import Telemetry, telemetry

#: how many reset-separated drop ranges the telemetry keeps exactly (1024 before it had a name)
_DROPS_KEPT = getattr(telemetry, "_DROPS_KEPT", 1024)

RING = 2
PER_CYCLE = 5  # calls folded per cycle: the first 3 are pushed out, the last 2 removed by the reset


def _dropped_positions(cycles: int) -> list[bool]:
    """The oracle: for every call's position (its mark), whether the ring dropped it."""
    out: list[bool] = []
    for _ in range(cycles):
        out += [True] * (PER_CYCLE - RING) + [False] * RING
    return out


def test_many_reset_and_drop_cycles_keep_the_drop_record_bounded_and_every_recent_count_exact() -> None:
    cycles = 3 * _DROPS_KEPT
    tel = Telemetry(maxlen=RING, fold_every=0)
    marks = []
    for _ in range(cycles):
        marks.append(tel.mark())
        for _ in range(PER_CYCLE):
            tel.record("ingest", 1, 8, 0.0, 1.0)
        tel.reset()
    assert len(tel._drops) <= _DROPS_KEPT, f"{len(tel._drops)} ranges kept after {cycles} cycles"
    dropped = _dropped_positions(cycles)
    suffix = [0] * (len(dropped) + 1)  # suffix[m]: the calls dropped at or after the mark m
    for i in range(len(dropped) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + dropped[i]
    now = tel.mark()
    assert now == cycles * PER_CYCLE
    # exact: from the very first mark (every drop), at the marks of the last _DROPS_KEPT cycles and at every position
    # within them (a mark mid-cycle too), and now
    assert tel.snapshot(0)[1] == suffix[0] == 3 * cycles
    assert tel.calls_since(0)[1] == 3 * cycles
    recent_from = marks[-_DROPS_KEPT]
    for m in range(recent_from, now + 1):
        assert tel.snapshot(m)[1] == suffix[m], f"mark {m}"
    assert tel.snapshot(now) == ((), 0)
    # older marks are never under-counted (a reader refuses rather than under-count), and never beyond every drop
    for m in marks[:-_DROPS_KEPT]:
        got = tel.snapshot(m)[1]
        assert suffix[m] <= got <= suffix[0], f"mark {m}: {got} vs {suffix[m]}"
    # the ring keeps working the same after all that: a fresh drop counts from a fresh mark
    m = tel.mark()
    for _ in range(RING + 4):
        tel.record("ingest", 1, 8, 0.0, 1.0)
    assert tel.snapshot(m)[1] == 4
    assert tel.chrome_trace()["otherData"]["dropped_calls"] == 4
    assert tel.totals["ingest"].calls == RING + 4, "totals count since the last reset"


def test_resets_that_remove_nothing_never_grow_the_drop_record() -> None:
    tel = Telemetry(maxlen=0, fold_every=0)  # every call dropped, a reset removes none
    for _ in range(3 * _DROPS_KEPT):
        tel.record("ingest", 0, 0, 0.0, 1.0)
        tel.reset()
    assert len(tel._drops) <= 1
    assert tel.snapshot(0)[1] == 3 * _DROPS_KEPT
    assert tel.snapshot(5)[1] == 3 * _DROPS_KEPT - 5
