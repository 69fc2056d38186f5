"""PPO on a Dict or Tuple action space with RLlib's stock module: RLlib's own minibatching trains it, but Conduit's
on-policy feed cannot deliver its nested 'actions' column. The refusal comes when the learner (and so the algorithm)
is built, typed and saying what to do, not after a whole iteration's sampling in the first update. Real RLlib PPO
torch learner; the build_algo tests on a local Ray."""

from __future__ import annotations

from typing import Any

import conduit_rllib
import gymnasium as gym
import numpy as np
import pytest
from conduit_rllib import UnsupportedConfigError
from ray.rllib.algorithms.ppo import PPOConfig


class NestedActionEnv(gym.Env):  # type: ignore[type-arg]
    """Ten steps of a 3-float observation; the action space is a Dict (or, with ``{"kind": "tuple"}``, a Tuple) of
    a Discrete(3) and a 2-float Box."""

    def __init__(self, config: Any = None) -> None:
        parts = (gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
        kind = (config or {}).get("kind", "dict")
        self.action_space = (gym.spaces.Dict({"move": parts[0], "force": parts[1]}) if kind == "dict"
                             else gym.spaces.Tuple(parts))
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        assert self.action_space.contains(action), action
        self.t += 1
        return np.full(3, self.t / 10, np.float32), 1.0, self.t >= 10, False, {}


def _config(kind: str) -> PPOConfig:
    return (PPOConfig().environment(NestedActionEnv, env_config={"kind": kind})
            .env_runners(num_env_runners=0).training(train_batch_size=40, minibatch_size=20, num_epochs=1))


@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_the_stock_module_on_a_nested_action_space_is_refused_when_the_learner_is_built(kind: str) -> None:
    """Before: the learner built; the first update refused the train batch's nested 'actions' column."""
    config = conduit_rllib.enable(_config(kind))
    with pytest.raises(UnsupportedConfigError, match=rf"(?s)'default_policy'.*nested action space.*{kind.title()}.*"
                                                     r"Box, Discrete or MultiDiscrete.*without conduit_rllib.enable"):
        config.build_learner(env=NestedActionEnv({"kind": kind}))


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", ["dict", "tuple"])
def test_build_algo_refuses_it_and_rllib_alone_trains_it(kind: str) -> None:
    """Before: ``build_algo`` returned an algorithm whose first ``train()`` sampled a whole iteration and then
    raised. RLlib without ``enable`` trains the same config (what the refusal offers as the way on)."""
    with pytest.raises(UnsupportedConfigError, match=r"nested action space"):
        conduit_rllib.enable(_config(kind)).build_algo()
    algo = _config(kind).build_algo()
    try:
        assert algo.train()["learners"]["default_policy"]["num_module_steps_trained"] > 0
    finally:
        algo.stop()
