"""PPO's on-policy path with RLlib's real PPO torch learner (no Ray cluster): minibatch counts and sizes
against RLlib's own iterator, version purity, refused batches, checkpoints, and enable() refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import conduit_rllib
import gymnasium as gym
import pytest
import torch
from conduit import ConfigurationError, EmptyBufferError, SchemaError
from conduit_rllib import MinibatchFeed, UnsupportedAlgorithmError, UnsupportedConfigError
from conduit_rllib.learner import ConduitPPOTorchLearner
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.algorithms.dqn import DQNConfig
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


def conduit_update(learner: Any, rows: int, *, minibatch_size: int, num_epochs: int,
                   shuffle: bool) -> tuple[list[list[int]], list[int], list[Any]]:
    """Row ids and env steps of each minibatch Conduit hands RLlib's update loop for ``train_batch(rows)``
    (taken as each arrives: a minibatch is valid until the next is asked for), and the pieces (SampleInfo)
    the feed delivered for them."""
    it = learner._create_iterator_if_necessary(
        training_data=TrainingData(batch=train_batch(rows)), num_epochs=num_epochs, minibatch_size=minibatch_size,
        shuffle_batch_per_epoch=shuffle)
    mbs, steps = [], []
    for mab in it:
        assert set(mab.policy_batches) == {DEFAULT_MODULE_ID}
        mbs.append(mab.policy_batches[DEFAULT_MODULE_ID][ROW].tolist())
        steps.append(mab.env_steps())
    return mbs, steps, list(learner.conduit_feed.delivered)


def rllib_minibatches(rows: int, minibatch_size: int, num_epochs: int, total: int = 0) -> list[list[int]]:
    """Row ids of each minibatch of RLlib's own ``MiniBatchCyclicIterator`` over ``train_batch(rows)``, unshuffled
    (``total``: its ``num_total_minibatches``)."""
    return [mb.policy_batches[DEFAULT_MODULE_ID][ROW].tolist() for mb in MiniBatchCyclicIterator(
        train_batch(rows), num_epochs=num_epochs, minibatch_size=minibatch_size, shuffle_batch_per_epoch=False,
        num_total_minibatches=total)]


def cyclic_pieces(rows: int, minibatch_size: int, num_epochs: int) -> list[tuple[int, int]]:
    """(pass, rows) of each piece the feed delivers for RLlib's cuts: the stream of K * minibatch_size rows
    (K = ceil(num_epochs * rows / minibatch_size)) is cut at every minibatch's end and at every pass's end."""
    total = -(-num_epochs * rows // minibatch_size) * minibatch_size
    cuts = sorted(set(range(minibatch_size, total + 1, minibatch_size)) | set(range(rows, total, rows)))
    return [(a // rows, b - a) for a, b in zip([0, *cuts], cuts, strict=False)]


@pytest.mark.parametrize(("rows", "minibatch_size", "num_epochs", "total"), [
    (100, 30, 2, 5),    # fewer than the epochs need (ceil(200 / 30) = 7): RLlib stops at 5, mid-epoch
    (100, 30, 2, 9),    # more: a third and a fourth pass go on
    (7, 3, 1, 4),       # tiny: [0, 1, 2], [3, 4, 5], [6, 0, 1], [2, 3, 4]
    (64, 16, 3, 12),    # the epochs' own count
    (10, 64, 1, 2),     # a minibatch larger than the shard: cycled over it, as RLlib does
])
def test_several_learners_count_of_minibatches_is_rllibs(learner: Any, rows: int, minibatch_size: int,
                                                         num_epochs: int, total: int) -> None:
    """With several learners RLlib passes each one ``num_total_minibatches``: exactly that many minibatches of
    ``minibatch_size`` rows from its shard, whatever the epochs say, so the learners step in lock step."""
    it = learner._create_iterator_if_necessary(
        training_data=TrainingData(batch=train_batch(rows)), num_epochs=num_epochs, minibatch_size=minibatch_size,
        shuffle_batch_per_epoch=False, num_total_minibatches=total)
    mbs = [mab.policy_batches[DEFAULT_MODULE_ID][ROW].tolist() for mab in it]
    rllib = rllib_minibatches(rows, minibatch_size, num_epochs, total)
    assert len(rllib) == total and {len(mb) for mb in rllib} == {minibatch_size}, "the expectation itself is RLlib's"
    assert mbs == rllib, f"not RLlib's {total} minibatches of {minibatch_size} rows: {mbs}"


@pytest.mark.parametrize(("rows", "minibatch_size", "num_epochs", "shuffle"), [
    (100, 30, 2, True),     # not divisible: K = ceil(200 / 30) = 7; 10 rows of a third (reshuffled) pass fill the last
    (100, 1000, 2, True),   # minibatch larger than the batch: one minibatch of 10 whole passes, as RLlib cycles
    (64, 16, 3, True),      # divisible: 12 minibatches, every pass ends on a minibatch's end
    (7, 3, 1, False),       # tiny, one epoch: [0, 1, 2], [3, 4, 5], [6, 0, 1]
    (250, 100, 3, False),   # K = ceil(7.5) = 8: rows 0-49 train a fourth time
])
def test_minibatches_are_rllibs_cyclic_cuts_and_cover_each_row_in_every_epoch(
        learner: Any, rows: int, minibatch_size: int, num_epochs: int, shuffle: bool) -> None:
    version = learner.conduit_version
    mbs, steps, infos = conduit_update(learner, rows, minibatch_size=minibatch_size, num_epochs=num_epochs,
                                       shuffle=shuffle)
    rllib = rllib_minibatches(rows, minibatch_size, num_epochs)
    k = -(-num_epochs * rows // minibatch_size)
    assert len(rllib) == k and {len(mb) for mb in rllib} == {minibatch_size}, "the expectation itself is RLlib's"
    assert [len(mb) for mb in mbs] == [len(mb) for mb in rllib], \
        f"expected RLlib's {k} minibatches of exactly {minibatch_size} rows, got sizes {[len(mb) for mb in mbs]}"
    assert steps == [rows] * k, "each minibatch reports the train batch's env steps, as RLlib's does"
    assert {int(i.version) for i in infos} == {version} and all(int(i.staleness) == 0 for i in infos), \
        "one update's minibatches come from one policy version"
    assert learner.conduit_version == version + 1
    assert [(int(i.epoch), len(i.handles)) for i in infos] == cyclic_pieces(rows, minibatch_size, num_epochs), \
        "the pieces end at each minibatch's end and each pass's end"
    assert infos[-1].last and not any(i.last for i in infos[:-1])
    stream = [r for mb in mbs for r in mb]
    rllib_first = [r for mb in rllib for r in mb][:rows]
    assert stream[:rows] == rllib_first == list(range(rows)), "epoch 0 walks the batch in RLlib's order"
    whole = len(stream) // rows  # whole passes: the E epochs and any the cycling adds (10 for 100 rows in 1000)
    assert whole >= num_epochs
    for e in range(whole):
        epoch_rows = stream[e * rows:(e + 1) * rows]
        assert sorted(epoch_rows) == list(range(rows)), f"epoch {e} does not hold each row exactly once"
        if e and shuffle and rows > 10:
            assert epoch_rows != list(range(rows)), f"epoch {e} was not reshuffled"
            assert epoch_rows != stream[(e - 1) * rows:e * rows], f"epoch {e} repeats epoch {e - 1}'s order"
    pad = stream[whole * rows:]
    assert len(pad) == k * minibatch_size - whole * rows and len(set(pad)) == len(pad), \
        f"the rows filling the last minibatch are distinct rows of one more pass, got {pad}"
    if not shuffle:
        assert mbs == rllib, "unshuffled, Conduit's minibatches are RLlib's row for row"


def test_versions_stay_pure_when_weights_change_between_updates(learner: Any) -> None:
    start = learner.conduit_version
    update = learner._update
    sizes: list[int] = []

    def counting(batch: Any, **kwargs: Any) -> Any:  # RLlib's SGD step: record the minibatch's rows
        sizes.append(len(batch[DEFAULT_MODULE_ID]))
        return update(batch, **kwargs)

    for i in range(3):
        rows = 90 + i
        sizes.clear()
        before = [p.detach().clone() for p in learner.module[DEFAULT_MODULE_ID].parameters()]
        learner._update = counting
        try:
            learner.update(batch=train_batch(rows), minibatch_size=32, num_epochs=2, shuffle_batch_per_epoch=True)
        finally:
            del learner._update
        infos = learner.conduit_feed.delivered
        assert {int(x.version) for x in infos} == {start + i}, "each update trains only its own rollout"
        assert all(int(x.staleness) == 0 for x in infos)
        assert sizes == [len(mb) for mb in rllib_minibatches(rows, 32, 2)] == [32] * 6, \
            f"{rows} rows, 2 epochs: RLlib's ceil({2 * rows} / 32) = 6 SGD steps of 32 rows, got {sizes}"
        assert [(int(x.epoch), len(x.handles)) for x in infos] == cyclic_pieces(rows, 32, 2), \
            "both epochs deliver the whole rollout, then the head of a third pass fills the last minibatch"
        after = list(learner.module[DEFAULT_MODULE_ID].parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), "the update changed no weights"
        # new weights arrive from elsewhere between updates: the next rollout is still delivered whole
        learner.module[DEFAULT_MODULE_ID].set_state(learner.module[DEFAULT_MODULE_ID].get_state())
    assert learner.conduit_version == start + 3


def test_a_batch_with_a_module_the_learner_lacks_is_refused_before_anything_is_ingested(learner: Any) -> None:
    """RLlib refuses such a batch at its first minibatch (a ValueError); Conduit's refusal is one too, and comes
    before any module's rows are ingested."""
    version = learner.conduit_version
    batch = MultiAgentBatch({DEFAULT_MODULE_ID: module_batch(10), "other": module_batch(10)}, env_steps=10)
    with pytest.raises(SchemaError, match=r"modules \['other'\].*has \['default_policy'\].*Nothing was ingested"):
        learner.update(batch=batch, minibatch_size=4, num_epochs=2)
    assert learner.conduit_version == version and learner.conduit_feed.semantics.pending_rollouts == 0
    assert list(learner.conduit_feeds) == [DEFAULT_MODULE_ID], "a feed was made for the unknown module"
    mbs = conduit_minibatches(learner, train_batch(10), minibatch_size=4, num_epochs=1, shuffle=False)
    assert [ids for _, _, ids in mbs] == rllib_minibatches(10, 4, 1) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    assert {v for v, _, _ in mbs} == {version}, "the refused batch took no version"


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
    (DQNConfig().multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda aid, *a, **k: "a"),
     UnsupportedConfigError, "multi-agent, but .*single-agent buffer"),
    (PPOConfig().rl_module(model_config={"use_attention": True}), UnsupportedConfigError, "feed-forward"),
    (PPOConfig().framework("tf2"), UnsupportedConfigError, "torch"),
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
