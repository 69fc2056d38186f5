"""A placement map names, at every whole item size it covers, the placement ``Planner.plan`` chooses there.

The map plans a geometric grid and bisects only between neighbours that differ, so a choice that changes and
changes back between two grid sizes would be missed. On the MI250X node with a learner on each of GCDs 0-3,
GCD 0 and GCD 2 are linked alike to the learners: their costs are the same sums in another order, equal up to
the last bit of a float. The planner broke that tie on the last bit, so its choice flipped between them from
one byte to the next, and the map (which planned neither flip) disagreed with it at those sizes.

A measured link whose time steps up at some call size (pageable host-to-GPU copies 80 us slower per call above
640 KB) makes the host the fastest only for items of about 20.4 .. 22.5 KB: narrower than one step of the
geometric grid, so the map, planning neither side of the step, named the slower GPU there.

A GPU smaller than host memory is the fastest from about 959 B per item (below, the host's smaller overheads
win) until it stops fitting at 1042 B: a window inside one grid step, which the map missed (host throughout).
"""

from __future__ import annotations

import pytest
from conduit.placement import BandwidthProfile, LinkCost, Planner, Topology, Workload, load_topology
from conduit.placement.planner import NothingFitsError
from conduit.placement.topology import GIB, Gpu


def _planned(planner: Planner, workload: Workload) -> object:
    try:
        return planner.plan(workload).placement
    except NothingFitsError:
        return None


def test_symmetric_gcds_do_not_flip_the_plan_from_byte_to_byte() -> None:
    """The same item sizes give the same choice between two candidates of equal cost (the first proposed),
    so the map, which plans only a grid, agrees with the planner at every size (on main the planner flipped to
    GCD 2 at 29, 32, 62, 76, 90, 239, ... B, and the map said GCD 0 there)."""
    planner = Planner(load_topology("mi250x-node"))
    w = Workload.transitions(64, capacity=10**6, batch=4096, learners=4)
    pmap = planner.placement_map(w, min_item_bytes=16, max_item_bytes=500)
    plans = {b: planner.plan(w.resized(b)) for b in range(16, 501)}
    assert {str(p.placement) for p in plans.values()} == {"gpu[cuda:0]"}
    assert plans[29].chosen.reason == "chosen: fastest feasible"
    assert [b for b, p in plans.items() if pmap.lookup(b) != p.placement] == []


@pytest.mark.parametrize(("topology", "capacity", "batch", "learners"), [
    ("mi250x-node", 10**6, 4096, 4),
    ("mi250x-node", 10**6, 512, 1),
    ("dgx-a100-80g", 10**6, 512, 1),
    ("dgx-a100-80g", 10**5, 256, 2),
    ("h200x1", 10**4, 64, 1),
])
def test_map_agrees_with_the_planner_at_every_size_near_its_boundaries(topology: str, capacity: int, batch: int,
                                                                       learners: int) -> None:
    """Around every boundary of a map over 16 B .. 10 MB (and over the small sizes, where overheads decide), the
    map's placement is the planner's, byte by byte."""
    planner = Planner(load_topology(topology))
    w = Workload.transitions(64, capacity=capacity, batch=batch, learners=learners)
    pmap = planner.placement_map(w, min_item_bytes=16, max_item_bytes=10**7)
    sizes = set(range(16, 400))
    for edge in pmap.boundaries:
        sizes |= set(range(max(16, int(edge) - 20), min(10**7, int(edge) + 20)))
    bad = [(b, str(pmap.range_of(b).spec), str(_planned(planner, w.resized(b))))
           for b in sorted(sizes) if pmap.range_of(b).spec != _planned(planner, w.resized(b))]
    assert bad == []


def test_map_plans_each_side_of_a_step_in_a_measured_curve() -> None:
    """The grid holds the item sizes where a growing field's bytes per ingestion call reach a point of the
    measured h2d_pageable curve, so the window in which its step makes the host fastest is in the map."""
    topo = load_topology("h200x1")
    step, extra = 640_000.0, 80e-6  # (bytes per call, seconds the step adds; the time never decreases)
    pts = ((step, 12e9), *((step * f, step * f / (step * f / 12e9 + extra)) for f in (1.02, 1.5, 2, 4, 8, 16, 64)))
    prof = BandwidthProfile({"h2d_pageable": LinkCost(15e-6, pts)}, source="measured", machine="stepped-pcie")
    planner = Planner(topo, prof)
    w = Workload.transitions(64, capacity=10**4, batch=64)
    pmap = planner.placement_map(w, min_item_bytes=16, max_item_bytes=10**6)
    assert [str(r.spec) for r in pmap.ranges] == ["host", "gpu[cuda:0]", "host", "gpu[cuda:0]"]
    window = pmap.ranges[2]
    sizes = [*range(int(window.lo) - 30, int(window.lo) + 30), *range(int(window.hi) - 30, int(window.hi) + 30),
             *range(20_000, 23_000, 50)]
    assert [b for b in sizes if pmap.range_of(b).spec != planner.plan(w.resized(b)).placement] == []
    assert planner.plan(w.resized(21_000)).placement.tier == "host"


def test_map_plans_where_a_faster_candidate_stops_fitting() -> None:
    """Each candidate's largest fitting size is planned, so the GPU's window between the host's cheap small
    items and the GPU's memory limit is in the map."""
    declared = load_topology("h200x1").declared
    topo = Topology("small-gpu", 512 * GIB, (Gpu(0, "a 16 GiB GPU", 16 * GIB),), 0, declared, "one small GPU")
    planner = Planner(topo)
    w = Workload.transitions(64, capacity=13_500_000, batch=64)
    pmap = planner.placement_map(w, min_item_bytes=16, max_item_bytes=10**5)
    assert [str(r.spec) for r in pmap.ranges] == ["host", "gpu[cuda:0]", "host", "None"]
    gpu = pmap.ranges[1]
    assert [b for b in range(int(gpu.lo) - 40, int(gpu.hi) + 40)
            if pmap.range_of(b).spec != planner.plan(w.resized(b)).placement] == []
