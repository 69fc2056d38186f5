"""An adaptive placement holds a buffer's ragged pools to what its map checked for the looked-up range: the
map's capacity x the largest whole item size *in* the range. A range ``[lo, hi)`` holds items of at most
``hi - 1`` whole bytes; ``hi`` itself is where the map found that the placement no longer fits (or is no
longer chosen), so pools sized for ``capacity`` items of ``hi`` bytes were never checked."""

from __future__ import annotations

import math

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PlacementError
from conduit.placement import AdaptivePlacement, BandwidthProfile, LinkCost, PlacementSpec, Planner, Topology, Workload
from conduit.placement.planner import NothingFitsError

#: 8 B id + 8 B per token
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
CAPACITY = 998


def _planner() -> Planner:
    links = {"host_copy": LinkCost.constant(10, 5), "host_gather": LinkCost.constant(8, 6, 100),
             "edp_deliver": LinkCost.constant(1e6, 20), "edp_ingest": LinkCost.constant(1e6, 20)}
    prof = BandwidthProfile(links, source="declared", machine="declared:tiny")
    return Planner(Topology("tiny", 100_000, (), 0, prof, "a test machine", "declared"), headroom=0.0,
                   host_usable=1.0)


def test_a_pool_for_items_of_the_ranges_end_is_refused_it_was_never_checked() -> None:
    planner = _planner()
    template = Workload.from_schema(TOKENS, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    pmap = planner.placement_map(template, min_item_bytes=16, max_item_bytes=1000, points=8)
    host = pmap.ranges[0]
    assert host.spec == PlacementSpec("host", ("cpu",)) and pmap.ranges[1].spec is None
    end = int(host.hi)  # the first size the host does not hold
    # the largest pool whose bytes, with the ids', stay within CAPACITY items of `end` bytes
    pool = (CAPACITY * end - 8 * CAPACITY) // 8
    per_item = (8 * CAPACITY + 8 * pool) / CAPACITY
    assert end - 1 < per_item <= end
    with pytest.raises(NothingFitsError):  # the buffer's items at that size fit nowhere on this machine
        planner.plan(template.resized(per_item))
    adaptive = AdaptivePlacement(pmap, mean_ragged_length=4)
    with pytest.raises(PlacementError, match="ragged_capacity"):
        ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=pool)  # was: built
    assert adaptive.current is None
    # the largest pool of items the map checked (end - 1 bytes) is accepted
    most = (CAPACITY * (end - 1) - 8 * CAPACITY) // 8
    planner.plan(template.resized((8 * CAPACITY + 8 * most) / CAPACITY))  # (fits)
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=most)
    assert edp.storage.tier == "host" and math.isclose(adaptive.map.max_item_bytes, 1000)
