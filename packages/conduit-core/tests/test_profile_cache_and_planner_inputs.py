"""Review of the placement planner's inputs: the profile cache and the planner's own settings.

* ``profile_machine(disk_directory=D)`` returned the cached profile whatever volume its disk tier had been measured
  on (the cache is keyed by machine only): a profile measured on a RAM-backed temp dir priced the disk tier of a
  slow volume at memory speed, and a plan of ``discover_topology(disk_directory=D)`` used figures of another volume.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from conduit.errors import ConfigurationError
from conduit.placement import BandwidthProfile, LinkCost, Planner, Workload, load_topology
from conduit.placement.cost import transition_schema
from conduit.placement.profile import load_profile, machine_id, measure_host_paths, profile_machine, profile_path
from conduit.storage.sharded import ShardedStorage


def _fake_cached(directory: Path, *, quick: bool = True) -> BandwidthProfile:
    """A profile of this machine whose disk tier was (said to be) measured in ``directory``, saved to the cache."""
    links = {k: LinkCost.constant(1.0, 1.0) for k in ("host_copy", "host_gather", "edp_deliver", "edp_ingest",
                                                      "disk_read", "disk_write")}
    prof = BandwidthProfile(links, source="measured", machine=machine_id(), created="2000-01-01T00:00:00+00:00",
                            details={"disk_directory": os.path.realpath(directory), "quick": quick,
                                     "torch_threads": torch.get_num_threads()})
    prof.save()
    return prof


def test_a_cached_profile_of_another_disk_directory_is_measured_again(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "fast").mkdir()
    (tmp_path / "slow").mkdir()
    _fake_cached(tmp_path / "fast")
    # the same directory, however spelt: the cache is what it was
    same = profile_machine(quick=True, disk_directory=str(tmp_path / "slow" / ".." / "fast"))
    assert same.created == "2000-01-01T00:00:00+00:00"
    prof = profile_machine(quick=True, disk_directory=str(tmp_path / "slow"))
    assert prof.created != "2000-01-01T00:00:00+00:00", "the disk figures of another directory were reused"
    assert prof.details["disk_directory"] == os.path.realpath(tmp_path / "slow")
    assert load_profile(profile_path()).created == prof.created  # the new measurement replaced the cache


def test_a_full_measurement_is_not_answered_by_a_cached_quick_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """profile_machine(quick=False) returned the cached quick profile (that `conduit plan --topology local` leaves
    there): fewer repetitions and smaller buffers than asked for."""
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path / "cache"))
    quick = _fake_cached(tmp_path, quick=True)
    assert profile_machine(quick=True, disk_directory=str(tmp_path)).created == quick.created  # quick for quick
    full = profile_machine(quick=False, disk_directory=str(tmp_path))
    assert full.created != quick.created and full.details["quick"] is False, "a quick profile answered a full one"
    # and a full cached profile answers both
    assert profile_machine(quick=True, disk_directory=str(tmp_path)).created == full.created
    assert profile_machine(quick=False, disk_directory=str(tmp_path)).created == full.created


@pytest.mark.parametrize("tol", [True, "0.02", None, [0.02]])
def test_a_tie_tolerance_that_is_no_number_is_a_configuration_error(tol: object) -> None:
    """True was taken as a tolerance of 100% (any candidate twice as slow counted as tied), and a string or None
    raised a bare TypeError from the comparison."""
    with pytest.raises(ConfigurationError, match="tie_tolerance"):
        Planner(load_topology("h200x1"), tie_tolerance=tol)  # type: ignore[arg-type]


def test_every_host_path_is_timed_by_the_clock_given() -> None:
    """measure_host_paths(clock=...) timed the bulk host copy by the wall clock whatever clock it was given (the
    gathers and EDP calls by the one given): ``edp_ingest``, a measured ingestion minus ``host_copy``'s prediction,
    mixed the two clocks. Here a clock that runs 1000x fast: every path's per-call overhead is at least 1000x the
    shortest time a call can take (100 ns)."""
    def fast() -> float:
        return time.perf_counter() * 1000

    links = measure_host_paths(quick=True, clock=fast)
    assert links["host_copy"].overhead_s >= 1e-4, links["host_copy"]
    assert links["host_gather"].overhead_s >= 1e-4, links["host_gather"]


def test_a_plan_from_a_measured_profile_completed_by_declared_figures_says_so() -> None:
    """A measured profile of host paths only, planning a declared GPU topology: every GPU path was priced by the
    topology's declared figures, and the plan said its bandwidth was all ``measured:<machine>``."""
    host_only = BandwidthProfile({"host_copy": LinkCost.constant(3.0, 1.0), "host_gather": LinkCost.constant(2.0, 1.0)},
                                 source="measured", machine="0123456789abcdef")
    plan = Planner(load_topology("h200x1"), host_only).plan(Workload.transitions(1000, capacity=10**5, batch=256))
    declared = load_topology("h200x1").declared
    assert declared is not None
    lacking = len(set(declared.links) - {"host_copy", "host_gather"})
    assert plan.profile_source == f"measured:0123456789abcdef, declared:h200x1 for {lacking} path(s) it lacks"
    assert plan.explain().startswith(f"topology h200x1 (bandwidth: {plan.profile_source})")
    assert plan.to_dict()["profile"] == plan.profile_source
    # the declared figures alone: named as before
    full = Planner(load_topology("h200x1")).plan(Workload.transitions(1000, capacity=10**5, batch=256))
    assert full.profile_source == "declared:h200x1"


@pytest.mark.parametrize(("tol", "said"), [(0.02, "2%"), (0.004, "0.4%"), (0.005, "0.5%"), (0.125, "12.5%")])
def test_a_plan_states_the_tie_tolerance_it_used(tol: float, said: str) -> None:
    """The reasons printed the tolerance rounded to a whole percent: a tolerance of 0.4% read 'within 0% of the
    chosen' for a candidate the planner had counted as tied, 12.5% read 12%."""
    plan = Planner(load_topology("dgx-a100-80g"), tie_tolerance=tol).plan(
        Workload.transitions(5000, capacity=10**6, batch=512, learners=2))
    twin = next(c for c in plan.candidates if str(c.spec) == "gpu[cuda:1]")  # as fast as gpu[cuda:0], chosen
    assert plan.placement.devices == ("cuda:0",)
    assert twin.reason.startswith(f"within {said} of the chosen"), twin.reason



def test_no_candidate_shards_a_buffer_over_more_gpus_than_it_has_slots() -> None:
    """With capacity 3 on an 8-GPU topology the plan listed sharded[4 GPUs] and sharded[8 GPUs] as fitting ('yes'),
    which ShardedStorage refuses (a shard without a slot): candidates that cannot be built."""
    with pytest.raises(ConfigurationError, match="at most one shard per slot"):
        ShardedStorage(transition_schema(8), 3, ["cpu"] * 4)
    plan = Planner(load_topology("dgx-a100-80g")).plan(Workload.transitions(8, capacity=3, batch=1))
    sharded = [str(c.spec) for c in plan.candidates if c.spec.tier == "sharded"]
    assert sharded and all(len(c.spec.devices) <= 3 for c in plan.candidates), sharded
