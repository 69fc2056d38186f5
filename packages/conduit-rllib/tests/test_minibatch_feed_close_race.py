"""A MinibatchFeed iteration racing close() on another thread raises the closed error.

The prefetching iteration submitted the next gather to its worker; a close() on another thread that stopped the
worker just before that submit left the job queued behind the end of the thread: it never ran, and the iteration
waited for it forever at its next step. Each iteration under test runs on its own thread, bounded by a join that
is only reached on a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conduit import ConfigurationError
from conduit.testing.lifecycle import call_bounded
from conduit_rllib import MinibatchFeed
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

BOUND = 60.0  # seconds: reached only on a hang
MODULE = "default_policy"


def feed_with_rollout(lo: int, hi: int, **kwargs: Any) -> MinibatchFeed:
    feed = MinibatchFeed(seed=3, **kwargs)
    put(feed, lo, hi, version=0)
    return feed


def put(feed: MinibatchFeed, lo: int, hi: int, *, version: int) -> None:
    ids = torch.arange(lo, hi)
    feed.set_policy_version(version)
    feed.ingest(MODULE, SampleBatch({Columns.OBS: ids.float()[:, None] * 2.0, Columns.ACTIONS: ids}), version=version)
    feed.seal()


def rows(mab: MultiAgentBatch) -> list[int]:
    return [int(a) for a in mab.policy_batches[MODULE][Columns.ACTIONS].tolist()]


def close_on_another_thread(feed: MinibatchFeed) -> None:
    closer = threading.Thread(target=feed.close, daemon=True)
    closer.start()
    closer.join(BOUND)
    assert not closer.is_alive(), "close() did not return"


def rest_of(it: Iterator[MultiAgentBatch], handed: list[list[int]]) -> None:
    for mab in it:
        handed.append(rows(mab))


def the_feed_goes_on(feed: MinibatchFeed) -> None:
    """After the close, a new rollout is delivered whole, each row once (a new worker and data plane)."""
    feed.configure(num_minibatches=4, num_epochs=1, shuffle=True)  # (accepted: nothing waits after the close)
    put(feed, 100, 124, version=1)
    got = call_bounded(lambda: sorted(r for mab in feed.minibatches() for r in rows(mab)), BOUND)
    assert got == list(range(100, 124))
    feed.close()


def test_a_close_landing_on_the_prefetch_submit_ends_the_iteration_with_the_closed_error() -> None:
    """close() on another thread stops the worker just before the iteration's next prefetch reaches it."""
    feed = feed_with_rollout(0, 40, num_minibatches=4, num_epochs=1, prefetch=True)
    it = feed.minibatches()
    handed = [rows(next(it))]  # minibatch 0 handed over; the gather of minibatch 1 was submitted
    pool = feed._pool
    assert pool is not None
    real_submit = pool.submit
    submits = []

    def close_first(*args: Any) -> Any:
        """The worker's submit, with a close() on another thread landing just before it."""
        submits.append(args)
        close_on_another_thread(feed)
        return real_submit(*args)

    pool.submit = close_first  # type: ignore[method-assign,assignment]
    out = call_bounded(lambda: rest_of(it, handed), BOUND)
    assert len(submits) == 1  # the race was met: the prefetch of minibatch 2 raced the close
    assert isinstance(out, ConfigurationError), out
    assert "closed" in str(out)
    # minibatch 1 (gathered before the close) was handed over whole; nothing after the close
    assert len(handed) == 2 and all(len(h) == 10 for h in handed)
    assert len(set(handed[0]) | set(handed[1])) == 20
    assert feed.dropped_items == 40  # the rollout being delivered was dropped by the close, and counted
    the_feed_goes_on(feed)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("minibatch_size", [None, 15])
def test_a_close_while_the_caller_trains_ends_the_iteration_with_the_closed_error(
        prefetch: bool, minibatch_size: int | None) -> None:
    """close() on another thread between two minibatches: the iteration's next step raises the closed error
    (it used to end silently with prefetch, and to say that no rollout was ever ingested without it)."""
    cuts: dict[str, Any] = ({"num_minibatches": 4} if minibatch_size is None
                            else {"minibatch_size": minibatch_size})
    feed = feed_with_rollout(0, 40, num_epochs=2, prefetch=prefetch, **cuts)
    it = feed.minibatches()
    first = rows(next(it))
    assert len(first) == (10 if minibatch_size is None else 15)
    close_on_another_thread(feed)
    handed: list[list[int]] = []
    out = call_bounded(lambda: rest_of(it, handed), BOUND)
    assert isinstance(out, ConfigurationError), out
    assert "closed" in str(out)
    assert handed == []
    assert feed.dropped_items == 40
    the_feed_goes_on(feed)
