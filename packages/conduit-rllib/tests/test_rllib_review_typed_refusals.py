"""Bad input to the RLlib adapter is refused typed, and changes nothing (no Ray; real buffers and feeds).

Reported in review:

* ``MinibatchFeed.ingest`` with a 0-d column raised a bare ``IndexError`` (rows are counted from a column's first
  dimension), and ``minibatches(env_steps=...)`` took any value (a string, a fraction) for the env steps RLlib sums;
* a replay state whose metric counters were damaged (negative, fractional, bool, text) was restored: ``int()``
  truncated 2.7 and parsed "3", and ``get_metrics`` then reported a negative number of steps added;
* ``update_priorities`` parsed text priorities (``["1", "2"]``) and took bools as 0 and 1, and ``add`` took
  ``weight=True`` as priority 1.0, where every other non-number is a ``PriorityError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, PriorityError, SchemaError
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, MinibatchFeed
from ray.rllib.env.single_agent_episode import SingleAgentEpisode


def episode(n: int, id_: str, done: bool = True) -> SingleAgentEpisode:
    obs = [np.full(2, i, np.float32) for i in range(n + 1)]
    return SingleAgentEpisode(id_=id_, observations=obs, actions=[0] * n, rewards=[float(i) for i in range(n)],
                              terminated=done, len_lookback_buffer=0)


def test_a_feed_refuses_a_zero_d_column_typed_and_ingests_nothing() -> None:
    """Failed before: IndexError (tuple index out of range)."""
    feed = MinibatchFeed(minibatch_size=2, prefetch=False)
    try:
        with pytest.raises(SchemaError, match="'v' is a single value"):
            feed.ingest("m", {"obs": torch.zeros(4, 1), "v": torch.tensor(1.0)}, version=0)
        feed.ingest("m", {"obs": torch.arange(4.0)[:, None]}, version=0)  # the feed goes on as if never called
        feed.seal()
        assert [mb.policy_batches["m"]["obs"][:, 0].tolist() for mb in feed.minibatches()] == [[0, 1], [2, 3]]
    finally:
        feed.close()


def test_a_rollout_whose_column_changed_shape_while_one_waits_is_refused_naming_the_shapes() -> None:
    """The refusal said "columns ['obs'] arrived while one with ['obs'] is waiting" for a column that kept its
    name and changed its row shape: nothing to tell what differed."""
    feed = MinibatchFeed(minibatch_size=2, prefetch=False)
    try:
        feed.ingest("m", {"obs": torch.zeros(4, 3)}, version=0)
        with pytest.raises(SchemaError, match=r"obs=torch.float32\[5\].*obs=torch.float32\[3\]"):
            feed.ingest("m", {"obs": torch.zeros(4, 5)}, version=0)
        feed.seal()  # the waiting rollout is as it was
        assert [tuple(mb.policy_batches["m"]["obs"].shape) for mb in feed.minibatches()] == [(2, 3), (2, 3)]
    finally:
        feed.close()


@pytest.mark.parametrize("env_steps", ["x", 2.5, -1, True])
def test_a_feed_refuses_env_steps_that_are_no_count_and_delivers_nothing(env_steps: Any) -> None:
    """The env steps each minibatch reports (RLlib sums them into num_env_steps_trained). Failed before: taken, the
    minibatches reporting e.g. "x" env steps."""
    feed = MinibatchFeed(minibatch_size=2, prefetch=False)
    try:
        feed.ingest("m", {"obs": torch.arange(4.0)[:, None]}, version=0)
        feed.seal()
        with pytest.raises(ConfigurationError, match="env_steps"):
            feed.minibatches(env_steps=env_steps)
        assert [mb.env_steps() for mb in feed.minibatches(env_steps=np.int64(7))] == [7, 7]  # nothing was taken
    finally:
        feed.close()


@pytest.mark.parametrize("damage", [
    {"unlogged": {"added": -5}}, {"unlogged": {"added": 2.7}}, {"unlogged": {"sampled": "3"}},
    {"unlogged": {"episodes": True}}, {"metrics_calls": -1}, {"metrics_calls": 1.5}, {"logged_iteration": 2.5},
    {"lifetime": {"added": 3, "evicted": 0, "sampled": 0, "episodes": 1, "episodes_evicted": 0}},  # < unlogged
    {"lifetime": {"added": 9.0, "evicted": 0, "sampled": 0, "episodes": 2, "episodes_evicted": 0}},
])
def test_a_replay_state_with_damaged_counters_is_refused_and_changes_nothing(damage: dict[str, Any]) -> None:
    """The counters get_metrics reports from are checked as the rest of the state is. Failed before: restored
    (e.g. num_env_steps_added reported -5, or 2.7 truncated to 2)."""
    saved = ConduitEpisodeReplayBuffer(capacity=20, seed=1)
    saved.add([episode(5, "a"), episode(4, "b")])  # 9 steps added, not logged yet
    state = saved.get_state()
    assert state["unlogged"]["added"] == 9
    buffer = ConduitEpisodeReplayBuffer(capacity=20, seed=1)
    buffer.add(episode(3, "c"))
    with pytest.raises(ConfigurationError, match="damaged"):
        buffer.set_state({**state, **damage})
    assert buffer.check_state(state) is None  # the undamaged state is fine
    assert len(buffer) == 3 and buffer.get_added_timesteps() == 3
    assert buffer.get_metrics()["num_env_steps_added"].peek() == 3


@pytest.mark.parametrize("priorities", [["1", "2", "3"], np.array(["1", "2", "3"]), np.array([True, False, True]),
                                        torch.tensor([True, True, False]), np.array([1.0, "2", 3.0], dtype=object)])
def test_priorities_that_are_text_or_bools_are_refused_and_change_nothing(priorities: Any) -> None:
    """Failed before: text was parsed as numbers and bools taken as 0 and 1 (floored to 1e-12)."""
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=20, seed=1)
    buffer.add(episode(6, "a"))
    buffer.sample(3)
    before = torch.as_tensor(buffer.get_state()["edp"]["semantics"]["sampler"]["leaves"]).clone()
    with pytest.raises(PriorityError, match="real numbers"):
        buffer.update_priorities(priorities)
    assert torch.equal(torch.as_tensor(buffer.get_state()["edp"]["semantics"]["sampler"]["leaves"]), before)
    assert buffer.update_priorities(np.array([1.0, 2.0, 3.0])) == 3  # numbers still update the last sample


@pytest.mark.parametrize("weight", [True, np.bool_(False)])
def test_an_add_weight_that_is_a_bool_is_refused_and_stores_nothing(weight: Any) -> None:
    """Failed before: True was stored as priority 1.0 (False as 0.0)."""
    buffer = ConduitPrioritizedEpisodeReplayBuffer(capacity=20, seed=1)
    with pytest.raises(PriorityError, match="bool"):
        buffer.add(episode(3, "a"), weight=weight)
    assert len(buffer) == 0
    buffer.add(episode(3, "a"), weight=2.0)
    assert len(buffer) == 3
