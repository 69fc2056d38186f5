"""``enable(prefetch=...)``: a value that is no bool was turned into one (``prefetch="no"`` is truthy, so it
prefetched), ``prefetch=False`` for DQN/SAC was accepted and silently ignored (it applies to PPO's minibatch
delivery only, as ``scheduler=`` applies to DQN/SAC only and is refused for PPO), and a ``prefetch`` set by hand in
``learner_config_dict["conduit"]`` was wrapped in ``bool()`` by the learner the same way. No Ray cluster."""

from __future__ import annotations

from typing import Any

import conduit_rllib
import gymnasium as gym
import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_rllib import UnsupportedConfigError
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.sac import SACConfig


@pytest.mark.parametrize("prefetch", ["no", 0, None])
def test_a_prefetch_that_is_no_bool_is_refused_and_changes_nothing(prefetch: Any) -> None:
    config = PPOConfig().environment("CartPole-v1")
    learner = config.learner_class
    with pytest.raises(UnsupportedConfigError, match="prefetch"):
        conduit_rllib.enable(config, prefetch=prefetch)
    assert config.learner_class is learner and "conduit" not in config.learner_config_dict


@pytest.mark.parametrize("make", [DQNConfig, SACConfig])
def test_prefetch_false_for_replay_is_refused_not_ignored(make: Any) -> None:
    config = make().environment("CartPole-v1" if make is DQNConfig else "Pendulum-v1")
    learner = config.learner_class
    with pytest.raises(UnsupportedConfigError, match="prefetch= applies to PPO"):
        conduit_rllib.enable(config, prefetch=False)
    assert config.learner_class is learner and not conduit_rllib.is_enabled(config)
    assert conduit_rllib.is_enabled(conduit_rllib.enable(config))  # the default still works


def test_ppo_still_takes_prefetch_false_and_a_hand_set_prefetch_is_checked() -> None:
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1").debugging(seed=0), prefetch=False)
    assert config.learner_config_dict["conduit"]["prefetch"] is False
    config.learners(learner_config_dict={"conduit": {"prefetch": "no"}})
    with pytest.raises(ConfigurationError, match="prefetch"):
        config.build_learner(env=gym.make("CartPole-v1"))


@pytest.mark.parametrize("prefetch", [np.bool_(True), np.bool_(False)])
def test_a_numpy_bool_prefetch_is_taken_as_minibatch_feed_takes_it(prefetch: Any) -> None:
    """``MinibatchFeed(prefetch=)`` takes NumPy bools (``conduit.checks.is_bool``); ``enable`` refused them."""
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1"), prefetch=prefetch)
    assert config.learner_config_dict["conduit"]["prefetch"] is bool(prefetch)
