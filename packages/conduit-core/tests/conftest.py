"""Fixtures shared by core's multi-node tests (each module connects to a kept cluster of its own job)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A 2-node local Ray cluster on 127.0.0.1 for this module (kept running for the next module: each module's
    connection is a Ray job of its own, and a module that lost one of the two nodes gets a fresh cluster)."""
    from conduit.distributed.testing import kept_cluster

    with kept_cluster(2) as lc:
        yield lc


@pytest.fixture(scope="module")
def servers(cluster: Any) -> Iterator[Any]:
    """One shard server on the head node (the learner's) and one on the worker node."""
    from conduit.distributed import ShardServers

    group = ShardServers([cluster.head, cluster.workers[0]])
    yield group
    group.shutdown()
