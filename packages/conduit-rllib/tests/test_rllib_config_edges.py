"""Edges between RLlib's configs and Conduit's adapter: algorithms named by string, options RLlib's replay
buffers accept for feed-forward models, chunks over capacity (review round 4, no Ray cluster)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit import CapacityError  # noqa: E402
from conduit_rllib import (  # noqa: E402
    ConduitDQNTorchLearner,
    ConduitEpisodeReplayBuffer,
    ConduitPPOTorchLearner,
    ConduitPrioritizedEpisodeReplayBuffer,
    ConduitSACTorchLearner,
    UnsupportedAlgorithmError,
    UnsupportedConfigError,
    enable,
    is_enabled,
)
from conduit_rllib.testing import id_episode  # noqa: E402
from ray.rllib.algorithms.dqn import DQN, DQNConfig  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.algorithms.sac import SACConfig  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer  # noqa: E402

#: what DQN's training step passes to sample() with burn_in_len=3 and a feed-forward model
DQN_BURN_IN_KW = dict(batch_length_T=0, lookback=0, min_batch_length_T=3, sample_episodes=True)


class _EdgeDQN(DQN):
    """A user's own DQN, registered under a name."""


# -- 1. algo_class given as a registered name ----------------------------------------------------------------
@pytest.mark.parametrize(("make", "name", "learner"), [(DQNConfig, "DQN", ConduitDQNTorchLearner),
                                                        (SACConfig, "SAC", ConduitSACTorchLearner),
                                                        (PPOConfig, "PPO", ConduitPPOTorchLearner)])
def test_algo_class_given_as_rllib_name_is_resolved_like_rllib(make: type, name: str, learner: type) -> None:
    config = make(algo_class=name)
    assert enable(config) is config
    assert config.learner_class is learner and is_enabled(config), (
        f"algo_class={name!r} names RLlib's {name}; enable() must wire it as for the class")


def test_algo_class_given_as_a_registered_user_name_is_resolved() -> None:
    from ray.tune import register_trainable

    register_trainable("ConduitEdgeDQN", _EdgeDQN)
    config = enable(DQNConfig(algo_class="ConduitEdgeDQN"))
    assert config.learner_class is ConduitDQNTorchLearner


def test_an_unregistered_algo_class_name_says_what_to_pass() -> None:
    config = DQNConfig(algo_class="NoSuchAlgorithmRegistered")
    with pytest.raises(UnsupportedAlgorithmError, match=r"not a registered trainable.*register_trainable"):
        enable(config)
    assert not is_enabled(config), "a refused enable() must not wire anything"


def test_a_registered_name_of_an_unsupported_algorithm_names_what_is_supported() -> None:
    with pytest.raises(UnsupportedAlgorithmError, match=r"DQN and SAC.*PPO.*APPO \(registered as 'APPO'\)"):
        enable(DQNConfig(algo_class="APPO"))


# -- 2a. burn_in_len (min_batch_length_T) with a feed-forward model ------------------------------------------
@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_burn_in_with_a_feed_forward_model_is_ignored_with_one_warning(prioritized: bool) -> None:
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buf = cls(capacity=50, seed=3)
    buf.add([id_episode(np.arange(10), terminated=True)])
    with pytest.warns(UserWarning, match="min_batch_length_T=3.*ignored"):
        s = buf.sample(num_items=400, n_step=1, gamma=0.9, beta=0.4, **DQN_BURN_IN_KW)
    drawn = set(s.columns[Columns.OBS][:, 0].long().tolist())
    assert drawn == set(range(10)), f"every stored transition is drawable (Conduit's uniform semantics), got {drawn}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf.sample(num_items=8, n_step=3, gamma=0.9, beta=0.4, **DQN_BURN_IN_KW)  # warned once per buffer


def test_burn_in_draws_what_rllibs_prioritized_buffer_draws() -> None:
    """RLlib's prioritized buffer (DQN's default) ignores min_batch_length_T for one-step transitions too."""
    rllib = PrioritizedEpisodeReplayBuffer(capacity=50)
    ours = ConduitPrioritizedEpisodeReplayBuffer(capacity=50, seed=1)
    rllib.add([id_episode(np.arange(6), episode_id="e", terminated=True)])
    ours.add([id_episode(np.arange(6), episode_id="e", terminated=True)])
    theirs = {int(e.get_observations(0)[0]) for e in rllib.sample(300, n_step=1, beta=0.4, **DQN_BURN_IN_KW)}
    with pytest.warns(UserWarning):
        mine = set(ours.sample(300, n_step=1, beta=0.4, **DQN_BURN_IN_KW).columns[Columns.OBS][:, 0].long().tolist())
    assert mine == theirs == set(range(6)), f"RLlib drew {theirs}, Conduit drew {mine}"


def test_sequences_are_still_refused_clearly() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=50)
    buf.add([id_episode(np.arange(5))])
    with pytest.raises(UnsupportedConfigError, match="feed-forward"):
        buf.sample(num_items=4, n_step=1, **(DQN_BURN_IN_KW | {"batch_length_T": 20}))


# -- 2b. one chunk over capacity ----------------------------------------------------------------------------
@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
@pytest.mark.parametrize("first", [True, False], ids=["first-add", "later-add"])
def test_a_single_chunk_over_capacity_says_what_to_configure_and_stores_nothing(prioritized: bool,
                                                                               first: bool) -> None:
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    buf = cls(capacity=4, seed=0)
    if not first:
        buf.add([id_episode(np.arange(3))])
    with pytest.raises(CapacityError, match=r"episode chunk of 6 steps.*replay_buffer_config\['capacity'\]"):
        buf.add(id_episode(np.arange(100, 106)))
    assert len(buf) == (0 if first else 3) and buf.get_added_timesteps() == (0 if first else 3)
    buf.add([id_episode(np.arange(200, 204))])  # keeps working: FIFO eviction per transition
    assert len(buf) == 4


def test_a_scheduler_for_ppo_is_refused_not_dropped() -> None:
    from conduit import Overlapped

    config = PPOConfig().environment("CartPole-v1")
    with pytest.raises(UnsupportedConfigError, match="DQN/SAC replay only"):
        enable(config, scheduler=Overlapped)
    assert not is_enabled(config), "a refused enable() must not wire anything"
