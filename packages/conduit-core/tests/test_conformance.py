"""The conformance suite, proven against conduit-core's own endpoints."""

from __future__ import annotations

from conduit.testing import (
    ConcurrencySuite,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    FreshnessSuite,
    ReplaySuite,
)


class TestCoreReplay(ReplaySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(**kwargs)


class TestCoreFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs):
        return CoreOnPolicyEndpoint(**kwargs)


class TestCoreConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(**kwargs)
