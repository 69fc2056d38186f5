"""The cached machine profile is keyed by the machine's GPUs too, not only by their names.

``machine_id`` hashed the GPUs' names (and so their count) only: on the same host, GPUs of the same model in other
PCI slots (another ``CUDA_VISIBLE_DEVICES``, a GPU replaced or moved) gave the same key, so the profile measured
before the change (its H2D and P2P figures per device index) was reused as this machine's. The key now holds each
GPU's name, PCI location and UUID, in device order. A machine without GPUs keeps the key it had, so its cached
profile is still reused.

The GPUs are described through ``torch.cuda``; on a machine without CUDA its device queries are replaced by ones
describing GPUs, so the key function is tested on GPU descriptions here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conduit.errors import PlacementError
from conduit.placement import BandwidthProfile, LinkCost
from conduit.placement.profile import (
    _cpu_model,
    gpu_descriptions,
    host_memory,
    load_profile,
    machine_id,
    profile_machine,
    profile_path,
)


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, buses: list[int], name: str = "NVIDIA H100 80GB HBM3") -> None:
    """Make torch.cuda report GPUs of one model on the given PCI buses (a UUID per bus)."""
    props = [SimpleNamespace(name=name, pci_domain_id=0, pci_bus_id=b, pci_device_id=0,
                             uuid=f"6f1c{b:04x}-0000-0000-0000-000000000000") for b in buses]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: props[i].name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props[i])


def _measured(machine: str) -> BandwidthProfile:
    links = {k: LinkCost.constant(1.0, 1.0) for k in ("host_copy", "host_gather", "edp_deliver", "edp_ingest",
                                                      "disk_read", "disk_write")}
    return BandwidthProfile(links, source="measured", machine=machine, created="2000-01-01T00:00:00+00:00",
                            details={"disk_directory": os.path.realpath(Path.cwd()), "quick": True,
                                     "torch_threads": torch.get_num_threads()})


def test_gpus_of_the_same_model_on_other_pci_buses_are_another_machine(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    _fake_gpus(monkeypatch, [0x18, 0x2A])
    before, path = machine_id(), profile_path()
    assert gpu_descriptions()[0] == "NVIDIA H100 80GB HBM3 pci=0000:18:00.0 uuid=6f1c0018-0000-0000-0000-000000000000"
    assert machine_id() == before, "the key is stable"
    _measured(before).save()
    _fake_gpus(monkeypatch, [0x9A, 0xAB])  # same names, same count: other GPUs
    assert machine_id() != before and profile_path() != path
    with pytest.raises(PlacementError, match="No bandwidth profile"):
        load_profile()  # the profile of the other GPUs is not this machine's cache
    with pytest.raises(PlacementError, match="another machine"):
        load_profile(path)
    _fake_gpus(monkeypatch, [0x2A, 0x18])  # the same GPUs in another device order (device indexes differ)
    assert machine_id() != before
    _fake_gpus(monkeypatch, [0x18, 0x2A])
    assert machine_id() == before and load_profile().machine == before


def test_the_key_function_tells_gpu_descriptions_apart() -> None:
    a = ["NVIDIA A100-SXM4-40GB pci=0000:07:00.0 uuid=1", "NVIDIA A100-SXM4-40GB pci=0000:0f:00.0 uuid=2"]
    b = [a[0], "NVIDIA A100-SXM4-40GB pci=0000:47:00.0 uuid=3"]
    keys = {machine_id(gpus=g) for g in (a, b, a[:1], a[::-1], [])}
    assert len(keys) == 5 and machine_id(gpus=a) == machine_id(gpus=list(a))


def test_a_machine_without_gpus_keeps_its_key_and_its_cached_profile(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The key of a machine without GPUs is what it was before GPU identities entered it (the hash of the same
    summary), so a profile cached under it is reused without measuring again."""
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    summary = {"hostname": socket.gethostname(), "platform": platform.machine(), "cpu": _cpu_model(),
               "cpus": os.cpu_count() or 1, "host_memory": host_memory(), "gpus": []}
    old_key = hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]
    assert gpu_descriptions() == [] and machine_id() == machine_id(gpus=[]) == old_key
    cached = _measured(old_key)
    cached.details["disk_directory"] = os.path.realpath(tmp_path)
    cached.save(tmp_path / "cache" / f"profile-{old_key}.json")
    assert profile_machine(quick=True, disk_directory=str(tmp_path)).created == cached.created


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpus_here_are_described_by_pci_location() -> None:
    got = gpu_descriptions()
    assert len(got) == torch.cuda.device_count() and all(" pci=" in d for d in got)
    assert machine_id() == machine_id(gpus=got)
