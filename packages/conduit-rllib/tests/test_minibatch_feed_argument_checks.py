"""``MinibatchFeed``'s own arguments (no Ray, no RLlib learner): ``configure`` rounded what the constructor refuses
(``num_epochs=2.5`` silently became 2 epochs, ``shuffle="no"`` shuffled) and failed untyped on a string count; the
constructor took a negative, fractional or string ``capacity``, a string ``prefetch`` and a non-Placement
``placement`` without a word (the last only failing at the first ingest)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_rllib import MinibatchFeed


def rows_per_minibatch(feed: MinibatchFeed, n: int = 12) -> list[int]:
    feed.ingest("m", {"obs": np.arange(n, dtype=np.float32)[:, None]}, version=0)
    feed.seal()
    return [len(mab.policy_batches["m"]) for mab in feed.minibatches()]


@pytest.mark.parametrize("bad", [
    dict(num_epochs=2.5), dict(num_epochs="2"), dict(num_minibatches=2.5), dict(num_minibatches="x"),
    dict(shuffle="no"), dict(num_epochs=True),
])
def test_configure_refuses_what_the_constructor_refuses_and_changes_nothing(bad: dict[str, Any]) -> None:
    feed = MinibatchFeed(num_minibatches=3, num_epochs=1, prefetch=False)
    args: dict[str, Any] = dict(num_minibatches=2, num_epochs=2, shuffle=True)
    with pytest.raises(ConfigurationError):
        feed.configure(**{**args, **bad})
    with pytest.raises(ConfigurationError):  # the same values at construction
        MinibatchFeed(**{**args, **bad})
    try:
        assert rows_per_minibatch(feed) == [4, 4, 4], "a refused configure changed the minibatching"
    finally:
        feed.close()


def test_configure_still_takes_numpy_counts() -> None:
    feed = MinibatchFeed(prefetch=False)
    try:
        counts: dict[str, Any] = dict(num_minibatches=np.int64(2), num_epochs=np.int64(2), shuffle=np.bool_(False))
        feed.configure(**counts)
        assert rows_per_minibatch(feed) == [6, 6, 6, 6]
    finally:
        feed.close()


@pytest.mark.parametrize("bad", [
    dict(capacity=-5), dict(capacity=2.7), dict(capacity="abc"), dict(capacity=None), dict(capacity=True),
    dict(prefetch="no"), dict(prefetch=None), dict(placement="cuda"),
])
def test_the_constructor_refuses_bad_arguments_typed(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(bad))):
        MinibatchFeed(**bad)
