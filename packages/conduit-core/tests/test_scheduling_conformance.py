"""The conformance suites over buffers driven by the overlapped scheduler (overlap on and off)."""

from __future__ import annotations

from typing import Any

from conduit.scheduling import Overlapped
from conduit.testing import (
    ConcurrencySuite,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    FreshnessSuite,
    ReplaySuite,
)


class TestOverlappedReplay(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> CoreReplayEndpoint:
        return CoreReplayEndpoint(scheduler=Overlapped(g_ing=2, g_del=2), **kwargs)


class TestSequentialGranularReplay(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> CoreReplayEndpoint:
        return CoreReplayEndpoint(scheduler=Overlapped(g_ing=4, g_del=4, overlap=False), **kwargs)


class TestOverlappedFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs: Any) -> CoreOnPolicyEndpoint:
        return CoreOnPolicyEndpoint(scheduler=Overlapped(g_ing=0.5), **kwargs)


class TestOverlappedConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs: Any) -> CoreReplayEndpoint:
        return CoreReplayEndpoint(scheduler=Overlapped(g_ing=4, g_del=2, queue_depth=16), **kwargs)
