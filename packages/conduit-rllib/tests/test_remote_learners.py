"""Remote learners (``num_learners >= 1``). DQN/SAC: the buffer stays in the driver, each learner trains its
contiguous slice of every sample (:mod:`conduit_rllib.remote`). PPO with two learners: each cuts RLlib's common
count of minibatches from its shard.

Real RLlib algorithms with learner actors on a local Ray (two learners average gradients over torch's gloo
backend on this CPU box), tiny settings.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import conduit_rllib  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import ConfigurationError  # noqa: E402
from conduit_rllib import UnsupportedConfigError  # noqa: E402
from conduit_rllib.delivery import ConduitSampledEpisodes  # noqa: E402
from conduit_rllib.learner import REPLAY_COMPONENT  # noqa: E402
from conduit_rllib.profiling import ExperiencePathProbe  # noqa: E402
from conduit_rllib.remote import ConduitLearnerGroup, route_to_remote_learners, split_sample  # noqa: E402
from conduit_rllib.workloads import dqn_large_obs, ppo_cartpole, sac_pendulum  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from ray.rllib.core.learner.learner_group import LearnerGroup  # noqa: E402
from ray.rllib.utils.metrics import (  # noqa: E402
    ENV_RUNNER_RESULTS,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_TRAINED,
    TD_ERROR_KEY,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_offpolicy_learner_state import same  # noqa: E402, I001  (sibling test helper)


def sample_of(rows: int) -> ConduitSampledEpisodes:
    """A sample whose row i holds i in every column (obs rows of 3), handles 100 + i."""
    i = torch.arange(rows)
    columns = {"obs": i.float().repeat_interleave(3).reshape(rows, 3), "actions": i.clone(),
               "rewards": i.float()}
    return ConduitSampledEpisodes(columns, i + 100)


@pytest.mark.parametrize(("rows", "shards", "sizes"), [(7, 3, [3, 2, 2]), (6, 2, [3, 3]), (5, 1, [5]), (4, 4, [1] * 4)])
def test_a_sample_splits_into_contiguous_slices_in_order_each_owning_its_rows(rows: int, shards: int,
                                                                            sizes: list[int]) -> None:
    sample = sample_of(rows)
    pieces = split_sample(sample, shards)
    assert [len(p) for p in pieces] == sizes
    assert torch.cat([p.handles for p in pieces]).tolist() == sample.handles.tolist(), "slices out of order"
    for name, col in sample.columns.items():
        assert torch.equal(torch.cat([p.columns[name] for p in pieces]), col), f"column {name!r} not kept"
    for p in pieces:
        for name, col in p.columns.items():
            # a view would ship the whole reused delivery buffer through Ray
            assert col.untyped_storage().nbytes() == col.numel() * col.element_size(), f"{name!r} is a view"
            assert col.untyped_storage().data_ptr() != sample.columns[name].untyped_storage().data_ptr()
    pieces[0].columns["rewards"][0] = -1.0
    assert sample.columns["rewards"][0] == 0.0, "a slice shares memory with the sample"


@pytest.mark.parametrize("shards", [0, 5])
def test_too_few_rows_for_the_learners_is_refused(shards: int) -> None:
    with pytest.raises(ConfigurationError, match="train_batch_size_per_learner"):
        split_sample(sample_of(4), shards)


def learner_views(algo: Any) -> list[tuple[int, int, list[int]]]:
    """Per learner, in learner order: Conduit batches, native batches, the handles of its last Conduit batch."""
    return [r.get() for r in algo.learner_group.foreach_learner(
        lambda learner: (learner.conduit_batches, learner.native_batches,
                         [] if learner.conduit_last_handles is None else learner.conduit_last_handles.tolist()))]


def test_dqn_with_two_remote_learners_trains_slices_in_order_and_a_restore_brings_one_buffer_copy_back(
        ray_local: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two remote DQN learners train contiguous slices of the driver's sample, in order. Then a restore: RLlib
    loads learner 0's state, the buffer's copy included, into every learner; the driver takes one copy back (a
    buffer's state may be gigabytes) and the other learners drop theirs.

    (One algorithm for both checks: a two-learner build is the expensive part; ``store_buffer_in_checkpoints``
    changes only what a checkpoint holds, not how the learners train.)"""
    config = (dqn_large_obs(4, steps=40, batch=10, capacity=200, learning_starts=20)
              .learners(num_learners=2).training(store_buffer_in_checkpoints=True))
    algo = conduit_rllib.enable(config).build_algo()
    try:
        assert isinstance(algo.learner_group, ConduitLearnerGroup)
        buffer = algo.local_replay_buffer
        assert isinstance(buffer, conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer)
        assert buffer.device == torch.device("cpu"), "a remote learner's slices leave from host memory"
        result = algo.train()
        result = algo.train()  # prioritized: every update's TD errors went back to the sampled items
        views = learner_views(algo)
        assert len(views) == 2 and all(c > 0 and n == 0 for c, n, _ in views), \
            f"not every learner trained Conduit slices only: {views}"
        assert views[0][0] == views[1][0], "the learners trained different numbers of updates"
        trained = result["learners"]["__all_modules__"][NUM_ENV_STEPS_TRAINED]
        assert trained > 0 and trained % 10 == 0, f"RLlib counts 10 rows per update (5 per learner): {trained}"
        assert len(buffer) >= 80

        # one more update by hand: learner k trained rows [5k, 5k + 5) of this sample, so RLlib's concatenation of
        # the learners' TD errors (in learner order) follows the sample's rows
        sample = buffer.sample(num_items=10, n_step=1, beta=0.4, sample_episodes=True)
        results = algo.learner_group.update(episodes=sample)
        views = learner_views(algo)
        assert [h for _, _, h in views] == [sample.handles[:5].tolist(), sample.handles[5:].tolist()]
        errors = [sum(len(e) for e in r[DEFAULT_MODULE_ID][TD_ERROR_KEY].peek()) for r in results]
        assert errors == [5, 5], f"each learner reports the TD errors of its own slice: {errors}"

        stored = len(algo.local_replay_buffer)
        algo.save_to_path(tmp_path / "ckpt")
        received: list[Any] = []
        results_of = ConduitLearnerGroup._results

        def recording(results: Any) -> list[Any]:
            values = results_of(results)
            received.extend(values)
            return values

        monkeypatch.setattr(ConduitLearnerGroup, "_results", staticmethod(recording))
        algo.restore_from_path(tmp_path / "ckpt")
        assert len(algo.local_replay_buffer) == stored
        assert sum(isinstance(v, dict) and "edp" in v for v in received) == 1, received
        kept = [r.get() for r in algo.learner_group.foreach_learner(lambda lr: lr._conduit_pending_state is None)]
        assert kept == [True, True], "a learner still holds a copy of the buffer's state"
    finally:
        algo.stop()


def test_sac_with_one_remote_learner_trains_conduit_batches_and_the_probe_times_the_driver_side(
        ray_local: None) -> None:
    config = sac_pendulum(steps=30, batch=16, prioritized=False, learning_starts=16).learners(num_learners=1)
    algo = conduit_rllib.enable(config).build_algo()
    try:
        probe = ExperiencePathProbe(algo)
        result = algo.train()
        ((conduit, native, handles),) = learner_views(algo)
        assert conduit > 0 and native == 0 and len(handles) == 16
        assert result["learners"]["__all_modules__"][NUM_ENV_STEPS_TRAINED] == 16 * conduit
        parts = probe.take()
        assert probe.parts == ("add", "sample", "priorities") and "batch" not in parts, parts
        assert parts["add"] > 0 and parts["sample"] > 0 and parts["update"] > 0, parts
        assert parts["exposed"] == parts["add"] + parts["sample"] + parts["priorities"], parts
        probe.close()
    finally:
        algo.stop()


def dqn(*, learners: int, store: bool = True) -> Any:
    """A Conduit DQN (4-dimensional observations, prioritized buffer of 100) with ``store_buffer_in_checkpoints``."""
    config = dqn_large_obs(4, steps=40, batch=8, capacity=100, learning_starts=20)
    return conduit_rllib.enable(config.learners(num_learners=learners)
                                .training(store_buffer_in_checkpoints=store)).build_algo()


def kept_copies(algo: Any) -> list[Any]:
    """Per remote learner, the replay part it keeps (None: none)."""
    return [r.get() for r in algo.learner_group.foreach_learner(lambda learner: learner._conduit_pending_state)]


def test_a_checkpoint_carries_the_buffer_between_a_driver_learner_and_remote_learners(ray_local: None,
                                                                                      tmp_path: Path) -> None:
    local = dqn(learners=0)
    try:
        local.train()
        saved = local.local_replay_buffer.get_state()
        local.save_to_path(tmp_path / "local")
    finally:
        local.stop()
    remote = dqn(learners=1)
    try:
        remote.restore_from_path(tmp_path / "local")
        same(remote.local_replay_buffer.get_state(), saved, "the local checkpoint's buffer, in the remote driver")
        assert kept_copies(remote) == [None], "the remote learner still holds a copy of the buffer after the restore"
        remote.train()
        trained = remote.local_replay_buffer.get_state()
        assert len(remote.local_replay_buffer) > len(local.local_replay_buffer), "the restored buffer grew"
        remote.save_to_path(tmp_path / "remote")
        assert kept_copies(remote) == [None], "learner 0 kept its copy of the buffer after the save"
    finally:
        remote.stop()
    again = dqn(learners=0)
    try:
        again.restore_from_path(tmp_path / "remote")
        same(again.local_replay_buffer.get_state(), trained, "the remote checkpoint's buffer, in a driver learner")
    finally:
        again.stop()


def test_remote_learner_state_holds_the_buffer_as_asked_and_a_bad_part_changes_nothing(ray_local: None) -> None:
    algo = dqn(learners=1, store=False)
    try:
        algo.train()
        buffer = algo.local_replay_buffer
        assert REPLAY_COMPONENT not in algo.learner_group.get_state()["learner"], "saved without the flag"
        named = algo.learner_group.get_state(components=f"learner/{REPLAY_COMPONENT}")["learner"]
        same(named[REPLAY_COMPONENT], buffer.get_state(), "the buffer asked for by name")
        state = algo.get_state()
        before = buffer.get_state()
        bad = {**state["learner_group"]["learner"], REPLAY_COMPONENT: {**named[REPLAY_COMPONENT], "capacity": 7}}
        weights = algo.learner_group.get_weights()
        with pytest.raises(ConfigurationError):
            algo.learner_group.set_state({"learner": bad})
        same(buffer.get_state(), before, "the buffer after a refused state")
        same(algo.learner_group.get_weights(), weights, "the weights after a refused state")
        algo.learner_group.set_state({"learner": {**state["learner_group"]["learner"], **named}})
        same(buffer.get_state(), before, "the buffer after its own state")
    finally:
        algo.stop()
    assert buffer.edp.closed, "algo.stop() left the driver's buffer open"


def test_a_learner_group_subclass_is_refused_not_stripped_of_its_overrides() -> None:
    class MyGroup(LearnerGroup):
        pass

    group = MyGroup.__new__(MyGroup)  # (route_to_remote_learners looks at the type first)
    group._is_shut_down = True  # (nothing to shut down when it is collected)
    with pytest.raises(UnsupportedConfigError, match="MyGroup"):
        route_to_remote_learners(group, buffer=None)
    assert type(group) is MyGroup


def test_ppo_with_two_learners_steps_them_in_lock_step_and_a_restore_keeps_each_ones_minibatch_order(
        ray_local: None) -> None:
    """Two PPO learners train RLlib's common count of minibatches through Conduit, each from its own shard, in lock
    step (both at version 1 after an iteration).

    RLlib saves learner 0's state and loads it into every learner. Each learner's permutation generator is
    Conduit's part of that state, and the learners' shards differ in size: a generator that advanced by a
    permutation of its shard's rows would differ between learners, and a restore (here a round trip of the
    algorithm's own state) would hand learner 1 learner 0's, changing what it trains next. One draw per rollout
    keeps the generators equal, so the round trip changes no learner's.

    (One algorithm for both checks: a two-learner PPO build is the expensive part, and the lock-step count is
    RLlib's for any epochs and minibatch size.)"""
    config = ppo_cartpole(batch=200, minibatch=32, epochs=3).learners(num_learners=2)  # shuffled passes

    def feed_state(learner: Any) -> tuple[int, int, Any]:
        rows = sum(len(i.handles) for i in learner.conduit_feed.delivered if int(i.epoch) == 0)
        return learner.conduit_version, rows, learner.conduit_feed.state_dict(drop_pending=True)["rng"].clone()

    algo = conduit_rllib.enable(config).build_algo()
    try:
        result = algo.train()
        got = [r.get() for r in algo.learner_group.foreach_learner(
            lambda learner: (learner.conduit_version, [(int(i.epoch), len(i.handles))
                                                       for i in learner.conduit_feed.delivered]))]
        assert len(got) == 2 and [v for v, _ in got] == [1, 1], got
        # RLlib's count for both learners: int(num_epochs * env steps / (learners * minibatch_size)); each shard
        # has a few more rows than env steps (the learner connector's row at each episode's end)
        steps = result[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED]
        total = int(3 * steps / (2 * 32))
        assert total > 0, steps
        for _, pieces in got:
            shard = sum(n for e, n in pieces if e == 0)
            assert shard > 0 and sum(n for _, n in pieces) == total * 32, \
                f"a learner with {shard} rows did not train RLlib's {total} minibatches of 32: {pieces}"

        algo.train()
        before = [r.get() for r in algo.learner_group.foreach_learner(feed_state)]
        assert [v for v, _, _ in before] == [2, 2] and all(rows > 0 for _, rows, _ in before), before
        algo.set_state(algo.get_state())  # what a checkpoint's save and restore amount to
        after = [r.get() for r in algo.learner_group.foreach_learner(feed_state)]
        assert all(torch.equal(b[2], a[2]) for b, a in zip(before, after, strict=True)), \
            f"a learner's permutation generator changed in the round trip (shard rows {[r for _, r, _ in before]})"
    finally:
        algo.stop()
