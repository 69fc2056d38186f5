"""A DQN checkpoint (its Conduit buffer stored, ``store_buffer_in_checkpoints=True``) restored with
``restore_from_path`` into an algorithm built with another ``num_env_runners`` than the saver's (local sampling to
one remote env runner and back): the buffer comes back whole and training goes on, adding to it. Real RLlib DQN on
a local Ray (2 CPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import conduit_rllib
import numpy as np
import pytest
import torch
from ray.rllib.algorithms.dqn import DQNConfig

pytestmark = pytest.mark.usefixtures("ray_local")


CAPACITY = 64


def _config(num_env_runners: int) -> DQNConfig:
    # iterations of 40 env steps (DQN's default is 1000): the saver's two fill the buffer of 64 and wrap it, so the
    # checkpoint holds a buffer that has evicted, as the 2000 steps into 300 did, at a twenty-fifth of the steps
    return (DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=num_env_runners,
                                                               rollout_fragment_length=20)
            .training(train_batch_size=8, num_steps_sampled_before_learning_starts=10, store_buffer_in_checkpoints=True,
                      replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": CAPACITY})
            .reporting(min_sample_timesteps_per_iteration=40)
            .debugging(seed=0))


def _same(a: Any, b: Any) -> bool:
    """Whether two buffer states hold the same values (arrays and tensors compared element by element)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    return bool(a == b)


@pytest.mark.parametrize(("saver", "restorer"), [(0, 1), (1, 0)])
def test_a_checkpoint_restores_into_another_number_of_env_runners(tmp_path: Path, saver: int,
                                                                  restorer: int) -> None:
    algo: Any = conduit_rllib.enable(_config(saver)).build_algo()
    try:
        algo.train()
        algo.train()
        saved = algo.local_replay_buffer.get_state()
        stored = len(algo.local_replay_buffer)
        path = algo.save_to_path(tmp_path / "ckpt")
    finally:
        algo.stop()
    assert stored == CAPACITY and saved["next"] > CAPACITY, "the saver's buffer did not fill and wrap"
    restored: Any = conduit_rllib.enable(_config(restorer)).build_algo()
    try:
        restored.restore_from_path(path)
        rb = restored.local_replay_buffer
        assert isinstance(rb, conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer)
        assert len(rb) == stored and _same(rb.get_state(), saved), "the restored buffer is not the saved one"
        restored.train()
        assert rb.get_state()["next"] > saved["next"], "training after the restore added nothing to the buffer"
    finally:
        restored.stop()
