"""PPO on a Dict or Tuple action space through Conduit: the train batch's 'actions' column is a dict/tuple of arrays.
Conduit stores each array as its own field and hands RLlib's update loop the column rebuilt as it came, so the
minibatches are RLlib's row for row and an update leaves the same weights as RLlib's own minibatching. Before, the
stock PPO module on such a space was refused when the learner was built. Real RLlib PPO torch learners; the
whole-algorithm test on a local Ray."""

from __future__ import annotations

from typing import Any

import conduit_rllib
import gymnasium as gym
import numpy as np
import pytest
import torch
from conduit_rllib.learner import ConduitPPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

KINDS = ["dict", "tuple"]


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
        move = action["move"] if isinstance(action, dict) else action[0]
        return np.full(3, self.t / 10, np.float32), float(move), self.t >= 10, False, {}


def _config(kind: str) -> PPOConfig:
    return (PPOConfig().environment(NestedActionEnv, env_config={"kind": kind}).env_runners(num_env_runners=0)
            .training(train_batch_size=40, minibatch_size=20, num_epochs=2).debugging(seed=0))


def _actions(kind: str, n: int) -> Any:
    g = torch.Generator().manual_seed(3)
    move, force = torch.randint(0, 3, (n,), generator=g), torch.rand(n, 2, generator=g) * 2 - 1
    return {"move": move, "force": force} if kind == "dict" else (move, force)


def _train_batch(kind: str, n: int) -> MultiAgentBatch:
    """A PPO train batch as RLlib's learner connector leaves it, with nested actions and a row id."""
    ids = torch.arange(n)
    return MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({
        Columns.OBS: torch.sin(ids.float()[:, None] + torch.arange(3.0)), Columns.ACTIONS: _actions(kind, n),
        Columns.ACTION_LOGP: torch.full((n,), -1.5), Columns.ACTION_DIST_INPUTS: torch.zeros(n, 7),
        "advantages": torch.cos(ids.float()), "value_targets": ids.float() / n, Columns.VF_PREDS: torch.zeros(n),
        "row_id": ids})}, env_steps=n)


def _learners(kind: str) -> tuple[Any, Any]:
    """RLlib's PPO learner and Conduit's, the latter's module given the former's weights."""
    env = NestedActionEnv({"kind": kind})
    stock = _config(kind).build_learner(env=env)
    ours = conduit_rllib.enable(_config(kind)).build_learner(env=env)
    assert isinstance(ours, ConduitPPOTorchLearner) and not isinstance(stock, ConduitPPOTorchLearner)
    ours.module.set_state(stock.module.get_state())
    return stock, ours


def _weights(learner: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.module[DEFAULT_MODULE_ID].state_dict().items()}


def _flat(actions: Any) -> list[torch.Tensor]:
    return [actions[k] for k in ("move", "force")] if isinstance(actions, dict) else list(actions)


@pytest.mark.parametrize("kind", KINDS)
def test_minibatches_carry_the_nested_actions_row_for_row_as_rllibs_iterator(kind: str) -> None:
    stock, ours = _learners(kind)
    try:
        theirs = list(MiniBatchCyclicIterator(_train_batch(kind, 50), num_epochs=2, minibatch_size=20,
                                              shuffle_batch_per_epoch=False))
        got = ours._create_iterator_if_necessary(training_data=TrainingData(batch=_train_batch(kind, 50)),
                                                 num_epochs=2, minibatch_size=20, shuffle_batch_per_epoch=False)
        compared = 0
        for a, b in zip(got, theirs, strict=True):  # (checked as each comes: a minibatch reuses the last one's memory)
            compared += 1
            a, b = a.policy_batches[DEFAULT_MODULE_ID], b.policy_batches[DEFAULT_MODULE_ID]
            assert a["row_id"].tolist() == torch.as_tensor(b["row_id"]).tolist()
            acts = a[Columns.ACTIONS]
            assert type(acts) is (dict if kind == "dict" else tuple), type(acts)
            if kind == "dict":
                assert list(acts) == ["move", "force"], "the keys come back in the order they went in"
            for x, y in zip(_flat(acts), _flat(b[Columns.ACTIONS]), strict=True):
                assert x.dtype == torch.as_tensor(y).dtype
                torch.testing.assert_close(x, torch.as_tensor(y), rtol=0, atol=0)
        assert compared == len(theirs) == 5
    finally:
        ours.conduit_feed.close()


@pytest.mark.parametrize("kind", KINDS)
def test_an_update_leaves_the_weights_rllibs_own_minibatching_leaves(kind: str) -> None:
    stock, ours = _learners(kind)
    try:
        for learner in (stock, ours):
            learner.update(batch=_train_batch(kind, 50), minibatch_size=20, num_epochs=2,
                           shuffle_batch_per_epoch=False)
        assert ours.conduit_version == 1, "the update did not go through Conduit's feed"
        before = _weights(_learners(kind)[0])
        after, want = _weights(ours), _weights(stock)
        assert any(not torch.equal(before[k], want[k]) for k in want), "the update changed no weight"
        for k in want:
            torch.testing.assert_close(after[k], want[k], msg=k)
    finally:
        ours.conduit_feed.close()


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_ppo_iteration_trains_through_conduit_as_rllib_alone_does(kind: str) -> None:
    """Same seed, one ``train()`` each: the same episodes are sampled, so the steps trained agree."""
    trained = {}
    for conduit in (True, False):
        config = conduit_rllib.enable(_config(kind)) if conduit else _config(kind)
        algo = config.build_algo()
        try:
            result = algo.train()["learners"]["default_policy"]
            trained[conduit] = result["num_module_steps_trained"]
            if conduit:
                assert algo.learner_group._learner.conduit_version == 1, "the update did not go through Conduit"
        finally:
            algo.stop()
    assert trained[True] == trained[False] > 0
