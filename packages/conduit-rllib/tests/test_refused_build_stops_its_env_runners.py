"""A config ``build_algo`` refuses after RLlib's setup has started remote env runners (``num_env_runners >= 1``):
the refusal stops what the build started, so the env runners' CPUs are back at once, not when the garbage collector
gets to the half-built algorithm (which the raised error's traceback keeps alive: in a notebook, or held in
``pytest.raises``, that is as long as the session). Real RLlib DQN on a local Ray (2 CPUs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import conduit_rllib
import pytest
import ray
from conduit import ConfigurationError
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner

pytestmark = pytest.mark.usefixtures("ray_local")


def _free_cpus_after(seconds: float, want: float) -> float:
    """The driver's view of free CPUs, polled until it reaches ``want`` or ``seconds`` pass (Ray reports resources
    freed by a killed actor a moment later)."""
    deadline = time.monotonic() + seconds
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= want or time.monotonic() > deadline:
            return free


def _config() -> DQNConfig:
    return (DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=1, num_cpus_per_env_runner=1)
            .training(train_batch_size=8, num_steps_sampled_before_learning_starts=10))


def _scheduler_factory_returning_no_scheduler(config: DQNConfig) -> None:
    conduit_rllib.enable(config, scheduler=lambda: 42)  # type: ignore[arg-type,return-value]


def _learner_class_changed_after_enable(config: DQNConfig) -> None:
    conduit_rllib.enable(config)
    config.learners(learner_class=DQNTorchLearner)


@pytest.mark.parametrize("refused", [_scheduler_factory_returning_no_scheduler, _learner_class_changed_after_enable])
def test_a_build_refused_in_on_algorithm_init_returns_the_env_runners_cpus(
        refused: Callable[[DQNConfig], None]) -> None:
    """Before: with the error held (as ``pytest.raises`` holds it), the env runner kept its CPU: the free CPUs
    stayed one short of what they were before the build."""
    before = _free_cpus_after(10, ray.cluster_resources()["CPU"])
    config = _config()
    refused(config)
    with pytest.raises(ConfigurationError) as held:
        config.build_algo()
    try:
        assert not getattr(held.value, "__notes__", None), "stopping the half-built algorithm failed"
        assert _free_cpus_after(10, before) == before, "the refused build left its env runner holding a CPU"
        if refused is not _scheduler_factory_returning_no_scheduler:
            return  # (the build below is the same after either refusal: once is enough)
        # the same session builds the corrected config at once, with the CPUs the refused build had taken
        # (an iteration of 20 env steps, not DQN's default 1000: past the 10 before learning starts, so it samples
        # on the new env runner and trains, at a fiftieth of the cost)
        algo: Any = conduit_rllib.enable(_config().reporting(min_sample_timesteps_per_iteration=20)).build_algo()
        try:
            algo.train()
        finally:
            algo.stop()
    finally:
        del held
