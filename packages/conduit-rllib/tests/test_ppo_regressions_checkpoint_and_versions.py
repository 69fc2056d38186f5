"""The RLlib adapter's PPO path, as a demanding user: a checkpoint taken while a stopped
update's prefetch is still gathering restores the minibatch order the saved learner goes on with, policy
versions are integers (a bool, float or string is refused typed, never rounded), a failed build in
``run_interleaved`` still closes the variants built before it, and the experience-path probe refuses an
algorithm whose learner runs remotely (it would report 0 s for the learner's parts)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest
import torch
from conduit import ConfigurationError
from conduit_rllib import MinibatchFeed, UnsupportedConfigError
from conduit_rllib.compare import run_interleaved
from conduit_rllib.learner import ON_POLICY_COMPONENT, ConduitPPOTorchLearner
from conduit_rllib.profiling import ExperiencePathProbe
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import SampleBatch

sys.path.insert(0, str(Path(__file__).parent))
from test_on_policy_learner_state_and_refusals import ROW, build_learner, train_batch  # noqa: E402, I001  (sibling test helpers)


def minibatch_iter(learner: ConduitPPOTorchLearner, n: int, *, minibatch_size: int, num_epochs: int) -> Any:
    """The iterator the learner's update loop walks for ``train_batch(n)`` (shuffled epochs)."""
    return learner._create_iterator_if_necessary(training_data=TrainingData(batch=train_batch(n)),
                                                 num_epochs=num_epochs, minibatch_size=minibatch_size,
                                                 shuffle_batch_per_epoch=True)


def row_order(learner: ConduitPPOTorchLearner, n: int) -> list[list[int]]:
    """Row ids of each minibatch of the learner's next update over ``train_batch(n)``."""
    return [mab.policy_batches[DEFAULT_MODULE_ID][ROW].tolist()
            for mab in minibatch_iter(learner, n, minibatch_size=5, num_epochs=3)]


# -- a checkpoint of a stopped update: the state does not depend on the prefetch thread's timing ------------

def test_a_checkpoint_of_a_stopped_update_restores_the_order_the_saved_learner_goes_on_with() -> None:
    a, b = build_learner(), build_learner()
    try:
        it = iter(minibatch_iter(a, 8, minibatch_size=4, num_epochs=3))
        next(it)  # training raised on the first minibatch: the prefetch of the epoch's last one is still out,
        # and selecting it starts epoch 1 (its permutation is drawn from the feed's RNG)
        state = a.get_state(components=ON_POLICY_COMPONENT)  # saved right away, e.g. by a fault handler
        b.set_state(state)
        assert b.conduit_version == a.conduit_version == 1
        assert torch.equal(b.conduit_feed.state_dict()["rng"], a.conduit_feed.state_dict(drop_pending=True)["rng"]), (
            "the saved RNG must be the one the saved learner goes on from, whatever the prefetch thread's timing")
        got_a, got_b = row_order(a, 12), row_order(b, 12)
        assert got_b == got_a, "the restored learner must deliver the minibatches the saved one does"
        del it
    finally:
        a.conduit_feed.close()
        b.conduit_feed.close()


def test_a_state_saved_with_one_feed_before_multi_agent_learners_still_restores() -> None:
    """Conduit's part was ``{"version", "feed"}`` before each module got a feed (``{"version", "feeds"}``): such a
    checkpoint restores a single-agent learner as it did."""
    a, b = build_learner(), build_learner()  # (b restores from a, which has trained one update since its build)
    try:
        row_order(a, 12)
        state = a.get_state(components=ON_POLICY_COMPONENT)
        part = state[ON_POLICY_COMPONENT]
        assert set(part) == {"version", "feeds"} and list(part["feeds"]) == [DEFAULT_MODULE_ID]
        state[ON_POLICY_COMPONENT] = {"version": part["version"], "feed": part["feeds"][DEFAULT_MODULE_ID]}
        b.set_state(state)
        assert b.conduit_version == a.conduit_version == 1
        assert row_order(b, 12) == row_order(a, 12), "the restored learner must deliver what the saved one does"
    finally:
        a.conduit_feed.close()
        b.conduit_feed.close()


def test_a_feed_state_taken_while_a_gather_runs_is_the_state_after_it() -> None:
    for seed in range(5):
        feed = MinibatchFeed(minibatch_size=4, num_epochs=3, seed=seed)
        try:
            feed.configure(minibatch_size=4, num_epochs=3, shuffle=True)
            feed.ingest("m", SampleBatch({"obs": torch.arange(8.0)[:, None]}), version=0)
            feed.seal()
            it = feed.minibatches()
            next(it)
            at_once = feed.state_dict(drop_pending=True)  # (mid-iteration: a plain state_dict() refuses)
            assert feed._pool is not None
            feed._pool.submit(lambda: None).wait()  # the prefetch thread has done all it was given
            later = feed.state_dict(drop_pending=True)
            assert torch.equal(at_once["rng"], later["rng"]), f"seed {seed}: the state changed under the reader"
            assert len(list(it)) == 5, "the iteration goes on with its other 5 of ceil(3 * 8 / 4) minibatches"
        finally:
            feed.close()


# -- versions are integers --------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [1.7, True, "2", None])
def test_a_version_that_is_no_integer_is_refused_typed_and_changes_nothing(version: Any) -> None:
    feed = MinibatchFeed(minibatch_size=2)
    batch = SampleBatch({"obs": torch.arange(4.0)[:, None]})
    try:
        feed.set_policy_version(3)
        with pytest.raises(ConfigurationError, match="policy version is an int"):
            feed.ingest("m", batch, version=version)
        with pytest.raises(ConfigurationError, match="policy version is an int"):
            feed.set_policy_version(version)
        assert feed.state_dict()["policy_version"] == 3 and feed.semantics.pending_rollouts == 0
        feed.ingest("m", batch, version=cast(Any, np.int64(3)))  # NumPy integers are integers
        feed.seal()
        assert [mb.policy_batches["m"]["obs"][:, 0].tolist() for mb in feed.minibatches()] == [[0, 1], [2, 3]]
        assert {info.version for info in feed.delivered} == {3}
        with pytest.raises(ConfigurationError, match="policy version is an int"):
            feed.set_policy_version(version)  # a live data plane: unchanged too
        assert feed.semantics.policy_version == 3 and feed.state_dict()["policy_version"] == 3
    finally:
        feed.close()



# -- run_interleaved closes what it built when a later build fails ------------------------------------------

def test_a_failed_build_in_run_interleaved_still_closes_the_variants_built_before_it(ray_local: None) -> None:
    good = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).debugging(seed=0)
    bad = PPOConfig().environment("NoSuchEnv-v9").env_runners(num_env_runners=0)
    callbacks = len(gc.callbacks)
    gc.disable()  # only close() may end the first variant's probe here, not a collection that happens to run
    try:
        with pytest.raises(gym.error.Error, match="NoSuchEnv"):
            run_interleaved({"native": good, "conduit": bad}, 1, progress=False)
        assert len(gc.callbacks) == callbacks, ("the native variant built before the failing one was never closed: "
                                                "its probe still times the garbage collector and its algorithm "
                                                "was not stopped")
    finally:
        gc.enable()


# -- the probe refuses an algorithm whose learner it cannot time ---------------------------------------------

def test_the_probe_refuses_a_remote_learner_instead_of_reporting_zero_experience_path(ray_local: None) -> None:
    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).learners(num_learners=1)
            .training(train_batch_size=64, minibatch_size=32, num_epochs=1).debugging(seed=0)).build_algo()
    callbacks = len(gc.callbacks)
    try:
        with pytest.raises(UnsupportedConfigError, match="num_learners=0"):
            ExperiencePathProbe(algo)
        assert len(gc.callbacks) == callbacks, "a refused probe must not time the garbage collector"
        assert algo.env_runner_group is not None
        runner = algo.env_runner_group.local_env_runner
        assert "sample" not in vars(runner), "a refused probe must leave the algorithm's calls unwrapped"
    finally:
        algo.stop()
