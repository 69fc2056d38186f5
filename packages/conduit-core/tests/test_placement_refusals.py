"""conduit.placement: bad input gives typed errors, and the placement map's boundaries are exact."""

from __future__ import annotations

import pytest
from conduit import ConfigurationError, PlacementError
from conduit.cli import main
from conduit.placement import BandwidthProfile, LinkCost, PlacementSpec, Planner, Topology, Workload, load_topology


def _host_only(host_bytes: int) -> Topology:
    links = {"host_copy": LinkCost.constant(10, 5), "host_gather": LinkCost.constant(8, 6, 100),
             "edp_deliver": LinkCost.constant(1e6, 20), "edp_ingest": LinkCost.constant(1e6, 20)}
    prof = BandwidthProfile(links, source="declared", machine="declared:tiny")
    return Topology("tiny", host_bytes, (), 0, prof, "a test machine", "declared")


def test_resized_workload_has_exactly_the_requested_item_bytes() -> None:
    """Rounding each growing field separately must not make the item a byte smaller (or larger)."""
    w = Workload((50, 50), capacity=10, batch=1)
    for b in range(90, 130):
        assert w.resized(b).item_bytes == b


def test_placement_map_never_maps_a_size_to_a_placement_that_does_not_fit() -> None:
    """Host holds 1000 items of <= 100 B exactly; 101 B items fit nowhere (the map must say so)."""
    planner = Planner(_host_only(100_000), headroom=0.0, host_usable=1.0)
    w = Workload((50, 50), capacity=998, batch=1)  # 998 slots + 2 output rows = 1000 items
    pmap = planner.placement_map(w, min_item_bytes=64, max_item_bytes=200, points=8)
    assert pmap.boundaries == [101.0]
    assert pmap.lookup(100).tier == "host"
    with pytest.raises(PlacementError):
        pmap.lookup(101)


@pytest.mark.parametrize("items", [0, -512])
def test_non_positive_ingest_items_is_a_configuration_error(items: int) -> None:
    with pytest.raises(ConfigurationError):
        Workload((8, 8), capacity=100, batch=10, ingest_items=items)


@pytest.mark.parametrize("tol", [-0.5, float("nan")])
def test_invalid_tie_tolerance_is_a_configuration_error(tol: float) -> None:
    with pytest.raises(ConfigurationError):
        Planner(load_topology("h200x1"), tie_tolerance=tol)


@pytest.mark.parametrize("bad", [
    {"name": "x", "host_memory_gib": 1, "gpu": [1, 2]},
    {"name": "x", "host_memory_gib": 1, "links": ["host_copy"]},
    {"name": "x", "host_memory_gib": 1, "links": {"host_copy": [1, 2]}},
    {"name": "x", "host_memory_gib": 1, "gpu": {"count": 2, "name": "g", "memory_gib": 1}, "p2p": [10]},
])
def test_malformed_topology_sections_are_placement_errors(bad: dict) -> None:
    with pytest.raises(PlacementError, match="Malformed"):
        Topology.from_file_dict(bad)


def test_bad_device_names_are_placement_errors() -> None:
    topo = load_topology("dgx-a100-80g")
    with pytest.raises(PlacementError):
        topo.memory_of("cuda:x")
    with pytest.raises(PlacementError):
        PlacementSpec("gpu", ())


@pytest.mark.parametrize("value", ["inf", "1e400", "nan"])
def test_cli_non_finite_counts_are_argument_errors(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--topology", "h200x1", "--obs-dim", "8", "--capacity", value, "--batch", "2"])
    assert e.value.code == 2
    assert "--capacity" in capsys.readouterr().err

