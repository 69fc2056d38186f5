"""The PPO learner's minibatch feed (conduit.OnPolicy behind RLlib batches), without Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, EmptyBufferError
from conduit_rllib import MinibatchFeed, UnsupportedConfigError
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch


def rollout(lo: int, hi: int) -> SampleBatch:
    ids = torch.arange(lo, hi)
    return SampleBatch({Columns.OBS: ids.float()[:, None].repeat(1, 3), Columns.ACTIONS: ids,
                        "advantages": ids.float() * 0.5})


def run(feed: MinibatchFeed, lo: int, hi: int, version: int) -> list[tuple[int, int, list[int]]]:
    feed.set_policy_version(version)
    feed.ingest("default_policy", rollout(lo, hi), version=version)
    feed.seal()
    out = []
    for mab in feed.minibatches():
        assert isinstance(mab, MultiAgentBatch)
        b = mab.policy_batches["default_policy"]
        assert torch.equal(b["advantages"], b[Columns.ACTIONS].float() * 0.5), "rows were mixed up"
        info = feed.delivered[-1]
        out.append((info.epoch, info.minibatch, b[Columns.ACTIONS].tolist()))
    return out


@pytest.mark.parametrize("prefetch", [False, True])
def test_each_row_once_per_epoch_in_m_minibatches(prefetch: bool) -> None:
    feed = MinibatchFeed(num_minibatches=4, num_epochs=3, seed=0, prefetch=prefetch)
    mbs = run(feed, 0, 103, version=0)
    assert len(mbs) == 12
    for e in range(3):
        rows = sorted(r for ep, _, ids in mbs if ep == e for r in ids)
        assert rows == list(range(103))
    feed.close()


def test_the_first_epoch_keeps_the_batch_order_and_later_ones_are_reshuffled() -> None:
    """As RLlib's MiniBatchCyclicIterator: it walks epoch 0 in the train batch's order and shuffles the
    batch only once an epoch is covered."""
    feed = MinibatchFeed(num_minibatches=4, num_epochs=3, seed=0)
    mbs = run(feed, 0, 100, version=0)
    first = [r for ep, _, ids in mbs if ep == 0 for r in ids]
    assert first == list(range(100)), "epoch 0 must be contiguous slices of the batch, in order"
    for e in (1, 2):
        later = [r for ep, _, ids in mbs if ep == e for r in ids]
        assert sorted(later) == list(range(100)) and later != list(range(100)), f"epoch {e} was not reshuffled"
    feed.close()


def test_prefetch_delivers_exactly_the_synchronous_sequence() -> None:
    a, b = MinibatchFeed(num_minibatches=5, num_epochs=2, seed=3, prefetch=False), \
        MinibatchFeed(num_minibatches=5, num_epochs=2, seed=3, prefetch=True)
    for v, (lo, hi) in enumerate([(0, 50), (50, 97), (97, 160)]):
        assert run(a, lo, hi, v) == run(b, lo, hi, v)
    a.close()
    b.close()


def test_reconfigure_between_rollouts_and_grow_storage() -> None:
    feed = MinibatchFeed(seed=1)
    feed.configure(num_minibatches=2, num_epochs=1, shuffle=False)
    assert [len(ids) for _, _, ids in run(feed, 0, 10, 0)] == [5, 5]
    feed.configure(num_minibatches=3, num_epochs=2, shuffle=True)
    mbs = run(feed, 0, 3000, 1)  # larger than the first storage: regrown while idle
    assert len(mbs) == 6 and feed.capacity >= 3000
    feed.set_policy_version(2)
    feed.ingest("default_policy", rollout(0, 10), version=2)
    with pytest.raises(ConfigurationError):
        feed.configure(num_minibatches=5, num_epochs=1, shuffle=True)  # a rollout is waiting
    feed.close()


def test_an_abandoned_rollout_is_dropped_once_the_policy_moves_on() -> None:
    feed = MinibatchFeed(num_minibatches=4, num_epochs=2, seed=2, prefetch=True)
    feed.set_policy_version(0)
    feed.ingest("default_policy", rollout(0, 40), version=0)
    feed.seal()
    it = feed.minibatches()
    next(it)
    next(it)
    it.close()  # the learner stopped mid-update (e.g. an exception)
    mbs = run(feed, 100, 140, version=1)
    assert all(100 <= r < 140 for _, _, ids in mbs for r in ids)
    assert feed.dropped_items == 40
    feed.close()


def test_bad_input_raises_typed_errors() -> None:
    feed = MinibatchFeed(num_minibatches=2)
    with pytest.raises(EmptyBufferError):
        feed.minibatches()
    for state in ({"h": np.zeros((4, 2))}, np.zeros((4, 2))):  # an RNN's state, nested or not
        with pytest.raises(UnsupportedConfigError, match=r"'state_in'.*recurrent module's state"):
            feed.ingest("default_policy", {"obs": np.zeros((4, 2)), "state_in": state}, version=0)
    feed.ingest("default_policy", rollout(0, 8), version=0)
    with pytest.raises(UnsupportedConfigError):
        feed.ingest("other_policy", rollout(0, 8), version=0)
    feed.close()
