"""Damaged values in a saved on-policy feed state or replay-buffer state are refused typed, changing nothing.

Reported: ``MinibatchFeed.load_state_dict`` took a negative ``dropped_items`` (a count of rows, reported back by
``feed.dropped_items``), and an RNG state that is no valid generator state escaped as torch's ``TypeError`` or
``RuntimeError`` instead of ``conduit.ConfigurationError``. The replay buffers' ``set_state`` read the next handle
with ``int()``: a fraction was truncated (4.5 loaded as 4), text parsed ("4") and a bool taken as 0 or 1; and
read ``alpha`` with ``float()``, so ``True`` or ``"1.0"`` loaded as 1.0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError
from conduit_rllib import ConduitPrioritizedEpisodeReplayBuffer, MinibatchFeed
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from conduit_rllib.testing import id_episode
from ray.rllib.policy.sample_batch import SampleBatch

ROW = "row"


def rollout(lo: int, hi: int) -> SampleBatch:
    ids = torch.arange(lo, hi)
    return SampleBatch({"obs": ids.float()[:, None], ROW: ids})


def deliver(feed: MinibatchFeed) -> list[list[int]]:
    return [mb.policy_batches["m"][ROW].tolist() for mb in feed.minibatches()]


def _feed() -> MinibatchFeed:
    return MinibatchFeed(minibatch_size=4, num_epochs=2, seed=3, prefetch=False)


def _trained_feed() -> MinibatchFeed:
    """A feed that delivered two rollouts (so its RNG has advanced) and dropped a stale one."""
    feed = _feed()
    for version, (lo, hi) in enumerate(((0, 10), (10, 22))):
        feed.set_policy_version(version)
        feed.ingest("m", rollout(lo, hi), version=version)
        feed.seal()
        deliver(feed)
    feed.ingest("m", rollout(22, 30), version=1)
    feed.seal()
    feed.set_policy_version(2)
    feed.drop_leftovers()  # the stale rollout of version 1: dropped, counted
    assert feed.dropped_items == 8
    return feed


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


DAMAGED_FEED_VALUES = [
    ("dropped_items", -1),
    ("dropped_items", 2.5),
    ("rng", torch.zeros(5056)),  # a float tensor: torch raised TypeError
    ("rng", torch.zeros(3, dtype=torch.uint8)),  # too short: torch raised RuntimeError
    ("rng", torch.zeros(5056, dtype=torch.uint8)),  # the right size, but no valid Mersenne Twister state
    ("rng", "not a tensor"),
    ("policy_version", 2.5),
    ("policy_version", True),
    ("last_sealed", 1.5),
]


@pytest.mark.parametrize(("key", "value"), DAMAGED_FEED_VALUES, ids=[f"{k}={v!r:.20}" for k, v in DAMAGED_FEED_VALUES])
def test_a_damaged_value_in_a_feed_state_is_refused_typed_and_changes_nothing(key: str, value: object) -> None:
    """The feed that refuses the state keeps its own: the same state_dict, and it delivers as its twin does."""
    feed = _trained_feed()
    before = feed.state_dict()
    twin = _feed()
    twin.load_state_dict(before)
    damaged = dict(_trained_feed().state_dict(), **{key: value})
    with pytest.raises(ConfigurationError, match="damaged") as refused:
        feed.load_state_dict(damaged)
    assert "load an undamaged" in str(refused.value), "the error must say what to do"
    with pytest.raises(ConfigurationError, match="damaged"):
        feed.check_state_dict(damaged)
    assert _same_state(feed.state_dict(), before), "a refused state changed the feed"
    assert feed.dropped_items == 8
    for f in (feed, twin):
        f.ingest("m", rollout(100, 111), version=2)
        f.seal()
    assert deliver(feed) == deliver(twin), "the feed no longer delivers as before the refused state"
    feed.close()
    twin.close()


@pytest.mark.parametrize("version", [-1, 0, 7, np.int64(4), torch.tensor(5)])
def test_a_feed_state_loads_every_policy_version_set_policy_version_takes(version: object) -> None:
    """The versions set_policy_version takes (any integer: a learner may go back, core's data plane allows it)
    round-trip through a state as plain ints."""
    feed = _feed()
    feed.set_policy_version(version)  # type: ignore[arg-type]
    restored = _feed()
    restored.load_state_dict(feed.state_dict())
    assert restored.state_dict()["policy_version"] == int(version)  # type: ignore[call-overload]
    assert type(restored.state_dict()["policy_version"]) is int


def _replay_state() -> dict[str, Any]:
    src = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    src.add([id_episode(np.arange(4), episode_id="s")])
    return src.get_state()


DAMAGED_REPLAY_VALUES = [
    ("next", 4.5),  # was truncated to the plane's next, 4
    ("next", 4.0),
    ("next", "4"),
    ("alpha", True),  # was taken as 1.0, the saved alpha
    ("alpha", "1.0"),
]


@pytest.mark.parametrize(("key", "value"), DAMAGED_REPLAY_VALUES, ids=[f"{k}={v!r}" for k, v in DAMAGED_REPLAY_VALUES])
def test_a_damaged_number_in_a_replay_state_is_refused_typed_and_changes_nothing(key: str, value: object) -> None:
    state = _replay_state()
    assert state["next"] == 4 and state["alpha"] == 1.0  # (what the damaged values stand in for)
    state[key] = value
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    buf.add([id_episode(np.arange(10, 15), episode_id="b")])
    twin = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    twin.set_state(buf.get_state())
    with pytest.raises(ConfigurationError, match="damaged"):
        buf.check_state(state)
    with pytest.raises(ConfigurationError, match="damaged"):
        buf.set_state(state)
    assert buf.get_state()["next"] == twin.get_state()["next"] == 5
    x = buf.sample(num_items=16, n_step=1, beta=0.4, **DQN_KW)
    y = twin.sample(num_items=16, n_step=1, beta=0.4, **DQN_KW)
    for k in x.columns:
        assert np.array_equal(x.columns[k].numpy(), y.columns[k].numpy()), f"column {k} differs from the twin"


@pytest.mark.parametrize("nxt", [0.0, 0.7, False])
def test_a_next_handle_that_is_no_int_in_an_empty_replay_state_is_refused(nxt: object) -> None:
    """A buffer that holds nothing saves next 0; 0.7 or False in its place was read as 0."""
    empty = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0).get_state()
    assert empty["next"] == 0
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    with pytest.raises(ConfigurationError, match="damaged"):
        buf.set_state(dict(empty, next=nxt))
