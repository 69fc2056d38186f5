"""PPO through Conduit makes the updates stock RLlib makes: the same number of SGD steps per train batch,
minibatches of exactly ``minibatch_size`` rows (RLlib's cyclic iterator), the same epochs, and the same
``num_env_steps_trained`` / ``num_module_steps_trained``; measured against RLlib's own PPO learner and
``MiniBatchCyclicIterator`` (no Ray cluster)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import conduit_rllib
import gymnasium as gym
import pytest
import torch
from conduit import ConfigurationError, OnPolicy
from conduit_rllib import MinibatchFeed
from conduit_rllib.learner import ConduitPPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

ROW = "row_id"
# (rows, minibatch_size, num_epochs): multiples and non-multiples, a minibatch larger than the batch
CASES = [(256, 64, 2), (250, 64, 2), (250, 64, 3), (100, 30, 2), (50, 64, 1), (10, 64, 1), (250, 100, 3), (7, 3, 1)]


def module_batch(n: int) -> SampleBatch:
    ids = torch.arange(n)
    return SampleBatch({Columns.OBS: ids.float()[:, None].repeat(1, 4) / n, Columns.ACTIONS: ids % 2,
                        Columns.ACTION_LOGP: torch.full((n,), -0.69), Columns.ACTION_DIST_INPUTS: torch.zeros(n, 2),
                        "advantages": ids.float() / n, "value_targets": torch.zeros(n),
                        Columns.VF_PREDS: torch.zeros(n), ROW: ids})


def train_batch(n: int) -> MultiAgentBatch:
    return MultiAgentBatch({DEFAULT_MODULE_ID: module_batch(n)}, env_steps=n)


def build(conduit: bool) -> Any:
    config = PPOConfig().environment("CartPole-v1").debugging(seed=0)
    if conduit:
        config = conduit_rllib.enable(config)
    learner = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(learner, ConduitPPOTorchLearner) == conduit
    return learner


@pytest.fixture(scope="module")
def learners() -> Any:
    stock, conduit = build(False), build(True)
    yield stock, conduit
    conduit.conduit_feed.close()


def rllib_rows(rows: int, minibatch_size: int, num_epochs: int) -> list[list[int]]:
    """Row ids of each minibatch of RLlib's own iterator, unshuffled."""
    return [mb.policy_batches[DEFAULT_MODULE_ID][ROW].tolist() for mb in MiniBatchCyclicIterator(
        train_batch(rows), num_epochs=num_epochs, minibatch_size=minibatch_size, shuffle_batch_per_epoch=False)]


def conduit_rows(learner: Any, rows: int, minibatch_size: int | None, num_epochs: int,
                 shuffle: bool) -> tuple[list[list[int]], list[int]]:
    """Row ids of each minibatch Conduit hands RLlib's update loop, and each one's env steps."""
    it = learner._create_iterator_if_necessary(training_data=TrainingData(batch=train_batch(rows)),
                                               num_epochs=num_epochs, minibatch_size=minibatch_size,
                                               shuffle_batch_per_epoch=shuffle)
    out, steps = [], []
    for mab in it:
        out.append(mab.policy_batches[DEFAULT_MODULE_ID][ROW].tolist())
        steps.append(mab.env_steps())
    return out, steps


def trained(learner: Any, rows: int, minibatch_size: int, num_epochs: int) -> dict[str, Any]:
    """Run one real ``Learner.update`` and return (SGD steps, minibatch sizes, the steps-trained metrics)."""
    sizes: list[int] = []
    update = learner._update

    def counting(batch: Any, **kwargs: Any) -> Any:
        sizes.append(len(batch[DEFAULT_MODULE_ID]))
        return update(batch, **kwargs)

    learner._update = counting
    try:
        result = learner.update(batch=train_batch(rows), minibatch_size=minibatch_size, num_epochs=num_epochs,
                                shuffle_batch_per_epoch=True)
    finally:
        del learner._update
    metrics = result["__all_modules__"]

    def value(key: str) -> Any:
        v = metrics[key]
        return v.peek() if hasattr(v, "peek") else v

    return {"updates": len(sizes), "sizes": sizes, "num_env_steps_trained": value("num_env_steps_trained"),
            "num_module_steps_trained": value("num_module_steps_trained")}


@pytest.mark.parametrize(("rows", "minibatch_size", "num_epochs"), CASES)
def test_update_count_minibatch_sizes_and_steps_trained_match_stock_rllib(
        learners: Any, rows: int, minibatch_size: int, num_epochs: int) -> None:
    stock, conduit = learners
    want = trained(stock, rows, minibatch_size, num_epochs)
    got = trained(conduit, rows, minibatch_size, num_epochs)
    assert got == want, f"{rows} rows, minibatch {minibatch_size}, {num_epochs} epochs: RLlib {want}, Conduit {got}"
    k = -(-num_epochs * rows // minibatch_size)
    assert want["updates"] == k and set(want["sizes"]) == {minibatch_size}, "the expectation itself is RLlib's"


@pytest.mark.parametrize(("rows", "minibatch_size", "num_epochs"), CASES)
def test_unshuffled_minibatches_are_rllibs_row_for_row(
        learners: Any, rows: int, minibatch_size: int, num_epochs: int) -> None:
    _, conduit = learners
    got, steps = conduit_rows(conduit, rows, minibatch_size, num_epochs, shuffle=False)
    assert got == rllib_rows(rows, minibatch_size, num_epochs), "not RLlib's cyclic minibatches"
    assert steps == [rows] * len(got), "each minibatch reports the train batch's env steps, as RLlib's does"


@pytest.mark.parametrize(("rows", "minibatch_size", "num_epochs"), [(250, 64, 3), (100, 30, 2), (256, 64, 2)])
def test_shuffled_every_row_trains_in_each_epoch_from_one_version(
        learners: Any, rows: int, minibatch_size: int, num_epochs: int) -> None:
    _, conduit = learners
    version = conduit.conduit_version
    got, _ = conduit_rows(conduit, rows, minibatch_size, num_epochs, shuffle=True)
    k = -(-num_epochs * rows // minibatch_size)
    assert [len(mb) for mb in got] == [minibatch_size] * k
    infos = conduit.conduit_feed.delivered
    assert {int(i.version) for i in infos} == {version} and all(int(i.staleness) == 0 for i in infos)
    stream = [r for mb in got for r in mb]
    assert stream[:rows] == list(range(rows)), "the first epoch walks the batch in its order, as RLlib's"
    for e in range(num_epochs):
        epoch = stream[e * rows:(e + 1) * rows]
        assert sorted(epoch) == list(range(rows)), f"epoch {e} does not hold each row exactly once"
        if e:
            assert epoch != list(range(rows)), f"epoch {e} was not reshuffled"
    pad = stream[num_epochs * rows:]
    assert len(pad) == k * minibatch_size - num_epochs * rows and len(set(pad)) == len(pad), \
        "the rows filling the last minibatch are distinct rows of one more pass"
    counts = Counter(stream)
    assert set(counts.values()) <= {num_epochs, num_epochs + 1}


def test_the_minibatch_sequence_is_deterministic_under_the_seed() -> None:
    a, b = build(True), build(True)
    try:
        for rows in (250, 97):
            assert conduit_rows(a, rows, 64, 3, shuffle=True) == conduit_rows(b, rows, 64, 3, shuffle=True)
    finally:
        a.conduit_feed.close()
        b.conduit_feed.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_feed_joins_pieces_across_epochs_with_and_without_prefetch(prefetch: bool) -> None:
    feed = MinibatchFeed(num_epochs=2, minibatch_size=64, shuffle=True, seed=5, prefetch=prefetch)
    sync = MinibatchFeed(num_epochs=2, minibatch_size=64, shuffle=True, seed=5, prefetch=False)
    try:
        seqs = []
        for f in (feed, sync):
            f.set_policy_version(0)
            f.ingest(DEFAULT_MODULE_ID, {ROW: torch.arange(10), "x": torch.arange(10).float() * 2}, version=0)
            f.seal()
            mbs = [m.policy_batches[DEFAULT_MODULE_ID] for m in f.minibatches()]
            for b in mbs:
                assert torch.equal(b["x"], b[ROW].float() * 2), "rows were mixed up while joining pieces"
            seqs.append([b[ROW].tolist() for b in mbs])
        assert seqs[0] == seqs[1]
        # 10 rows, 2 epochs, minibatch 64: one minibatch of 64 rows = 6 whole passes and 4 rows of a 7th
        (only,) = seqs[0]
        assert len(only) == 64 and Counter(only) == Counter({r: 7 if r in only[60:] else 6 for r in range(10)})
        assert [int(i.epoch) for i in feed.delivered] == list(range(7)) and feed.delivered[-1].last
        assert feed.edp is not None and len(feed.edp) == 0, "the rollout's storage is released after its last piece"
    finally:
        feed.close()
        sync.close()


def test_a_semantics_cutting_an_epoch_wrongly_is_refused() -> None:
    class Bad(OnPolicy):
        def epoch_sizes(self, n: int, epoch: int) -> list[int]:
            return [n - 1]  # drops a row in a whole epoch

    from conduit import ExperienceDataPlane, ExperienceSchema, Field

    edp = ExperienceDataPlane(ExperienceSchema({"x": Field((), torch.float32)}), capacity=16,
                              semantics=Bad(num_minibatches=1, num_epochs=2))
    try:
        edp.ingest({"x": torch.arange(8).float()}, version=0)
        edp.seal()
        with pytest.raises(ConfigurationError, match=r"epoch_sizes returned \[7\].*summing to 8"):
            edp.deliver()
    finally:
        edp.close()


def test_a_ppo_iteration_reports_stock_rllibs_steps_trained(ray_local: None) -> None:
    """Whole algorithms, same seed: the first iteration samples the same episodes, so RLlib's learner
    metrics must be equal (250 env steps, minibatch 64, 3 epochs: no multiple of 64)."""
    from conduit_rllib.workloads import ppo_cartpole

    got = []
    for conduit in (False, True):
        config = ppo_cartpole(batch=250, minibatch=64, epochs=3)
        algo = (conduit_rllib.enable(config) if conduit else config).build_algo()
        try:
            learners = algo.train()["learners"]
            got.append({k: int(learners["__all_modules__"][k])
                        for k in ("num_env_steps_trained", "num_module_steps_trained")}
                       | {"minibatch": float(learners[DEFAULT_MODULE_ID]["module_train_batch_size_mean"])})
        finally:
            algo.stop()
    stock, ours = got
    assert ours == stock, f"stock RLlib {stock}, through Conduit {ours}"
    assert stock["minibatch"] == 64.0 and stock["num_module_steps_trained"] % 64 == 0
