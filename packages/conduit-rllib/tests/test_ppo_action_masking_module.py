"""RLlib's own action-masking module on a Dict observation space ({"action_mask", "observations"}) trains through
Conduit's on-policy feed. Its forward pass inside the learner connector replaces the Dict column by flat 'obs' and
'action_mask' columns, so the train batch reaches the feed flat; a module that leaves the Dict column nested is
delivered it nested (test_ppo_nested_columns.py). Real RLlib, local Ray."""

from __future__ import annotations

from typing import Any

import conduit_rllib
import gymnasium as gym
import numpy as np
import pytest
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.examples.rl_modules.classes.action_masking_rlm import ActionMaskingTorchRLModule

pytestmark = pytest.mark.usefixtures("ray_local")


class MaskedEnv(gym.Env):  # type: ignore[type-arg]
    """Five steps of a Dict observation {"action_mask", "observations"}; both actions allowed."""

    def __init__(self, config: Any = None) -> None:
        self.observation_space = gym.spaces.Dict({"action_mask": gym.spaces.Box(0.0, 1.0, (2,), np.float32),
                                                  "observations": gym.spaces.Box(-1.0, 1.0, (3,), np.float32)})
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def _obs(self) -> dict[str, np.ndarray]:
        return {"action_mask": np.ones(2, np.float32), "observations": np.full(3, self.t / 5, np.float32)}

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[dict[str, np.ndarray], dict]:
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict[str, np.ndarray], float, bool, bool, dict]:
        self.t += 1
        return self._obs(), float(action), self.t >= 5, False, {}


def test_a_dict_observation_module_that_flattens_its_batch_builds_and_trains() -> None:
    config = conduit_rllib.enable(
        PPOConfig().environment(MaskedEnv).rl_module(rl_module_spec=RLModuleSpec(
            module_class=ActionMaskingTorchRLModule)).env_runners(num_env_runners=0)
        .training(train_batch_size=32, minibatch_size=8, num_epochs=1).debugging(seed=0))
    algo = config.build_algo()
    try:
        algo.train()
        learner = algo.learner_group._learner
        assert learner.conduit_version == 1, "the update did not go through Conduit's feed"
    finally:
        algo.stop()
