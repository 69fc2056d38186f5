"""Multi-agent PPO through Conduit: each RLModule's rows go through a feed of its own, and each minibatch RLlib
trains holds every module's next minibatch, in lock step as RLlib's own iterator cuts a multi-agent batch (a module
with fewer rows cycles through more passes). Measured against RLlib's PPO learner and ``MiniBatchCyclicIterator``;
the whole-algorithm test on a local Ray. Before, ``enable`` refused multi-agent PPO configs."""

from __future__ import annotations

from typing import Any

import conduit_rllib
import pytest
import torch
from conduit_rllib import UnsupportedConfigError
from conduit_rllib.learner import ON_POLICY_COMPONENT, ConduitPPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator, MiniBatchDummyIterator

MODULES = ("p0", "p1")


def _config() -> PPOConfig:
    return (PPOConfig().environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .multi_agent(policies=set(MODULES), policy_mapping_fn=lambda agent_id, *args, **kwargs: f"p{agent_id}")
            .env_runners(num_env_runners=0).training(train_batch_size=64, minibatch_size=16, num_epochs=2)
            .debugging(seed=0))


def _module_batch(n: int, first: int) -> SampleBatch:
    ids = torch.arange(first, first + n)
    return SampleBatch({Columns.OBS: torch.sin(ids.float()[:, None] + torch.arange(4.0)), Columns.ACTIONS: ids % 2,
                        Columns.ACTION_LOGP: torch.full((n,), -0.69), Columns.ACTION_DIST_INPUTS: torch.zeros(n, 2),
                        "advantages": torch.cos(ids.float()), "value_targets": ids.float() / 100,
                        Columns.VF_PREDS: torch.zeros(n), "row_id": ids})


def _batch(rows: dict[str, int]) -> MultiAgentBatch:
    """A train batch of each module's ``rows`` (row ids 1000 * i + 0..n), reporting the most rows as env steps."""
    return MultiAgentBatch({m: _module_batch(n, 1000 * i) for i, (m, n) in enumerate(rows.items())},
                           env_steps=max(rows.values()))


@pytest.fixture(scope="module")
def learners() -> Any:
    """RLlib's multi-agent PPO learner and Conduit's, the latter's modules given the former's weights."""
    env = MultiAgentCartPole({"num_agents": 2})
    stock = _config().build_learner(env=env)
    ours = conduit_rllib.enable(_config()).build_learner(env=env)
    assert isinstance(ours, ConduitPPOTorchLearner) and sorted(ours.conduit_feeds) == list(MODULES)
    yield stock, ours
    ours.shutdown()


def _weights(learner: Any) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}": v.detach().clone() for m in MODULES for k, v in learner.module[m].state_dict().items()}


def _rows(iterator: Any) -> list[dict[str, list[int]]]:
    """Each step's row ids by module (read as each comes: a minibatch reuses the last one's memory)."""
    return [{m: torch.as_tensor(b["row_id"]).tolist() for m, b in mab.policy_batches.items()} for mab in iterator]


# (rows per module, minibatch_size, num_epochs, num_total_minibatches): the larger module first or second, RLlib's
# count for several learners, and RLlib's one-batch iterator (no minibatch_size, one epoch)
CASES = [({"p0": 50, "p1": 30}, 20, 2, 0), ({"p0": 30, "p1": 50}, 16, 3, 0), ({"p0": 40, "p1": 25}, 10, 1, 7),
         ({"p0": 20, "p1": 13}, None, 1, 0)]


@pytest.mark.parametrize(("rows", "size", "epochs", "total"), CASES)
def test_each_step_holds_every_modules_minibatch_rllibs_row_for_row(learners: Any, rows: dict[str, int],
                                                                     size: int | None, epochs: int, total: int) -> None:
    _, ours = learners
    version = ours.conduit_version
    cls = MiniBatchCyclicIterator if size else MiniBatchDummyIterator
    want = _rows(cls(_batch(rows), num_epochs=epochs, minibatch_size=size, shuffle_batch_per_epoch=False,
                     num_total_minibatches=total))
    got = _rows(ours._create_iterator_if_necessary(training_data=TrainingData(batch=_batch(rows)), num_epochs=epochs,
                                                   minibatch_size=size, shuffle_batch_per_epoch=False,
                                                   num_total_minibatches=total))
    assert got == want
    if size and not total:  # the expectation itself is RLlib's: steps until the largest module had its passes
        assert len(want) == -(-epochs * max(rows.values()) // size)
    for m in MODULES:
        assert {int(i.version) for i in ours.conduit_feeds[m].delivered} == {version}


def test_shuffled_each_module_trains_each_of_its_rows_in_every_pass(learners: Any) -> None:
    _, ours = learners
    got = _rows(ours._create_iterator_if_necessary(training_data=TrainingData(batch=_batch({"p0": 48, "p1": 20})),
                                                   num_epochs=2, minibatch_size=16, shuffle_batch_per_epoch=True))
    assert len(got) == 6  # ceil(2 * 48 / 16)
    for i, (m, n) in enumerate({"p0": 48, "p1": 20}.items()):
        stream = [r - 1000 * i for step in got for r in step[m]]
        assert len(stream) == 96 and stream[:n] == list(range(n)), "the first pass keeps the batch's order"
        passes = [stream[k:k + n] for k in range(0, len(stream) - len(stream) % n, n)]
        assert all(sorted(p) == list(range(n)) for p in passes), f"module {m}: a pass misses or repeats a row"
        assert any(p != list(range(n)) for p in passes[1:]), f"module {m}: later passes were not reshuffled"


def test_an_update_leaves_every_modules_weights_as_rllibs_own_minibatching(learners: Any) -> None:
    stock, ours = learners
    for m in MODULES:
        ours.module[m].load_state_dict(stock.module[m].state_dict())
    before = _weights(stock)
    for learner in (stock, ours):
        learner.update(batch=_batch({"p0": 50, "p1": 30}), minibatch_size=20, num_epochs=2,
                       shuffle_batch_per_epoch=False)
    after, want = _weights(ours), _weights(stock)
    for m in MODULES:
        assert any(not torch.equal(before[k], want[k]) for k in want if k.startswith(f"{m}.")), f"{m} did not train"
    for k in want:
        torch.testing.assert_close(after[k], want[k], msg=k)


def test_the_state_carries_every_modules_feed_and_a_restored_learner_reshuffles_as_the_saved_one(
        learners: Any) -> None:
    _, ours = learners
    state = ours.get_state(components=ON_POLICY_COMPONENT)
    assert sorted(state[ON_POLICY_COMPONENT]["feeds"]) == list(MODULES)
    twin = conduit_rllib.enable(_config().debugging(seed=7)).build_learner(env=MultiAgentCartPole({"num_agents": 2}))
    try:
        twin.set_state(state)
        assert twin.conduit_version == ours.conduit_version
        runs = [_rows(learner._create_iterator_if_necessary(
            training_data=TrainingData(batch=_batch({"p0": 40, "p1": 24})), num_epochs=3, minibatch_size=16,
            shuffle_batch_per_epoch=True)) for learner in (ours, twin)]
        assert runs[0] == runs[1], "the restored learner does not reshuffle as the saved one"
    finally:
        twin.shutdown()


def test_a_batch_refused_for_one_module_leaves_the_others_rows_dropped_by_the_next_update(learners: Any) -> None:
    _, ours = learners
    bad = _batch({"p0": 12, "p1": 8})
    bad.policy_batches["p1"]["extra"] = [0] * 8  # a list: no array Conduit can store
    dropped = ours.conduit_feeds["p0"].dropped_items
    with pytest.raises(UnsupportedConfigError, match=r"'extra' is a list"):
        ours._create_iterator_if_necessary(training_data=TrainingData(batch=bad), num_epochs=1, minibatch_size=4)
    got = _rows(ours._create_iterator_if_necessary(training_data=TrainingData(batch=_batch({"p0": 8, "p1": 8})),
                                                   num_epochs=1, minibatch_size=4, shuffle_batch_per_epoch=False))
    assert [s["p0"] for s in got] == [[0, 1, 2, 3], [4, 5, 6, 7]], "the refused batch's rows were trained"
    assert ours.conduit_feeds["p0"].dropped_items == dropped + 12, "p0's ingested rows were not dropped, counted"


def test_a_multi_agent_learner_has_no_single_feed_and_its_refusal_names_conduit_feeds(
        learners: Any) -> None:
    _, ours = learners
    with pytest.raises(AttributeError, match="conduit_feeds"):
        ours.conduit_feed  # noqa: B018


@pytest.mark.usefixtures("ray_local")
def test_a_multi_agent_ppo_iteration_trains_each_module_through_conduit_as_rllib_alone_does() -> None:
    """Same seed, one ``train()`` each: the same episodes are sampled, so each module's steps trained agree."""
    trained = {}
    for conduit in (True, False):
        algo = (conduit_rllib.enable(_config()) if conduit else _config()).build_algo()
        try:
            result = algo.train()["learners"]
            trained[conduit] = {m: result[m]["num_module_steps_trained"] for m in MODULES}
            if conduit:
                learner = algo.learner_group._learner
                assert learner.conduit_version == 1
                assert all(learner.conduit_feeds[m].delivered for m in MODULES), "a module bypassed Conduit"
        finally:
            algo.stop()
    assert trained[True] == trained[False] and all(v > 0 for v in trained[True].values())


@pytest.mark.usefixtures("ray_local")
def test_two_remote_learners_cut_rllibs_common_count_for_every_module() -> None:
    """Two learners, each on its shard of the episodes: RLlib hands both one count of minibatches (from the largest
    module's steps) and every module of every learner cuts exactly that many, as RLlib's own iterator does."""
    config = _config().learners(num_learners=2).training(train_batch_size=200, minibatch_size=32, num_epochs=2)
    trained = {}
    for conduit in (True, False):
        algo = (conduit_rllib.enable(config.copy()) if conduit else config.copy()).build_algo()
        try:
            result = algo.train()["learners"]
            trained[conduit] = {m: result[m]["num_module_steps_trained"] for m in MODULES}
            if conduit:
                counts = [r.get() for r in algo.learner_group.foreach_learner(lambda learner: (
                    learner.conduit_version, {m: len(f.delivered) for m, f in learner.conduit_feeds.items()}))]
                assert [v for v, _ in counts] == [1, 1] and all(min(c.values()) > 0 for _, c in counts), counts
        finally:
            algo.stop()
    assert trained[True] == trained[False] and all(v > 0 for v in trained[True].values()), trained


def test_a_removed_module_takes_its_feed_with_it_and_the_others_train_on() -> None:
    """Before: the removed module's feed (its prefetch thread and data plane) stayed with the learner for its
    life, one more per module a league removed."""
    import threading

    learner = conduit_rllib.enable(_config()).build_learner(env=MultiAgentCartPole({"num_agents": 2}))
    try:
        learner.update(batch=_batch({"p0": 40, "p1": 40}), minibatch_size=16, num_epochs=2)
        gone = learner.conduit_feeds["p1"]
        assert gone.edp is not None, "p1's feed made no data plane in the update"
        threads = sum(t.name.startswith("conduit-minibatch") and t.is_alive() for t in threading.enumerate())
        learner.remove_module("p1")
        assert list(learner.conduit_feeds) == ["p0"] and gone.edp is None, "p1's feed was not closed and dropped"
        after = sum(t.name.startswith("conduit-minibatch") and t.is_alive() for t in threading.enumerate())
        assert after == threads - 1, f"p1's prefetch thread did not end ({threads} -> {after} threads)"
        data = TrainingData(batch=_batch({"p0": 8}))
        got = _rows(learner._create_iterator_if_necessary(training_data=data, num_epochs=1, minibatch_size=4,
                                                          shuffle_batch_per_epoch=False))
        assert got == [{"p0": [0, 1, 2, 3]}, {"p0": [4, 5, 6, 7]}]
    finally:
        learner.shutdown()
