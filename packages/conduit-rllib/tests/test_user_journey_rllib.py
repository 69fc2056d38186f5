"""An RLlib user's journey through conduit-rllib: the README followed literally, and the buffer corners it meets.

1. ``update_priorities(handles=...)`` before any add: no handle has been issued, so every handle named is bad,
   and it is refused as after adds (``PriorityError``), not answered with 0.
2. An episode id that comes back after all of its stored steps were evicted is a new episode, as in RLlib's own
   episode buffers (an evicted episode's id is forgotten there: its next chunk starts a new episode, whatever its
   ``t_started``): its first chunk added again is stored, not refused as "stored twice".
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from typing import Any  # noqa: E402

import conduit_rllib  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit import ConfigurationError, PriorityError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode
from ray.rllib.algorithms.algorithm import Algorithm  # noqa: E402
from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.utils.metrics import NUM_EPISODES_ADDED_LIFETIME  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer  # noqa: E402

Buffer = ConduitEpisodeReplayBuffer | ConduitPrioritizedEpisodeReplayBuffer
#: Conduit's buffer next to RLlib's own of the same kind
KINDS = [(ConduitEpisodeReplayBuffer, EpisodeReplayBuffer),
         (ConduitPrioritizedEpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer)]


def stored_ids(buf: Buffer) -> list[int]:
    """The observation ids of every stored transition, sorted."""
    state = buf.get_state()
    if state["edp"] is None:
        return []
    return sorted(state["edp"]["storage"]["data"][Columns.OBS][:len(buf), 0].numpy().astype(np.int64).tolist())


# -- 1. update_priorities(handles=...) before any add ------------------------------------------------------------


@pytest.mark.parametrize(("handles", "priorities", "match"), [
    ([0], [1.0], "never issued"), ([3, 7], [0.5, 2.0], "never issued"), ([-1], [1.0], "never issued"),
    ([0.5], [1.0], "whole numbers"), (["a"], [1.0], "whole numbers"), ([0, 1], [1.0], "2 transitions")],
    ids=["handle-0", "two-handles", "negative", "fraction", "string", "length-mismatch"])
def test_update_priorities_with_handles_before_any_add_is_refused(handles: list[Any], priorities: list[float],
                                                                  match: str) -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, seed=0)
    with pytest.raises(PriorityError, match=match):
        buf.update_priorities(priorities, handles=handles)
    # as after adds: the same call names a handle never issued there too
    after = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, seed=0)
    after.add([id_episode(np.arange(2), episode_id="e")])
    issued_too = [h for h in handles if isinstance(h, int) and 0 <= h < 2]
    if match == "never issued" and not issued_too:
        with pytest.raises(PriorityError, match=match):
            after.update_priorities(priorities, handles=handles)
    # nothing changed: the buffer is as built, and an add and sample still work
    assert len(buf) == 0 and buf.get_state()["edp"] is None
    buf.add([id_episode(np.arange(4), episode_id="e")])
    assert buf.sample(num_items=4, n_step=1, beta=0.4, **DQN_KW).columns[Columns.OBS].shape[0] == 4


def test_update_priorities_with_no_handles_before_any_add_updates_nothing() -> None:
    """An empty update names no transition: 0 updated, before adds as after them."""
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, seed=0)
    assert buf.update_priorities(np.zeros(0), handles=np.zeros(0, dtype=np.int64)) == 0
    buf.add([id_episode(np.arange(2), episode_id="e")])
    assert buf.update_priorities(np.zeros(0), handles=np.zeros(0, dtype=np.int64)) == 0


# -- 2. an episode id that comes back after its steps were all evicted -------------------------------------------


@pytest.mark.parametrize(("kind", "native"), KINDS, ids=["uniform", "prioritized"])
def test_an_evicted_unfinished_episodes_first_chunk_comes_back_as_a_new_episode(kind: type[Buffer],
                                                                                 native: type) -> None:
    """RLlib forgets an evicted episode's id: a chunk of it that comes back later is a new episode. Conduit
    evicts per transition; once every stored step of an unfinished episode is evicted, the same holds."""
    first = id_episode(np.arange(3), episode_id="e")  # t_started 0, unfinished
    other = id_episode(np.arange(10, 16), episode_id="f", terminated=True)
    again = id_episode(np.arange(20, 23), episode_id="e")  # e's id with t_started 0 again
    rllib = native(capacity=6)
    for chunk in (first, other, again):  # RLlib's own buffer takes it (e was evicted whole by f)
        rllib.add([chunk])
    buf = kind(capacity=6, seed=0)
    buf.add([first])
    buf.add([other])  # evicts every step of e
    assert stored_ids(buf) == list(range(10, 16))
    buf.add([again])  # refused before: "its steps up to 2 were already added (they would be stored twice)"
    assert stored_ids(buf) == [13, 14, 15, 20, 21, 22]
    # counted as a new episode, as RLlib counts it
    assert buf.get_metrics()[NUM_EPISODES_ADDED_LIFETIME] == rllib.get_metrics()[NUM_EPISODES_ADDED_LIFETIME] == 3
    # the new run is e's now: its continuation joins it (n-step returns run across the chunks) ...
    buf.add([id_episode(np.arange(23, 25), episode_id="e", t_started=3)])
    s = buf.sample(num_items=64, n_step=3, gamma=1.0, beta=0.4, **DQN_KW)
    obs, n = s.columns[Columns.OBS][:, 0].numpy(), s.columns["n_step"].numpy()
    assert (obs == 21).any() and (n[obs == 21] == 3).all(), "the continuation did not join the returned episode"
    # ... and its first chunk added again, while its steps are stored, is still refused
    with pytest.raises(ConfigurationError, match="stored twice"):
        buf.add([again])
    assert stored_ids(buf) == [15, 20, 21, 22, 23, 24]


@pytest.mark.parametrize(("kind", "native"), KINDS, ids=["uniform", "prioritized"])
def test_an_episode_evicted_within_the_same_add_comes_back_as_a_new_episode(kind: type[Buffer],
                                                                            native: type) -> None:
    """One add whose earlier chunk evicts every step of an unfinished episode, then brings it back."""
    first = id_episode(np.arange(3), episode_id="e")
    other = id_episode(np.arange(10, 16), episode_id="f", terminated=True)
    again = id_episode(np.arange(20, 22), episode_id="e")
    rllib = native(capacity=6)
    rllib.add([first])
    rllib.add([other, again])
    buf = kind(capacity=6, seed=0)
    buf.add([first])
    buf.add([other, again])
    assert stored_ids(buf) == [12, 13, 14, 15, 20, 21]


@pytest.mark.parametrize(("kind", "native"), KINDS, ids=["uniform", "prioritized"])
def test_a_continuation_after_its_episode_was_evicted_is_counted_as_a_new_episode_as_rllib_counts_it(
        kind: type[Buffer], native: type) -> None:
    """The continuation an EnvRunner sends (``t_started`` right after the evicted steps) was always stored, but
    not counted: ``num_episodes_added`` trailed RLlib's, which counts the forgotten id's chunk as a new episode."""
    chunks = [[id_episode(np.arange(3), episode_id="e")],
              [id_episode(np.arange(10, 16), episode_id="f", terminated=True)],  # evicts every step of e
              [id_episode(np.arange(3, 5), episode_id="e", t_started=3)]]
    rllib, buf = native(capacity=6), kind(capacity=6, seed=0)
    for add in chunks:
        rllib.add(add)
        buf.add(add)
    want = rllib.get_metrics()[NUM_EPISODES_ADDED_LIFETIME]
    assert want == 3 and buf.get_metrics()[NUM_EPISODES_ADDED_LIFETIME] == want
    assert stored_ids(buf) == [3, 4, 12, 13, 14, 15]


@pytest.mark.parametrize("kind", [k for k, _ in KINDS], ids=["uniform", "prioritized"])
def test_a_partly_evicted_unfinished_episodes_first_chunk_again_is_still_refused(kind: type[Buffer]) -> None:
    """While a step of the episode is stored, its first chunk again would store steps twice (RLlib, which
    evicts whole episodes, still holds the episode then and refuses a chunk that does not continue it)."""
    buf = kind(capacity=6, seed=0)
    buf.add([id_episode(np.arange(3), episode_id="e")])
    buf.add([id_episode(np.arange(10, 14), episode_id="f", terminated=True)])  # evicts e's step 0 only
    with pytest.raises(ConfigurationError, match="stored twice"):
        buf.add([id_episode(np.arange(20, 23), episode_id="e")])
    assert stored_ids(buf) == [1, 2, 10, 11, 12, 13]


# -- 3. the README's recipe under a user's usual DQN and PPO settings, next to stock RLlib --------------------------

#: the replay counters the README promises in every iteration's ``replay_buffer`` results
PROMISED = ("num_env_steps_added", "num_env_steps_sampled", "num_episodes_added", "num_env_steps_added_lifetime",
            "num_env_steps_sampled_lifetime", "num_episodes_added_lifetime", "num_env_steps_evicted",
            "num_env_steps_evicted_lifetime", "num_env_steps_stored", "actual_n_step")
#: of those, the ones that equal RLlib's for the same adds and samples (no eviction here)
SAME_AS_RLLIB = PROMISED[:6]


def _dqn_counts(results: dict[str, Any]) -> dict[str, float]:
    replay = results["replay_buffer"]
    out = {k: float(replay[k]) for k in SAME_AS_RLLIB}
    out["trained"] = float(results["learners"]["__all_modules__"]["num_env_steps_trained"])
    return out


@pytest.mark.usefixtures("ray_local")
def test_dqn_with_uniform_replay_an_n_step_range_and_training_intensity_counts_as_stock_rllib(tmp_path: Any) -> None:
    """A user's DQN: uniform buffer, n-step drawn from 1..3, training_intensity; random actions so both runs
    see the same episodes. Conduit's buffer is used, every promised metric is reported, the counts are RLlib's,
    and the stopped algorithm saves (algo.save()) and comes back (Algorithm.from_checkpoint) with its buffer
    (the user set store_buffer_in_checkpoints=True: without it no buffer is saved)."""
    def config() -> DQNConfig:
        return (DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
                .reporting(min_sample_timesteps_per_iteration=48)
                .training(n_step=(1, 4), training_intensity=32, train_batch_size=8, epsilon=[(0, 1.0), (10 ** 6, 1.0)],
                          num_steps_sampled_before_learning_starts=24,
                          replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 500},
                          store_buffer_in_checkpoints=True)
                .debugging(seed=3, log_level="ERROR"))

    native = config().build_algo()
    try:
        want = [_dqn_counts(native.train()) for _ in range(2)]
    finally:
        native.stop()
    algo = conduit_rllib.enable(config()).build_algo()
    try:
        assert isinstance(algo.local_replay_buffer, ConduitEpisodeReplayBuffer)
        results = [algo.train() for _ in range(2)]
        for r in results:
            missing = [k for k in PROMISED if k not in r["replay_buffer"]]
            assert not missing, f"the README promises {missing} in the results"
            assert 1.0 <= float(r["replay_buffer"]["actual_n_step"]) <= 3.0
        assert [_dqn_counts(r) for r in results] == want
        assert want[0]["trained"] > 0 and want[1]["num_env_steps_sampled"] > want[1]["num_env_steps_added"], \
            "training_intensity should make more samples than adds"
        size, nxt = len(algo.local_replay_buffer), algo.local_replay_buffer.get_state()["next"]
    finally:
        algo.stop()
    saved = algo.save(str(tmp_path))  # a stopped algorithm still saves (README)
    again = Algorithm.from_checkpoint(saved.checkpoint.path)
    try:
        buf = again.local_replay_buffer
        assert isinstance(buf, ConduitEpisodeReplayBuffer) and (len(buf), buf.get_state()["next"]) == (size, nxt)
        r = again.train()
        assert float(r["replay_buffer"]["num_env_steps_added_lifetime"]) == want[1]["num_env_steps_added_lifetime"] + 48
    finally:
        again.stop()


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("training", [dict(minibatch_size=64, num_epochs=3, shuffle_batch_per_epoch=False),
                                      dict(minibatch_size=None, num_epochs=1)], ids=["mb64-3epochs", "whole-batch"])
def test_ppo_with_a_users_epochs_and_minibatches_trains_as_stock_rllib(training: dict[str, Any]) -> None:
    """Same seed, stock PPO and PPO with Conduit: the same steps trained and, minibatch for minibatch, the same
    losses over two iterations (the README: RLlib's cuts and order, row for row unshuffled)."""
    def run(enabled: bool) -> list[tuple[float, float, float]]:
        config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
                  .training(train_batch_size_per_learner=250, **training).debugging(seed=0, log_level="ERROR"))
        algo = (conduit_rllib.enable(config) if enabled else config).build_algo()
        try:
            out = []
            for _ in range(2):
                learners = algo.train()["learners"]
                out.append((float(learners["__all_modules__"]["num_env_steps_trained"]),
                            float(learners["default_policy"]["num_module_steps_trained"]),
                            float(learners["default_policy"]["total_loss"])))
            return out
        finally:
            algo.stop()

    stock, got = run(False), run(True)
    assert [g[:2] for g in got] == [s[:2] for s in stock]
    assert [g[2] for g in got] == pytest.approx([s[2] for s in stock], rel=1e-5), f"conduit {got}\n rllib {stock}"
