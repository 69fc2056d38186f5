"""Refused adds and priority updates of the replay path, driven with real RLlib episode objects (no Ray cluster).

Defects found and fixed:

1. ``add()`` of something that is no ``SingleAgentEpisode`` (an old-API-stack ``SampleBatch``, a dict, an int)
   raised an untyped ``AttributeError``/``TypeError`` from inside ``chunk_columns``. Now a ``conduit.SchemaError``
   that says what to pass; nothing of the add is stored (also when good episodes come first in the same add).
2. ``update_priorities`` with priorities that are no numbers raised NumPy's untyped ``ValueError``; with
   ``handles`` that are no whole numbers it raised ``ValueError`` (strings) or silently truncated a fraction
   (1.7 updated handle 1, a transition nobody named). Now both are ``conduit.PriorityError`` and no priority
   changes.

Also pinned (behaviour no test checked before): n-step returns over real CartPole chunks made by
``episode.cut()``, with the episode truncated vs terminated exactly at the end of a chunk; a priority update
for the last sample after its transitions were evicted (their slots reused) changes nothing.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from typing import Any  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import ConduitError, PriorityError, SchemaError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.policy.sample_batch import SampleBatch  # noqa: E402

Buffer = ConduitEpisodeReplayBuffer | ConduitPrioritizedEpisodeReplayBuffer
KINDS = [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer]


def stored_obs(buf: Buffer) -> list[float]:
    """The first observation value of every stored transition, in storage order."""
    state = buf.get_state()
    if state["edp"] is None:
        return []
    return state["edp"]["storage"]["data"][Columns.OBS][:len(buf), 0].tolist()


def book(buf: Buffer) -> dict[str, Any]:
    """What an add changes besides the stored transitions."""
    state = buf.get_state()
    return {k: state[k] for k in ("next", "tail", "tail_t", "ended", "lifetime", "unlogged")}


def leaves(buf: ConduitPrioritizedEpisodeReplayBuffer) -> torch.Tensor:
    """The priority tree's leaves (priority ** alpha per slot)."""
    return buf.get_state()["edp"]["semantics"]["sampler"]["leaves"].clone()


# -- 1. an add of something that is no SingleAgentEpisode -------------------------------------------------------


NOT_EPISODES = {
    "sample_batch": lambda: SampleBatch({"obs": np.zeros((3, 2), dtype=np.float32),
                                         "actions": np.zeros(3, dtype=np.int64)}),
    "dict": lambda: {"obs": np.zeros((3, 2), dtype=np.float32)},
    "int": lambda: 5,
    "array": lambda: np.zeros((3, 2), dtype=np.float32),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("what", sorted(NOT_EPISODES))
def test_an_add_of_something_that_is_no_episode_is_a_schema_error_and_stores_nothing(
        kind: type[Buffer], what: str) -> None:
    for start_empty in (True, False):
        buf = kind(capacity=20, seed=0)
        if not start_empty:
            buf.add([id_episode(np.arange(3), episode_id="a")])
        before, contents = book(buf), stored_obs(buf)
        bad = NOT_EPISODES[what]()
        good = id_episode(np.arange(10, 13), episode_id="b")
        for add in ([bad], [good, bad]):  # alone, and after a good episode of the same add
            with pytest.raises(SchemaError, match="SingleAgentEpisode"):
                buf.add(add)
            assert book(buf) == before and stored_obs(buf) == contents, "a refused add stored something"
        buf.add([good])  # the buffer keeps working
        assert stored_obs(buf) == contents + [10.0, 11.0, 12.0]


# -- 2. priorities or handles that are no numbers ----------------------------------------------------------------


@pytest.mark.parametrize(("priorities", "handles"), [
    (["abc"], [1]),
    ([{"p": 1.0}], [1]),
    ([5.0], [1.7]),
    ([5.0], ["x"]),
    ([5.0], [True]),
    ([5.0, 6.0], [2, 2.5]),
])
def test_priorities_or_handles_that_are_no_numbers_are_a_priority_error_and_change_nothing(
        priorities: list[Any], handles: list[Any]) -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=1.0, seed=0)
    buf.add([id_episode(np.arange(5))])
    before = leaves(buf)
    with pytest.raises(PriorityError):
        buf.update_priorities(priorities, handles=handles)
    assert torch.equal(leaves(buf), before), "a refused priority update changed priorities"
    assert buf.update_priorities([5.0], handles=[2.0]) == 1  # a float that is a whole number names handle 2
    assert leaves(buf)[2] == 5.0 and torch.equal(leaves(buf)[:2], before[:2])


def test_priorities_of_the_last_sample_that_are_no_numbers_are_refused_and_the_update_can_be_retried() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=1.0, seed=0)
    buf.add([id_episode(np.arange(5))])
    s = buf.sample(3, n_step=1, beta=0.4, **DQN_KW)
    before = leaves(buf)
    with pytest.raises(PriorityError, match="numbers"):
        buf.update_priorities(["abc", "d", "e"])
    assert torch.equal(leaves(buf), before)
    assert buf.update_priorities(np.array([7.0, 7.0, 7.0])) == 3  # the sample still takes its update
    assert all(leaves(buf)[int(h)] == 7.0 for h in s.handles)


# -- pinned: n-step over real chunks, truncated vs terminated at a chunk's end --------------------------------


def cartpole_chunks(steps: int, cut_after: int, *, truncated: bool) -> list[SingleAgentEpisode]:
    """One CartPole episode of ``steps`` steps, rewards 1, 2, ..., cut (``episode.cut()``, as an EnvRunner
    does) after ``cut_after`` steps; it ends (truncated, or terminated) with its second chunk's last step."""
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=3)
    ep = SingleAgentEpisode(observation_space=env.observation_space, action_space=env.action_space)
    ep.add_env_reset(observation=obs)
    chunks = []
    for t in range(steps):
        obs, _, _, _, _ = env.step(t % 2)
        last = t == steps - 1
        ep.add_env_step(observation=obs, action=t % 2, reward=float(t + 1),
                        terminated=last and not truncated, truncated=last and truncated)
        if t + 1 == cut_after:
            successor = ep.cut()
            ep.to_numpy()
            chunks.append(ep)
            ep = successor
    ep.to_numpy()
    chunks.append(ep)
    env.close()
    return chunks


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("truncated", [True, False])
def test_n_step_returns_over_real_cut_chunks_stop_at_the_end_and_keep_truncated_apart_from_terminated(
        kind: type[Buffer], truncated: bool) -> None:
    chunks = cartpole_chunks(6, 3, truncated=truncated)
    assert [(c.t_started, len(c), c.is_done) for c in chunks] == [(0, 3, False), (3, 3, True)]
    all_obs = np.concatenate([chunks[0].get_observations()[:-1], chunks[1].get_observations()])
    buf = kind(capacity=20, seed=0)
    buf.add(chunks[:1])
    buf.add(chunks[1:])  # the continuation in a later add, as an EnvRunner's next sample
    s = buf.sample(300, n_step=3, gamma=0.5, beta=0.4, **DQN_KW)
    c = {k: v.numpy() for k, v in s.columns.items()}
    seen = set()
    for i in range(300):
        t = int(np.flatnonzero((all_obs[:-1] == c[Columns.OBS][i]).all(axis=1))[0])
        n = min(3, 6 - t)
        assert c["n_step"][i] == n
        assert c[Columns.REWARDS][i] == pytest.approx(sum(0.5 ** k * (t + 1 + k) for k in range(n)))
        np.testing.assert_array_equal(c[Columns.NEXT_OBS][i], all_obs[t + n])
        ends = t + n == 6  # the n-th step is the episode's last
        assert bool(c[Columns.TERMINATEDS][i]) == (ends and not truncated)
        assert bool(c[Columns.TRUNCATEDS][i]) == (ends and truncated)
        seen.add(t)
    assert seen == set(range(6))


def test_a_priority_update_for_a_sample_whose_transitions_were_evicted_changes_nothing() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=4, alpha=1.0, seed=0)
    buf.add([id_episode(np.arange(4))])
    s = buf.sample(4, n_step=1, beta=0.4, **DQN_KW)
    buf.add([id_episode(np.arange(10, 14))])  # every sampled transition evicted, its slot reused
    before = leaves(buf)
    assert buf.update_priorities(np.full(4, 9.0)) == 0
    assert torch.equal(leaves(buf), before), "an evicted transition's update reached its slot's new item"
    assert (s.handles < 4).all()
    with pytest.raises(ConduitError):  # the update was the sample's one
        buf.update_priorities(np.full(4, 9.0))
