"""RLlib-adapter regressions: repeated first chunks, the feed's state, PPO checkpoints (no Ray cluster).

1. An episode's first chunk (``t_started`` 0) added again was stored twice: the duplicate check skipped
   chunks that start at timestep 0. Now it is refused, typed, nothing stored (as RLlib's own buffers refuse
   a chunk that does not start where the stored steps end).
2. ``MinibatchFeed.state_dict()`` after ``load_state_dict()`` returned the caller's RNG tensor itself:
   changing one changed the other.
3. A PPO checkpoint taken while minibatches of a rollout were still to come was silently inexact: the waiting
   rollout was not saved, so a restore could not deliver the rest (and the permutations they draw). Saving that
   rest is not clean (RLlib cannot resume an update part-way, and the state would carry the train batch), so
   the contract is explicit now: ``MinibatchFeed.state_dict()`` refuses, typed, while something waits for
   delivery (``drop_pending=True`` gives the state once that is dropped, counted), and the PPO learner's
   ``get_state`` refuses Conduit's part inside an update. Between updates and after an update that stopped
   part-way (its leftover is dropped by the next update anyway) the learner's checkpoint stays exact.
4. The off-policy learner without an attached replay buffer kept a restored replay part unchecked (a damaged
   one, or no Conduit state at all, was taken and failed only when a buffer was attached, e.g. while an
   algorithm was built), and trained on batches sampled from a Conduit buffer it did not hold (its checkpoints
   silently missed that buffer). Now both are refused, typed, changing nothing.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import conduit_rllib  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import ConfigurationError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, MinibatchFeed  # noqa: E402
from conduit_rllib.learner import ON_POLICY_COMPONENT, REPLAY_COMPONENT, ConduitDQNTorchLearner  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode
from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.policy.sample_batch import SampleBatch  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_offpolicy_learner_state import _column_row_missing, filled, weights, weights_unchanged  # noqa: E402, I001  (sibling test helpers)
from test_on_policy_learner_state_and_refusals import ROW, build_learner, train_batch  # noqa: E402, I001  (sibling test helpers)

Buffer = ConduitEpisodeReplayBuffer | ConduitPrioritizedEpisodeReplayBuffer
KINDS = [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer]


def stored_ids(buf: Buffer) -> list[int]:
    """The observation ids of every stored transition, in storage order."""
    state = buf.get_state()
    return sorted(state["edp"]["storage"]["data"][Columns.OBS][:len(buf), 0].numpy().astype(np.int64).tolist())


# -- 1. an episode's first chunk added twice ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_episodes_first_chunk_added_again_is_refused_and_nothing_is_stored(kind: type[Buffer]) -> None:
    buf = kind(capacity=20, seed=0)
    first = id_episode(np.arange(4), episode_id="e")  # t_started 0, unfinished
    buf.add([first])
    before = buf.get_state()
    with pytest.raises(ConfigurationError, match=r"starts at timestep 0(.|\n)*stored twice"):
        buf.add([first])
    assert len(buf) == 4 and stored_ids(buf) == [0, 1, 2, 3], "the first chunk, added again, was stored twice"
    assert buf.get_state()["next"] == before["next"] and buf.get_state()["tail_t"] == before["tail_t"]
    buf.add([id_episode(np.arange(4, 6), episode_id="e", t_started=4)])  # the real continuation still joins
    s = buf.sample(num_items=64, n_step=3, gamma=1.0, beta=0.4, **DQN_KW)
    obs = s.columns[Columns.OBS][:, 0].numpy()
    n = s.columns["n_step"].numpy()
    assert (n[obs == 2] == 3).all(), "the continuation was not linked to the episode's stored steps"


@pytest.mark.parametrize("kind", KINDS)
def test_an_episodes_first_chunk_twice_in_one_add_is_refused_and_nothing_is_stored(kind: type[Buffer]) -> None:
    buf = kind(capacity=20, seed=0)
    buf.add([id_episode(np.arange(10, 12), episode_id="other")])
    first = id_episode(np.arange(4), episode_id="e")
    with pytest.raises(ConfigurationError, match="stored twice"):
        buf.add([first, id_episode(np.arange(20, 22)), first])
    assert stored_ids(buf) == [10, 11], "a refused add stored part of its chunks"


def test_a_real_episode_cut_still_joins_and_its_first_chunk_again_is_refused() -> None:
    """With RLlib's own chunks (SingleAgentEpisode.cut()), as EnvRunners produce them."""
    ep = SingleAgentEpisode(id_="r", observations=[np.zeros(2, np.float32)], len_lookback_buffer=0)
    for t in range(3):
        ep.add_env_step(np.full(2, t + 1, np.float32), t, float(t))
    head = ep.to_numpy()
    tail = ep.cut()
    for t in range(3, 5):
        tail.add_env_step(np.full(2, t + 1, np.float32), t, float(t))
    buf = ConduitEpisodeReplayBuffer(capacity=20, seed=0)
    buf.add([head])
    buf.add([tail.to_numpy()])
    assert len(buf) == 5
    with pytest.raises(ConfigurationError, match="stored twice"):
        buf.add([head])
    assert len(buf) == 5


# -- 2. the feed's state after a load is its own ------------------------------------------------------------


def test_the_feed_state_after_a_load_owns_its_rng_tensor() -> None:
    src = MinibatchFeed(minibatch_size=2, num_epochs=2, seed=3)
    saved = src.state_dict()
    feed = MinibatchFeed(minibatch_size=2, num_epochs=2, seed=0)
    feed.load_state_dict(saved)
    rng = saved["rng"].clone()
    out = feed.state_dict()
    assert out["rng"] is not saved["rng"], "state_dict() handed out the tensor load_state_dict() was given"
    saved["rng"].zero_()  # the caller reuses its tensor
    assert torch.equal(feed.state_dict()["rng"], rng), "changing the loaded tensor changed the feed's state"
    out["rng"].zero_()  # the caller changes what state_dict() returned
    assert torch.equal(feed.state_dict()["rng"], rng), "changing a returned state changed the feed's state"
    # and the feed delivers what the source would (its RNG is the saved one)
    for f in (src, feed):
        f.configure(minibatch_size=2, num_epochs=2, shuffle=True)
        f.ingest("m", SampleBatch({"obs": torch.arange(6.0)[:, None]}), version=0)
        f.seal()
    got = [[mab.policy_batches["m"]["obs"][:, 0].tolist() for mab in f.minibatches()] for f in (src, feed)]
    src.close()
    feed.close()
    assert got[0] == got[1], "the restored feed shuffles differently from the one that saved the state"


# -- 3. a PPO checkpoint while minibatches are still to come ---------------------------------------------------


def rows_feed(seed: int = 5) -> MinibatchFeed:
    """A feed with one sealed rollout of 10 rows, cut into minibatches of 4 over 2 shuffled epochs (5 of them)."""
    feed = MinibatchFeed(minibatch_size=4, num_epochs=2, seed=seed)
    feed.configure(minibatch_size=4, num_epochs=2, shuffle=True)
    feed.ingest("m", SampleBatch({"obs": torch.arange(10.0)[:, None]}), version=0)
    feed.seal()
    return feed


def ids(mab: Any) -> list[int]:
    return [int(x) for x in mab.policy_batches["m"]["obs"][:, 0].tolist()]


def next_rollout(feed: MinibatchFeed, version: int) -> list[list[int]]:
    feed.set_policy_version(version)
    feed.drop_leftovers()
    feed.ingest("m", SampleBatch({"obs": torch.arange(100.0, 110.0)[:, None]}), version=version)
    feed.seal()
    return [ids(mab) for mab in feed.minibatches()]


@pytest.mark.parametrize("stage", ["sealed", "mid-epoch", "held"])
def test_a_feed_state_with_minibatches_still_to_come_is_refused_typed_and_changes_nothing(stage: str) -> None:
    feed, twin = rows_feed(), rows_feed()
    try:
        twin_rows = [ids(mab) for mab in twin.minibatches()]
        it: Any = None  # (a generator: close() stops it)
        got: list[list[int]] = []
        if stage != "sealed":
            it = feed.minibatches()
            got = [ids(next(it))]
            if stage == "held":
                it.close()  # the iteration stopped: the prefetched minibatch is held for the next one
        with pytest.raises(ConfigurationError, match=r"waiting for delivery(.|\n)*between iterations"):
            feed.state_dict()
        rest = [ids(mab) for mab in (it if stage == "mid-epoch" else feed.minibatches())]
        assert got + rest == twin_rows, "a refused state_dict changed the deliveries"
        assert feed.state_dict()["dropped_items"] == 0  # between iterations: accepted, nothing dropped
    finally:
        feed.close()
        twin.close()


def test_drop_pending_gives_the_state_the_feed_goes_on_from_once_the_rollout_is_dropped() -> None:
    feed = rows_feed()
    restored = MinibatchFeed(minibatch_size=4, num_epochs=2, seed=0)
    try:
        it: Any = feed.minibatches()
        next(it)  # 1 of 5 minibatches delivered
        state = feed.state_dict(drop_pending=True)
        assert state["dropped_items"] == 10, "the rows dropped with the waiting rollout are counted"
        assert feed.semantics.pending_rollouts == 1, "drop_pending changed the feed itself"
        restored.load_state_dict(state)
        restored.configure(minibatch_size=4, num_epochs=2, shuffle=True)
        it.close()
        assert next_rollout(restored, 1) == next_rollout(feed, 1), "the restored feed goes on differently"
        assert restored.dropped_items == feed.dropped_items == 10
    finally:
        feed.close()
        restored.close()


def test_a_ppo_learner_refuses_conduits_part_inside_an_update_and_is_exact_between_updates() -> None:
    a, b = build_learner(), build_learner()
    try:
        refused: list[str] = []
        update = a._update

        def checkpoint_then_update(batch: Any) -> Any:  # a checkpoint from inside the update (e.g. a loss hook)
            with pytest.raises(ConfigurationError, match="inside an update") as err:
                a.get_state(components=ON_POLICY_COMPONENT)
            refused.append(str(err.value))
            assert ON_POLICY_COMPONENT not in a.get_state(not_components=ON_POLICY_COMPONENT)
            return update(batch)

        a._update = checkpoint_then_update  # type: ignore[method-assign]
        a.update(batch=train_batch(10), minibatch_size=4, num_epochs=2, shuffle_batch_per_epoch=True)
        assert len(refused) == 5, "every minibatch's checkpoint attempt must be refused"
        a._update = update  # type: ignore[method-assign]
        b.set_state(a.get_state(components=ON_POLICY_COMPONENT))  # between updates: accepted, exact
        rows: list[list[list[int]]] = [[], []]
        for learner, seen in zip((a, b), rows, strict=True):
            trains = learner._update

            def recording(batch: Any, trains: Any = trains, seen: list[list[int]] = seen) -> Any:
                seen.append([int(r) for r in batch[DEFAULT_MODULE_ID][ROW].tolist()])
                return trains(batch)

            learner._update = recording  # type: ignore[method-assign]
            learner.update(batch=train_batch(12), minibatch_size=5, num_epochs=3, shuffle_batch_per_epoch=True)
        assert len(rows[0]) == 8 and rows[0] == rows[1], "the learner restored between updates delivers differently"
        assert a.conduit_version == b.conduit_version == 2
    finally:
        a.conduit_feed.close()
        b.conduit_feed.close()


# -- 4. the off-policy learner without an attached buffer ---------------------------------------------------


@pytest.fixture(scope="module")
def learner() -> Iterator[ConduitDQNTorchLearner]:
    """A DQN learner built locally, as before enable's on_algorithm_init attaches a buffer."""
    config = conduit_rllib.enable(DQNConfig().environment("CartPole-v1").debugging(seed=0)
                                  .training(store_buffer_in_checkpoints=True))  # the learner state holds the buffer
    built = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(built, ConduitDQNTorchLearner)
    yield built
    built.shutdown()


def detached(learner: ConduitDQNTorchLearner) -> ConduitDQNTorchLearner:
    learner.conduit_replay = None
    learner._conduit_pending_state = None
    return learner


def rllib_part_changed(learner: ConduitDQNTorchLearner) -> dict[str, Any]:
    """The learner's RLlib part with every weight moved by one (restoring it would show in the weights)."""
    state = learner.get_state(components="rl_module")
    return {"rl_module": {mid: {k: v + 1 for k, v in ws.items()} for mid, ws in state["rl_module"].items()}}


@pytest.mark.parametrize("part", ["damaged", "not-conduit", "capacity-not-its-contents"])
def test_an_unattached_learner_refuses_a_bad_replay_part_and_restores_nothing(
        learner: ConduitDQNTorchLearner, part: str) -> None:
    detached(learner)
    if part == "damaged":
        bad: Any = _column_row_missing(filled(ConduitPrioritizedEpisodeReplayBuffer, 0, 6).get_state())
    elif part == "not-conduit":
        native = EpisodeReplayBuffer(capacity=10)
        native.add([id_episode(np.arange(3))])
        bad = native.get_state()
    else:
        bad = dict(filled(ConduitEpisodeReplayBuffer, 0, 6).get_state(), capacity=10 ** 12)
    w = weights(learner)
    with pytest.raises(ConfigurationError, match="damaged|not a Conduit replay-buffer state"):
        learner.set_state({REPLAY_COMPONENT: bad, **rllib_part_changed(learner)})
    assert learner._conduit_pending_state is None, "the unattached learner kept a replay part it cannot restore"
    assert weights_unchanged(learner, w), "RLlib's part was restored from a state whose replay part was refused"
    good = filled(ConduitEpisodeReplayBuffer, 0, 6).get_state()
    learner.set_state({REPLAY_COMPONENT: good})  # an undamaged part is still kept, and restored at the attach
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    learner.conduit_attach_replay(buf)
    assert len(buf) == 6
    detached(learner)


def cartpole_buffer() -> ConduitEpisodeReplayBuffer:
    """A buffer of CartPole-shaped transitions (4 float32 observations, actions 0/1)."""
    space = gym.make("CartPole-v1")
    obs = [np.full(4, t / 10, np.float32) for t in range(9)]
    ep = SingleAgentEpisode(id_="c", observations=obs, actions=[t % 2 for t in range(8)], rewards=[1.0] * 8,
                            terminated=True, observation_space=space.observation_space,
                            action_space=space.action_space, len_lookback_buffer=0).to_numpy()
    buf = ConduitEpisodeReplayBuffer(capacity=32, seed=0)
    buf.add([ep])
    return buf


def test_an_unattached_learner_refuses_a_conduit_sample_and_changes_nothing(
        learner: ConduitDQNTorchLearner) -> None:
    detached(learner)
    buf = cartpole_buffer()
    sample = buf.sample(num_items=8, n_step=1, gamma=0.99, **DQN_KW)
    w, seq = weights(learner), learner._weights_seq_no
    with pytest.raises(ConfigurationError, match=r"no buffer is attached(.|\n)*conduit_attach_replay"):
        learner.update(episodes=sample)
    assert weights_unchanged(learner, w) and learner._weights_seq_no == seq, "the refused update changed the learner"
    assert learner.conduit_batches == 0
    learner.conduit_attach_replay(buf)  # attached: the same sample trains, and the buffer is in the checkpoint
    learner.update(episodes=sample)
    assert learner.conduit_batches == 1 and not weights_unchanged(learner, w)
    assert learner.get_state()[REPLAY_COMPONENT]["next"] == 8
    detached(learner)
