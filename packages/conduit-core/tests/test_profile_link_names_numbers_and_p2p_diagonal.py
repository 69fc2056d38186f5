"""Profile and topology files: link names that are no path, figures that are no numbers, a p2p diagonal.

* ``load_profile`` took any link name (``"h2d_pined"``, ``"p2p:0"``, ``"host_copy:x"``): an entry no lookup ever
  reads, so the profile silently lacked the figure the file meant to give (a topology data file refuses them).
* ``LinkCost.from_dict`` coerced its figures with ``float()``: ``"overhead_s": "0.5"`` and ``true`` (1 s) were
  read as numbers, in a profile file and in a topology file's profile-form link alike.
* ``p2p.matrix_gbps`` skipped its diagonal unread: a bandwidth written there (or a typo) was silently ignored.
  The diagonal is now ``null`` or ``0`` (a GPU's copy within itself is no P2P copy: ``gpu_gather`` prices it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conduit.errors import PlacementError
from conduit.placement import BandwidthProfile, LinkCost, load_profile, load_topology
from conduit.placement.profile import machine_id
from conduit.placement.topology import Topology

LINKS = {k: LinkCost.constant(5.0, 10.0) for k in ("host_copy", "host_gather", "edp_deliver", "edp_ingest")}


def _profile_file(tmp_path: Path, edit: Any) -> Path:
    data = BandwidthProfile(dict(LINKS), source="measured", machine=machine_id()).to_dict()
    edit(data["links"])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("name", ["h2d_pined", "p2p:0", "host_copy:x", "h2d_pinned:01", "p2p:1:1", "gpu_gather:0:1",
                                  "host_copy:0", ""])
def test_a_profile_link_name_that_is_no_path_is_refused(tmp_path: Path, name: str) -> None:
    def edit(links: dict[str, Any]) -> None:
        links[name] = LinkCost.constant(3.0).to_dict()

    with pytest.raises(PlacementError, match="no data path|no link name|not priced per GPU"):
        load_profile(_profile_file(tmp_path, edit))


@pytest.mark.parametrize("name", ["h2d_pinned:3", "p2p:0:2", "p2p", "gpu_gather:1"])
def test_per_gpu_profile_link_names_still_load(tmp_path: Path, name: str) -> None:
    def edit(links: dict[str, Any]) -> None:
        links[name] = LinkCost.constant(3.0).to_dict()

    assert name in load_profile(_profile_file(tmp_path, edit)).links


@pytest.mark.parametrize(("key", "value"), [("overhead_s", "0.5"), ("overhead_s", True), ("per_row_s", "1e-9"),
                                            ("per_row_s", False), ("points", [["1", 5e9]]), ("points", [[1, "5e9"]]),
                                            ("points", [[True, 5e9]])])
def test_a_profile_figure_that_is_no_number_is_refused(tmp_path: Path, key: str, value: object) -> None:
    def edit(links: dict[str, Any]) -> None:
        links["host_copy"][key] = value

    with pytest.raises(PlacementError, match=f"{key}"):
        load_profile(_profile_file(tmp_path, edit))



def _topology_data() -> dict[str, Any]:
    return {"name": "t", "host_memory_gib": 64, "gpu": {"count": 2, "name": "G", "memory_gib": 16},
            "links": {"host_copy": {"gbps": 10}}}


@pytest.mark.parametrize("value", ["5", True])
def test_a_profile_form_link_in_a_topology_file_refuses_a_figure_that_is_no_number(value: object) -> None:
    d = _topology_data()
    d["links"]["h2d_pinned"] = {"overhead_s": value, "points": [[1.0, 2e10]]}
    with pytest.raises(PlacementError, match="overhead_s"):
        Topology.from_file_dict(d)


@pytest.mark.parametrize("diag", [300, "fast", -1, True, float("nan")])
def test_a_p2p_matrix_diagonal_holding_a_figure_is_refused(diag: object) -> None:
    d = _topology_data()
    d["p2p"] = {"matrix_gbps": [[diag, 100], [100, None]]}
    with pytest.raises(PlacementError, match=r"matrix_gbps\[0\]\[0\]"):
        Topology.from_file_dict(d)


@pytest.mark.parametrize("diag", [None, 0, 0.0])
def test_a_p2p_matrix_diagonal_of_null_or_zero_still_loads(diag: object) -> None:
    d = _topology_data()
    d["p2p"] = {"matrix_gbps": [[diag, 100], [50, diag]]}
    topo = Topology.from_file_dict(d)
    assert topo.declared is not None
    assert topo.declared.link("p2p", 0, 1).peak_bandwidth == 100e9
    assert topo.declared.link("p2p", 1, 0).peak_bandwidth == 50e9
    assert not any(k in topo.declared.links for k in ("p2p:0:0", "p2p:1:1"))


def test_the_shipped_topologies_still_load() -> None:
    for name in ("dgx-a100-80g", "h200x1", "mi250x-node"):
        assert load_topology(name).declared is not None
