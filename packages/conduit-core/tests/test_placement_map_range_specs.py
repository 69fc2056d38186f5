"""A placement map range whose placement is no ``PlacementSpec``.

``PlacementMap`` checked its ranges' bounds but not their placements: ``MapRange(0, inf, "host")`` was accepted,
``lookup`` handed out the string, and ``AdaptivePlacement`` failed building the buffer with an ``AttributeError``
(``'str' object has no attribute 'build'``). The map now refuses it with a ``ConfigurationError`` naming the range.
"""

from __future__ import annotations

import math

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field
from conduit.errors import ConfigurationError
from conduit.placement import PlacementSpec, Workload
from conduit.placement.placement_map import AdaptivePlacement, MapRange, PlacementMap

SCHEMA = ExperienceSchema(x=Field((4,), torch.float32))
TEMPLATE = Workload.from_schema(SCHEMA, capacity=64, batch=8)


@pytest.mark.parametrize("spec", ["host", ("host", ("cpu",)), {"tier": "host", "devices": ["cpu"]}])
def test_a_range_whose_placement_is_no_spec_is_refused_naming_it(spec: object) -> None:
    with pytest.raises(ConfigurationError, match=r"range 1 places its items on .*not a PlacementSpec"):
        PlacementMap([MapRange(0.0, 8.0, PlacementSpec("host", ("cpu",))),
                      MapRange(8.0, math.inf, spec)], TEMPLATE, "t")  # type: ignore[arg-type]


def test_ranges_of_specs_and_of_nothing_fits_are_accepted_and_build() -> None:
    pmap = PlacementMap([MapRange(0.0, 32.0, PlacementSpec("host", ("cpu",))), MapRange(32.0, math.inf, None)],
                        TEMPLATE, "t")
    edp = ExperienceDataPlane(SCHEMA, capacity=64, placement=AdaptivePlacement(pmap))
    try:
        assert edp.storage.tier == "host"  # type: ignore[attr-defined]
    finally:
        edp.close()
