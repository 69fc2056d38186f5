"""conduit_rllib.enable: what it wires into a config, and the typed errors for what it cannot serve."""

from __future__ import annotations

import pickle

import conduit_rllib
import pytest
from conduit_rllib import (
    ConduitDQNTorchLearner,
    ConduitOffPolicyLearner,
    ConduitPPOTorchLearner,
    ConduitSACTorchLearner,
    UnsupportedAlgorithmError,
    UnsupportedConfigError,
)
from conduit_rllib.enable import InstallReplayBuffer
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.bc import BCConfig
from ray.rllib.algorithms.cql import CQLConfig
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.algorithms.impala import IMPALAConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.sac import SACConfig


@pytest.mark.parametrize(("make", "learner"), [(DQNConfig, ConduitDQNTorchLearner), (SACConfig, ConduitSACTorchLearner),
                                               (PPOConfig, ConduitPPOTorchLearner)])
def test_enable_returns_the_same_config_wired_for_conduit(make: type, learner: type) -> None:
    config = make().environment("CartPole-v1" if make is not SACConfig else "Pendulum-v1")
    rb_before = dict(getattr(config, "replay_buffer_config", {}) or {})
    assert conduit_rllib.enable(config) is config
    assert config.learner_class is learner and conduit_rllib.is_enabled(config)
    hooks = config.callbacks_on_algorithm_init
    if make is PPOConfig:
        assert config.learner_config_dict["conduit"]["prefetch"] is True
        assert hooks is None
    else:
        assert [type(h) for h in hooks] == [InstallReplayBuffer]
        assert dict(config.replay_buffer_config) == rb_before, "RLlib's replay config must stay as the user set it"
    again = conduit_rllib.enable(config)
    assert again is config and (hooks is None or len(config.callbacks_on_algorithm_init) == 1), "idempotent"
    pickle.loads(pickle.dumps(config.get_state()))  # the wiring travels into checkpoints


def test_user_callbacks_are_kept() -> None:
    def mine(**kwargs: object) -> None:
        pass

    config = DQNConfig().callbacks(on_algorithm_init=mine)
    conduit_rllib.enable(config)
    assert config.callbacks_on_algorithm_init[0] is mine and len(config.callbacks_on_algorithm_init) == 2


@pytest.mark.parametrize("make", [APPOConfig, IMPALAConfig, CQLConfig, BCConfig])
def test_other_algorithms_get_an_error_naming_what_is_supported(make: type) -> None:
    with pytest.raises(UnsupportedAlgorithmError, match="DQN and SAC.*PPO"):
        conduit_rllib.enable(make())


def test_settings_the_adapter_cannot_serve() -> None:
    cases = [
        (DQNConfig().api_stack(enable_rl_module_and_learner=False, enable_env_runner_and_connector_v2=False),
         "new API stack"),
        (DQNConfig().framework("tf2"), "torch"),
        # (a multi-agent config takes RLlib's multi-agent buffer types, a single-agent one the single-agent types)
        (DQNConfig().multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda aid, *a, **k: "a"),
         "multi-agent, but .*single-agent buffer.*'MultiAgentPrioritizedEpisodeReplayBuffer'"),
        (DQNConfig().training(replay_buffer_config={"type": "MultiAgentPrioritizedEpisodeReplayBuffer"}),
         "single-agent, but .*multi-agent buffer.*'PrioritizedEpisodeReplayBuffer'"),
        (DQNConfig().rl_module(model_config={"use_lstm": True}), "Stateful"),
        (DQNConfig().learners(learner_connector=lambda *a: []), "learner connector"),
    ]
    for config, words in cases:
        learner_before = config._learner_class
        with pytest.raises(UnsupportedConfigError, match=words):
            conduit_rllib.enable(config)
        assert config._learner_class is learner_before, "a refused config is left unchanged"
    with pytest.raises(UnsupportedConfigError):
        conduit_rllib.enable({"env": "CartPole-v1"})  # type: ignore[arg-type]


def test_custom_learner_classes_need_the_mixin() -> None:
    class MyLearner(DQNTorchLearner):
        pass

    with pytest.raises(UnsupportedConfigError, match="ConduitOffPolicyLearner"):
        conduit_rllib.enable(DQNConfig().learners(learner_class=MyLearner))

    class MyConduitLearner(ConduitOffPolicyLearner, MyLearner):
        pass

    config = conduit_rllib.enable(DQNConfig().learners(learner_class=MyConduitLearner))
    assert config.learner_class is MyConduitLearner
