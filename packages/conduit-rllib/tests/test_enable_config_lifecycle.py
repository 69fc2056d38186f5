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

