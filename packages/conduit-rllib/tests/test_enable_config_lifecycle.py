"""``conduit_rllib.enable`` as a demanding RLlib user meets it: configs RLlib accepts whose own learner class
enable must not drop, combinations certain to fail refused early and typed, and a config changed after enable."""

from __future__ import annotations

from typing import Any

import conduit_rllib
import pytest
from conduit_rllib import ConduitOffPolicyLearner, ConduitOnPolicyLearner, UnsupportedConfigError
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner


class MyPPOLearner(PPOTorchLearner):
    """A user's PPO learner (e.g. its own loss)."""


class MyConduitPPOLearner(ConduitOnPolicyLearner, MyPPOLearner):
    pass


class MyDQNLearner(DQNTorchLearner):
    """A user's DQN learner."""


class MyPPOConfig(PPOConfig):
    """A user's PPO config whose algorithm trains with its own learner by default (RLlib's documented way)."""

    learner: type = MyPPOLearner

    def get_default_learner_class(self) -> Any:
        return self.learner


class MyDQNConfig(DQNConfig):
    def get_default_learner_class(self) -> Any:
        return MyDQNLearner


# -- a config subclass whose default learner is its own -----------------------------------------------------------

@pytest.mark.parametrize(("make", "mixin"), [(MyPPOConfig, "ConduitOnPolicyLearner"),
                                              (MyDQNConfig, "ConduitOffPolicyLearner")], ids=["ppo", "dqn"])
def test_a_configs_own_default_learner_is_not_silently_replaced(make: Any, mixin: str) -> None:
    """A config subclass whose ``get_default_learner_class`` returns the user's learner (``config.learner_class``
    is that learner) had it replaced by Conduit's copy of RLlib's stock learner: the user's loss silently gone.
    It is refused like an explicit ``learner_class`` without the mixin, and the config is left alone."""
    config = make().environment("CartPole-v1")
    assert config.learner_class in (MyPPOLearner, MyDQNLearner)
    with pytest.raises(UnsupportedConfigError, match=mixin):
        conduit_rllib.enable(config)
    assert config._learner_class is None and not config.callbacks_on_algorithm_init, "the refused call changed it"
    assert config.learner_class in (MyPPOLearner, MyDQNLearner)


def test_a_configs_own_default_learner_with_the_mixin_is_kept() -> None:
    config = MyPPOConfig().environment("CartPole-v1")
    config.learner = MyConduitPPOLearner
    conduit_rllib.enable(config)
    assert config.learner_class is MyConduitPPOLearner and conduit_rllib.is_enabled(config)


def test_rllibs_stock_learner_given_explicitly_is_still_replaced() -> None:
    config = conduit_rllib.enable(DQNConfig().learners(learner_class=DQNTorchLearner))
    assert issubclass(config.learner_class, ConduitOffPolicyLearner)


# -- PPO on several learners without a minibatch_size -------------------------------------------------------------

@pytest.mark.parametrize("minibatch_size", [None, 0])
def test_ppo_on_several_learners_without_a_minibatch_size_is_refused_typed_naming_the_fix(
        minibatch_size: int | None) -> None:
    """RLlib's LearnerGroup computes the learners' common count of minibatches from ``minibatch_size`` whenever it
    shards episodes among two or more learners (``int(epochs * steps / (learners * minibatch_size))``), so every
    PPO training step ends in a TypeError (None) or ZeroDivisionError (0) there, with or without Conduit, after the
    whole build and a first rollout. enable accepted the config, and the README promised PPO on any num_learners
    and RLlib's cuts without a minibatch_size."""
    config = PPOConfig().environment("CartPole-v1").learners(num_learners=2).training(minibatch_size=minibatch_size)
    with pytest.raises(UnsupportedConfigError, match=r"minibatch_size.*num_learners"):
        conduit_rllib.enable(config)
    assert config._learner_class is None and "conduit" not in config.learner_config_dict, "the refused call changed it"
    # what RLlib itself serves stays accepted: one learner (remote or local) without a minibatch_size, or a size
    for ok in (PPOConfig().learners(num_learners=1).training(minibatch_size=None),
               PPOConfig().training(minibatch_size=None),
               PPOConfig().learners(num_learners=2).training(minibatch_size=64)):
        assert conduit_rllib.is_enabled(conduit_rllib.enable(ok))
