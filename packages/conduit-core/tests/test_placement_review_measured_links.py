"""A link measured with no positive time in any sample (a clock that did not tick, NaN timings) is refused
typed, never accepted as an unlimited link that costs nothing (the planner would then prefer it)."""

from __future__ import annotations

import math

import pytest
from conduit.errors import PlacementError
from conduit.placement import LinkCost


@pytest.mark.parametrize("times", [(0.0, 0.0), (math.nan, math.nan), (-1e-6, 0.0)])
@pytest.mark.parametrize("overhead", [0.0, 1e-5])
def test_a_bound_without_any_timed_sample_is_refused_not_unlimited(times: tuple[float, float],
                                                                   overhead: float) -> None:
    samples = [(1 << 20, times[0]), (1 << 24, times[1])]
    with pytest.raises(PlacementError, match="took any time"):
        LinkCost.fit_or_bound(samples, overhead)  # was: points ((1.0, inf),), overhead 0: every transfer free


def test_a_bound_keeps_the_samples_that_were_timed() -> None:
    link = LinkCost.fit_or_bound([(1 << 20, 0.0), (1 << 24, 2e-3)], 5e-3)
    assert math.isfinite(link.bandwidth(1 << 24))
    assert link.seconds(1 << 24) >= 2e-3 * (1 - 1e-12)
