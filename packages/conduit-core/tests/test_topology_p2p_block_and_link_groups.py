"""A topology data file's ``p2p`` block, GPU-to-GPU figures declared twice, and the GPU indices of its lists.

* The ``p2p`` block's keys were never checked: a misspelt ``matrix_gbps`` (``matrix_gpbs``) next to ``gbps`` was
  dropped, and a machine of non-uniform links (MI250X) was planned with one uniform link; ``p2p.gbsp`` was
  dropped too. They are refused now, naming the key and the accepted ones (as the top-level and ``gpu`` keys are).
* ``links.p2p`` (or ``links.p2p:i:j``) and the ``p2p`` block could both declare one path: the block's figure
  silently replaced the other. Declaring one figure twice is refused now; a pair in ``links`` next to the block's
  default (``p2p.gbps``) is no conflict and keeps working.
* ``host_link_groups`` took ``true`` / ``false`` as GPUs 1 and 0, and ``gpu.count`` took the string ``"8"``;
  both are refused now.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
from conduit.errors import PlacementError
from conduit.placement import Topology


def _shipped(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((resources.files("conduit.placement") / "topologies" / f"{name}.json")
                                      .read_text())
    return data


def test_a_misspelt_link_matrix_is_refused_not_replaced_by_the_uniform_default() -> None:
    d = _shipped("mi250x-node")
    d["p2p"]["matrix_gpbs"] = d["p2p"].pop("matrix_gbps")
    d["p2p"]["gbps"] = 100
    with pytest.raises(PlacementError, match=r"unknown key\(s\) p2p\.matrix_gpbs; p2p takes p2p\.gbps, "
                                             r"p2p\.matrix_gbps, p2p\.overhead_us"):
        Topology.from_file_dict(d)


def test_a_misspelt_p2p_key_is_refused() -> None:
    d = _shipped("dgx-a100-80g")
    d["p2p"]["overhead_usec"] = 3
    with pytest.raises(PlacementError, match=r"unknown key\(s\) p2p\.overhead_usec"):
        Topology.from_file_dict(d)


def test_the_default_gpu_to_gpu_figure_declared_in_links_and_in_the_p2p_block_is_refused() -> None:
    d = _shipped("dgx-a100-80g")
    d["links"]["p2p"] = {"gbps": 1}
    with pytest.raises(PlacementError, match=r"links\.p2p and p2p\.gbps both declare the figure of 'p2p'"):
        Topology.from_file_dict(d)


def test_a_pair_declared_in_links_and_in_the_link_matrix_is_refused() -> None:
    d = _shipped("mi250x-node")
    d["links"]["p2p:0:1"] = {"gbps": 1}
    with pytest.raises(PlacementError, match=r"links\.p2p:0:1 and p2p\.matrix_gbps both declare the figure of "
                                             r"'p2p:0:1'"):
        Topology.from_file_dict(d)


def test_a_pair_in_links_next_to_the_blocks_default_still_overrides_it() -> None:
    d = _shipped("dgx-a100-80g")
    d["links"]["p2p:0:1"] = {"gbps": 1}
    topo = Topology.from_file_dict(d)
    assert topo.declared is not None
    assert topo.declared.link("p2p", 0, 1).peak_bandwidth == 1e9
    assert topo.declared.link("p2p", 0, 2).peak_bandwidth == d["p2p"]["gbps"] * 1e9


def test_every_shipped_topology_still_loads() -> None:
    for name in ("dgx-a100-80g", "mi250x-node", "h200x1"):
        Topology.from_file_dict(_shipped(name))


@pytest.mark.parametrize("groups", [[[True, False]], [[True], [2, 3]]])
def test_bools_in_host_link_groups_are_refused_not_taken_as_gpus(groups: object) -> None:
    d = _shipped("dgx-a100-80g")
    d["host_link_groups"] = groups
    with pytest.raises(PlacementError, match="host_link_groups must be lists of GPU indices"):
        Topology.from_file_dict(d)


@pytest.mark.parametrize("count", ["8", float("nan")])
def test_a_gpu_count_that_is_no_number_is_refused_as_such(count: object) -> None:
    d = _shipped("dgx-a100-80g")
    d["gpu"]["count"] = count
    with pytest.raises(PlacementError, match="gpu.count must be a whole number"):
        Topology.from_file_dict(d)
