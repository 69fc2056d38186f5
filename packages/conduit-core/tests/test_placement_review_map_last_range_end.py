"""A placement map's ranges are half-open (``lo <= item_bytes < hi``, sizes located by the whole bytes they
need): a size at or past the end of a last range that ends at a finite ``hi`` lies in no range, and a
lookup refuses it typed (was: the last range's placement, for items it never covered)."""

from __future__ import annotations

import pytest
import torch
from conduit import ExperienceSchema, Field
from conduit.errors import PlacementError
from conduit.placement import PlacementSpec, Workload
from conduit.placement.placement_map import MapRange, PlacementMap

HOST = PlacementSpec("host", ("cpu",))
DISK = PlacementSpec("disk", ("disk",))
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((8,), torch.float32))
TEMPLATE = Workload.from_schema(SCHEMA, capacity=16, batch=4)


@pytest.mark.parametrize("max_item_bytes", [None, 100.0])
def test_a_size_at_the_end_of_a_finite_last_range_is_in_no_range_and_refused(max_item_bytes: float | None) -> None:
    pmap = PlacementMap([MapRange(1.0, 50.0, HOST), MapRange(50.0, 100.0, DISK)], TEMPLATE, "t",
                        max_item_bytes=max_item_bytes)
    assert pmap.lookup(99) == DISK and pmap.lookup(49) == HOST and pmap.lookup(49.5) == DISK
    for size in (100, 99.5):  # 99.5 B items need 100 whole bytes: past [50, 100) too
        with pytest.raises(PlacementError, match="Re-plan with a larger maximum"):
            pmap.lookup(size)  # was: disk
    assert pmap.max_item_bytes == 99


def test_an_open_last_range_still_answers_up_to_the_maximum() -> None:
    pmap = PlacementMap([MapRange(1.0, 50.0, HOST), MapRange(50.0, float("inf"), DISK)], TEMPLATE, "t",
                        max_item_bytes=100.0)
    assert pmap.lookup(100) == DISK and pmap.max_item_bytes == 100
    with pytest.raises(PlacementError):
        pmap.lookup(100.5)
