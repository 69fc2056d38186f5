"""A placement map built for a fractional ``max_item_bytes`` plans whole bytes only up to its floor: it
must not hand out a placement for sizes between the floor and the fractional maximum (they need one more
whole byte per item, which no plan checked)."""

from __future__ import annotations

import pytest
import torch
from conduit import ExperienceSchema, Field
from conduit.errors import PlacementError
from conduit.placement import BandwidthProfile, LinkCost, Planner, Topology, Workload
from conduit.placement.planner import NothingFitsError

SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((8,), torch.float32))
CAPACITY = 998  # + 2 output rows (batch 1): 100,000 B of host memory hold items of <= 100 B exactly


def _planner() -> Planner:
    links = {"host_copy": LinkCost.constant(10, 5), "host_gather": LinkCost.constant(8, 6, 100),
             "edp_deliver": LinkCost.constant(1e6, 20), "edp_ingest": LinkCost.constant(1e6, 20)}
    prof = BandwidthProfile(links, source="declared", machine="declared:tiny")
    return Planner(Topology("tiny", 100_000, (), 0, prof, "a test machine", "declared"), headroom=0.0,
                   host_usable=1.0)


def test_map_with_a_fractional_maximum_refuses_sizes_above_the_whole_bytes_it_planned() -> None:
    planner = _planner()
    template = Workload.from_schema(SCHEMA, capacity=CAPACITY, batch=1)
    pmap = planner.placement_map(template, min_item_bytes=40, max_item_bytes=100.5, points=8)
    # items of 100.4 B are planned as 101 whole bytes: nothing fits them on this machine
    with pytest.raises(NothingFitsError):
        planner.plan(template.resized(100.4))
    with pytest.raises(PlacementError, match="Re-plan with a larger maximum"):
        pmap.lookup(100.4)  # was: host, which does not hold 998 items of 101 B
    assert pmap.lookup(100) == planner.plan(template.resized(100)).placement  # the largest size it planned
    assert pmap.max_item_bytes == 100


def test_map_over_a_range_without_a_whole_byte_still_covers_its_maximum() -> None:
    planner = _planner()
    template = Workload.from_schema(SCHEMA, capacity=CAPACITY, batch=1)
    pmap = planner.placement_map(template, min_item_bytes=60.2, max_item_bytes=60.7, points=2)
    assert pmap.lookup(60.7) == planner.plan(template.resized(61)).placement
