"""Small refusals: a topology data file's unknown keys, a torch group's bad timeout, a prioritized draw without handles.

* A declared topology with a misspelt top-level key (``disk_gb`` for ``disk_gib``) or ``gpu`` key was loaded
  without it: no disk tier, or no GPUs. ``Topology.from_file_dict`` now refuses keys the file form does not have.
* ``ShardServers.torch_group(timeout=None)`` raised a bare ``TypeError`` from ``float(None)`` (and ``"5"`` was
  taken as 5 s); it is now a ``ConfigurationError`` raised before any group is formed.
* A prioritized endpoint whose draws carry weights but ``handles=None`` failed inside a replay check with a
  ``TypeError`` on None; the suite's ``draw`` helper now says that a prioritized draw must carry handles.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from typing import Any

import numpy as np
import pytest
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement import Topology
from conduit.placement.topology import _FILE_GPU_KEYS, _FILE_KEYS
from conduit.testing import CoreReplayEndpoint, Draw, ReplaySuite
from conduit.testing.suites.replay import draw


def _shipped(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((resources.files("conduit.placement") / "topologies" / f"{name}.json")
                                      .read_text())
    return data


# -- topology data files ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("right", "wrong"), [("disk_gib", "disk_gb"), ("host_memory_gib", "host_memory_gb"),
                                              ("gpu", "gpus")])
def test_a_misspelt_top_level_key_is_refused_naming_it_and_the_accepted_keys(right: str, wrong: str) -> None:
    d = _shipped("h200x1")
    d[wrong] = d.pop(right)
    if right != "host_memory_gib":  # (without host_memory_gib the file was refused before, as malformed)
        loaded = Topology.from_file_dict({k: v for k, v in d.items() if k != wrong})
        assert loaded.disk_bytes == 0 or loaded.num_gpus == 0  # what the misspelt file silently became
    with pytest.raises(PlacementError, match=rf"Topology 'h200x1': unknown key\(s\) {wrong};") as err:
        Topology.from_file_dict(d)
    for k in _FILE_KEYS:
        assert k in str(err.value), f"the accepted key {k} is not listed: {err.value}"


def test_a_misspelt_gpu_key_is_refused_naming_it() -> None:
    d = _shipped("dgx-a100-80g")
    d["gpu"]["memory_gb"] = d["gpu"].pop("memory_gib")
    with pytest.raises(PlacementError, match=r"unknown key\(s\) gpu\.memory_gb; gpu takes gpu\.count, "
                                             r"gpu\.memory_gib, gpu\.name"):
        Topology.from_file_dict(d)


def test_every_shipped_file_uses_only_accepted_keys_and_loads() -> None:
    names = [p.name.removesuffix(".json") for p in (resources.files("conduit.placement") / "topologies").iterdir()
             if p.name.endswith(".json")]
    used: set[str] = set()
    for name in names:
        d = _shipped(name)
        used |= set(d)
        assert set(d.get("gpu", {})) <= _FILE_GPU_KEYS
        topo = Topology.from_file_dict(d)
        assert topo.name == name and topo.disk_bytes > 0 and topo.num_gpus > 0
    assert {"nics", "host_link_groups", "source", "notes"} <= used <= _FILE_KEYS


def test_the_simulator_still_reads_the_declared_network_cards() -> None:
    from conduit.simulation.cluster import load_node

    topo = load_node("mi250x-node")
    assert topo.details["nics"]["attached_gpus"] == [0, 2, 4, 6]


# -- ShardServers.torch_group timeout ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_server(cluster: Any) -> Iterator[Any]:
    """One shard server on the head node of the tests' shared cluster (conftest.py)."""
    from conduit.distributed import ShardServers

    servers = ShardServers([cluster.head])
    try:
        yield servers
    finally:
        servers.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timeout", [None, "5", 0, -1.0, float("nan"), float("inf"), True])
def test_a_bad_torch_group_timeout_is_refused_before_a_group_is_formed(one_server: Any, timeout: Any) -> None:
    with pytest.raises(ConfigurationError, match="timeout must be a finite number of seconds > 0, got "):
        one_server.torch_group(timeout=timeout)  # None was a bare TypeError from float(None); "5" was taken
    assert one_server.torch_group(create=False) is None, "a group was formed"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timeout", [None, "5", 0, float("inf"), True])
def test_a_torch_group_built_directly_checks_its_timeout_too(one_server: Any, timeout: Any) -> None:
    """``TorchGroup(servers, timeout=None)`` (the class, not ``torch_group``) raised a bare ``TypeError``."""
    from conduit.distributed.transport import TorchGroup

    with pytest.raises(ConfigurationError, match="timeout must be a finite number of seconds > 0, got "):
        TorchGroup(one_server, timeout=timeout, measure=False)


# -- the conformance suite's draws ------------------------------------------------------------------------------------
class _NoHandles(CoreReplayEndpoint):
    """Broken: its draws carry ids and (prioritized) importance weights, but no handles."""

    def sample(self, n: int) -> Draw:
        d = super().sample(n)
        return Draw(d.ids, None, d.weights)


class _NoHandlesSuite(ReplaySuite):
    def make_replay(self, **kw: Any) -> Any:
        return _NoHandles(**kw)


def test_a_prioritized_draw_without_handles_fails_the_suite_readably() -> None:
    # was: TypeError: 'NoneType' object is not subscriptable, from d.handles[...] inside the check
    with pytest.raises(AssertionError, match=r"importance weights but handles=None: a prioritized draw carries one "
                                             r"handle per item"):
        _NoHandlesSuite().test_update_for_live_handle_drawn_before_an_eviction_is_applied()


def test_a_uniform_draw_may_still_leave_handles_out() -> None:
    ep = _NoHandles(capacity=8, prioritized=False, seed=0)
    try:
        ep.insert(np.arange(8))
        d = draw(ep, 16)
        assert d.handles is None and d.weights is None and len(d.ids) == 16
    finally:
        ep.close()
