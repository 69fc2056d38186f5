"""The conformance suites, through RLlib's buffer interfaces (single- and multi-agent) and the PPO learner's minibatch
feed."""

from __future__ import annotations

from typing import Any

from conduit.testing import ConcurrencySuite, FreshnessSuite, ReplaySuite
from conduit_rllib.testing import RLlibMultiAgentReplayEndpoint, RLlibOnPolicyEndpoint, RLlibReplayEndpoint


class TestRLlibReplay(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> RLlibReplayEndpoint:
        return RLlibReplayEndpoint(**kwargs)


class TestRLlibConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs: Any) -> RLlibReplayEndpoint:
        return RLlibReplayEndpoint(**kwargs)


class TestRLlibMultiAgentReplay(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> RLlibMultiAgentReplayEndpoint:
        return RLlibMultiAgentReplayEndpoint(**kwargs)


class TestRLlibMultiAgentConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs: Any) -> RLlibMultiAgentReplayEndpoint:
        return RLlibMultiAgentReplayEndpoint(**kwargs)


class TestRLlibFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs: Any) -> RLlibOnPolicyEndpoint:
        return RLlibOnPolicyEndpoint(**kwargs)
