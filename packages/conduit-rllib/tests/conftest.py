"""Shared fixtures: a local Ray per test module (a job on a node kept running between modules), CPU only."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A local one-node Ray (2 CPUs) for the module, never an existing cluster on the machine: the node is kept
    running for the next module (``kept_cluster``), each module a Ray job of its own."""
    import torch
    from conduit.distributed.testing import kept_cluster

    torch.set_num_threads(1)
    with kept_cluster(1, num_cpus=2, object_store_memory=512 << 20, fast_failure_detection=False,
                      logging_level="ERROR"):
        yield


@pytest.fixture(scope="module")
def conduit_variant(ray_local: None) -> Iterator[Any]:
    """A Conduit DQN variant (large observations, 16 envs steps of 40, a buffer of 500) that ran one iteration:
    the buffer is filled and learning has started. Closed after the module."""
    from conduit_rllib.compare import Variant
    from conduit_rllib.workloads import dqn_large_obs

    v = Variant("conduit", dqn_large_obs(16, steps=40, learning_starts=20, capacity=500))
    try:
        v.iteration()
        yield v
    finally:
        v.close()
