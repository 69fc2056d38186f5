"""The PPO learner's on-policy path across updates: an update that stopped mid-epoch blocks no later one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conduit_rllib import MinibatchFeed
from conduit_rllib.learner import ConduitOnPolicyLearner
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator


def rollout(lo: int, hi: int) -> SampleBatch:
    ids = torch.arange(lo, hi)
    return SampleBatch({Columns.OBS: ids.float()[:, None].repeat(1, 3), Columns.ACTIONS: ids})


def rllib_minibatches(lo: int, hi: int, *, minibatch_size: int, num_epochs: int, shuffle: bool) -> list[list[int]]:
    """The actions (row ids) of each minibatch RLlib's own ``MiniBatchCyclicIterator`` makes of ``rollout(lo, hi)``."""
    batch = MultiAgentBatch({"default_policy": rollout(lo, hi)}, env_steps=hi - lo)
    return [mb.policy_batches["default_policy"][Columns.ACTIONS].tolist() for mb in MiniBatchCyclicIterator(
        batch, num_epochs=num_epochs, minibatch_size=minibatch_size, shuffle_batch_per_epoch=shuffle)]


class StubLearner(ConduitOnPolicyLearner):
    """Just what ConduitOnPolicyLearner._create_iterator_if_necessary touches of a Learner."""

    def __init__(self, **feed_kwargs: Any) -> None:
        self.module = {"default_policy": None}  # (the learner's modules: only their ids are read)
        self.conduit_feeds = {"default_policy": MinibatchFeed(**feed_kwargs)}

    def _make_batch_if_necessary(self, training_data: Any) -> MultiAgentBatch:
        return training_data.batch

    def should_module_be_updated(self, module_id: str, batch: Any = None) -> bool:
        return True

    def iterator(self, lo: int, hi: int, *, minibatch_size: int, num_epochs: int) -> Any:
        batch = MultiAgentBatch({"default_policy": rollout(lo, hi)}, env_steps=hi - lo)
        return self._create_iterator_if_necessary(
            training_data=SimpleNamespace(data_iterators=None, batch=batch), num_epochs=num_epochs,
            minibatch_size=minibatch_size, shuffle_batch_per_epoch=True)


@pytest.mark.parametrize("prefetch", [False, True])
def test_an_update_that_failed_mid_epoch_does_not_block_later_updates(prefetch: bool) -> None:
    learner = StubLearner(seed=0, prefetch=prefetch)
    it = iter(learner.iterator(0, 400, minibatch_size=100, num_epochs=2))  # 8 minibatches of 100
    next(it)
    del it  # _update raised: RLlib's update loop drops the iterator mid-epoch
    # the next rollout has a different row count, hence other cuts: it must train, not raise forever.
    # RLlib: ceil(2 * 250 / 100) = 5 minibatches of 100; the third ends epoch 0 and begins epoch 1
    want = [len(mb) for mb in rllib_minibatches(1000, 1250, minibatch_size=100, num_epochs=2, shuffle=True)]
    assert want == [100] * 5, "the expectation itself is RLlib's"
    for _ in range(2):
        version = learner.conduit_version
        # a minibatch is valid until the next one is asked for: keep its row ids, not its tensors
        got = [mab.policy_batches["default_policy"][Columns.ACTIONS].tolist() for mab in
               learner.iterator(1000, 1250, minibatch_size=100, num_epochs=2)]
        assert [len(mb) for mb in got] == want, f"RLlib's cuts are {want}, got {[len(mb) for mb in got]}"
        stream = [r for mb in got for r in mb]
        assert stream[:250] == list(range(1000, 1250)), "epoch 0 walks the new rollout in its order, as RLlib's"
        assert sorted(stream[250:]) == list(range(1000, 1250)), "each row of the new rollout once in epoch 1"
        assert stream[250:] != list(range(1000, 1250)), "epoch 1 was not reshuffled"
        infos = learner.conduit_feed.delivered
        assert {int(i.version) for i in infos} == {version} and all(int(i.staleness) == 0 for i in infos), \
            "only the new rollout trains: the abandoned one is dropped"
        assert [(int(i.epoch), len(i.handles)) for i in infos] == [(0, 100), (0, 100), (0, 50), (1, 50), (1, 100),
                                                                   (1, 100)]
        assert infos[-1].last
    learner.conduit_feed.close()


def test_an_abandoned_rollout_does_not_crowd_out_a_larger_next_one() -> None:
    learner = StubLearner(seed=0, prefetch=False)
    it = iter(learner.iterator(0, 100, minibatch_size=1000, num_epochs=1))  # one minibatch: 10 passes, capacity 256
    del it  # the first delivery happened, the update failed before consuming
    got = [mab.policy_batches["default_policy"][Columns.ACTIONS].tolist() for mab in
           learner.iterator(1000, 1200, minibatch_size=1000, num_epochs=1)]  # 200 rows: one minibatch of 5 passes
    # RLlib's Learner has its iterator shuffle only with num_epochs > 1, so the cycles repeat the batch's order
    want = rllib_minibatches(1000, 1200, minibatch_size=1000, num_epochs=1, shuffle=False)
    assert got == want == [list(range(1000, 1200)) * 5], f"not RLlib's minibatch: sizes {[len(mb) for mb in got]}"
    infos = learner.conduit_feed.delivered
    assert [(int(i.epoch), len(i.handles)) for i in infos] == [(p, 200) for p in range(5)] and infos[-1].last
    assert {int(i.version) for i in infos} == {1}, "only the new rollout trains"
    learner.conduit_feed.close()


def test_drop_leftovers_keeps_rollouts_a_feed_may_still_deliver() -> None:
    """Only a feed that drops every rollout behind the policy treats pending ones as leftovers."""
    feed = MinibatchFeed(num_minibatches=2, max_staleness=1, prefetch=False)
    feed.ingest("default_policy", rollout(0, 8), version=0)
    feed.seal()
    feed.set_policy_version(1)  # one version behind: still deliverable under max_staleness=1
    feed.drop_leftovers()
    assert feed.semantics.pending_rollouts == 1 and feed.dropped_items == 0
    feed.close()
