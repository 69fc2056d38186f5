"""Conduit's options in ``config.learner_config_dict["conduit"]`` are used or refused, never dropped.

Defects found and fixed: the PPO learner read ``placement`` and ``prefetch`` from there and dropped any other key
silently (a misspelt ``"prefech": False`` went on prefetching); DQN/SAC never read the entry at all, so options a
user put there (e.g. ``{"conduit": {"prefetch": False}}``, which ``enable(prefetch=False)`` refuses for DQN/SAC)
were dropped silently too. Now the PPO learner's build refuses an unknown key, and ``enable`` (and the build of a
DQN/SAC config changed after it) refuses the entry for DQN/SAC, both typed, naming what to do.
"""

from __future__ import annotations

from typing import Any

import conduit_rllib
import pytest
from conduit import ConfigurationError
from conduit_rllib import UnsupportedConfigError
from conduit_rllib.enable import _check_still_served
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.sac import SACConfig
from ray.rllib.utils import force_list


@pytest.mark.usefixtures("ray_local")
def test_a_ppo_learner_refuses_a_conduit_option_it_does_not_take() -> None:
    config: Any = conduit_rllib.enable(
        PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).learners(num_learners=0)
        .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1)
        .rl_module(model_config={"fcnet_hiddens": [8]}).debugging(seed=0, log_level="ERROR"))
    config.learners(learner_config_dict={"conduit": {"prefetch": True, "placement": None, "prefech": False}})
    with pytest.raises(ConfigurationError, match=r"'prefech'.*'placement' and 'prefetch'"):
        config.build_algo()  # was: built, prefetching, the misspelt option never read
    # the options it takes still build
    config.learners(learner_config_dict={"conduit": {"prefetch": False, "placement": None}})
    algo = config.build_algo()
    try:
        feeds = [r.get() for r in algo.learner_group.foreach_learner(lambda learner: learner.conduit_feed.prefetch)]
        assert feeds == [False], "prefetch=False from the config reached the learner's feed"
    finally:
        algo.stop()


@pytest.mark.parametrize("make", [DQNConfig, SACConfig])
def test_dqn_and_sac_refuse_conduits_ppo_options_in_the_learner_config(make: type) -> None:
    config = make().learners(learner_config_dict={"conduit": {"prefetch": False}, "mine": 1})
    with pytest.raises(UnsupportedConfigError, match=r"DQN/SAC do not read it.*enable\(config, placement="):
        conduit_rllib.enable(config)  # was: accepted, the option never read
    assert not conduit_rllib.is_enabled(config) and not force_list(config.callbacks_on_algorithm_init)
    assert config.learner_config_dict == {"conduit": {"prefetch": False}, "mine": 1}, "the config is unchanged"
    # set after enable: the build's check refuses it the same way; the user's own keys stay theirs
    later = conduit_rllib.enable(make().learners(learner_config_dict={"mine": 1}))
    _check_still_served(later)
    later.learners(learner_config_dict={"conduit": {"prefetch": False}})
    with pytest.raises(UnsupportedConfigError, match="DQN/SAC do not read it"):
        _check_still_served(later)
