"""The conformance suites, driving Conduit buffers through SRL's buffer calls (put/get, pickle)."""

from __future__ import annotations

from typing import Any

from conduit.testing import ConcurrencySuite, FreshnessSuite, ReplaySuite
from conduit_srl.testing import SrlOnPolicyEndpoint, SrlReplayEndpoint


class TestSrlReplay(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(**kwargs)


class TestSrlReplayInTheCaller(ReplaySuite):
    """The same buffers with Conduit's work in the caller (overlap off, nothing assembled ahead)."""

    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(overlap=False, prefetch=0, **kwargs)


class TestSrlFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs: Any) -> SrlOnPolicyEndpoint:
        return SrlOnPolicyEndpoint(**kwargs)


class TestSrlConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(**kwargs)
