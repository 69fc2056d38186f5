"""The conformance suite: the semantics every Conduit adapter must keep, as tests.

Adapters subclass the suites in a short ``tests/test_conformance.py``::

    from conduit.testing import ReplaySuite

    class TestMyReplay(ReplaySuite):
        def make_replay(self, **kwargs):
            return MyAdapterReplayEndpoint(**kwargs)

Importing this module needs pytest (``pip install 'conduit-core[testing]'``).
"""

import pytest

pytest.register_assert_rewrite("conduit.testing.suites")

from conduit.testing.endpoints import (  # noqa: E402
    CAP_CHECKPOINT,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    Draw,
    EndpointFactory,
    Minibatch,
    OnPolicyEndpoint,
    ReplayEndpoint,
    discover_endpoints,
)
from conduit.testing.reference import CoreOnPolicyEndpoint, CoreReplayEndpoint  # noqa: E402
from conduit.testing.suites.concurrency import ConcurrencySuite  # noqa: E402
from conduit.testing.suites.freshness import FreshnessSuite  # noqa: E402
from conduit.testing.suites.replay import ReplaySuite  # noqa: E402

__all__ = [
    "ReplayEndpoint",
    "OnPolicyEndpoint",
    "Draw",
    "EndpointFactory",
    "discover_endpoints",
    "Minibatch",
    "CAP_PRIORITIZED",
    "CAP_CHECKPOINT",
    "CAP_CONCURRENT_INGEST",
    "ReplaySuite",
    "FreshnessSuite",
    "ConcurrencySuite",
    "CoreReplayEndpoint",
    "CoreOnPolicyEndpoint",
]
