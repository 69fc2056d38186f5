"""A measured profile whose disk tier was measured on another volume than a discovered topology offers.

``profile_machine(disk_directory=D)`` measures again when the cached profile's disk tier was measured elsewhere,
but a profile taken from the cache (``load_profile()``, measured in the temp dir) and
``discover_topology(disk_directory=D)`` were planned together without a word: the disk tier of ``D`` was priced
with the temp dir's ``disk_read`` / ``disk_write`` (another volume's speed) while ``Plan.build`` put the files in
``D``. The cost model now refuses that pair, naming both directories and what to measure.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conduit.errors import PlacementError
from conduit.placement import BandwidthProfile, LinkCost, Planner, Workload, discover_topology
from conduit.placement.profile import machine_id

LINKS = {k: LinkCost.constant(5.0, 10.0) for k in ("host_copy", "host_gather", "disk_read", "disk_write")}
LINKS |= {"edp_deliver": LinkCost(4e-5), "edp_ingest": LinkCost(3e-5)}
WORKLOAD = Workload((64,), capacity=1000, batch=10)


def _measured_in(directory: Path) -> BandwidthProfile:
    return BandwidthProfile(dict(LINKS), source="measured", machine=machine_id(),
                            details={"disk_directory": str(directory)})


def _local(directory: Path) -> object:
    return dataclasses.replace(discover_topology(disk_directory=str(directory)), gpus=())


def test_a_profile_measured_on_another_volume_is_refused_naming_both(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    fast.mkdir()
    slow.mkdir()
    with pytest.raises(PlacementError, match=rf"measured the disk tier in {fast}.*offers the disk tier in {slow}.*"
                                             rf"profile_machine\(disk_directory="):
        Planner(_local(slow), _measured_in(fast))  # type: ignore[arg-type]


def test_the_same_volume_however_spelt_is_planned(tmp_path: Path) -> None:
    vol = tmp_path / "vol"
    vol.mkdir()
    plan = Planner(_local(vol), _measured_in(tmp_path / "x" / ".." / "vol")).plan(WORKLOAD)  # type: ignore[arg-type]
    assert plan.placement.tier == "host"


def test_a_profile_that_names_no_disk_directory_is_still_planned(tmp_path: Path) -> None:
    prof = BandwidthProfile(dict(LINKS), source="measured", machine=machine_id())
    assert Planner(_local(tmp_path), prof).plan(WORKLOAD).placement.tier == "host"  # type: ignore[arg-type]
