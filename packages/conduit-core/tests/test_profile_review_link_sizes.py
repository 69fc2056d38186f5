"""Review of the measured-bandwidth cost model: the sizes a link is priced at.

``LinkCost.seconds`` priced a NaN size at NaN seconds (a NaN latency compares False with everything, so a planner
choosing by it would pick arbitrarily), a negative size at nothing and a negative row count at less than the rows
cost; ``bandwidth`` answered NaN with the first point's figure; ``CostModel.move_seconds`` priced a negative
migration at 0 s. Each is now a ``ConfigurationError`` naming the argument.
"""

from __future__ import annotations

import math

import pytest
from conduit.errors import ConfigurationError
from conduit.placement import LinkCost, PlacementSpec, load_topology
from conduit.placement.cost import CostModel

BULK = LinkCost(2e-6, ((4096.0, 1e9), (1 << 20, 8e9)))
GATHER = LinkCost(1e-6, ((16.0, 1e9), (4096.0, 1e10)), 1e-9, by_row=True)


@pytest.mark.parametrize("nbytes", [math.nan, -1.0, -4096, math.inf, "4096", None, True])
def test_a_link_refuses_a_size_that_is_no_count_of_bytes(nbytes: object) -> None:
    for link in (BULK, GATHER):
        with pytest.raises(ConfigurationError, match="nbytes"):
            link.seconds(nbytes)  # type: ignore[arg-type]  # NaN was: nan s; -4096: 0 s
        with pytest.raises(ConfigurationError, match="nbytes"):
            link.bandwidth(nbytes)  # type: ignore[arg-type]  # NaN was: the first point's 1e9


@pytest.mark.parametrize("rows", [math.nan, -4, math.inf])
def test_a_gather_refuses_a_row_count_that_is_no_count(rows: float) -> None:
    with pytest.raises(ConfigurationError, match="rows"):
        GATHER.seconds(4096, rows)  # -4 was: 1.4 us, less than 4 rows' cost; NaN: nan s
    with pytest.raises(ConfigurationError, match="rows"):
        BULK.seconds(4096, rows)  # (ignored by a bulk link before: -4 rows priced as 0)


def test_sizes_that_are_counts_are_still_priced() -> None:
    assert BULK.seconds(0) == 0.0 and GATHER.seconds(0, 0) == 0.0  # a call that moves nothing costs nothing
    assert BULK.seconds(4096) == pytest.approx(2e-6 + 4096 / 1e9)
    assert GATHER.seconds(16 * 8, 8) == pytest.approx(1e-6 + 8 * 1e-9 + 16 * 8 / 1e9)
    assert BULK.bandwidth(0) == 1e9 and BULK.bandwidth(1 << 20) == 8e9


def test_move_seconds_refuses_a_negative_size() -> None:
    model = CostModel(load_topology("h200x1"))
    host, gpu = PlacementSpec("host", ("cpu",)), PlacementSpec("gpu", ("cuda:0",))
    with pytest.raises(ConfigurationError, match="nbytes"):
        model.move_seconds(-1e9, host, gpu)  # was: 0.0 s
    assert model.move_seconds(0, host, gpu) == 0.0 and model.move_seconds(1e9, host, gpu) > 0
