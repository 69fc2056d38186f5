"""A stateful RLModule given as a module class (RLlib's LSTM example module), which ``enable`` cannot see in
``model_config``: Conduit's PPO learner refuses it when it is built, typed and saying what to use, instead of
letting the algorithm sample a whole iteration and fail in its first update. Real PPO torch learner, no Ray."""

from __future__ import annotations

import conduit_rllib
import gymnasium as gym
import pytest
from conduit_rllib import UnsupportedConfigError
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.examples.rl_modules.classes.lstm_containing_rlm import LSTMContainingRLModule


def test_a_stateful_module_class_is_refused_when_the_learner_is_built() -> None:
    """Before: enable() and the learner's build took it; the first update (after a whole iteration's sampling)
    raised 'stateful (RNN) modules with time-padded batches are not supported', naming no alternative."""
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1").rl_module(rl_module_spec=RLModuleSpec(
        module_class=LSTMContainingRLModule, model_config={"lstm_cell_size": 8, "dense_layers": [8],
                                                           "max_seq_len": 4})))
    with pytest.raises(UnsupportedConfigError, match=r"(?s)'default_policy'.*stateful.*feed-forward.*without "
                                                     r"conduit_rllib.enable"):
        config.build_learner(env=gym.make("CartPole-v1"))


def test_a_feed_forward_module_class_is_still_built() -> None:
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1"))
    learner = config.build_learner(env=gym.make("CartPole-v1"))
    learner.conduit_feed.close()
