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


def rollout(lo: int, hi: int) -> SampleBatch:
    ids = torch.arange(lo, hi)
    return SampleBatch({Columns.OBS: ids.float()[:, None].repeat(1, 3), Columns.ACTIONS: ids})


class StubLearner(ConduitOnPolicyLearner):
    """Just what ConduitOnPolicyLearner._create_iterator_if_necessary touches of a Learner."""

    def __init__(self, **feed_kwargs: Any) -> None:
        self.conduit_feed = MinibatchFeed(**feed_kwargs)

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
    it = iter(learner.iterator(0, 400, minibatch_size=100, num_epochs=2))  # M = 4
    next(it)
    del it  # _update raised: RLlib's update loop drops the iterator mid-epoch
    # the next rollout has a different row count, hence another M: it must train, not raise forever
    for _ in range(2):
        got = [mab.policy_batches["default_policy"][Columns.ACTIONS] for mab in
               learner.iterator(1000, 1250, minibatch_size=100, num_epochs=2)]
        assert len(got) == 2 * 2  # M = round(2.5) = 2, E = 2
        for e in range(2):
            rows = torch.cat(got[2 * e:2 * e + 2]).sort().values
            assert torch.equal(rows, torch.arange(1000, 1250)), "each row of the new rollout once per epoch"
    learner.conduit_feed.close()


def test_an_abandoned_rollout_does_not_crowd_out_a_larger_next_one() -> None:
    learner = StubLearner(seed=0, prefetch=False)
    it = iter(learner.iterator(0, 100, minibatch_size=1000, num_epochs=1))  # M = 1, capacity 256
    del it  # the first delivery happened, the update failed before consuming
    got = [mab.policy_batches["default_policy"][Columns.ACTIONS] for mab in
           learner.iterator(1000, 1200, minibatch_size=1000, num_epochs=1)]  # M = 1 again, 200 rows
    assert len(got) == 1 and torch.equal(got[0].sort().values, torch.arange(1000, 1200))
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
