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
from ray.rllib.connectors.connector_v2 import ConnectorV2


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


# -- a config changed after enable ---------------------------------------------------------------------------------

def _hook(**kwargs: object) -> None:
    pass


def test_is_enabled_says_no_once_callbacks_set_after_enable_replaced_conduits_hook() -> None:
    """RLlib's ``config.callbacks(on_algorithm_init=...)`` replaces the list of callbacks, Conduit's with it: the
    algorithm then trains on RLlib's own buffer (Conduit's learner takes RLlib's episodes as RLlib does), while
    is_enabled kept saying True. Calling enable again after the change wires Conduit back, keeping the user's hook."""
    config = conduit_rllib.enable(DQNConfig().environment("CartPole-v1"))
    config.callbacks(on_algorithm_init=_hook)
    assert not conduit_rllib.is_enabled(config), "Conduit's replay hook is gone: the config is not enabled"
    conduit_rllib.enable(config)
    assert conduit_rllib.is_enabled(config) and config.callbacks_on_algorithm_init[0] is _hook
    ppo = conduit_rllib.enable(PPOConfig().environment("CartPole-v1")).callbacks(on_algorithm_init=_hook)
    assert conduit_rllib.is_enabled(ppo), "PPO needs no hook: its learner class is all of Conduit's wiring"


class _Tap(ConnectorV2):
    def __call__(self, *, rl_module: Any, batch: Any, episodes: Any, **kwargs: Any) -> Any:
        return batch


CHANGED_AFTER_ENABLE = {
    # before: AttributeError ('DQNTorchLearner' object has no attribute 'conduit_attach_replay') at build
    "learner class without the mixin": (lambda c: c.learners(learner_class=DQNTorchLearner), "mixin"),
    # before: built and trained with the user's connector piece silently never called
    "learner connector": (lambda c: c.learners(learner_connector=lambda *a, **k: _Tap()), "learner connector"),
    # before: built, then RLlib's LSTM module failed on Conduit's one-step batch (a torch shape RuntimeError)
    "stateful model": (lambda c: c.rl_module(model_config={"use_lstm": True}), "Stateful"),
}


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("change", list(CHANGED_AFTER_ENABLE))
def test_a_dqn_config_changed_after_enable_into_one_conduit_cannot_serve_is_refused_typed_at_build(
        change: str) -> None:
    """RLlib's config stays mutable after enable: a setting enable refuses, made after it, was served wrong
    (a skipped connector) or failed untyped once the algorithm was built or trained. Conduit's build-time hook
    checks the config again and refuses it typed, saying to make the change before enable or call it again."""
    config = conduit_rllib.enable(
        DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=0, rollout_fragment_length=8)
        .training(train_batch_size=16, num_steps_sampled_before_learning_starts=16,
                  replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 1000})
        .reporting(min_sample_timesteps_per_iteration=32).debugging(seed=0))
    make_change, words = CHANGED_AFTER_ENABLE[change]
    make_change(config)
    with pytest.raises(UnsupportedConfigError, match=f"{words}.*call enable\\(\\) again"):
        config.build_algo()
