"""PPO: the on-policy feed after close and after a plane that could not be grown (the core's closed
data plane refuses all work), a learner's shutdown stopping the prefetch thread, a prefetched minibatch of an
iteration stopped but not closed yet (across a restore, and across the next iteration), and the feed's state
after a restore."""

from __future__ import annotations

import gc
import shutil
import threading
from pathlib import Path

import conduit_rllib
import gymnasium as gym
import pytest
import torch
from conduit import DiskPlacement, PlacementError
from conduit_rllib import MinibatchFeed
from conduit_rllib.learner import ConduitPPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

ROW = "row"


def rollout(lo: int, hi: int) -> SampleBatch:
    ids = torch.arange(lo, hi)
    return SampleBatch({"obs": ids.float()[:, None], ROW: ids})


def rows_of(feed: MinibatchFeed) -> list[list[int]]:
    return [mb.policy_batches["m"][ROW].tolist() for mb in feed.minibatches()]


def build_learner() -> ConduitPPOTorchLearner:
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1").debugging(seed=0))
    learner = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(learner, ConduitPPOTorchLearner)
    return learner


def learner_minibatch_sizes(learner: ConduitPPOTorchLearner, n: int, *, minibatch_size: int,
                            num_epochs: int) -> list[int]:
    """Rows of each minibatch the learner's update loop gets for a train batch of ``n`` rows."""
    batch = MultiAgentBatch({DEFAULT_MODULE_ID: rollout(0, n)}, env_steps=n)
    it = learner._create_iterator_if_necessary(training_data=TrainingData(batch=batch), num_epochs=num_epochs,
                                               minibatch_size=minibatch_size, shuffle_batch_per_epoch=True)
    return [len(mab.policy_batches[DEFAULT_MODULE_ID]) for mab in it]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "conduit-minibatch"]


def test_a_closed_feed_takes_the_next_rollout_and_continues_exactly() -> None:
    closed, kept = (MinibatchFeed(minibatch_size=4, num_epochs=2, seed=3) for _ in range(2))
    for feed in (closed, kept):
        feed.ingest("m", rollout(0, 6), version=0)
        feed.seal()
        rows_of(feed)
    closed.close()
    assert closed.state_dict()["policy_version"] == 0
    for feed in (closed, kept):
        feed.set_policy_version(1)
        feed.ingest("m", rollout(10, 16), version=1)
        feed.seal()
    assert rows_of(closed) == rows_of(kept), "a closed feed's next rollout must continue the permutation RNG"
    closed.close()
    kept.close()


def test_learner_shutdown_stops_the_prefetch_thread_and_a_later_update_still_works() -> None:
    before = set(prefetch_threads())
    learner = build_learner()
    try:
        learner_minibatch_sizes(learner, 40, minibatch_size=16, num_epochs=2)
        started = set(prefetch_threads()) - before
        assert len(started) == 1, "the update should have started one prefetch thread"
        learner.shutdown()
        assert not any(t.is_alive() for t in started), "Learner.shutdown() left Conduit's prefetch thread running"
        assert learner_minibatch_sizes(learner, 40, minibatch_size=16, num_epochs=2) == [16] * 5
    finally:
        learner.conduit_feed.close()


def test_shutting_down_a_learner_whose_build_never_ran_is_harmless() -> None:
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1").debugging(seed=0))
    learner = config.learner_class(config=config, module_spec=config.get_multi_rl_module_spec(env=gym.make(
        "CartPole-v1")))
    learner.shutdown()  # LearnerGroup.__del__ does this when the learner's build() raised


def test_a_minibatch_prefetched_before_a_restore_is_not_delivered_after_it() -> None:
    feed = MinibatchFeed(minibatch_size=2, num_epochs=1, seed=1)
    feed.set_policy_version(5)
    feed.ingest("m", rollout(0, 6), version=5)
    feed.seal()
    saved = feed.state_dict(drop_pending=True)  # (the sealed rollout waits: a plain state_dict() refuses)
    it = feed.minibatches()
    assert next(it).policy_batches["m"][ROW].tolist() == [0, 1]  # [2, 3] is being prefetched
    feed.load_state_dict(saved)  # e.g. Learner.set_state after an update failed mid-way
    del it
    gc.collect()  # the abandoned iterator ends now
    feed.ingest("m", rollout(100, 104), version=5)
    feed.seal()
    assert rows_of(feed) == [[100, 101], [102, 103]], "rows of the rollout the restore discarded were delivered"
    feed.close()


def test_the_state_after_a_restore_reports_the_policy_version_set_since() -> None:
    feed = MinibatchFeed(minibatch_size=2, num_epochs=1)
    feed.load_state_dict(MinibatchFeed(minibatch_size=2, num_epochs=1).state_dict())
    feed.set_policy_version(7)
    assert feed.state_dict()["policy_version"] == 7


def test_a_plane_that_cannot_be_grown_leaves_the_feed_usable(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    feed, twin = MinibatchFeed(minibatch_size=4, num_epochs=2, seed=3, placement=DiskPlacement(directory=volume)), \
        MinibatchFeed(minibatch_size=4, num_epochs=2, seed=3)
    for f in (feed, twin):
        f.ingest("m", rollout(0, 6), version=0)
        f.seal()
        rows_of(f)
    shutil.rmtree(volume)  # (the idle plane's mapped files stay readable, and nothing of them is needed)
    volume.write_text("the volume went away")  # a larger rollout needs a new plane, which cannot be placed now
    with pytest.raises(PlacementError):
        feed.ingest("m", rollout(0, 40), version=1)
    volume.unlink()
    volume.mkdir()
    for f in (feed, twin):
        f.ingest("m", rollout(10, 16), version=1)
        f.seal()
    assert rows_of(feed) == rows_of(twin), "after a refused growth the feed must continue as if it never happened"
    feed.close()
    twin.close()


def test_an_abandoned_iteration_still_alive_hands_its_prefetched_minibatch_to_the_next_one_in_order() -> None:
    feed = MinibatchFeed(minibatch_size=2, num_epochs=1, max_staleness=1, seed=0)
    feed.ingest("m", rollout(0, 6), version=0)
    feed.seal()
    first = feed.minibatches()
    assert next(first).policy_batches["m"][ROW].tolist() == [0, 1]  # [2, 3] is being prefetched
    # the caller's training raised; its traceback still holds the iterator (not closed yet) when it goes on
    feed.ingest("m", rollout(10, 14), version=1)
    feed.seal()
    assert rows_of(feed) == [[2, 3], [4, 5]], "the rest of rollout 0, in order"
    del first
    gc.collect()
    assert rows_of(feed) == [[10, 11], [12, 13]], "one iteration mixed rollouts (or rows were repeated)"
    assert [i.version for i in feed.delivered] == [1, 1]
    feed.close()
