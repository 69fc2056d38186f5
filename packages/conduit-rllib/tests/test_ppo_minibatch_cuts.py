"""RLlib's minibatch cuts through Conduit where they were not yet RLlib's: a PPO config without a
``minibatch_size`` (RLlib then cuts minibatches of the train batch's *env steps*, not its module rows),
measured against RLlib's own PPO learner on the same real CartPole train batch; and a minibatch joined
from many pieces (``minibatch_size`` far above the rollout's rows) is one concatenation per column, not
one per piece (no Ray cluster: one local EnvRunner, no remote workers)."""

from __future__ import annotations

import copy
import sys
from typing import Any

import conduit_rllib
import gymnasium as gym
import pytest
import torch
from conduit_rllib import MinibatchFeed, on_policy
from conduit_rllib.errors import UnsupportedConfigError
from conduit_rllib.learner import ConduitPPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

ROW = "row_id"
SAMPLED = 300  # env steps sampled for the train batch
EPOCHS = 3


def ppo_config(conduit: bool) -> Any:
    """A real PPO config on CartPole without a minibatch_size (RLlib's default is 128; None is allowed)."""
    config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).learners(num_learners=0)
              .training(train_batch_size_per_learner=SAMPLED, minibatch_size=None, num_epochs=EPOCHS)
              .debugging(seed=0, log_level="ERROR"))
    return conduit_rllib.enable(config) if conduit else config


@pytest.fixture(scope="module")
def setup() -> Any:
    """(stock learner, Conduit learner, sampled episodes, the train batch RLlib's PPO connector builds from them)."""
    runner = SingleAgentEnvRunner(config=ppo_config(False))
    episodes = runner.sample(num_timesteps=SAMPLED)
    runner.stop()
    stock = ppo_config(False).build_learner(env=gym.make("CartPole-v1"))
    conduit = ppo_config(True).build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(conduit, ConduitPPOTorchLearner) and not isinstance(stock, ConduitPPOTorchLearner)
    built = stock._make_batch_if_necessary(TrainingData(episodes=copy.deepcopy(episodes)))
    module = built.policy_batches[DEFAULT_MODULE_ID]
    yield stock, conduit, episodes, {k: v for k, v in module.items() if isinstance(v, torch.Tensor)}
    conduit.conduit_feed.close()


def same_batch(cols: dict[str, torch.Tensor], env_steps: int) -> MultiAgentBatch:
    """A fresh copy of the train batch (RLlib shuffles its batch in place), each row tagged with its index."""
    n = int(next(iter(cols.values())).shape[0])
    return MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({**{k: v.clone() for k, v in cols.items()},
                                                            ROW: torch.arange(n)})}, env_steps=env_steps)


def update(learner: Any, **data: Any) -> dict[str, Any]:
    """One real ``Learner.update`` as PPO's training step calls it (this config's minibatch_size, num_epochs,
    shuffling); returns each SGD step's row ids (or sizes) and the steps-trained metrics."""
    steps: list[Any] = []
    real = learner._update

    def recording(batch: Any, **kwargs: Any) -> Any:
        mb = batch[DEFAULT_MODULE_ID]
        steps.append(mb[ROW].tolist() if ROW in mb else len(mb))
        return real(batch, **kwargs)

    config = learner.config
    learner._update = recording
    try:
        result = learner.update(**data, minibatch_size=config.minibatch_size, num_epochs=config.num_epochs,
                                shuffle_batch_per_epoch=config.shuffle_batch_per_epoch)
    finally:
        del learner._update
    metrics = result["__all_modules__"]

    def value(key: str) -> int:
        v = metrics[key]
        return int(v.peek() if hasattr(v, "peek") else v)

    return {"steps": steps, "num_env_steps_trained": value("num_env_steps_trained"),
            "num_module_steps_trained": value("num_module_steps_trained")}


def check_epochs(steps: list[list[int]], rows: int, epochs: int, who: str) -> None:
    stream = [r for mb in steps for r in mb]
    for e in range(epochs):
        assert sorted(stream[e * rows:(e + 1) * rows]) == list(range(rows)), \
            f"{who}: epoch {e} does not hold each of the {rows} rows exactly once"


@pytest.mark.parametrize("env_steps", ["sampled", "rows", "more"])
def test_without_minibatch_size_conduit_cuts_the_same_train_batch_as_rllib(setup: Any, env_steps: str) -> None:
    """RLlib cuts ``minibatch_size = batch.count`` (env steps) rows per minibatch; the train batch has the
    sampled env steps plus one bootstrap row per episode, so the two differ unless the batch reports its rows."""
    stock, conduit, _, cols = setup
    rows = int(cols["obs"].shape[0])
    assert rows > SAMPLED, "PPO's connector adds one bootstrap row per episode"
    s = {"sampled": SAMPLED, "rows": rows, "more": 2 * rows + 7}[env_steps]
    want = update(stock, batch=same_batch(cols, s))
    got = update(conduit, batch=same_batch(cols, s))
    k = -(-EPOCHS * rows // s)
    assert [len(mb) for mb in want["steps"]] == [s] * k, "the expectation itself is RLlib's: minibatches of env steps"
    assert [len(mb) for mb in got["steps"]] == [len(mb) for mb in want["steps"]], (
        f"{rows} rows reporting {s} env steps, {EPOCHS} epochs, no minibatch_size: RLlib makes "
        f"{len(want['steps'])} SGD steps of {[len(mb) for mb in want['steps']]} rows, Conduit "
        f"{len(got['steps'])} of {[len(mb) for mb in got['steps']]}")
    check_epochs(want["steps"], rows, EPOCHS, "RLlib")
    check_epochs(got["steps"], rows, EPOCHS, "Conduit")
    assert {k: v for k, v in got.items() if k != "steps"} == {k: v for k, v in want.items() if k != "steps"}, \
        "steps-trained metrics differ from RLlib's"


def test_without_minibatch_size_the_episode_path_matches_rllib(setup: Any) -> None:
    """PPO's own path (episodes through the learner connector): the batch reports as many env steps as rows."""
    stock, conduit, episodes, _ = setup
    want = update(stock, episodes=copy.deepcopy(episodes))
    got = update(conduit, episodes=copy.deepcopy(episodes))
    assert got == want and len(want["steps"]) == EPOCHS, f"RLlib {want}, Conduit {got}"


def test_an_uncuttable_batch_is_refused_typed_and_changes_nothing(setup: Any) -> None:
    """No minibatch_size, several epochs and a batch that reports 0 env steps: RLlib would cut empty
    minibatches forever; Conduit refuses, saying what to set, and the next update is served as usual."""
    _, conduit, _, cols = setup
    version, dropped = conduit.conduit_version, conduit.conduit_feed.dropped_items
    with pytest.raises(UnsupportedConfigError, match="minibatch_size"):
        update(conduit, batch=same_batch(cols, 0))
    assert (conduit.conduit_version, conduit.conduit_feed.dropped_items) == (version, dropped), \
        "the refused update changed the learner's state"
    rows = int(cols["obs"].shape[0])
    got = update(conduit, batch=same_batch(cols, rows))
    assert [len(mb) for mb in got["steps"]] == [rows] * EPOCHS


# -- joining many pieces -------------------------------------------------------------------------------------


def rllib_rows(n: int, minibatch_size: int, num_epochs: int) -> list[list[int]]:
    mab = MultiAgentBatch({"m": SampleBatch({"row": torch.arange(n), "twice": torch.arange(n) * 2})}, env_steps=n)
    return [mb.policy_batches["m"]["row"].tolist() for mb in MiniBatchCyclicIterator(
        mab, num_epochs=num_epochs, minibatch_size=minibatch_size, shuffle_batch_per_epoch=False)]


def delivered_stream(n: int, shuffle: bool) -> list[int]:
    """The rows Conduit's data plane delivers for a feed as below, piece by piece, each copied at once."""
    feed = MinibatchFeed(minibatch_size=64, num_epochs=2, shuffle=shuffle, prefetch=False)
    try:
        feed.ingest("m", {"row": torch.arange(n), "twice": torch.arange(n) * 2}, version=0)
        feed.seal()
        assert feed.edp is not None
        stream: list[int] = []
        while True:
            batch, info = feed.edp.deliver()
            stream += batch.tensor("row").tolist()
            if info.last:
                return stream
    finally:
        feed.close()


def test_zero_epochs_with_a_minibatch_size_is_refused_typed_and_changes_nothing(setup: Any) -> None:
    """num_epochs=0 with a minibatch_size: stock RLlib cuts no minibatch and fails with a raw error; Conduit
    trained one epoch. Now refused, naming num_epochs, before the learner's state changes."""
    _, conduit, _, cols = setup
    version, dropped = conduit.conduit_version, conduit.conduit_feed.dropped_items
    rows = int(cols["obs"].shape[0])
    with pytest.raises(UnsupportedConfigError, match="num_epochs >= 1"):
        conduit.update(batch=same_batch(cols, rows), minibatch_size=64, num_epochs=0)
    assert (conduit.conduit_version, conduit.conduit_feed.dropped_items) == (version, dropped), \
        "the refused update changed the learner's state"


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_minibatch_of_many_pieces_is_joined_by_one_concatenation_per_column(
        monkeypatch: pytest.MonkeyPatch, prefetch: bool, shuffle: bool) -> None:
    """minibatch_size 64 over rollouts of 1..9 rows: a minibatch is joined from up to 64 pieces (one per
    epoch it spans). Each column is concatenated once, from exactly the minibatch's rows (joining piece by
    piece re-copied the growing head each time: 63 concatenations, 2079 rows, for 64 one-row pieces), and
    the joined rows are the pieces' rows in delivery order (none overwritten by a later piece's delivery)."""
    want = {n: rllib_rows(n, 64, 2) for n in range(1, 10)}
    pieces = {n: delivered_stream(n, shuffle) for n in range(1, 10)}
    cats: list[list[int]] = []  # rows of each input, per torch.cat made by conduit_rllib.on_policy
    real_cat = torch.cat

    def counting(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if sys._getframe(1).f_globals.get("__name__") == on_policy.__name__:
            cats.append([int(t.shape[0]) for t in tensors])
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting)
    for n in range(1, 10):
        feed = MinibatchFeed(minibatch_size=64, num_epochs=2, shuffle=shuffle, prefetch=prefetch)
        try:
            feed.ingest("m", {"row": torch.arange(n), "twice": torch.arange(n) * 2}, version=0)
            feed.seal()
            cats.clear()
            got = []
            for mab in feed.minibatches():
                b = mab.policy_batches["m"]
                assert torch.equal(b["twice"], b["row"] * 2), "the columns of a minibatch were mixed up"
                got.append(b["row"].tolist())
            assert [r for mb in got for r in mb] == pieces[n], f"{n}-row rollout: joined rows are not the pieces'"
            if not shuffle:
                assert got == want[n], f"{n}-row rollout: not RLlib's minibatches: {got}"
            assert [len(mb) for mb in got] == [len(mb) for mb in want[n]], f"{n}-row rollout: not RLlib's cuts"
            joined = len(got)  # 64 > n rows: every minibatch spans epochs
            assert len(cats) == 2 * joined, (f"{n}-row rollout: {len(cats)} concatenations for {joined} joined "
                                             f"minibatches of 2 columns (want one per column): {cats[:6]}...")
            assert all(sum(c) == 64 for c in cats), f"{n}-row rollout: concatenated rows {[sum(c) for c in cats]}"
        finally:
            feed.close()
