"""PPO's on-policy path with RLlib's real PPO torch learner (no Ray cluster): minibatch counts and sizes
against RLlib's own iterator, version purity, refused batches, checkpoints, and enable() refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import conduit_rllib
import gymnasium as gym
import pytest
import torch
from conduit import ConfigurationError, EmptyBufferError
from conduit_rllib import MinibatchFeed, UnsupportedAlgorithmError, UnsupportedConfigError
from conduit_rllib.learner import ConduitPPOTorchLearner
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.algorithms.marwil import MARWILConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

ROW = "row_id"


def build_learner() -> ConduitPPOTorchLearner:
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1").debugging(seed=0))
    learner = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(learner, ConduitPPOTorchLearner)
    return learner


@pytest.fixture(scope="module")
def learner() -> Any:
    learner = build_learner()
    yield learner
    learner.conduit_feed.close()


def module_batch(n: int) -> SampleBatch:
    ids = torch.arange(n)
    return SampleBatch({Columns.OBS: ids.float()[:, None].repeat(1, 4) / max(n, 1), Columns.ACTIONS: ids % 2,
                        Columns.ACTION_LOGP: torch.full((n,), -0.69), Columns.ACTION_DIST_INPUTS: torch.zeros(n, 2),
                        "advantages": ids.float() / max(n, 1), "value_targets": torch.zeros(n),
                        Columns.VF_PREDS: torch.zeros(n), ROW: ids})


def train_batch(n: int) -> MultiAgentBatch:
    return MultiAgentBatch({DEFAULT_MODULE_ID: module_batch(n)}, env_steps=n)


def conduit_minibatches(learner: Any, batch: MultiAgentBatch, *, minibatch_size: int | None, num_epochs: int,
                        shuffle: bool) -> list[tuple[int, int, list[int]]]:
    """(version, epoch, row ids) of each minibatch Conduit hands RLlib's update loop for ``batch``."""
    it = learner._create_iterator_if_necessary(
        training_data=TrainingData(batch=batch), num_epochs=num_epochs, minibatch_size=minibatch_size,
        shuffle_batch_per_epoch=shuffle)
    out = []
    for mab in it:
        assert set(mab.policy_batches) == {DEFAULT_MODULE_ID}
        info = learner.conduit_feed.delivered[-1]
        out.append((info.version, info.epoch, mab.policy_batches[DEFAULT_MODULE_ID][ROW].tolist()))
    return out


@pytest.mark.parametrize(("rows", "minibatch_size", "num_epochs", "shuffle"), [
    (100, 30, 2, True),     # not divisible: M = round(100 / 30) = 3, sizes 34, 33, 33
    (100, 1000, 2, True),   # minibatch larger than the batch: one minibatch per epoch
    (64, 16, 3, True),      # divisible
    (7, 3, 1, False),       # tiny, one epoch
    (250, 100, 3, False),   # M = round(2.5) = 2
])
def test_minibatches_match_the_declared_m_and_cover_each_row_once_per_epoch(
        learner: Any, rows: int, minibatch_size: int, num_epochs: int, shuffle: bool) -> None:
    mbs = conduit_minibatches(learner, train_batch(rows), minibatch_size=minibatch_size, num_epochs=num_epochs,
                              shuffle=shuffle)
    m = max(1, round(rows / minibatch_size))
    assert len(mbs) == num_epochs * m, f"expected {num_epochs} epochs x {m} minibatches, got {len(mbs)}"
    sizes = [len(ids) for _, _, ids in mbs]
    assert max(sizes) - min(sizes) <= 1, f"minibatch sizes differ by more than one: {sizes}"
    assert len({v for v, _, _ in mbs}) == 1, "one update's minibatches come from one policy version"
    rllib_first = [r for mb in MiniBatchCyclicIterator(train_batch(rows), num_epochs=1, minibatch_size=minibatch_size,
                                                       shuffle_batch_per_epoch=False)
                   for r in mb.policy_batches[DEFAULT_MODULE_ID][ROW].tolist()][:rows]
    for e in range(num_epochs):
        epoch_rows = [r for _, ep, ids in mbs if ep == e for r in ids]
        assert sorted(epoch_rows) == list(range(rows)), f"epoch {e} does not hold each row exactly once"
        if e == 0:
            assert epoch_rows == rllib_first, "epoch 0 walks the batch in RLlib's order"
        elif shuffle and rows > 10:
            assert epoch_rows != list(range(rows)), f"epoch {e} was not reshuffled"


def test_versions_stay_pure_when_weights_change_between_updates(learner: Any) -> None:
    start = learner.conduit_version
    for i in range(3):
        before = [p.detach().clone() for p in learner.module[DEFAULT_MODULE_ID].parameters()]
        learner.update(batch=train_batch(90 + i), minibatch_size=32, num_epochs=2, shuffle_batch_per_epoch=True)
        infos = learner.conduit_feed.delivered
        assert {int(x.version) for x in infos} == {start + i}, "each update trains only its own rollout"
        assert len(infos) == 2 * 3 and all(int(x.staleness) == 0 for x in infos)
        after = list(learner.module[DEFAULT_MODULE_ID].parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), "the update changed no weights"
        # new weights arrive from elsewhere between updates: the next rollout is still delivered whole
        learner.module[DEFAULT_MODULE_ID].set_state(learner.module[DEFAULT_MODULE_ID].get_state())
    assert learner.conduit_version == start + 3


def test_a_multi_module_batch_is_refused_naming_what_is_supported(learner: Any) -> None:
    version = learner.conduit_version
    batch = MultiAgentBatch({DEFAULT_MODULE_ID: module_batch(10), "other": module_batch(10)}, env_steps=10)
    with pytest.raises(UnsupportedConfigError, match=r"one RLModule.*'default_policy', 'other'.*Multi-agent"):
        learner.update(batch=batch, minibatch_size=4, num_epochs=2)
    assert learner.conduit_version == version and learner.conduit_feed.semantics.pending_rollouts == 0
    assert len(conduit_minibatches(learner, train_batch(10), minibatch_size=4, num_epochs=1, shuffle=False)) == 2


def test_an_empty_train_batch_is_refused_clearly_and_changes_nothing(learner: Any) -> None:
    version = learner.conduit_version
    with pytest.raises(EmptyBufferError, match="'default_policy' has no rows"):
        learner.update(batch=train_batch(0), minibatch_size=16, num_epochs=2)
    assert learner.conduit_version == version, "a refused update must not count as an update"
    mbs = conduit_minibatches(learner, train_batch(10), minibatch_size=5, num_epochs=1, shuffle=False)
    assert [v for v, _, _ in mbs] == [version, version]


def test_a_restored_learner_continues_versions_and_minibatch_order(tmp_path: Path) -> None:
    a, b = build_learner(), build_learner()
    try:
        for n in (50, 60):
            a.update(batch=train_batch(n), minibatch_size=16, num_epochs=3, shuffle_batch_per_epoch=True)
        a.save_to_path(tmp_path / "learner")
        b.restore_from_path(tmp_path / "learner")
        assert b.conduit_version == a.conduit_version == 2
        got_a = conduit_minibatches(a, train_batch(70), minibatch_size=16, num_epochs=3, shuffle=True)
        got_b = conduit_minibatches(b, train_batch(70), minibatch_size=16, num_epochs=3, shuffle=True)
        assert got_b == got_a, "the restored learner must deliver the versions and row order the saved one does"
        assert {v for v, _, _ in got_b} == {2}
        # weight syncs ask only for the module: Conduit's state stays out of them
        assert "conduit_on_policy" not in a.get_state(components="rl_module")
        with pytest.raises(ConfigurationError, match="damaged"):
            b.set_state({"conduit_on_policy": {"version": 5, "feed": {"rng": "x"}}})
        assert b.conduit_version == 3, "a refused state leaves the learner as it was"
    finally:
        a.conduit_feed.close()
        b.conduit_feed.close()


@pytest.mark.parametrize(("config", "error", "words"), [
    (AlgorithmConfig(), UnsupportedAlgorithmError, "DQN and SAC.*PPO"),
    (MARWILConfig(), UnsupportedAlgorithmError, "DQN and SAC.*PPO.*MARWIL"),
    (PPOConfig().multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda aid, *a, **k: "a"),
     UnsupportedConfigError, "single-agent"),
    (PPOConfig().rl_module(model_config={"use_attention": True}), UnsupportedConfigError, "feed-forward"),
    (PPOConfig().framework("tf2"), UnsupportedConfigError, "torch"),
    (PPOConfig().learners(num_learners=3), UnsupportedConfigError, "num_learners <= 1"),
])
def test_enable_refuses_what_it_cannot_serve_and_leaves_the_config_alone(config: Any, error: type,
                                                                           words: str) -> None:
    learner_before, dict_before = config._learner_class, dict(config.learner_config_dict)
    with pytest.raises(error, match=words):
        conduit_rllib.enable(config)
    assert config._learner_class is learner_before and config.learner_config_dict == dict_before


def test_a_train_batch_with_a_column_conduit_cannot_hold_is_refused_without_counting_an_update(
        learner: Any) -> None:
    version = learner.conduit_version
    batch = module_batch(10)
    batch["infos"] = [{}] * 10
    with pytest.raises(UnsupportedConfigError, match="'infos' is a list"):
        learner.update(batch=MultiAgentBatch({DEFAULT_MODULE_ID: batch}, env_steps=10), minibatch_size=5)
    assert learner.conduit_version == version, "a refused update must not count as an update"
    mbs = conduit_minibatches(learner, train_batch(10), minibatch_size=5, num_epochs=1, shuffle=False)
    assert [v for v, _, _ in mbs] == [version, version] and learner.conduit_version == version + 1


def test_a_feed_state_round_trip_keeps_the_drop_count_and_refuses_damage_without_change() -> None:
    feed = MinibatchFeed(num_minibatches=2, num_epochs=2, seed=4, prefetch=False)
    feed.ingest(DEFAULT_MODULE_ID, module_batch(8), version=0)
    feed.seal()
    feed.set_policy_version(1)
    feed.drop_leftovers()
    assert feed.dropped_items == 8
    state = feed.state_dict()
    other = MinibatchFeed(num_minibatches=2, num_epochs=2, seed=4, prefetch=False)
    other.load_state_dict(state)
    assert other.dropped_items == 8 and other.state_dict()["policy_version"] == 1
    with pytest.raises(ConfigurationError, match="damaged"):
        other.load_state_dict({**state, "rng": None})
    assert other.dropped_items == 8 and other.state_dict()["policy_version"] == 1, "a refused load changed state"
    for f in (feed, other):
        f.ingest(DEFAULT_MODULE_ID, module_batch(8), version=1)
        f.seal()
    assert [b.policy_batches[DEFAULT_MODULE_ID][ROW].tolist() for b in feed.minibatches()] == \
        [b.policy_batches[DEFAULT_MODULE_ID][ROW].tolist() for b in other.minibatches()]
    feed.close()
    other.close()
