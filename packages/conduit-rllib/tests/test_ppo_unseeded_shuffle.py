"""PPO without a seed (RLlib's default, ``config.debugging(seed=None)``): RLlib then reshuffles each later epoch
from an unseeded generator, so unseeded runs train different minibatch orders. Conduit's feed must not pin one
order for every unseeded run. Real PPO torch learners, no Ray cluster."""

from __future__ import annotations

import conduit_rllib
import gymnasium as gym
import torch
from conduit_rllib.learner import ConduitPPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

ROWS = 24
ROW = "row_id"


def minibatch_rows(seed: int | None) -> list[list[int]]:
    """Row ids of each minibatch a fresh learner of a PPO config with ``seed`` trains for one 3-epoch update."""
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1").debugging(seed=seed))
    learner = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(learner, ConduitPPOTorchLearner)
    try:
        ids = torch.arange(ROWS)
        batch = SampleBatch({Columns.OBS: torch.zeros(ROWS, 4), Columns.ACTIONS: ids % 2,
                             Columns.ACTION_LOGP: torch.zeros(ROWS), "advantages": torch.zeros(ROWS),
                             "value_targets": torch.zeros(ROWS), Columns.VF_PREDS: torch.zeros(ROWS), ROW: ids})
        it = learner._create_iterator_if_necessary(
            training_data=TrainingData(batch=MultiAgentBatch({DEFAULT_MODULE_ID: batch}, env_steps=ROWS)),
            num_epochs=3, minibatch_size=ROWS, shuffle_batch_per_epoch=True)
        return [mab.policy_batches[DEFAULT_MODULE_ID][ROW].tolist() for mab in it]
    finally:
        learner.conduit_feed.close()


def test_unseeded_learners_reshuffle_differently_as_rllibs_unseeded_shuffle_does() -> None:
    """Before: a config without a seed gave every learner seed 0, so every unseeded run trained the very same
    minibatch order (RLlib's own reshuffles draw from NumPy's unseeded generator then, and the DQN/SAC buffers
    already take a fresh seed). Two later epochs of 24 rows agree by chance with probability 1 / (24!)^2."""
    first, second = minibatch_rows(None), minibatch_rows(None)
    assert first[0] == second[0] == list(range(ROWS))  # the first epoch keeps the batch's order, as RLlib's
    assert sorted(first[1]) == sorted(second[1]) == list(range(ROWS))
    assert first[1:] != second[1:]


def test_seeded_learners_still_reshuffle_alike() -> None:
    assert minibatch_rows(7) == minibatch_rows(7)
