"""A remote DQN learner on another node of a real local Ray cluster (``ray.cluster_utils``): the Conduit buffer
stays in the driver on the head node, and each sample's slice reaches the learner's node through Ray's object
store (:mod:`conduit_rllib.remote`)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import conduit_rllib  # noqa: E402
import ray  # noqa: E402
from conduit.distributed.testing import local_cluster  # noqa: E402
from conduit_rllib.workloads import dqn_large_obs  # noqa: E402


def _node_of_learner(learner: object, _: object = None) -> tuple[str, int]:
    return ray.get_runtime_context().get_node_id(), int(getattr(learner, "conduit_batches", 0))


def test_dqn_learner_on_another_node_trains_the_drivers_samples() -> None:
    import torch

    torch.set_num_threads(1)
    # a cluster of its own, not the kept one the other modules share: the node added here is gone at the end,
    # and a kept cluster's next user would find it still listed until Ray declares it dead
    with local_cluster(1, num_cpus=2, object_store_memory=256 << 20) as lc:
        other = lc.add_node(num_cpus=1, resources={"learner_node": 1})
        config = (dqn_large_obs(64, steps=40, batch=16, capacity=200, learning_starts=20)
                  .learners(num_learners=1, custom_resources_per_learner={"learner_node": 0.5}))
        algo = conduit_rllib.enable(config).build_algo()
        try:
            result = algo.train()
            result = algo.train()
            ((node, batches),) = [r.get() for r in algo.learner_group.foreach_learner(_node_of_learner)]
            assert node == other != lc.head, "the learner is not on the other node"
            assert batches > 0, "the learner on the other node trained no Conduit batch"
            assert result["learners"]["__all_modules__"]["num_env_steps_trained"] == 16 * 40
            assert len(algo.local_replay_buffer) == 80, "the buffer in the driver holds every env step"
        finally:
            algo.stop()
