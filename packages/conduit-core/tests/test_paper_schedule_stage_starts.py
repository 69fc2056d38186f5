"""``paper_schedule``'s stages start where the division says, not where float rounding puts them.

Stage ``j`` of ``n`` over ``iterations`` starts at the first iteration ``i >= j * iterations / n``. The schedule
computed ``int(i / (iterations / n))``: where ``i * n / iterations`` is a whole number, the float quotient could
land just below it (``9 / (18 / 14)`` is ``6.999...``), so that stage started one iteration late and the one
before it got an extra iteration (18 iterations of 14 sizes: stage 6 had 2 iterations, stage 7 one).
"""

from __future__ import annotations

import pytest
from conduit.placement.growth import paper_schedule


@pytest.mark.parametrize(("iterations", "stages"), [(18, 14), (36, 14), (40, 5), (41, 5), (7, 7), (100, 3)])
def test_each_stage_starts_at_the_first_iteration_of_its_share(iterations: int, stages: int) -> None:
    sched = paper_schedule(iterations, tuple(range(stages)))
    for j in range(stages):
        first = -(-j * iterations // stages)  # ceil(j * iterations / stages), in integers
        assert sched.index(j) == first, (j, sched)
    assert sched == sorted(sched) and len(sched) == iterations


def test_the_papers_schedule_is_unchanged() -> None:
    assert paper_schedule() == [s for s in (128, 1000, 5000, 10000, 20000) for _ in range(8)]
