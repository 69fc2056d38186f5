"""Shared fixtures: a local Ray per test module (started here, shut down after), CPU only."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """A fresh local Ray instance for the module (never an existing cluster on the machine)."""
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()
