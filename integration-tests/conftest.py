"""Session fixtures of the cross-adapter tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_cluster() -> Iterator[None]:
    """The multi-node endpoint (``distributed``) connects to a 2-node local Ray cluster on first use; its
    servers are stopped and the connection closed here, at the end of each module, so no actor outlives the tests
    that used it (a module run after it in the same process may start Ray itself, e.g. under pytest-xdist)."""
    yield
    import sys

    mod = sys.modules.get("conduit.distributed.testing")
    if mod is not None:
        mod.shutdown_shared()
