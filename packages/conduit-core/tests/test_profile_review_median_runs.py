"""Review of the profiler's medians: how many runs a measurement takes.

``_median_seconds`` ran a cheap call at most 7x ``reps`` times, though it says (and was written for) up to 8x: the
``- reps`` for the runs already made was applied after the cap instead of to the count that fits in ``min_total``,
so the cheapest calls (per-call overheads, the noisiest figures of a profile) got an eighth fewer samples.
"""

from __future__ import annotations

import pytest
from conduit.placement.profile import _median_seconds


def test_a_cheap_call_is_run_up_to_eight_times_reps() -> None:
    """A call the clock sees as 1 us long fits 20000 times in min_total (20 ms): it runs 8x reps, as documented
    (was 7x)."""
    now = [0.0]
    runs = [0]

    def clock() -> float:  # every reading 1 us after the last: each run lasts 1 us
        now[0] += 1e-6
        return now[0]

    def call() -> None:
        runs[0] += 1

    assert _median_seconds(call, reps=10, warmup=0, clock=clock) == pytest.approx(1e-6)
    assert runs[0] == 80


def test_a_call_that_fits_few_times_is_run_reps_times() -> None:
    """A call as long as min_total runs ``reps`` times: the extra runs never go below none."""
    now = [0.0]
    runs = [0]

    def clock() -> float:
        now[0] += 0.01
        return now[0]

    def call() -> None:
        runs[0] += 1

    _median_seconds(call, reps=5, warmup=1, clock=clock, min_total=0.02)
    assert runs[0] == 6  # 1 warm-up + 5
