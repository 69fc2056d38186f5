"""DQN/SAC with a stateful RLModule given as a module class (which ``enable`` cannot see in ``model_config``):
Conduit's off-policy learner refuses it when the algorithm is built, typed and saying what to use, as PPO's
learner does. Before, ``build_algo`` took it; with a ``max_seq_len`` in the config's ``model_config`` RLlib's
training step then asked Conduit's buffer for sequences in the first sample (refused there, after the warm-up
sampling), and without one the module trained on one-step batches with no state at all. Real RLlib, local Ray."""

from __future__ import annotations

import threading
from typing import Any

import conduit_rllib
import pytest
import torch
from conduit_rllib import UnsupportedConfigError
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.dqn.torch.default_dqn_torch_rl_module import DefaultDQNTorchRLModule
from ray.rllib.algorithms.sac import SACConfig
from ray.rllib.algorithms.sac.torch.default_sac_torch_rl_module import DefaultSACTorchRLModule
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

pytestmark = pytest.mark.usefixtures("ray_local")


class StatefulDQNModule(DefaultDQNTorchRLModule):
    """RLlib's DQN module with an initial state: stateful in RLlib's sense (``is_stateful()``)."""

    def get_initial_state(self) -> Any:
        return {"h": torch.zeros(4)}


class StatefulSACModule(DefaultSACTorchRLModule):
    def get_initial_state(self) -> Any:
        return {"h": torch.zeros(4)}


def _config(algo: str, model_config: dict[str, Any]) -> Any:
    make, env, module = ((DQNConfig, "CartPole-v1", StatefulDQNModule) if algo == "dqn"
                         else (SACConfig, "Pendulum-v1", StatefulSACModule))
    return conduit_rllib.enable(
        make().environment(env).rl_module(rl_module_spec=RLModuleSpec(module_class=module), model_config=model_config)
        .env_runners(num_env_runners=0, rollout_fragment_length=8)
        .training(train_batch_size=16, num_steps_sampled_before_learning_starts=16)
        .reporting(min_sample_timesteps_per_iteration=32).debugging(seed=0))


def _conduit_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("conduit") and t.is_alive()}


@pytest.mark.parametrize(("algo", "model_config"), [("dqn", {"max_seq_len": 4}), ("sac", {"max_seq_len": 4}),
                                                    ("dqn", {})], ids=["dqn-seq", "sac-seq", "dqn-no-seq-len"])
def test_a_stateful_module_class_is_refused_when_the_algorithm_is_built(algo: str,
                                                                         model_config: dict[str, Any]) -> None:
    """Before: build_algo took it (failing-before: DID NOT RAISE)."""
    config = _config(algo, model_config)
    before = _conduit_threads()
    with pytest.raises(UnsupportedConfigError, match=r"(?s)'default_policy'.*Stateful.*stateful.*one-step.*"
                                                     r"feed-forward.*without conduit_rllib.enable"):
        config.build_algo()
    assert not _conduit_threads() - before, "the refused build left Conduit threads running"
    assert not config._is_frozen, "the refused build froze the user's config"


def test_a_remote_learner_refuses_it_typed_too(ray_local: None) -> None:
    """With ``num_learners=1`` the learner is built in its own actor: the refusal reaches ``build_algo``'s caller
    as the same type, with the same message."""
    config = _config("dqn", {"max_seq_len": 4}).learners(num_learners=1)
    with pytest.raises(UnsupportedConfigError, match=r"(?s)stateful.*one-step.*feed-forward"):
        config.build_algo()
