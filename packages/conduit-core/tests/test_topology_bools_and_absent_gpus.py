"""Topology sizes and the cost model's memory fractions refuse bools, and a topology file's link naming a GPU
the machine does not have is refused, naming the entry (a PlacementError / ConfigurationError, not a silent
value).

Before: ``"host_memory_gib": true`` declared a 1 GiB host, ``"gpu": {"memory_gib": true}`` 1 GiB GPUs,
``Topology("m", True)`` and ``Gpu(0, "g", True)`` were built, ``CostModel(topo, headroom=True)`` kept 100 %
headroom, and ``"links": {"p2p:0:3": ...}`` on a one-GPU machine (or ``"h2d_pinned:7"``, ``"host_copy:0"``) was
loaded and never read: the planner priced those paths with the defaults while the file seemed to say otherwise.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import numpy as np
import pytest
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement.cost import CostModel
from conduit.placement.topology import Gpu, Topology, available_topologies, load_topology


def _h200() -> dict[str, Any]:
    path = resources.files("conduit.placement") / "topologies" / "h200x1.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


@pytest.mark.parametrize(("where", "value"), [("host_memory_gib", True), ("disk_gib", False),
                                              ("gpu.memory_gib", True), ("host_memory_gib", "128")])
def test_a_size_in_a_topology_file_that_is_no_number_is_refused_by_name(where: str, value: object) -> None:
    d = _h200()
    if where.startswith("gpu."):
        d["gpu"][where[4:]] = value
    else:
        d[where] = value
    with pytest.raises(PlacementError, match=rf"Topology 'h200x1': {where.replace('.', '[.]')} is {value!r}; it must "
                                             rf"be a finite number >= 0"):
        Topology.from_file_dict(d)


@pytest.mark.parametrize(("key", "said"), [
    ("p2p:0:3", "names GPU 3, which the topology does not have (gpu.count 1: GPU 0)"),
    ("h2d_pinned:1", "names GPU 1, which the topology does not have"),
    ("gpu_gather:7", "names GPU 7, which the topology does not have"),
    ("host_copy:0", "host_copy is not priced per GPU, so this entry would never be read; write links.host_copy"),
    ("p2p:0", "is no link name; write 'p2p:i:j'"),
    ("h2d_pinned:0:0", "is no link name; write 'h2d_pinned:i'"),
    ("d2h_pinned:00", "is no link name; write 'd2h_pinned:i'"),
    ("p2p:0:0", "is no link name; write 'p2p:i:j' with two distinct GPU indices"),
])
def test_a_link_naming_a_gpu_the_topology_lacks_is_refused_by_name(key: str, said: str) -> None:
    d = _h200()
    d["links"][key] = {"gbps": 10}
    with pytest.raises(PlacementError) as e:
        Topology.from_file_dict(d)
    assert f"Topology 'h200x1': links.{key}" in str(e.value) and said in str(e.value), e.value


def test_links_for_gpus_the_topology_has_are_taken_and_read() -> None:
    d = _h200()
    d["gpu"]["count"] = 2
    d["links"].update({"h2d_pinned:1": {"gbps": 7}, "p2p:1:0": {"gbps": 3},
                       "p2p:0:1": {"gbps": 4}})  # (both directions: a pair declared one way is refused)
    prof = Topology.from_file_dict(d).declared
    assert prof is not None
    assert prof.link("h2d_pinned", 1).bandwidth(1 << 30) == pytest.approx(7e9)
    assert prof.link("p2p", 1, 0).bandwidth(1 << 30) == pytest.approx(3e9)
    for name in available_topologies():  # the shipped files are still read
        load_topology(name)


@pytest.mark.parametrize("build", [lambda: Topology("m", True), lambda: Topology("m", 1 << 30, (), np.bool_(True)),
                                   lambda: Topology("m", -1), lambda: Topology("m", 1.5),
                                   lambda: Gpu(0, "g", True), lambda: Gpu(False, "g", 1 << 30),
                                   lambda: Gpu(0, "g", -1), lambda: Topology("m", 1 << 30, ("cuda:0",))])  # type: ignore[arg-type]
def test_topology_and_gpu_constructors_refuse_bools_and_non_sizes(build: Any) -> None:
    with pytest.raises(PlacementError, match="must be"):
        build()


def test_topology_and_gpu_constructors_take_numpy_ints() -> None:
    t = Topology("m", np.int64(1 << 30), (Gpu(np.int64(0), "g", np.int64(1 << 30)),), 0)  # type: ignore[arg-type]
    assert t.memory_of("cuda:0") == 1 << 30


@pytest.mark.parametrize("name", ["headroom", "gpu_usable", "host_usable", "disk_usable"])
@pytest.mark.parametrize("value", [True, np.bool_(False), "0.5", None])
def test_cost_model_fractions_refuse_bools_and_non_numbers(name: str, value: object) -> None:
    topo = load_topology("h200x1")
    with pytest.raises(ConfigurationError, match=rf"{name} must be a number from 0 to \d+ \(a fraction\), got "):
        CostModel(topo, **{name: value})  # type: ignore[arg-type]
    assert CostModel(topo, **{name: 0.5}).topology is topo  # type: ignore[arg-type]
