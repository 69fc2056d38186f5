"""The RLlib replay buffers: a bad add leaves the buffer unchanged, and a state saved before any add
restores an empty buffer."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from conduit import CapacityError, SchemaError
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from ray.rllib.core.columns import Columns
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

SPACE = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
ACTS = gym.spaces.Discrete(1000)


def chunk(episode: str, code: int, t0: int, t1: int, *, terminated: bool = False) -> SingleAgentEpisode:
    """Steps t0..t1-1 of an episode: obs_t = code * 100 + t (both dims), action t, reward t + 1."""
    obs = np.array([[code * 100 + t] * 2 for t in range(t0, t1 + 1)], dtype=np.float32)
    e = SingleAgentEpisode(id_=episode, observations=list(obs), actions=list(range(t0, t1)),
                           rewards=[float(t + 1) for t in range(t0, t1)], terminated=terminated,
                           observation_space=SPACE, action_space=ACTS, t_started=t0, len_lookback_buffer=0)
    return e.to_numpy()


def draw_all(buf: ConduitEpisodeReplayBuffer, n_step: int, gamma: float) -> dict[str, np.ndarray]:
    s = buf.sample(num_items=400, n_step=n_step, gamma=gamma, beta=0.4, **DQN_KW)
    return {k: v.numpy().copy() for k, v in s.columns.items()}


def _bad_obs_episode() -> SingleAgentEpisode:
    return SingleAgentEpisode(id_="bad", observations=[np.zeros(3, np.float32)] * 2, actions=[0], rewards=[0.0],
                              len_lookback_buffer=0)


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_an_add_with_a_bad_chunk_after_good_ones_stores_nothing(prioritized: bool) -> None:
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buf = cls(capacity=100, seed=0)
    buf.add([chunk("A", 1, 0, 3)])
    with pytest.raises(SchemaError):
        buf.add([chunk("B", 2, 0, 3), _bad_obs_episode()])
    assert len(buf) == 3 and buf.get_added_timesteps() == 3, "the good chunk before the bad one was stored"
    assert "B" not in buf._tail
    with pytest.raises(CapacityError):
        buf.add([chunk("C", 3, 0, 2), chunk("D", 4, 0, 101)])
    assert len(buf) == 3
    buf.add([chunk("A", 1, 3, 5, terminated=True)])  # the buffer keeps working, links intact
    c = draw_all(buf, n_step=5, gamma=1.0)
    assert set(c[Columns.OBS][:, 0].tolist()) == {100, 101, 102, 103, 104}
    np.testing.assert_array_equal(c[Columns.NEXT_OBS][:, 0], 105)


def test_an_add_of_differing_chunks_into_an_empty_buffer_stores_nothing() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=100, seed=0)
    with pytest.raises(SchemaError):
        buf.add([chunk("A", 1, 0, 3), _bad_obs_episode()])
    assert len(buf) == 0
    buf.add([_bad_obs_episode()])  # the first real add decides the schema
    assert len(buf) == 1


def test_restoring_a_state_saved_before_any_add_empties_the_buffer() -> None:
    empty_state = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, seed=0).get_state()
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, seed=0)
    buf.add([chunk("A", 1, 0, 3)])
    buf.set_state(empty_state)
    assert len(buf) == 0 and buf.get_num_episodes() == 0, "the checkpoint's (empty) contents were not restored"
    buf.add([chunk("B", 2, 0, 3)])  # raised "written by another producer" before the fix
    s = buf.sample(num_items=50, n_step=1, beta=0.4, **DQN_KW)
    assert set(s.columns[Columns.OBS][:, 0].tolist()) == {200, 201, 202}
