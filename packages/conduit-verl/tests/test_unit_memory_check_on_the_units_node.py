"""``tq.init`` sizes a field's first pools against the memory of the Ray node each storage unit runs on.

``capacity`` x ``mean_length`` sizes each tensor field's first pool, which every unit allocates in its own process, on
its own node, at the field's first put. The config check compared that pool with the physical memory of the machine
that runs ``tq.init`` (the driver): a pool far beyond a worker node's memory was accepted when the driver's machine was
larger, and only the first put on that node failed, untyped; a small driver machine refused a pool the nodes could
hold. It now compares, node by node, the pools of the units placed there with the memory Ray has on that node.

A local two-node cluster: the head (this process, its machine's memory) and a worker node that declares little memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from conduit import ConfigurationError

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]

#: the small worker node's Ray memory (tasks and actors, plus its object store)
SMALL = (256 << 20) + (80 << 20)


@pytest.fixture(scope="module")
def small_worker() -> Iterator[str]:
    """The head node (as ``ray_local``'s, so the kept cluster is reused) plus a worker node of :data:`SMALL` memory;
    yields the worker's node id."""
    from conduit.distributed.testing import kept_cluster

    with kept_cluster(1, num_cpus=8, object_store_memory=512 << 20, fast_failure_detection=False,
                      runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}}) as lc:
        yield lc.add_node(num_cpus=1, memory=256 << 20, object_store_memory=80 << 20)  # (stopped on exit)


def _units() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("ConduitStorageUnit#")]


def _bootstrap(num_units: int, capacity: int, mean_length: int) -> Any:
    """``bootstrap`` (what ``tq.init`` runs) with this config; the units it started are stopped afterwards."""
    import ray
    from conduit_verl import tq_storage
    from omegaconf import OmegaConf

    conf = OmegaConf.create({"backend": {"storage_backend": "Conduit", "Conduit": {
        "num_units": num_units, "capacity": capacity, "mean_length": mean_length}}})
    try:
        return tq_storage.bootstrap(conf)
    finally:
        for name in _units():
            ray.kill(ray.get_actor(name, namespace=tq_storage.NAMESPACE))
        tq_storage._OWNED_RUNS.clear()


def test_a_pool_beyond_the_units_node_is_refused_though_the_driver_could_hold_it(small_worker: str) -> None:
    """One unit per node, a first pool of 1 GiB: this machine (the driver's) holds it, the worker node does not.
    Before: accepted, and the worker's unit would fail at the field's first put."""
    import ray

    assert os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") > 4 << 30  # (the driver's check passed here)
    assert ray.get_runtime_context().get_node_id() != small_worker
    with pytest.raises(ConfigurationError, match=rf"1 storage unit\(s\) placed on Ray node {small_worker[:12]}.* "
                                                 rf"more than the {SMALL} bytes of memory Ray has on that node"):
        _bootstrap(2, 1024, 1 << 20)
    assert _units() == [], "a unit was started for a refused config"


def test_the_units_sharing_a_node_are_counted_together(small_worker: str) -> None:
    """A first pool of 200 MiB: one unit fits the worker node, two do not (four units over two nodes)."""
    handles = _bootstrap(2, 1024, 200 << 10)  # fits: one unit on each node
    assert len(handles) == 2
    with pytest.raises(ConfigurationError, match=rf"2 storage unit\(s\) placed on Ray node {small_worker[:12]}"):
        _bootstrap(4, 1024, 200 << 10)
    assert _units() == []
