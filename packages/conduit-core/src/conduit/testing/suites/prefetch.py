"""What prefetching may and may not change: bounded priority staleness, no crossing of policy versions.

These checks are mixed into :class:`~conduit.testing.ReplaySuite` and
:class:`~conduit.testing.FreshnessSuite`, so every adapter runs them whether or not it
prefetches: a synchronous adapter passes them trivially (staleness 0), a prefetching one
passes only if its scheduler keeps the bounds it declares.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest

from conduit.errors import EmptyBufferError, StaleExperienceError
from conduit.testing.endpoints import CAP_PRIORITIZED, OnPolicyEndpoint, ReplayEndpoint
from conduit.testing.suites.base import draw, needs, staleness

__all__ = ["PrefetchReplayChecks", "PrefetchFreshnessChecks", "expect_stale"]


def expect_stale(ep: OnPolicyEndpoint, what: str) -> None:
    """``ep.consume()`` raises :class:`~conduit.StaleExperienceError` for ``what``; anything else fails, saying
    what came instead (another error, or minibatches)."""
    try:
        got = ep.consume()
    except StaleExperienceError:
        return
    except Exception as e:  # noqa: BLE001 - reported as the failure
        raise AssertionError(f"delivering {what} raised {type(e).__name__} ({e}), expected StaleExperienceError "
                             f"(a stale rollout is not an empty buffer: raise conduit.StaleExperienceError)") from e
    pytest.fail(f"delivering {what} returned {len(got)} minibatches of versions {sorted({m.version for m in got})} "
                f"instead of raising StaleExperienceError")


class PrefetchReplayChecks:
    """Prioritized replay: a draw precedes at most ``priority_staleness`` priority updates."""

    def replay(self, **kwargs: Any) -> AbstractContextManager[ReplayEndpoint]:
        raise NotImplementedError  # provided by ReplaySuite

    def test_prefetched_priorities_at_most_declared_staleness(self) -> None:
        """A draw delivered after k > ``priority_staleness`` priority updates reflects the first of them.

        A learner alternates draw and update. After the update that gives item 0 nearly all
        the priority mass, draw i follows i updates; an endpoint that declares staleness g
        (its prefetch depth g_del) may deliver draws 1..g from before that update, never
        draw g+1 or later. Their importance weights must match the new priorities too.

        Troubleshooting: count ``update_priorities`` calls since each prepared batch was
        drawn and discard it past the bound; declare the bound in ``priority_staleness``.
        """
        n, size, alpha, beta = 8, 256, 1.0, 0.4
        with self.replay(capacity=n, prioritized=True, alpha=alpha, beta=beta, seed=11) as ep:
            needs(ep, CAP_PRIORITIZED)
            k = staleness(ep)
            ep.insert(np.arange(n))
            flat = np.ones(n)
            for _ in range(k + 2):  # steady state: prefetch (if any) is running
                d = draw(ep, size)
                ep.update_priorities(d.handles, flat[d.ids])
            d = draw(ep, size)
            assert sorted(set(d.ids.tolist())) == list(range(n)), "every item should appear in 256 draws of 8"
            skewed = np.full(n, 1e-6)
            skewed[0] = 1e6
            ep.update_priorities(d.handles, skewed[d.ids])
            draws = []
            for _ in range(k + 3):
                d = draw(ep, size)
                draws.append(d)
                ep.update_priorities(d.handles, skewed[d.ids])
            probs = skewed ** alpha / (skewed ** alpha).sum()
            for i, d in enumerate(draws[k:], start=k + 1):
                share = float((d.ids == 0).mean())
                assert share > 0.99, (
                    f"draw {i} after the update (declared priority_staleness={k}) still follows the old "
                    f"priorities: item 0 is {share:.0%} of it, expected ~100%")
                assert d.weights is not None, f"draw {i}: a prioritized endpoint returned no importance weights"
                expected = (n * probs[d.ids]) ** (-beta) / (n * probs.min()) ** (-beta)
                np.testing.assert_allclose(d.weights, expected, rtol=1e-3,
                                           err_msg=f"draw {i}: importance weights do not follow the new priorities")


class PrefetchFreshnessChecks:
    """On-policy: whatever was prepared ahead, delivery checks the policy version at delivery time."""

    def on_policy(self, **kwargs: Any) -> AbstractContextManager[OnPolicyEndpoint]:
        raise NotImplementedError  # provided by FreshnessSuite

    @staticmethod
    def _epochs(mbs: Iterator[Any] | list[Any], epochs: int) -> list[list[int]]:
        mbs = list(mbs)
        return [sorted(np.concatenate([m.ids for m in mbs if m.epoch == e] or [np.zeros(0, np.int64)]).tolist())
                for e in range(epochs)]

    def test_prefetch_never_crosses_a_policy_version(self) -> None:
        """A rollout that turned stale while the previous one was delivered is dropped (or raises), never served.

        Two rollouts of version 0 are waiting; the first is consumed, then the policy moves
        to version 1 (max_staleness=0). A prefetcher that prepared the second rollout's
        first minibatch during the first rollout must not deliver it: with
        ``on_stale="drop"`` nothing is left to deliver, with ``"raise"`` the delivery raises
        and the rollout stays intact until the version allows it again.

        Troubleshooting: never prefetch past the current rollout, or re-check staleness
        when handing a prepared minibatch over.
        """
        for on_stale in ("drop", "raise"):
            with self.on_policy(num_minibatches=3, num_epochs=2, max_staleness=0, on_stale=on_stale, seed=3) as ep:
                ep.ingest(np.arange(24), version=0)
                ep.end_rollout()
                ep.ingest(np.arange(100, 124), version=0)
                ep.end_rollout()
                first = ep.consume()
                assert self._epochs(first, 2) == [list(range(24))] * 2, "the first rollout was not delivered whole"
                ep.set_policy_version(1)
                if on_stale == "drop":
                    with pytest.raises(EmptyBufferError):
                        got = ep.consume()
                        pytest.fail(f"a stale rollout was delivered after the policy moved on: "
                                    f"{[(m.version, m.ids.tolist()) for m in got][:2]}")
                    continue
                expect_stale(ep, "the second rollout of version 0, after the policy moved to version 1 "
                                 "(max_staleness=0, on_stale='raise')")
                ep.set_policy_version(0)
                try:
                    second = ep.consume()
                except EmptyBufferError:
                    second = []
                assert self._epochs(second, 2) == [list(range(100, 124))] * 2, (
                    "the stale rollout was changed by the failed delivery")
