"""The conformance suites over buffers driven by the overlapped scheduler (overlap on and off)."""

from __future__ import annotations

from typing import Any

import pytest
from conduit.errors import ConduitError
from conduit.scheduling import Automatic, Overlapped, Scheduler
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


class TestAutomaticReplay(ReplaySuite):
    def make_replay(self, **kwargs: Any) -> CoreReplayEndpoint:
        return CoreReplayEndpoint(scheduler=Automatic(g_ing_max=2, g_del_max=2, confirm_deliveries=3), **kwargs)


class TestAutomaticFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs: Any) -> CoreOnPolicyEndpoint:
        return CoreOnPolicyEndpoint(scheduler=Automatic(confirm_deliveries=2), **kwargs)


class TestOverlappedConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs: Any) -> CoreReplayEndpoint:
        return CoreReplayEndpoint(scheduler=Overlapped(g_ing=4, g_del=2, queue_depth=16), **kwargs)


# -- the prefetch checks can fail: a scheduler that prefetches naively is caught ------------------------------------
class _NaivePrefetch(Scheduler):
    """Draws (replay) or consumes (on-policy) the next batch ahead with a real selection and keeps it,
    whatever happens in between: no staleness bound, no version check. It declares no staleness."""

    output_depth = 2

    def attach(self, edp: Any) -> None:
        super().attach(edp)
        self.ahead: list[tuple[Any, Any]] = []

    def ingest(self, batch: Any, *, version: Any, priorities: Any) -> Any:
        return self.edp.ingest_now(batch, version=version, priorities=priorities)

    def deliver(self, n: Any, **kwargs: Any) -> Any:
        out = self.ahead.pop(0) if self.ahead else self._draw(n, kwargs)
        while len(self.ahead) < 2:
            try:
                self.ahead.append(self._draw(n, kwargs))
            except ConduitError:
                break
        return out

    def _draw(self, n: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
        batch, info = self.edp.deliver_now(n, **kwargs)
        return batch.clone(), info


def test_priority_staleness_check_catches_an_undeclared_prefetch() -> None:
    class Suite(ReplaySuite):
        def make_replay(self, **kwargs: Any) -> CoreReplayEndpoint:
            return CoreReplayEndpoint(scheduler=_NaivePrefetch(), **kwargs)

    with pytest.raises(AssertionError, match="old priorities"):
        Suite().test_prefetched_priorities_at_most_declared_staleness()


def test_version_check_catches_a_prefetch_across_rollouts() -> None:
    class Suite(FreshnessSuite):
        def make_on_policy(self, **kwargs: Any) -> CoreOnPolicyEndpoint:
            return CoreOnPolicyEndpoint(scheduler=_NaivePrefetch(), **kwargs)

    with pytest.raises((AssertionError, pytest.fail.Exception)):
        Suite().test_prefetch_never_crosses_a_policy_version()
