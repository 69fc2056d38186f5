"""Session fixtures of the cross-adapter tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_cluster() -> Iterator[None]:
    """The multi-node endpoint (``distributed``) starts one 2-node local Ray cluster on first use;
    it is stopped here, at the end of the session, so nothing outlives the tests."""
    yield
    import sys

    mod = sys.modules.get("conduit.distributed.testing")
    if mod is not None:
        mod.shutdown_shared()
