"""A topology file that declares a GPU pair's P2P figure in one direction only (``links.p2p:0:1`` without
``p2p:1:0`` and without a default ``p2p``) is inconsistent: it is refused when it is loaded, naming the
missing direction, not accepted and then failing every plan that shards over the pair."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
from conduit.errors import PlacementError
from conduit.placement import Planner, Topology, Workload, available_topologies, load_topology


def _two_gpus(**links: Any) -> dict[str, Any]:
    d = json.loads(resources.files("conduit.placement").joinpath("topologies/h200x1.json").read_text())
    d["name"] = "two"
    d["gpu"]["count"] = 2
    d.pop("p2p", None)
    d["links"].update(links)
    return d


def test_a_p2p_figure_declared_in_one_direction_only_is_refused_at_load() -> None:
    with pytest.raises(PlacementError, match=r"p2p:1:0"):
        Topology.from_file_dict(_two_gpus(**{"p2p:0:1": {"gbps": 100}}))  # was: loaded, then every plan failed


def test_p2p_figures_in_both_directions_or_with_a_default_load_and_plan() -> None:
    w = Workload.transitions(100, capacity=1000, batch=10)
    for links in ({"p2p:0:1": {"gbps": 100}, "p2p:1:0": {"gbps": 90}},
                  {"p2p:0:1": {"gbps": 100}, "p2p": {"gbps": 20}}):
        Planner(Topology.from_file_dict(_two_gpus(**links))).plan(w)


def test_the_shipped_topologies_still_load() -> None:
    for name in available_topologies():
        load_topology(name)
