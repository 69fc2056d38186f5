"""The on-policy feed's storage capacity across a checkpoint: a restored feed is sized as the saved one was.

Reported: a ``MinibatchFeed`` grows its storage to ``max(capacity, the smallest power of two >= 2 x rows)`` when a
rollout arrives while nothing waits, and never shrinks it; but its state did not carry that capacity, so a feed (or
PPO learner) restored from a checkpoint sized its storage from the first rollout after the restore. The restored
feed then held less than the one that never stopped: ``feed.capacity`` differed after the same training, and rollouts
that the never-stopped feed lets wait were refused with ``CapacityError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import conduit_rllib
import gymnasium as gym
import pytest
import torch
from conduit import ConfigurationError
from conduit_rllib import MinibatchFeed
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.policy.sample_batch import SampleBatch

ROW = "row"


def rollout(lo: int, hi: int) -> SampleBatch:
    ids = torch.arange(lo, hi)
    return SampleBatch({"obs": ids.float()[:, None], ROW: ids})


def deliver(feed: MinibatchFeed) -> list[list[int]]:
    return [mb.policy_batches["m"][ROW].tolist() for mb in feed.minibatches()]


def test_a_restored_feed_lets_as_many_rollouts_wait_as_the_one_that_never_stopped() -> None:
    """A feed grown to 128 rows by a rollout of 40 is saved between rollouts; the feed restored from it takes four
    rollouts of 10 rows waiting, as the saved one does, and delivers the same minibatches. Failed before: the
    restored feed was sized 32 by its first rollout of 10, and the fourth ingest raised CapacityError."""
    kept, restored = (MinibatchFeed(minibatch_size=4, num_epochs=2, seed=5, prefetch=False) for _ in range(2))
    for lo, hi in ((0, 10), (100, 140)):
        kept.ingest("m", rollout(lo, hi), version=0)
        kept.seal()
        deliver(kept)
    assert kept.capacity == 128
    restored.load_state_dict(kept.state_dict())
    assert restored.capacity == kept.capacity, "the restored feed's capacity is not the saved one's"
    for feed in (kept, restored):
        for k in range(4):  # 40 rows waiting: within 128, not within the 32 one rollout of 10 sizes
            feed.ingest("m", rollout(1000 + 10 * k, 1010 + 10 * k), version=0)
            feed.seal()
    for _ in range(4):
        assert deliver(restored) == deliver(kept)
    assert restored.capacity == kept.capacity == 128
    kept.close()
    restored.close()


def test_a_state_saved_by_an_older_version_without_the_capacity_still_loads() -> None:
    """A feed state without the capacity (saved before it was kept) loads, and the feed keeps its own capacity."""
    saved = MinibatchFeed(minibatch_size=4, num_epochs=1, prefetch=False)
    saved.ingest("m", rollout(0, 40), version=0)
    saved.seal()
    deliver(saved)
    state = saved.state_dict()
    del state["capacity"]
    feed = MinibatchFeed(minibatch_size=4, num_epochs=1, prefetch=False, capacity=16)
    feed.load_state_dict(state)
    assert feed.capacity == 16
    saved.close()


@pytest.mark.parametrize("capacity", [-1, 2.5, True, "128"])
def test_a_damaged_capacity_in_a_state_is_refused_and_changes_nothing(capacity: object) -> None:
    """A capacity that is no int >= 0 in a feed state is a damaged state: refused, the feed unchanged."""
    saved = MinibatchFeed(minibatch_size=4, num_epochs=1, prefetch=False)
    state = dict(saved.state_dict(), capacity=capacity)
    feed = MinibatchFeed(minibatch_size=4, num_epochs=1, prefetch=False, capacity=8)
    with pytest.raises(ConfigurationError, match="capacity"):
        feed.load_state_dict(state)
    assert feed.capacity == 8


class OneStepCartPole(gym.Wrapper):
    """CartPole whose episodes end after one step when ``config["one_step"]``: a train batch holds one row per step
    plus one per episode, so PPO's rollout of 40 steps has 80 rows, where plain CartPole's has about 42 (as when a
    policy balances longer after a restore)."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.one_step = bool((config or {}).get("one_step"))

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated or self.one_step, info


def _ppo(one_step: bool) -> PPOConfig:
    return conduit_rllib.enable(
        PPOConfig().environment(OneStepCartPole, env_config={"one_step": one_step})
        .env_runners(num_env_runners=0).training(train_batch_size_per_learner=40, minibatch_size=16, num_epochs=1)
        .debugging(seed=0))


@pytest.mark.usefixtures("ray_local")
def test_a_restored_ppo_learner_keeps_the_feed_capacity_of_the_one_that_never_stopped(tmp_path: Path) -> None:
    """PPO, checkpointed after an iteration whose rollout of 80 rows sized the feed 256; restored, its rollouts
    have about 42 rows. The restored feed has the checkpoint's capacity, before and after its next iteration, as
    the never-stopped feed does (its capacity never shrinks). Failed before: 0 after the restore and 128 after an
    iteration (sized by the first rollout after the restore)."""
    algo = _ppo(one_step=True).build_algo()
    try:
        feed = algo.learner_group._learner.conduit_feed  # type: ignore[union-attr]
        algo.train()
        saved = feed.capacity
        algo.save_to_path(str(tmp_path / "ckpt"))
        algo.train()
        assert feed.capacity == saved == 256
    finally:
        algo.stop()
    restored = _ppo(one_step=False).build_algo()
    try:
        restored.restore_from_path(str(tmp_path / "ckpt"))
        restored_feed = restored.learner_group._learner.conduit_feed  # type: ignore[union-attr]
        assert restored_feed.capacity == saved, "the restored feed's capacity is not the checkpoint's"
        restored.train()
        assert restored_feed.capacity == saved, (f"restored feed capacity {restored_feed.capacity}, the never-stopped "
                                                 f"one's {saved}")
    finally:
        restored.stop()
