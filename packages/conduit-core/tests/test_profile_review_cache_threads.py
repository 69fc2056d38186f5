"""Review of the profile cache: the configuration a cached profile is reused for.

``profile_machine`` returned the cached profile whatever intra-op thread count it had been measured with
(``details["torch_threads"]``, recorded but never compared): host copies and gathers of large tensors run on that
many threads, so a profile cached by a 16-thread process priced a 1-thread one (``OMP_NUM_THREADS=1``, a Ray
worker) at 16 threads' bandwidth. It now measures again (and caches that measurement in its place).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conduit.placement import BandwidthProfile, LinkCost
from conduit.placement.profile import load_profile, machine_id, profile_machine, profile_path


def test_a_cached_profile_measured_with_other_torch_threads_is_measured_again(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    links = {k: LinkCost.constant(1.0, 1.0) for k in ("host_copy", "host_gather", "edp_deliver", "edp_ingest",
                                                      "disk_read", "disk_write")}
    BandwidthProfile(links, source="measured", machine=machine_id(), created="2000-01-01T00:00:00+00:00",
                     details={"disk_directory": os.path.realpath(tmp_path), "quick": True,
                              "torch_threads": threads + 7}).save()
    prof = profile_machine(quick=True, disk_directory=str(tmp_path))
    assert prof.created != "2000-01-01T00:00:00+00:00", "a profile measured with other torch threads was reused"
    assert prof.details["torch_threads"] == threads
    assert load_profile(profile_path()).created == prof.created  # the new measurement replaced the cache
    # and the measurement made with these threads answers the next call
    assert profile_machine(quick=True, disk_directory=str(tmp_path)).created == prof.created
