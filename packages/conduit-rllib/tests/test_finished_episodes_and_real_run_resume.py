"""Finished episodes added again, and real DQN/PPO runs with ``conduit_rllib.enable`` resumed from checkpoints.

1. A finished episode added again was stored twice (and counted as a new episode): the duplicate check knew only
   unfinished episodes, so a whole episode (``t_started`` 0, done) added twice, or any chunk starting inside a
   finished episode's steps, went in silently. (RLlib's own buffers refuse any chunk of an episode they hold
   that has ended.) Now such a chunk is refused, typed, nothing stored, while a step of the episode is still
   stored (as RLlib forgets an evicted episode, an evicted one may be added again); the check survives a
   checkpoint. So is a chunk starting at or after the episode's end (session 25: RLlib refuses it too).
2. Today's changes in a real run: DQN with ``n_step`` 3 on a remote EnvRunner whose episodes arrive in chunks
   over several iterations (every chunk joins its episode; the n-step returns are the episode's), with
   evaluation workers, saved mid-training and continued with ``Algorithm.from_checkpoint``; the same for PPO.
3. Suspected, not a bug: PPO with one epoch fills its last minibatch from the unshuffled head, as RLlib's learner
   does (it reshuffles only with ``num_epochs > 1``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import conduit_rllib  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit import ConfigurationError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.learner import ConduitPPOTorchLearner  # noqa: E402
from conduit_rllib.testing import id_episode  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_rllib_regressions_chunks_and_feed_state import DQN_KW, KINDS, Buffer, stored_ids  # noqa: E402, I001  (sibling test helpers)



# -- 1. a finished episode added again ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_finished_episode_added_again_is_refused_and_nothing_is_stored(kind: type[Buffer]) -> None:
    buf = kind(capacity=20, seed=0)
    whole = id_episode(np.arange(4), episode_id="e", terminated=True)  # t_started 0, done
    buf.add([whole])
    before = buf.get_state()
    with pytest.raises(ConfigurationError, match=r"'e'(.|\n)*ended(.|\n)*new episode id"):
        buf.add([whole])
    assert stored_ids(buf) == [0, 1, 2, 3]
    assert buf.get_added_timesteps() == 4 and buf.get_state()["lifetime"]["episodes"] == 1
    assert buf.get_state()["next"] == before["next"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_chunk_inside_a_finished_episodes_steps_is_refused_with_the_good_chunks_of_its_add(
        kind: type[Buffer]) -> None:
    buf = kind(capacity=20, seed=0)
    buf.add([id_episode(np.arange(3), episode_id="e"), id_episode(np.arange(3, 5), episode_id="e", t_started=3,
                                                                  terminated=True)])
    other = id_episode(np.arange(10, 12), episode_id="f")
    last_again = id_episode(np.arange(3, 5), episode_id="e", t_started=3, terminated=True)
    with pytest.raises(ConfigurationError, match=r"'e' ended at timestep 5(.|\n)*starting at timestep 3"):
        buf.add([other, last_again])  # the good chunk before it is not stored either
    assert stored_ids(buf) == [0, 1, 2, 3, 4]
    with pytest.raises(ConfigurationError):  # at its end: refused too, as RLlib refuses it
        buf.add([id_episode(np.arange(5, 7), episode_id="e", t_started=5)])
    buf.add([id_episode(np.arange(5, 7), episode_id="e2")])  # new steps under a new id: a new run, not linked
    s = buf.sample(num_items=64, n_step=3, gamma=0.5, **DQN_KW)
    obs = s.columns[Columns.OBS][:, 0].numpy().astype(np.int64)
    assert set(obs.tolist()) <= {0, 1, 2, 3, 4, 5, 6}
    assert all(int(s.columns["n_step"][i]) <= 5 - obs[i] for i in range(len(s)) if obs[i] < 5)


def test_a_finished_episode_is_refused_after_a_restore_and_accepted_once_evicted() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    whole = id_episode(np.arange(3), episode_id="e", terminated=True)
    buf.add([whole])
    restored = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    restored.set_state(buf.get_state())
    with pytest.raises(ConfigurationError, match="ended"):
        restored.add([whole])
    restored.add([id_episode(np.arange(10, 16), episode_id="g", terminated=True)])  # evicts all of "e"
    restored.add([whole])  # (RLlib's buffers forget an evicted episode too)
    assert stored_ids(restored) == [0, 1, 2, 13, 14, 15]


def test_many_finished_episodes_are_forgotten_once_evicted() -> None:
    """The ended episodes' record is bounded by what is stored, not by how many episodes ever ended."""
    buf = ConduitEpisodeReplayBuffer(capacity=4, seed=0)
    for i in range(100):
        buf.add([id_episode(np.array([i]), episode_id=f"e{i}", terminated=True)])
    assert list(buf.get_state()["ended"]) == ["e96", "e97", "e98", "e99"]  # those with a step stored
    buf.add([id_episode(np.array([0]), episode_id="e0", terminated=True)])  # long evicted: a new episode
    with pytest.raises(ConfigurationError, match="ended"):
        buf.add([id_episode(np.array([99]), episode_id="e99", terminated=True)])


def test_a_state_saved_without_the_ended_record_still_loads() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=8, seed=0)
    buf.add([id_episode(np.arange(3), episode_id="e", terminated=True)])
    state = buf.get_state()
    del state["ended"]
    restored = ConduitEpisodeReplayBuffer(capacity=8, seed=0)
    restored.set_state(state)
    assert stored_ids(restored) == [0, 1, 2]


def test_a_damaged_ended_record_is_refused_and_changes_nothing() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=8, seed=0)
    buf.add([id_episode(np.arange(3), episode_id="e", terminated=True)])
    state = buf.get_state()
    state["ended"] = {"e": "x"}
    target = ConduitEpisodeReplayBuffer(capacity=8, seed=0)
    target.add([id_episode(np.arange(20, 22), episode_id="z")])
    with pytest.raises(ConfigurationError, match="damaged"):
        target.set_state(state)
    assert stored_ids(target) == [20, 21]


# -- 2. today's changes in real runs ------------------------------------------------------------------------------


class _AddLog:
    """Records (episode id, t_started, length, done, first obs value) of every chunk a buffer's add receives."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from conduit_rllib.replay import _ConduitReplay
        from ray.rllib.utils import force_list

        self.chunks: list[tuple[str, int, int, bool, np.ndarray]] = []
        add = _ConduitReplay.add

        def logged(buf: Any, episodes: Any, weight: float | None = None) -> None:
            for e in force_list(episodes):
                self.chunks.append((e.id_, e.t_started, len(e), e.is_done, np.asarray(e.get_observations())))
            add(buf, episodes, weight)

        monkeypatch.setattr(_ConduitReplay, "add", logged)


def _ppo_learner(algo: Any) -> ConduitPPOTorchLearner:
    """The local learner of a Conduit-enabled PPO algorithm."""
    learner = algo.learner_group._learner
    assert isinstance(learner, ConduitPPOTorchLearner)
    return learner


def _conduit_threads(before: frozenset[threading.Thread] = frozenset()) -> list[str]:
    """Conduit's live threads but those in ``before`` (the ones other tests of this process left, e.g. a feed the
    garbage collector has not finalised yet: the check is about the threads the test's algorithm started)."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("conduit") and t not in before)


def _conduit_threads_now() -> frozenset[threading.Thread]:
    return frozenset(t for t in threading.enumerate() if t.name.startswith("conduit"))


def test_a_real_dqn_n_step_run_with_chunked_episodes_checkpoints_and_goes_on(
        ray_local: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.algorithms.dqn import DQNConfig

    before = _conduit_threads_now()
    log = _AddLog(monkeypatch)
    config = (DQNConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=1, rollout_fragment_length=4)
              .training(n_step=3, gamma=0.5, train_batch_size=16, num_steps_sampled_before_learning_starts=24,
                        replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 2000,
                                              "alpha": 0.6, "beta": 0.4}, store_buffer_in_checkpoints=True)
              .reporting(min_sample_timesteps_per_iteration=40)
              .evaluation(evaluation_interval=1, evaluation_duration=1, evaluation_num_env_runners=1)
              .debugging(seed=1))
    conduit_rllib.enable(config)
    algo = config.build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        assert result["evaluation"]["env_runners"]["num_episodes"] >= 1  # the evaluation workers ran
        buf = algo.local_replay_buffer
        assert isinstance(buf, ConduitPrioritizedEpisodeReplayBuffer)
        added = sum(n for _, _, n, _, _ in log.chunks)
        assert len(buf) == added == result["env_runners"]["num_env_steps_sampled_lifetime"]  # no eval step stored
        # every EnvRunner chunk was taken, each continuation right where its episode's stored steps end
        ends: dict[str, int] = {}
        for eid, t0, n, _, _ in log.chunks:
            assert t0 == ends.get(eid, 0)
            ends[eid] = t0 + n
        assert any(t0 > 0 for _, t0, _, _, _ in log.chunks)  # episodes did span several adds
        # the n-step returns are the episodes' own (CartPole pays 1 per step): 3 steps unless the episode ended
        # or its stored steps do, and the next observation is the one n steps on, across chunk boundaries
        obs_of: dict[tuple[float, ...], tuple[str, int]] = {}
        episode_obs: dict[str, list[np.ndarray]] = {}
        done_at: dict[str, int] = {}
        for eid, t0, n, done, obs in log.chunks:
            rows = episode_obs.setdefault(eid, [obs[0]])
            rows.extend(obs[1:])
            for k in range(n):
                obs_of[tuple(obs[k].tolist())] = (eid, t0 + k)
            if done:
                done_at[eid] = t0 + n
        s = buf.sample(num_items=64, n_step=3, gamma=0.5, beta=0.4, **DQN_KW)
        for i in range(len(s)):
            eid, t = obs_of[tuple(s.columns[Columns.OBS][i].tolist())]
            k = min(3, done_at.get(eid, ends[eid]) - t)
            assert int(s.columns["n_step"][i]) == k
            assert float(s.columns[Columns.REWARDS][i]) == pytest.approx(sum(0.5 ** j for j in range(k)))
            assert np.array_equal(s.columns[Columns.NEXT_OBS][i].numpy(), episode_obs[eid][t + k])
        buf.update_priorities(np.ones(len(s)))
        saved_len, saved_added = len(buf), buf.get_added_timesteps()
        path = algo.save_to_path(tmp_path / "mid")
    finally:
        algo.stop()
    assert _conduit_threads(before) == []
    restored = Algorithm.from_checkpoint(path)
    try:
        rb = restored.local_replay_buffer
        assert isinstance(rb, ConduitPrioritizedEpisodeReplayBuffer)
        assert len(rb) == saved_len and rb.get_added_timesteps() == saved_added
        first = len(log.chunks)
        restored.train()
        new = log.chunks[first:]
        assert new and len(rb) == saved_len + sum(n for _, _, n, _, _ in new)  # the new EnvRunner's chunks joined
    finally:
        restored.stop()
    assert _conduit_threads(before) == []


def test_a_real_ppo_run_checkpoints_mid_training_and_goes_on_where_it_was(ray_local: None, tmp_path: Path) -> None:
    from conduit_rllib.learner import ON_POLICY_COMPONENT
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.algorithms.ppo import PPOConfig

    before = _conduit_threads_now()
    config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1)
              .training(train_batch_size_per_learner=128, minibatch_size=48, num_epochs=2)
              .evaluation(evaluation_interval=1, evaluation_duration=1, evaluation_num_env_runners=1)
              .debugging(seed=3))
    conduit_rllib.enable(config)
    algo = config.build_algo()
    try:
        result = algo.train()
        learner = _ppo_learner(algo)
        assert learner.conduit_version == 1 and result["evaluation"]["env_runners"]["num_episodes"] >= 1
        rows = result["learners"]["default_policy"]["num_module_steps_trained"]
        assert rows % 48 == 0 and rows >= 2 * 128  # whole minibatches, every row in both epochs
        saved = learner.get_state(components=ON_POLICY_COMPONENT)[ON_POLICY_COMPONENT]
        path = algo.save_to_path(tmp_path / "mid")
    finally:
        algo.stop()
    assert _conduit_threads(before) == []
    restored = Algorithm.from_checkpoint(path)
    try:
        learner = _ppo_learner(restored)
        state = learner.get_state(components=ON_POLICY_COMPONENT)[ON_POLICY_COMPONENT]
        assert state["version"] == saved["version"] == 1
        assert state["feeds"]["default_policy"]["rng"].equal(saved["feeds"]["default_policy"]["rng"])
        restored.train()
        assert learner.conduit_version == 2 and learner.conduit_feed.delivered
    finally:
        restored.stop()
    assert _conduit_threads(before) == []



# -- 3. PPO with one epoch: the rows that fill the last minibatch ------------------------------------------------


def test_one_epoch_ppo_fills_its_last_minibatch_from_the_unshuffled_head_as_rllib() -> None:
    """Suspected, not a bug: with ``num_epochs=1`` RLlib's learner turns ``shuffle_batch_per_epoch`` off
    (``shuffle and num_epochs > 1``), so its cyclic iterator fills the last minibatch from the train batch's
    unshuffled head; Conduit's does the same, row for row, whatever ``shuffle_batch_per_epoch`` says."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_on_policy_learner_state_and_refusals import (  # noqa: I001  (sibling test helpers)
        build_learner, conduit_minibatches, train_batch)

    learner = build_learner()
    try:
        for shuffle in (True, False):
            out = conduit_minibatches(learner, train_batch(250), minibatch_size=64, num_epochs=1, shuffle=shuffle)
            assert [len(mb) for _, _, mb in out] == [64] * 4
            assert [r for _, _, mb in out for r in mb] == [*range(250), *range(6)]
    finally:
        learner.conduit_feed.close()
