"""An unlimited tie tolerance with a fastest candidate that costs nothing.

``Planner(tie_tolerance=math.inf)`` is accepted (a number >= 0: every feasible candidate ties, the fewest devices
and simplest tier win), and a profile may price a path at nothing (no overhead, unlimited bandwidth). Together the
planner raised a bare ``ValueError`` (``min()`` of an empty sequence): the tie bound ``0 * (1 + inf)`` is NaN, so
not even the fastest candidate counted as tied with itself. The fastest is now always tied.
"""

from __future__ import annotations

import math

import pytest
from conduit.placement import BandwidthProfile, LinkCost, Planner, Topology, Workload

PATHS = ("host_copy", "host_gather", "disk_read", "disk_write", "edp_deliver", "edp_ingest")


def _topology(link: LinkCost) -> Topology:
    prof = BandwidthProfile(dict.fromkeys(PATHS, link), source="declared", machine="declared:free")
    return Topology("free", 1 << 34, (), 1 << 34, prof)


@pytest.mark.parametrize("tolerance", [math.inf, 0.0, 0.02])
def test_a_free_fastest_candidate_is_chosen_whatever_the_tolerance(tolerance: float) -> None:
    plan = Planner(_topology(LinkCost(0.0)), tie_tolerance=tolerance).plan(Workload((64,), capacity=1000, batch=10))
    assert plan.placement.tier == "host"
    assert plan.chosen.estimate.total_s == 0.0
    assert plan.chosen.reason == "chosen: fastest feasible"


def test_an_unlimited_tolerance_still_plans_a_priced_topology() -> None:
    plan = Planner(_topology(LinkCost.constant(5.0, 10.0)), tie_tolerance=math.inf).plan(
        Workload((64,), capacity=1000, batch=10))
    assert plan.placement.tier == "host"
