"""A ragged field's mean bytes are planned rounded up to a whole byte, never down.

* ``Workload.from_schema`` rounded each ragged field's bytes to the *nearest* byte: an int8 field at a mean of
  0.4 elements planned 0 B (the plan checked no pool memory, and ``Plan.build()`` then refused the buffer as one
  planned at ``mean_ragged_length=0``); at 2.4 it planned 2 B, pools of 2 elements per item, fewer than capacity
  items at the declared mean take. Each field's bytes are now rounded up.
"""

from __future__ import annotations

import math

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field
from conduit.placement import Planner, Workload, load_topology

TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int8, ragged=True))


@pytest.mark.parametrize("length", [0.4, 2.4, 7.0])
def test_a_ragged_field_plans_at_least_its_mean_bytes(length: float) -> None:
    capacity = 64
    w = Workload.from_schema(TOKENS, capacity=capacity, batch=8, mean_ragged_length=length)
    assert w.field_bytes[1] >= length, f"planned {w.field_bytes[1]} B for a mean of {length} int8 elements"
    assert w.field_bytes[1] == math.ceil(length)
    edp = ExperienceDataPlane(TOKENS, capacity=capacity,
                              placement=Planner(load_topology("h200x1")).plan(w).build())
    try:  # (at 0.4 the build refused: "planned for 0 B of them per item")
        assert edp.storage.ragged_capacity is not None
        assert edp.storage.ragged_capacity >= capacity * length
    finally:
        edp.close()

