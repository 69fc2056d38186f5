"""A profile file whose ``source`` is neither ``measured`` nor ``declared``.

``load_profile`` refuses a measured profile of another machine (``check_machine``), but the check ran only for
``source == "measured"``: the same file with ``"source": "Measured"`` (or any other word) was loaded, planned this
machine's discovered topology, and the plan named it ``measured:<the other machine>``. Such a file is now refused
as no profile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conduit.errors import PlacementError
from conduit.placement import BandwidthProfile, LinkCost, load_profile
from conduit.placement.profile import machine_id

LINKS = {k: LinkCost.constant(5.0, 10.0) for k in ("host_copy", "host_gather", "edp_deliver", "edp_ingest")}


def _file(tmp_path: Path, source: str, machine: str) -> Path:
    data = BandwidthProfile(dict(LINKS), source="measured", machine=machine).to_dict()
    data["source"] = source
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("source", ["Measured", "estimated", "", None])
def test_a_profile_of_another_machine_cannot_pass_as_another_source(tmp_path: Path, source: object) -> None:
    with pytest.raises(PlacementError, match=r"source is .*neither 'measured' nor 'declared'"):
        load_profile(_file(tmp_path, source, "0123456789abcdef"))  # type: ignore[arg-type]


def test_measured_here_and_declared_profiles_still_load(tmp_path: Path) -> None:
    assert load_profile(_file(tmp_path, "measured", machine_id())).source == "measured"
    assert load_profile(_file(tmp_path, "declared", "declared:x")).source == "declared"
