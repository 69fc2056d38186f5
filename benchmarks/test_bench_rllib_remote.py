"""DQN with a remote learner (``num_learners=1``), with and without Conduit: one ``algo.train()``.

The learner runs in a Ray actor, as RLlib users put it on a GPU. Each update, RLlib's path ships the
sampled one-step episodes (32 ``SingleAgentEpisode`` objects) to the actor, whose learner connector turns
them into the train batch; Conduit's ships the sample's columns (one tensor each) and the actor trains them as
they are (:mod:`conduit_rllib.remote`). Workload: DQN on LargeObsCartPole with d = 1000 float32 observations,
RLlib's defaults (batch 32, prioritized replay, one env step and one update per training step), 50 steps per
iteration; a ratio table in ``benchmarks/results/rllib_remote_iteration.md``.

Run: ``.venv/bin/python -m pytest benchmarks/test_bench_rllib_remote.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

VARIANTS = ["native", "conduit"]
STEPS = 50
OBS_DIM = 1000


@pytest.fixture(scope="module")
def algos() -> Iterator[dict[str, Any]]:
    import conduit_rllib
    import ray
    import torch
    from conduit_rllib.workloads import dqn_large_obs

    torch.set_num_threads(1)
    # a learner actor takes one CPU; the driver runs the EnvRunner
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    made: dict[str, Any] = {}
    try:
        for variant in VARIANTS:
            config = dqn_large_obs(OBS_DIM, steps=STEPS, batch=32, capacity=5000).learners(num_learners=1)
            if variant == "conduit":
                conduit_rllib.enable(config)
            made[variant] = config.build_algo()
            made[variant].train()  # past learning start: every later iteration makes STEPS updates
        yield made
    finally:
        for algo in made.values():
            algo.stop()
        ray.shutdown()


@pytest.mark.parametrize("variant", VARIANTS)
def test_iteration_with_a_remote_learner(benchmark: Any, algos: dict[str, Any], variant: str, ratios: Any) -> None:
    algo = algos[variant]
    benchmark.group = f"rllib-remote-iteration-dqn-d{OBS_DIM}"
    benchmark.pedantic(algo.train, rounds=5, iterations=1, warmup_rounds=1)
    updates = algo.learner_group.foreach_learner(
        lambda learner: getattr(learner, "conduit_batches", None))
    if variant == "conduit":
        assert [r.get() for r in updates][0] > 0, "the remote learner trained no Conduit batch"
    ratios.add("rllib_remote_iteration", f"dqn-d{OBS_DIM}", variant, benchmark, baseline="native",
               note=f"One algo.train() of DQN with one remote learner (num_learners=1): {STEPS} env steps and "
                    f"updates, each update's sample shipped to the learner actor.")
