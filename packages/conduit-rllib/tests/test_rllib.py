"""Conduit inside real RLlib runs (local Ray, CPU): DQN, SAC and PPO, the learner's batch, checkpoints."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import conduit_rllib
import numpy as np
import pytest
import torch
from conduit_rllib import ConduitPrioritizedEpisodeReplayBuffer, ConduitSampledEpisodes
from conduit_rllib.workloads import dqn_large_obs, ppo_cartpole, sac_pendulum
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

pytestmark = pytest.mark.usefixtures("ray_local")


def learner_of(algo: Algorithm) -> Any:
    return next(iter(algo.learner_group.foreach_learner(lambda learner: learner))).get()


def cyclic_pieces(rows: int, minibatch_size: int, num_epochs: int) -> list[tuple[int, int]]:
    """(pass, rows) of each piece Conduit's PPO feed delivers for a train batch of ``rows``: RLlib's
    ``MiniBatchCyclicIterator`` makes K minibatches of exactly ``minibatch_size`` rows (K counted here with
    RLlib's iterator itself), a stream cut at every minibatch's end and at every pass's end."""
    batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({"x": torch.arange(rows)})}, env_steps=rows)
    sizes = [len(mb.policy_batches[DEFAULT_MODULE_ID]) for mb in MiniBatchCyclicIterator(
        batch, num_epochs=num_epochs, minibatch_size=minibatch_size, shuffle_batch_per_epoch=False)]
    assert sizes == [minibatch_size] * -(-num_epochs * rows // minibatch_size), "the expectation itself is RLlib's"
    total = sum(sizes)
    cuts = sorted(set(range(minibatch_size, total + 1, minibatch_size)) | set(range(rows, total, rows)))
    return [(a // rows, b - a) for a, b in zip([0, *cuts], cuts, strict=False)]


@pytest.fixture(scope="module")
def dqn(ray_local: None) -> Any:
    """A Conduit DQN on 8-dimensional observations after one iteration (learning from step 60)."""
    config = dqn_large_obs(8, steps=120, batch=16, capacity=100, learning_starts=60)
    config.training(store_buffer_in_checkpoints=True)  # its checkpoints hold the buffer
    algo = conduit_rllib.enable(config).build_algo()
    algo.train()
    yield algo
    algo.stop()


def test_dqn_trains_from_conduit_batches(dqn: Algorithm) -> None:
    buf = dqn.local_replay_buffer
    assert isinstance(buf, ConduitPrioritizedEpisodeReplayBuffer)
    assert len(buf) == 100, "capacity 100, 120 steps added: FIFO per transition"
    learner = learner_of(dqn)
    assert learner.conduit_batches >= 50 and learner.native_batches == 0, (learner.conduit_batches,
                                                                          learner.native_batches)
    assert learner.conduit_replay is buf
    stats = buf.edp.telemetry.summary()
    assert stats["deliver"]["calls"] == learner.conduit_batches, "one Conduit delivery per learner update"
    leaves = buf.edp.semantics.sampler.state_dict()["leaves"]
    assert len(np.unique(leaves[leaves > 0])) > 10, "TD errors reached the priorities"


def test_the_learner_batch_equals_what_rllibs_connector_builds(dqn: Algorithm) -> None:
    """The same transitions, turned into a train batch by RLlib's own learner connector, give the same tensors."""
    learner = learner_of(dqn)
    s = dqn.local_replay_buffer.sample(num_items=16, n_step=1, gamma=0.99, beta=0.4, sample_episodes=True)
    assert isinstance(s, ConduitSampledEpisodes)
    native = learner._learner_connector(rl_module=learner.module, batch={}, episodes=list(s), shared_data={},
                                        metrics=learner.metrics)["default_policy"]
    ours = s.to_multi_agent_batch().policy_batches["default_policy"]
    assert set(native) == set(ours), (sorted(native), sorted(ours))
    for k in native:
        a, b = torch.as_tensor(native[k]), ours[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
        torch.testing.assert_close(a, b, msg=f"column {k}")


def test_checkpoint_round_trip_keeps_the_buffer(dqn: Algorithm, tmp_path: Path) -> None:
    buf = dqn.local_replay_buffer
    calls = {"n": 0}
    orig = buf.get_state

    def counting() -> dict[str, Any]:
        calls["n"] += 1
        return orig()

    buf.get_state = counting
    dqn.train()
    assert calls["n"] == 0, "training (weight sync included) must not serialize the buffer"
    buf.get_state = orig
    path = dqn.save_to_path(tmp_path / "ckpt")
    before = buf.get_state()
    restored = Algorithm.from_checkpoint(path)
    try:
        rb = restored.local_replay_buffer
        assert isinstance(rb, ConduitPrioritizedEpisodeReplayBuffer) and rb is not buf
        after = rb.get_state()
        assert len(rb) == len(buf)
        for k, v in before["edp"]["storage"]["data"].items():
            assert torch.equal(after["edp"]["storage"]["data"][k], v), f"column {k} not restored"
        np.testing.assert_array_equal(after["edp"]["semantics"]["sampler"]["leaves"],
                                      before["edp"]["semantics"]["sampler"]["leaves"])
        x = buf.sample(num_items=8, n_step=1, beta=0.4, sample_episodes=True)
        y = rb.sample(num_items=8, n_step=1, beta=0.4, sample_episodes=True)
        assert torch.equal(x.columns[Columns.OBS], y.columns[Columns.OBS]), "the restored sampler draws alike"
        restored.train()  # and training goes on from the restored buffer
        assert learner_of(restored).conduit_batches > 0
        # restore_from_path into a running algorithm replaces its buffer's contents too
        again = list(x)
        for e in again:  # (under its source episode's id a sampled step would be stored twice: refused)
            e.id_ = uuid.uuid4().hex
        dqn.local_replay_buffer.add(again)
        dqn.restore_from_path(path)
        assert len(dqn.local_replay_buffer) == len(rb)
    finally:
        restored.stop()


def test_sac_trains_from_conduit_batches_of_a_remote_env_runner() -> None:
    config = sac_pendulum(steps=60, batch=32, learning_starts=30).env_runners(num_env_runners=1)
    algo = conduit_rllib.enable(config).build_algo()
    try:
        algo.train()
        learner = learner_of(algo)
        assert isinstance(algo.local_replay_buffer, ConduitPrioritizedEpisodeReplayBuffer)
        assert learner.conduit_batches >= 25 and learner.native_batches == 0
        assert algo.local_replay_buffer.edp.schema[Columns.ACTIONS].dtype == torch.float32
    finally:
        algo.stop()


def test_ppo_minibatches_come_from_conduit_each_row_once_per_epoch() -> None:
    config = ppo_cartpole(batch=400, minibatch=64, epochs=3)
    algo = conduit_rllib.enable(config).build_algo()
    try:
        for version in range(2):
            result = algo.train()
            learner = learner_of(algo)
            feed = learner.conduit_feed
            infos = feed.delivered
            assert {i.version for i in infos} == {version}, "one rollout, one policy version per update"
            assert all(int(i.staleness) == 0 for i in infos) and infos[-1].last
            first = np.concatenate([i.handles.numpy() for i in infos if i.epoch == 0])
            rows = len(first)  # the train batch's rows
            pieces = cyclic_pieces(rows, 64, 3)
            assert [(int(i.epoch), len(i.handles)) for i in infos] == pieces, \
                f"{rows} rows, 3 epochs: not RLlib's ceil({3 * rows} / 64) minibatches of 64 (pieces {pieces})"
            for epoch in range(3):
                handles = np.concatenate([i.handles.numpy() for i in infos if i.epoch == epoch])
                assert len(handles) == len(set(handles.tolist())), "a row trained twice in one epoch"
                assert sorted(handles.tolist()) == sorted(first.tolist()), "every row once per epoch"
            extra = [h for i in infos if i.epoch == 3 for h in i.handles.tolist()]
            assert len(extra) == sum(p for _, p in pieces) - 3 * rows, "the last minibatch is filled from one more pass"
            assert len(set(extra)) == len(extra) and set(extra) <= set(first.tolist()), \
                "the rows filling the last minibatch are distinct rows of the train batch"
            trained = result["learners"]
            assert float(trained[DEFAULT_MODULE_ID]["module_train_batch_size_mean"]) == 64.0, \
                "every SGD step trains a minibatch of exactly minibatch_size rows"
            assert int(trained["__all_modules__"]["num_module_steps_trained"]) == sum(p for _, p in pieces), \
                "RLlib counts K x 64 module steps trained"
            assert feed.prefetch and feed._pool is not None, "minibatch k+1 is gathered on the prefetch thread"
        assert learner.conduit_version == 2
    finally:
        algo.stop()


def test_ppo_with_one_remote_learner_delivers_through_conduit_in_the_actor() -> None:
    config = ppo_cartpole(batch=400, minibatch=64, epochs=2).learners(num_learners=1)
    algo = conduit_rllib.enable(config).build_algo()
    try:
        algo.train()
        algo.train()
        got = [r.get() for r in algo.learner_group.foreach_learner(
            lambda learner: (learner.conduit_version, [(int(i.version), int(i.epoch), len(i.handles))
                                                       for i in learner.conduit_feed.delivered]))]
        assert len(got) == 1
        version, infos = got[0]
        assert version == 2 and infos and {v for v, _, _ in infos} == {1}
        rows = sum(n for _, e, n in infos if e == 0)  # the train batch's rows
        # epochs 0 and 1 whole, and epoch 2 (the head of one more pass) when 2 * rows is no multiple of 64
        assert [(e, n) for _, e, n in infos] == cyclic_pieces(rows, 64, 2), \
            f"{rows} rows, 2 epochs: not RLlib's minibatches of 64 ({infos})"
    finally:
        algo.stop()
