"""The conformance suite: the semantics every Conduit adapter must keep, as tests.

Adapters subclass the suites in a short ``tests/test_conformance.py``::

    from conduit.testing import ReplaySuite

    class TestMyReplay(ReplaySuite):
        def make_replay(self, **kwargs):
            return MyAdapterReplayEndpoint(**kwargs)

The suites' determinism tests compare draws made inside one process. ``integration-tests/`` also makes
those calls in fresh processes with other ``PYTHONHASHSEED`` values, for every registered adapter
(:func:`assert_deterministic_across_processes`, :mod:`conduit.testing.crossprocess`), so a seed or an order
taken from ``hash()`` of a string is caught; an adapter's own tests can call it with the adapter's name.

Importing this module needs pytest (``pip install 'conduit-core[testing]'``).
"""

import pytest

pytest.register_assert_rewrite("conduit.testing.suites", "conduit.testing.crossprocess")

from conduit.testing.crossprocess import (  # noqa: E402
    ProcessDraws,
    assert_deterministic_across_processes,
    draws_in_subprocess,
)
from conduit.testing.endpoints import (  # noqa: E402
    CAP_CHECKPOINT,
    CAP_CHECKPOINT_BETWEEN_ROLLOUTS,
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
    "CAP_CHECKPOINT_BETWEEN_ROLLOUTS",
    "CAP_CONCURRENT_INGEST",
    "ReplaySuite",
    "FreshnessSuite",
    "ConcurrencySuite",
    "CoreReplayEndpoint",
    "CoreOnPolicyEndpoint",
    "draws_in_subprocess",
    "assert_deterministic_across_processes",
    "ProcessDraws",
]
