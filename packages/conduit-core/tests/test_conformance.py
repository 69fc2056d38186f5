"""The conformance suite, proven against conduit-core's own endpoints."""

from __future__ import annotations

import pytest
from conduit.semantics import sumtree
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


class TestCoreReplayOnNumPyTrees(ReplaySuite):
    """The replay suite where prioritized replay runs on NumPy's sum tree, as in an install without the compiled
    kernels (the sampler's general draw and update paths, which the compiled tree mostly bypasses)."""

    @pytest.fixture(autouse=True)
    def _numpy_trees(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(sumtree, "COMPILED", False)

    def make_replay(self, **kwargs):
        endpoint = CoreReplayEndpoint(**kwargs)
        tree = getattr(endpoint.edp.semantics.sampler, "_tree", None)
        assert tree is None or type(tree) is sumtree.SumTree, type(tree)
        return endpoint


class TestCoreFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs):
        return CoreOnPolicyEndpoint(**kwargs)


class TestCoreConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(**kwargs)
