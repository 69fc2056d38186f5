"""Bad arguments to the online migration and to the placement map are refused typed, changing nothing.

* ``migrate``'s ``chunk_bytes`` that is no int >= 1 (a string raised a bare TypeError; 0, a negative count, a float
  or a bool were taken silently) and a ``progress`` that is not callable (a bare TypeError after the first chunk)
  are a ConfigurationError before anything is built or copied;
* an item size that is no real number (a string, None, a bool, a tensor), looked up in a placement map (directly or
  through ``AdaptivePlacement.rebalance``), or bounding a map to plan, is a ConfigurationError, not a bare TypeError
  (a bool or a 0-d tensor was taken as a size); the buffer stays where it is; so is a map's ``max_item_bytes`` or an
  ``AdaptivePlacement``'s ``mean_ragged_length`` that is no real number;
* ``paper_schedule`` with fewer iterations than stage sizes is refused: it silently left the largest sizes out (the
  default five stages over 4 iterations never reached 20000, so the growth experiment had nothing to migrate for).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field
from conduit.placement import HostPlacement, Planner, load_topology
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import Workload
from conduit.placement.migration import migrate
from conduit.placement.placement_map import AdaptivePlacement, MapRange, PlacementMap

SCHEMA = ExperienceSchema(obs=Field((3,)))

def _buffer() -> ExperienceDataPlane:
    edp = ExperienceDataPlane(SCHEMA, capacity=16)
    for i in range(3):  # 30 items through a ring of 16: the live range is [14, 30)
        edp.ingest({"obs": torch.arange(30, dtype=torch.float32).view(10, 3) + 30 * i})
    edp.flush()
    return edp

@pytest.mark.parametrize("kwargs", [
    {"chunk_bytes": "4MiB"}, {"chunk_bytes": 0}, {"chunk_bytes": -5}, {"chunk_bytes": 1.5}, {"chunk_bytes": True},
    {"chunk_bytes": 12, "progress": 5},
], ids=["str", "zero", "negative", "float", "bool", "progress-not-callable"])
def test_bad_chunk_bytes_or_progress_is_refused_before_anything_changes(kwargs: dict[str, Any]) -> None:
    edp = _buffer()
    storage, before = edp.storage, edp.state_dict()
    with pytest.raises(ConfigurationError, match="chunk_bytes|progress"):
        migrate(edp, HostPlacement(), **kwargs)
    assert edp.storage is storage, "a refused migration swapped the storage"
    after = edp.state_dict()
    assert (after["storage"]["oldest"], after["storage"]["next"]) == (before["storage"]["oldest"],
                                                                       before["storage"]["next"])
    assert torch.equal(after["storage"]["data"]["obs"], before["storage"]["data"]["obs"])
    # the same migration with good arguments goes through (a NumPy integer is an int)
    seen: list[tuple[int, int]] = []
    report = migrate(edp, HostPlacement(), chunk_bytes=np.int64(12), progress=lambda c, h: seen.append((c, h)))
    assert report.items == 16 and report.chunks > 1 and seen
    assert torch.equal(edp.state_dict()["storage"]["data"]["obs"], before["storage"]["data"]["obs"])



def test_a_transform_with_the_schema_unchanged_is_refused_before_anything_changes() -> None:
    """(Was: accepted; the stored items went through it, batches still on their way to storage did not: a buffer
    of items of two kinds.)"""
    edp = _buffer()
    storage, before = edp.storage, edp.state_dict()
    with pytest.raises(ConfigurationError, match="schema is unchanged"):
        edp.migrate(HostPlacement(), transform=lambda b: {"obs": b["obs"] * 0})
    assert edp.storage is storage
    assert torch.equal(edp.state_dict()["storage"]["data"]["obs"], before["storage"]["data"]["obs"])

BAD_SIZES = ["64", None, True, torch.tensor(64.0)]
BAD_SIZE_IDS = ["str", "none", "bool", "tensor"]


def _map() -> PlacementMap:
    return PlacementMap([MapRange(1.0, 100.0, PlacementSpec("host", ("cpu",))),
                         MapRange(100.0, math.inf, PlacementSpec("disk", ("disk",)))],
                        Workload.from_schema(SCHEMA, capacity=16, batch=4), "test", max_item_bytes=1000.0)


@pytest.mark.parametrize("size", BAD_SIZES, ids=BAD_SIZE_IDS)
def test_a_map_refuses_an_item_size_that_is_no_number(size: Any) -> None:
    pmap = _map()
    with pytest.raises(ConfigurationError, match="item_bytes"):
        pmap.lookup(size)
    with pytest.raises(ConfigurationError, match="item_bytes"):
        pmap.range_of(size)
    assert pmap.lookup(np.float64(12.0)) == PlacementSpec("host", ("cpu",))  # a NumPy number is a number


@pytest.mark.parametrize("size", ["64", True, torch.tensor(64.0)], ids=["str", "bool", "tensor"])  # (None: observe)
def test_rebalance_with_an_item_size_that_is_no_number_is_refused_and_moves_nothing(size: Any) -> None:
    edp = _buffer()
    storage, placement = edp.storage, edp.placement
    adaptive = AdaptivePlacement(_map())
    with pytest.raises(ConfigurationError, match="item_bytes"):
        adaptive.rebalance(edp, item_bytes=size)
    assert edp.storage is storage and edp.placement is placement and not adaptive.migrations
    assert adaptive.rebalance(edp, item_bytes=12.0) is None  # host already: the map keeps it there


@pytest.mark.parametrize("bounds", [("1", 100), (None, 100), (1, "100"), (True, 100)],
                         ids=["str-min", "none-min", "str-max", "bool-min"])
def test_a_map_to_plan_between_sizes_that_are_no_numbers_is_refused(bounds: tuple[Any, Any]) -> None:
    planner = Planner(load_topology("dgx-a100-80g"))
    with pytest.raises(ConfigurationError, match="min_item_bytes"):
        planner.placement_map(Workload.from_schema(SCHEMA, capacity=16, batch=4), min_item_bytes=bounds[0],
                              max_item_bytes=bounds[1], points=2)


@pytest.mark.parametrize("iterations,sizes", [(4, None), (1, (128, 1000)), (2, (1, 2, 3))])
def test_a_schedule_with_fewer_iterations_than_stages_is_refused(iterations: int, sizes: Any) -> None:
    from conduit.placement.growth import paper_schedule

    kwargs = {} if sizes is None else {"sizes": sizes}
    with pytest.raises(ConfigurationError, match="stages"):
        paper_schedule(iterations, **kwargs)
    every = paper_schedule(5) if sizes is None else paper_schedule(len(sizes), sizes)
    assert every == sorted(set(every)) == list(sizes or (128, 1000, 5000, 10000, 20000)), "a stage was left out"


@pytest.mark.parametrize("value", ["1000", True], ids=["str", "bool"])
def test_a_map_maximum_or_a_mean_ragged_length_that_is_no_number_is_refused(value: Any) -> None:
    ranges = [MapRange(1.0, math.inf, PlacementSpec("host", ("cpu",)))]
    workload = Workload.from_schema(SCHEMA, capacity=16, batch=4)
    with pytest.raises(ConfigurationError, match="max_item_bytes"):
        PlacementMap(ranges, workload, "test", max_item_bytes=value)
    with pytest.raises(ConfigurationError, match="mean_ragged_length"):
        AdaptivePlacement(_map(), mean_ragged_length=value)
    with pytest.raises(ConfigurationError, match="mean_ragged_length"):
        AdaptivePlacement(_map(), mean_ragged_length=None)  # type: ignore[arg-type]
