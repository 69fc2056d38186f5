"""Episodes evicted from Conduit's replay buffers, next to RLlib's own buffers for the same adds (no Ray).

Reported: ``get_num_episodes_evicted()`` returned 0 whatever was evicted, and ``get_metrics()`` logged no
``num_episodes_evicted`` (RLlib's buffers count every episode they evict, per call and over their lifetime,
and keep the count in their checkpoint state).

Conduit evicts per transition and RLlib whole episodes, so Conduit counts an episode as evicted once its last
stored step is: while the oldest episode Conduit holds is only partly evicted, RLlib (which dropped it whole)
counts it and Conduit does not yet. For the same adds the two counts therefore differ by exactly the episodes
Conduit holds beyond RLlib's (0 or 1), and are equal whenever the eviction falls on an episode boundary.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.testing import id_episode  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from ray.rllib.utils.metrics import NUM_EPISODES_EVICTED, NUM_EPISODES_EVICTED_LIFETIME  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer  # noqa: E402

KINDS = {"uniform": (ConduitEpisodeReplayBuffer, EpisodeReplayBuffer),
         "prioritized": (ConduitPrioritizedEpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer)}


@pytest.fixture(scope="module")
def cartpole_chunks() -> list[list[Any]]:
    """What a DQN EnvRunner hands the buffer: 120 samples of 7 CartPole steps (random actions), each a list of
    episode chunks (an episode spans several samples; a sample may end one episode and begin the next). (840 steps:
    the random episodes' lengths differ from run to run, and a CI run's 420 steps evicted only 8 of RLlib's
    episodes from the capacity of 100, short of the 10 the test asks to be sure it overfilled the buffer.)"""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    config = DQNConfig().environment("CartPole-v1").env_runners(rollout_fragment_length=7).debugging(seed=3)
    runner = SingleAgentEnvRunner(config=config)
    try:
        return [runner.sample(num_timesteps=7, random_actions=True) for _ in range(120)]
    finally:
        runner.stop()


@pytest.mark.parametrize("kind", list(KINDS))
def test_evicted_episodes_of_real_cartpole_chunks_match_rllibs(kind: str, cartpole_chunks: list[list[Any]]) -> None:
    """840 CartPole steps in chunks into a capacity of 100, Conduit's buffer and RLlib's of the same kind: after
    every add, Conduit's evicted count is RLlib's less the episodes Conduit still holds in part. Failed before:
    Conduit's count stayed 0 while RLlib's rose past 10."""
    conduit_cls, rllib_cls = KINDS[kind]
    conduit, native = conduit_cls(capacity=100, seed=0), rllib_cls(capacity=100)
    for chunks in cartpole_chunks:
        conduit.add(chunks)
        native.add(chunks)
        extra = conduit.get_num_episodes() - native.get_num_episodes()  # partly evicted, held by Conduit only
        assert extra in (0, 1), (conduit.get_num_episodes(), native.get_num_episodes())
        expected = native.get_num_episodes_evicted() - extra
        assert conduit.get_num_episodes_evicted() == expected, (
            f"Conduit reports {conduit.get_num_episodes_evicted()} episodes evicted, RLlib "
            f"{native.get_num_episodes_evicted()} (Conduit holding {extra} more in part)")
        # single-agent: every module id reads the one count, as in RLlib
        assert conduit.get_num_episodes_evicted(DEFAULT_MODULE_ID) == expected
    assert native.get_num_episodes_evicted() >= 10, "the chunks did not overfill the buffer: no test"


def _whole(count: int, length: int) -> list[Any]:
    return [id_episode(np.arange(length) + 100 * i, terminated=True) for i in range(count)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_metrics_log_rllibs_evicted_episode_counts(kind: str) -> None:
    """Whole episodes of 10 steps into a capacity of 50 (evictions fall on episode boundaries): each
    ``get_metrics()`` reports RLlib's ``num_episodes_evicted`` and its lifetime total. Failed before: the keys
    were missing."""
    conduit_cls, rllib_cls = KINDS[kind]
    conduit, native = conduit_cls(capacity=50, seed=0), rllib_cls(capacity=50)
    for i, eps in enumerate(_whole(12, 10)):
        conduit.add([eps])
        native.add([eps])
        if i % 3 == 2:  # a get_metrics call every third add: the sums cover the adds since the previous call
            got, want = conduit.get_metrics(), native.get_metrics()
            for key in (NUM_EPISODES_EVICTED, NUM_EPISODES_EVICTED_LIFETIME):
                assert got.get(key) == want[key], f"{key} after add {i}: conduit {got.get(key)}, rllib {want[key]}"
    assert native.get_num_episodes_evicted() == conduit.get_num_episodes_evicted() == 7


@pytest.mark.parametrize("kind", list(KINDS))
def test_evicted_episodes_survive_get_state_set_state(kind: str) -> None:
    """A buffer restored from ``get_state()`` reports the evicted episodes of the saved one and goes on counting
    as it does (RLlib's buffers keep the count in their state too). Its oldest episode is partly evicted when
    saved, so the restored buffer must know which episode its oldest steps belong to."""
    conduit_cls, rllib_cls = KINDS[kind]
    episodes = [id_episode(np.arange(n) + 100 * i, terminated=True) for i, n in enumerate([7, 9, 11, 13, 8, 6] * 3)]
    saved, native = conduit_cls(capacity=40, seed=0), rllib_cls(capacity=40)
    for eps in episodes[:9]:
        saved.add([eps])
        native.add([eps])
    restored = conduit_cls(capacity=40, seed=0)
    restored.set_state(saved.get_state())
    native_restored = rllib_cls(capacity=40)
    native_restored.set_state(native.get_state())
    assert restored.get_num_episodes_evicted() == saved.get_num_episodes_evicted() > 0
    assert native_restored.get_num_episodes_evicted() == native.get_num_episodes_evicted()
    for eps in episodes[9:]:
        for buf in (saved, restored, native_restored):
            buf.add([eps])
        assert restored.get_num_episodes_evicted() == saved.get_num_episodes_evicted()
        extra = restored.get_num_episodes() - native_restored.get_num_episodes()
        assert restored.get_num_episodes_evicted() == native_restored.get_num_episodes_evicted() - extra
    # the restored buffer logs the counts the saved one had not logged yet, as it does for the other counters
    assert restored.get_metrics()[NUM_EPISODES_EVICTED_LIFETIME] == saved.get_num_episodes_evicted()
