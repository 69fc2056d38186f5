"""The conformance suites, driving Conduit buffers through SRL's buffer calls (put/get, pickle).

Each suite runs on the defaults (each put stored in ``put``, one entry assembled ahead) and on the overlapped
path (``overlap=True``: a Conduit worker stores the puts and gathers ahead); replay also with everything in the
caller (``prefetch=0``: nothing assembled ahead)."""

from __future__ import annotations

from typing import Any

from conduit.testing import ConcurrencySuite, FreshnessSuite, ReplaySuite
from conduit_srl.testing import SrlOnPolicyEndpoint, SrlReplayEndpoint


class TestSrlReplay(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(**kwargs)


class TestSrlReplayOverlapped(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(overlap=True, **kwargs)


class TestSrlReplayInTheCaller(ReplaySuite):
    """The same buffers with all of Conduit's work in the caller (nothing assembled ahead either)."""

    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(prefetch=0, **kwargs)


class TestSrlFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs: Any) -> SrlOnPolicyEndpoint:
        return SrlOnPolicyEndpoint(**kwargs)


class TestSrlFreshnessOverlapped(FreshnessSuite):
    def make_on_policy(self, **kwargs: Any) -> SrlOnPolicyEndpoint:
        return SrlOnPolicyEndpoint(overlap=True, **kwargs)


class TestSrlConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(**kwargs)


class TestSrlConcurrencyOverlapped(ConcurrencySuite):
    def make_replay(self, **kwargs: Any) -> SrlReplayEndpoint:
        return SrlReplayEndpoint(overlap=True, **kwargs)
