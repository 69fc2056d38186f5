"""The off-policy path: what DQN/SAC train on through Conduit's replay buffers.

Episodes are built by stepping a real ``SingleAgentEpisode`` and cutting it as an EnvRunner does
(``rollout_fragment_length``), and compared field by field with RLlib's own buffers where the draws match.
"""

from __future__ import annotations

from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_rllib.replay import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

OBS = gym.spaces.Box(-1e6, 1e6, (1,), np.float32)
ACTS: gym.spaces.Discrete = gym.spaces.Discrete(100)


def stepped_chunks(steps: int, every: int, *, terminated: bool = True) -> list[SingleAgentEpisode]:
    """One episode of ``steps`` steps (obs t, action t, reward t + 1), cut every ``every`` steps as an EnvRunner
    cuts at its rollout_fragment_length; the last step terminates (or truncates)."""
    e = SingleAgentEpisode(observation_space=OBS, action_space=ACTS)
    e.add_env_reset(np.array([0.0], np.float32))
    chunks = []
    for t in range(steps):
        last = t == steps - 1
        e.add_env_step(np.array([t + 1.0], np.float32), t, float(t + 1), terminated=terminated and last,
                       truncated=not terminated and last)
        if (t + 1) % every == 0 or last:
            chunks.append(e)
            if not e.is_done:
                e = e.cut(len_lookback_buffer=1)
    return chunks


def by_obs(buf: ConduitEpisodeReplayBuffer, **kw: object) -> dict[float, tuple[float, float, bool, bool, int]]:
    """Every stored transition (drawn many times): obs -> (reward, next obs, terminated, truncated, n)."""
    s = buf.sample(num_items=400, **kw)  # type: ignore[arg-type]
    c = s.columns
    return {float(c["obs"][i, 0]): (float(c["rewards"][i]), float(c["new_obs"][i, 0]), bool(c["terminateds"][i]),
                                    bool(c["truncateds"][i]), int(c["n_step"][i])) for i in range(len(s))}


def test_n_step_over_chunks_of_one_episode_discounts_and_stops_at_its_end() -> None:
    for terminated in (True, False):
        buf = ConduitEpisodeReplayBuffer(capacity=50)
        for c in stepped_chunks(5, 2, terminated=terminated):
            buf.add(c)
        got = by_obs(buf, n_step=3, gamma=0.5)
        end = (terminated, not terminated)
        assert got == {0.0: (1 + 0.5 * 2 + 0.25 * 3, 3.0, False, False, 3),
                       1.0: (2 + 0.5 * 3 + 0.25 * 4, 4.0, False, False, 3),
                       2.0: (3 + 0.5 * 4 + 0.25 * 5, 5.0, *end, 3),
                       3.0: (4 + 0.5 * 5, 5.0, *end, 2),
                       4.0: (5.0, 5.0, *end, 1)}, got


def test_a_continuation_chunk_after_a_lost_chunk_is_not_linked_across_the_gap() -> None:
    """An EnvRunner's chunk that never reached the buffer (e.g. dropped by sample_timeout_s) leaves a gap in
    the episode: the n-step return must not sum rewards across it (RLlib's buffer refuses such a chunk)."""
    first, _lost, third = stepped_chunks(6, 2)  # steps 0-1, 2-3 (lost), 4-5
    buf = ConduitEpisodeReplayBuffer(capacity=50)
    buf.add(first)
    buf.add(third)
    got = by_obs(buf, n_step=2, gamma=0.5)
    # step 1's 2-step return stops at the newest step stored before the gap: it bootstraps from obs 2
    assert got[1.0] == (2.0, 2.0, False, False, 1), f"step 1 was linked to step 4 across the gap: {got[1.0]}"
    assert got[0.0] == (1 + 0.5 * 2, 2.0, False, False, 2)
    assert got[4.0] == (5 + 0.5 * 6, 6.0, True, False, 2)


def test_a_gap_survives_a_state_round_trip() -> None:
    first, _lost, third = stepped_chunks(6, 2)
    buf = ConduitEpisodeReplayBuffer(capacity=50)
    buf.add(first)
    twin = ConduitEpisodeReplayBuffer(capacity=50)
    twin.set_state(buf.get_state())
    twin.add(third)
    assert by_obs(twin, n_step=2, gamma=0.5)[1.0] == (2.0, 2.0, False, False, 1)


def test_a_restore_that_rolls_chunks_back_does_not_link_the_next_chunk_across_them() -> None:
    """An algorithm restored from a checkpoint while its EnvRunners go on: the chunks added after the save are
    gone from the buffer, the runner's next chunk starts after them."""
    first, second, third = stepped_chunks(6, 2)
    buf = ConduitEpisodeReplayBuffer(capacity=50)
    buf.add(first)
    saved = buf.get_state()
    buf.add(second)
    buf.set_state(saved)
    buf.add(third)
    got = by_obs(buf, n_step=3, gamma=0.5)
    assert sorted(got) == [0.0, 1.0, 4.0, 5.0]
    assert got[1.0] == (2.0, 2.0, False, False, 1), f"step 1 was linked across the rolled-back steps: {got[1.0]}"


def test_importance_weights_and_duplicate_updates_match_rllib_on_one_transition() -> None:
    """One stored transition drawn four times, priorities 4, 3, 2, 1 for the four draws: as in RLlib the last
    one applies, and the largest (4) is the next add's default priority (both buffers: the new item is drawn
    with probability 4 / 5); weights are exactly 1 with one item."""
    ep = stepped_chunks(1, 1)[0]
    other = SingleAgentEpisode(observations=[np.array([7.0], np.float32)] * 2, actions=[7], rewards=[7.0],
                               terminated=True, observation_space=OBS, action_space=ACTS, len_lookback_buffer=0)
    conduit = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, alpha=1.0)
    rllib = PrioritizedEpisodeReplayBuffer(capacity=10, alpha=1.0)
    for buf in (conduit, rllib):
        buf.add(ep)
    s = conduit.sample(num_items=4, beta=0.7)
    r: Any = rllib.sample(num_items=4, beta=0.7)
    assert s.columns["weights"].tolist() == [e.get_extra_model_outputs("weights")[0] for e in r] == [1.0] * 4
    assert [float(x) for x in s.columns["rewards"]] == [float(e.get_rewards(0)) for e in r]
    for buf in (conduit, rllib):
        buf.update_priorities(np.array([4.0, 3.0, 2.0, 1.0]))
        buf.add(other)
    got = conduit.sample(num_items=2, beta=1.0)
    w = dict(zip((float(x) for x in got.columns["obs"][:, 0]), got.columns["weights"].tolist(), strict=True))
    want = dict((float(e.get_observations(0)[0]), e.get_extra_model_outputs("weights")[0])
                for e in cast(Any, rllib.sample(num_items=400, beta=1.0)))
    for obs, weight in w.items():  # (N P) ** -beta / max: item 0 (p 1/5) weight 1, item 7 (p 4/5) weight 1/4
        assert abs(weight - want[obs]) < 1e-6, (obs, weight, want[obs])


def test_a_state_without_chunk_timesteps_still_links_and_a_damaged_one_is_refused_unchanged() -> None:
    first, second, third = stepped_chunks(6, 2)
    buf = ConduitEpisodeReplayBuffer(capacity=50)
    buf.add(first)
    state = buf.get_state()
    assert state["tail_t"] == {first.id_: 2}
    old = {k: v for k, v in state.items() if k != "tail_t"}  # saved before the timesteps were kept
    twin = ConduitEpisodeReplayBuffer(capacity=50)
    twin.set_state(old)
    twin.add(second)
    assert by_obs(twin, n_step=2, gamma=0.5)[1.0] == (2 + 0.5 * 3, 3.0, False, False, 2)
    before = twin.get_state()
    for bad in ({first.id_: -1}, {first.id_: "2"}, {"not-unfinished": 3}):
        with pytest.raises(ConfigurationError, match="damaged"):
            twin.set_state({**state, "tail_t": bad})
        with pytest.raises(ConfigurationError, match="damaged"):
            twin.check_state({**state, "tail_t": bad})
    after = twin.get_state()
    assert after["tail"] == before["tail"] and after["tail_t"] == before["tail_t"] == {first.id_: 4}
    twin.add(third)
    assert by_obs(twin, n_step=2, gamma=0.5)[3.0] == (4 + 0.5 * 5, 5.0, False, False, 2)


#: how many samples the env runner is asked for (2 envs x 4 steps each)
SAMPLES = 30


def test_a_real_env_runners_chunks_link_into_whole_episodes_and_a_dropped_sample_leaves_a_gap() -> None:
    """SingleAgentEnvRunner's cut chunks (rollout_fragment_length 4, two envs) link into one run per episode;
    when one sample()'s chunks never reach the buffer, each episode cut there continues as a new run.

    The sample dropped is the first one that cuts an episode (one with steps both before and after it): the env
    runner's random actions come from its action space's own generator, which ``config.debugging(seed=...)`` does
    not seed (the seed reaches the first env reset and the global random/numpy/torch generators; two runs seeded
    alike still end episodes at different steps), so a fixed sample cut no episode in about 3% of runs."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    config = DQNConfig().environment("CartPole-v1").env_runners(num_envs_per_env_runner=2, rollout_fragment_length=4)
    runner = SingleAgentEnvRunner(config=config)
    try:
        samples = [runner.sample(num_timesteps=8, random_actions=True) for _ in range(SAMPLES)]
    finally:
        runner.stop()
    seen_in: dict[str, set[int]] = {}  # episode id -> the samples that carried a chunk of it
    for i, eps in enumerate(samples):
        for e in eps:
            seen_in.setdefault(e.id_, set()).add(i)
    cutting = [i for i in range(SAMPLES) if any(min(s) < i < max(s) for s in seen_in.values())]
    assert cutting, f"no sample of {SAMPLES} cut an episode: {sorted(map(sorted, seen_in.values()))}"
    dropped = cutting[0]
    whole, gappy = ConduitEpisodeReplayBuffer(capacity=5000), ConduitEpisodeReplayBuffer(capacity=5000)
    for i, eps in enumerate(samples):
        whole.add(eps)
        if i != dropped:
            gappy.add(eps)
    assert whole.get_num_episodes() == len(seen_in)
    kept = sum(1 for s in seen_in.values() if s - {dropped})  # an episode wholly inside it is not stored at all
    cut = sum(1 for s in seen_in.values() if min(s) < dropped < max(s))  # steps before and after it were kept
    assert cut >= 1, (dropped, cut)
    # each episode the dropped sample cut is stored as two runs; one whose earlier steps were all dropped, as one
    assert gappy.get_num_episodes() == kept + cut, (gappy.get_num_episodes(), kept, cut, dropped)
    s = gappy.sample(num_items=512, n_step=3, gamma=0.5)
    want = {1: 1.0, 2: 1.5, 3: 1.75}  # CartPole pays 1 per step
    assert all(float(r) == want[int(n)] for r, n in zip(s.columns["rewards"], s.columns["n_step"], strict=True))


def test_a_chunk_added_again_is_refused_typed_and_changes_nothing() -> None:
    """RLlib's buffer refuses a chunk that does not start where its episode's stored steps end (assertion);
    Conduit's stored the steps a second time and linked the n-step returns back into the past."""
    first, second, third = stepped_chunks(6, 2)
    buf = ConduitEpisodeReplayBuffer(capacity=50)
    buf.add(first)
    buf.add(second)
    before = buf.get_state()
    other = stepped_chunks(2, 2)[0]  # another episode: not stored either when the add is refused
    for again in ([second], [other, second], [third, second, other]):
        with pytest.raises(ConfigurationError, match="already added|ended at timestep"):
            buf.add(again)
        after = buf.get_state()
        assert after["next"] == before["next"] == 4 and after["tail_t"] == before["tail_t"] and len(buf) == 4
    buf.add(third)
    assert by_obs(buf, n_step=2, gamma=0.5) == {0.0: (2.0, 2.0, False, False, 2), 1.0: (3.5, 3.0, False, False, 2),
                                                2.0: (5.0, 4.0, False, False, 2), 3.0: (6.5, 5.0, False, False, 2),
                                                4.0: (8.0, 6.0, True, False, 2), 5.0: (6.0, 6.0, True, False, 1)}


@pytest.mark.parametrize("done", [False, True], ids=["ongoing", "finished"])
@pytest.mark.parametrize("kind", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer],
                         ids=["uniform", "prioritized"])
def test_an_episode_evicted_earlier_in_the_same_add_comes_back_as_a_new_one(kind: Any, done: bool) -> None:
    """One add whose later chunk evicts every step of an episode it added first, then brings that episode's id
    again: RLlib's ``EpisodeReplayBuffer`` evicts after each episode of an add, so the id is forgotten and the
    chunk starts a new episode; so does Conduit, uniform and prioritized (it refused the chunk as a repeat of steps
    no longer stored). (RLlib's ``PrioritizedEpisodeReplayBuffer`` fails on this add with an IndexError.)"""
    from conduit_rllib.testing import id_episode
    from ray.rllib.utils.metrics import NUM_EPISODES_ADDED_LIFETIME
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

    chunks = [id_episode(np.arange(3), episode_id="e", terminated=done),
              id_episode(np.arange(10, 16), episode_id="f", terminated=True),  # evicts every step of e
              id_episode(np.arange(20, 22), episode_id="e")]
    rllib = EpisodeReplayBuffer(capacity=6)
    rllib.add(chunks)
    buf = kind(capacity=6, seed=0)
    buf.add(chunks)
    assert len(buf) == 6
    assert buf.get_metrics()[NUM_EPISODES_ADDED_LIFETIME] == rllib.get_metrics()[NUM_EPISODES_ADDED_LIFETIME] == 3
