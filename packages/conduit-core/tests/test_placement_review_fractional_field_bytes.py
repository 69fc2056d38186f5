"""Review of the planner's capacity constraint: a workload given fractional field sizes.

``Workload(field_bytes=...)`` truncated each size to whole bytes (``int``), while ``from_schema`` and ``resized``
round up so that "the plan never counts less than the items take": a ragged field given at its mean of 100.75
bytes per item was planned at 100, so a million items were checked for 0.75 MB less than they hold, and a
placement that does not fit could be chosen. Sizes are now rounded up.
"""

from __future__ import annotations

import math

from conduit.placement import PlacementSpec, Workload, load_topology
from conduit.placement.cost import CostModel


def test_fractional_field_bytes_are_rounded_up() -> None:
    w = Workload((100.75, 8, 0.25), capacity=1000, batch=10)
    assert w.field_bytes == (101, 8, 1)  # was (100, 8, 0)
    assert w.item_bytes >= 100.75 + 8 + 0.25
    assert Workload((64, 4.0), capacity=10, batch=1).field_bytes == (64, 4)  # whole sizes are kept


def test_the_memory_checked_holds_the_items() -> None:
    w = Workload((1000.5, 4.5), capacity=10**6, batch=256)
    model = CostModel(load_topology("h200x1"))
    columns = 10**6 * (1000.5 + 4.5)
    host = model.memory(PlacementSpec("host", ("cpu",)), w)["cpu"]
    gpu = model.memory(PlacementSpec("gpu", ("cuda:0",)), w)["cuda:0"]
    assert host >= math.ceil(columns) and gpu >= math.ceil(columns)  # was 1e6 bytes short
