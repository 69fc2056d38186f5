"""The conformance suite's freshness tests over conduit-verl's verl-facing minibatch delivery."""

from __future__ import annotations

from typing import Any

from conduit.testing import FreshnessSuite
from conduit_verl.testing import VerlOnPolicyEndpoint


class TestVerlFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs: Any) -> VerlOnPolicyEndpoint:
        return VerlOnPolicyEndpoint(**kwargs)
