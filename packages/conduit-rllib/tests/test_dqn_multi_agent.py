"""Multi-agent DQN/SAC through Conduit: every RLModule's transitions in a Conduit buffer of its own, B drawn per
module per sample as RLlib's multi-agent buffers draw them ("independent" replay). Measured against RLlib's
``MultiAgentEpisodeReplayBuffer`` and RLlib's own multi-agent DQN; the whole-algorithm tests on a local Ray.
Before, ``enable`` refused multi-agent DQN/SAC configs."""

from __future__ import annotations

from typing import Any

import conduit_rllib
import gymnasium as gym
import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    EmptyBufferError,
    Overlapped,
    PriorityError,
    SchemaError,
    Synchronous,
)
from conduit_rllib import (
    ConduitMultiAgentEpisodeReplayBuffer,
    ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
    ConduitMultiAgentSample,
    UnsupportedConfigError,
)
from conduit_rllib.learner import REPLAY_COMPONENT
from conduit_rllib.remote import split_sample
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.sac import SACConfig
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole, MultiAgentPendulum
from ray.rllib.utils.metrics import TD_ERROR_KEY
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer

MODULES = ("p0", "p1")
SPACE = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
#: agent -> module: a0 and a2 share p0, a1 has p1
MAPPING = {"a0": "p0", "a1": "p1", "a2": "p0"}


def _to_module(agent_id: Any, *args: Any, **kwargs: Any) -> str:
    return MAPPING[agent_id]


def ma_chunk(steps: dict[str, tuple[int, int]], *, ids: dict[str, str], ended: frozenset[str] = frozenset(),
             episode_id: str = "E") -> MultiAgentEpisode:
    """One multi-agent chunk in which every agent of ``steps`` acts at every env step: agent ``a`` (code c = its
    number + 1) steps t0..t1-1 with obs_t = (c * 100 + t, c * 100 + t), action t, reward t + 1; ``ended`` agents'
    episodes terminate at t1; ``ids``: each agent's episode id (a continuation keeps its agent's)."""
    t0 = {a: s[0] for a, s in steps.items()}
    n = {s[1] - s[0] for s in steps.values()}.pop()  # (one length: every agent acts at every env step)
    code = {a: int(a[1:]) + 1 for a in steps}

    def obs(a: str, t: int) -> np.ndarray:
        return np.full(2, code[a] * 100 + t, np.float32)

    return MultiAgentEpisode(
        id_=episode_id, observations=[{a: obs(a, t0[a] + k) for a in steps} for k in range(n + 1)],
        actions=[{a: t0[a] + k for a in steps} for k in range(n)],
        rewards=[{a: float(t0[a] + k + 1) for a in steps} for k in range(n)],
        terminateds={a: a in ended for a in steps} | {"__all__": len(ended) == len(steps)},
        observation_space=gym.spaces.Dict({a: SPACE for a in steps}),
        action_space=gym.spaces.Dict({a: gym.spaces.Discrete(1000) for a in steps}),
        agent_t_started=t0, env_t_started=min(t0.values()), len_lookback_buffer=0, agent_episode_ids=ids,
        agent_to_module_mapping_fn=_to_module)


IDS = {"a0": "e-a0", "a1": "e-a1", "a2": "e-a2"}


def filled(cls: type = ConduitMultiAgentEpisodeReplayBuffer, **kwargs: Any) -> Any:
    """a0, a1, a2 step 0..2 in one chunk, then 3..5 in a second one; a1's episode ends at 6."""
    buf = cls(capacity=kwargs.pop("capacity", 100), seed=0, **kwargs)
    buf.add([ma_chunk({"a0": (0, 3), "a1": (0, 3), "a2": (0, 3)}, ids=IDS)])
    buf.add([ma_chunk({"a0": (3, 6), "a1": (3, 6), "a2": (3, 6)}, ids=IDS, ended=frozenset({"a1"}))])
    return buf


def columns(sample: ConduitMultiAgentSample) -> dict[str, dict[str, np.ndarray]]:
    return {m: {k: v.numpy().copy() for k, v in part.columns.items()} for m, part in sample.parts.items()}


def test_each_agent_goes_to_its_module_and_each_module_draws_b_of_its_own_transitions() -> None:
    buf = filled()
    assert buf.get_module_ids() == ["p0", "p1"]
    assert (buf.get_num_timesteps("p0"), buf.get_num_timesteps("p1"), len(buf)) == (12, 6, 18)
    assert buf.get_num_episodes("p0") == 2 and buf.get_num_episodes() == 3, "a0 and a2 are two episodes of p0"
    sample = buf.sample(num_items=300, n_step=1, gamma=0.9, **DQN_KW)
    assert isinstance(sample, ConduitMultiAgentSample) and list(sample.parts) == ["p0", "p1"]
    c = columns(sample)
    for m, codes in (("p0", {1, 3}), ("p1", {2})):
        obs = c[m][Columns.OBS][:, 0]
        assert len(obs) == 300, "B rows per module, as RLlib's independent replay draws"
        assert set(obs.tolist()) == {cd * 100 + t for cd in codes for t in range(6)}, f"{m}: not its transitions"
        np.testing.assert_array_equal(c[m][Columns.NEXT_OBS][:, 0], obs + 1)
        np.testing.assert_array_equal(c[m][Columns.ACTIONS], obs % 100)
        np.testing.assert_array_equal(c[m][Columns.REWARDS], obs % 100 + 1)
        np.testing.assert_array_equal(c[m][Columns.TERMINATEDS], obs == 205)  # only a1's episode ended
    assert [e.module_id for e in sample[298:302]] == ["p0", "p0", "p1", "p1"], "episodes name their module"
    mab = sample.to_multi_agent_batch()
    assert set(mab.policy_batches) == set(MODULES) and mab.env_steps() == 600, "RLlib counts every module's rows"


def test_n_step_returns_stay_inside_each_agents_episode() -> None:
    """a0 and a2 share p0: a return never sums from one agent's steps into the other's (or across a chunk gap)."""
    buf = filled(ConduitMultiAgentPrioritizedEpisodeReplayBuffer, alpha=0.6)
    gamma = 0.9
    c = columns(buf.sample(num_items=400, n_step=3, gamma=gamma, beta=0.4, **DQN_KW))
    for m in MODULES:
        for o, r, k, nobs in zip(c[m][Columns.OBS][:, 0], c[m][Columns.REWARDS], c[m]["n_step"],
                                 c[m][Columns.NEXT_OBS][:, 0], strict=True):
            t = int(o) % 100
            assert k == min(3, 6 - t), f"{m} obs {o}: {k} steps summed"
            assert nobs == o + k, f"{m} obs {o}: bootstraps from {nobs}"
            assert r == pytest.approx(sum(gamma ** j * (t + j + 1) for j in range(k)), rel=1e-5)


def test_modules_draw_apart() -> None:
    """Each module's plane has a seed of its own: two modules holding alike steps do not draw the same rows."""
    buf = ConduitMultiAgentEpisodeReplayBuffer(capacity=100, seed=0)
    buf.add([ma_chunk({"a0": (0, 50), "a1": (0, 50)}, ids=IDS)])
    c = columns(buf.sample(num_items=64, n_step=1, gamma=0.9, **DQN_KW))
    assert not np.array_equal(c["p0"][Columns.OBS][:, 0] % 100, c["p1"][Columns.OBS][:, 0] % 100)


def _transitions(obs: Any, next_obs: Any, actions: Any, rewards: Any) -> list[tuple[Any, ...]]:
    """Transitions as sortable tuples (obs and next obs as tuples of floats)."""
    return sorted((tuple(map(float, o)), int(a), round(float(r), 5), tuple(map(float, n)))
                  for o, a, r, n in zip(obs, actions, rewards, next_obs, strict=True))


def test_a_turn_based_games_transitions_are_rllibs_for_each_module() -> None:
    """TicTacToe: the players act in turns, so an agent's next observation is the one at its next turn, and
    chunks are cut with one player's action still waiting for its next observation. Every module holds exactly
    the transitions of its agent's episodes in RLlib's buffer (its ``agent_episodes``, concatenated across
    chunks), in any order; two envs per runner, so chunks of two episodes interleave."""
    from ray.rllib.examples.envs.classes.multi_agent.tic_tac_toe import TicTacToe

    config = (DQNConfig().environment(TicTacToe)
              .multi_agent(policies={"p1", "p2"}, policy_mapping_fn=lambda agent_id, *args, **kwargs: (
                  "p1" if agent_id == "player1" else "p2"))
              .env_runners(num_envs_per_env_runner=2, rollout_fragment_length=7).debugging(seed=1))
    runner = MultiAgentEnvRunner(config=config)
    ours = ConduitMultiAgentEpisodeReplayBuffer(capacity=10_000, seed=0)
    theirs = MultiAgentEpisodeReplayBuffer(capacity=10_000)
    try:
        for _ in range(30):
            episodes = runner.sample(num_timesteps=7, random_actions=True)
            ours.add(episodes)
            theirs.add(episodes)
    finally:
        runner.stop()
    state = ours.get_state()["modules"]
    for m, agent in (("p1", "player1"), ("p2", "player2")):
        want = []
        for episode in theirs.episodes:
            sa = episode.agent_episodes.get(agent)
            if sa is not None and len(sa):
                obs = np.asarray(sa.get_observations())
                want += _transitions(obs[:-1], obs[1:], sa.get_actions(), sa.get_rewards())
        n = state[m]["edp"]["storage"]["next"]
        data = {k: v[:n].numpy() for k, v in state[m]["edp"]["storage"]["data"].items()}
        got = _transitions(data[Columns.OBS], data[Columns.NEXT_OBS], data[Columns.ACTIONS], data[Columns.REWARDS])
        assert len(want) > 30 and got == sorted(want), f"{m}: {len(got)} transitions, RLlib's buffer holds {len(want)}"
        assert ours.get_num_timesteps(m) == theirs.get_num_timesteps(m)
        assert ours.get_added_timesteps(m) == theirs.get_added_timesteps(m)
    assert sorted(ours.get_module_ids()) == sorted(theirs.get_module_ids()) == ["p1", "p2"]
    s = ours.sample(num_items=64, n_step=1, gamma=0.99, **DQN_KW)
    assert {m: len(p) for m, p in s.parts.items()} == {"p1": 64, "p2": 64}


def _unchanged(buf: Any, before: dict[str, int]) -> None:
    assert {m: buf.get_num_timesteps(m) for m in buf.get_module_ids()} == before
    assert {m: buf.get_added_timesteps(m) for m in buf.get_module_ids()} == before


def test_a_refused_add_stores_nothing_for_any_module() -> None:
    buf = filled()
    before = {"p0": 12, "p1": 6}
    fresh = ma_chunk({"a0": (0, 2)}, ids={"a0": "new-a0"}, episode_id="F")  # p0's part is fine
    again = ma_chunk({"a1": (0, 2)}, ids={"a1": "e-a1"}, episode_id="G")  # p1's is a repeat of stored steps
    with pytest.raises(ConfigurationError, match="e-a1"):
        buf.add([fresh, again])
    _unchanged(buf, before)
    not_ma = SingleAgentEpisode(observations=[np.zeros(2, np.float32)] * 2, actions=[0], rewards=[1.0])
    with pytest.raises(SchemaError, match="MultiAgentEpisode"):
        buf.add([fresh, not_ma])
    _unchanged(buf, before)
    # a module's first add refused: the module is not registered, and the other module's steps are not stored
    empty = ConduitMultiAgentEpisodeReplayBuffer(capacity=4, seed=0)
    with pytest.raises(CapacityError):
        empty.add([ma_chunk({"a0": (0, 3), "a1": (0, 3)}, ids=IDS), ma_chunk({"a1": (3, 8)}, ids=IDS)])
    assert empty.get_module_ids() == [] and len(empty) == 0
    with pytest.raises(EmptyBufferError):
        empty.sample(4, **DQN_KW)
    buf.add([fresh])  # the refused calls stored nothing of it, so it is no repeat
    assert buf.get_num_timesteps("p0") == 14


def test_priorities_apply_to_the_named_modules_last_sample_only() -> None:
    buf = filled(ConduitMultiAgentPrioritizedEpisodeReplayBuffer, alpha=1.0)
    s = buf.sample(num_items=4, n_step=1, gamma=0.9, beta=0.0, **DQN_KW)
    obs0 = s.parts["p0"].columns[Columns.OBS][:, 0].clone()
    p1_handles = s.parts["p1"].handles.clone()
    assert buf.update_priorities(np.array([1e4, 1.0, 1.0, 1.0]), "p0") == 4
    with pytest.raises(PriorityError, match="call sample"):
        buf.update_priorities(np.ones(4), "p0")  # p0's last sample took its update
    with pytest.raises(PriorityError, match="'p9'"):
        buf.update_priorities(np.ones(4), "p9")
    c = columns(buf.sample(num_items=400, n_step=1, gamma=0.9, beta=0.0, **DQN_KW))
    top = float(obs0[0])
    assert (c["p0"][Columns.OBS][:, 0] == top).mean() > 0.9, "p0's raised item dominates p0's draws"
    assert len(set(c["p1"][Columns.OBS][:, 0].tolist())) == 6, "p1's priorities were not touched"
    assert buf.update_priorities(np.ones(4), "p1", handles=p1_handles) == 4


def test_state_round_trips_every_module_and_a_refused_state_changes_nothing() -> None:
    buf = filled(ConduitMultiAgentPrioritizedEpisodeReplayBuffer, alpha=0.6)
    buf.sample(num_items=8, n_step=1, gamma=0.9, beta=0.4, **DQN_KW)
    state = buf.get_state()
    twin = ConduitMultiAgentPrioritizedEpisodeReplayBuffer(capacity=100, seed=5, alpha=0.6)
    twin.add([ma_chunk({"a2": (0, 1)}, ids={"a2": "other"})])
    twin.set_state(state)
    assert twin.get_module_ids() == ["p0", "p1"] and len(twin) == 18
    a, b = (columns(x.sample(num_items=50, n_step=2, gamma=0.9, beta=0.4, **DQN_KW)) for x in (buf, twin))
    for m in MODULES:
        for k in a[m]:
            np.testing.assert_array_equal(a[m][k], b[m][k], err_msg=f"{m}.{k}")
    damaged = twin.get_state()
    damaged["modules"]["p1"] = {**damaged["modules"]["p1"], "succ": [1, 2]}
    with pytest.raises(ConfigurationError, match="Module 'p1'.*damaged"):
        twin.set_state(damaged)
    assert len(twin) == 18
    for wrong, words in ((ConduitMultiAgentEpisodeReplayBuffer(capacity=100), "prioritized"),
                         (conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=100), "not a Conduit replay")):
        with pytest.raises(ConfigurationError, match=words):
            wrong.set_state(state)
    twin.close()
    with pytest.raises(ConfigurationError, match="closed"):
        twin.add([ma_chunk({"a0": (0, 1)}, ids={"a0": "x"})])
    assert twin.get_state()["modules"].keys() == {"p0", "p1"}, "a closed buffer still saves"


def test_sampling_refusals_are_typed_and_draw_nothing() -> None:
    buf = filled()
    with pytest.raises(UnsupportedConfigError, match="independent"):
        buf.sample(4, replay_mode="synchronized", **DQN_KW)
    with pytest.raises(ConfigurationError, match="'p7'"):
        buf.sample(4, modules_to_sample={"p0", "p7"}, **DQN_KW)
    only = buf.sample(4, modules_to_sample=["p1"], **DQN_KW)
    assert list(only.parts) == ["p1"]
    with pytest.raises(ConfigurationError, match="scheduler"):
        ConduitMultiAgentEpisodeReplayBuffer(capacity=10, scheduler=Synchronous())  # not a factory
    with pytest.raises(ConfigurationError, match="capacity"):
        ConduitMultiAgentEpisodeReplayBuffer(capacity=0)


def test_each_module_gets_a_scheduler_of_its_own_from_the_factory() -> None:
    """A scheduler serves one data plane: the factory is called once per module, and the overlapped draws are the
    module's own transitions. Before the first add nothing is built; close() ends every module's scheduler."""
    made: list[Overlapped] = []

    def factory() -> Overlapped:
        made.append(Overlapped(g_del=2, background_ingest=True))
        return made[-1]

    buf = filled(ConduitMultiAgentPrioritizedEpisodeReplayBuffer, scheduler=factory)
    assert len(made) == 2 and [b.edp.scheduler for b in buf.buffers.values()] == made
    for _ in range(3):
        c = columns(buf.sample(num_items=16, n_step=1, gamma=0.9, beta=0.4, **DQN_KW))
        assert set(c["p0"][Columns.OBS][:, 0] // 100) <= {1, 3} and set(c["p1"][Columns.OBS][:, 0] // 100) == {2}
        buf.update_priorities(np.ones(16), "p0")
        buf.update_priorities(np.ones(16), "p1")
    buf.close()
    assert all(b.edp.closed for b in buf.buffers.values())
    with pytest.raises(ConfigurationError, match="not a conduit Scheduler"):
        filled(scheduler=lambda: "not a scheduler")


def test_remote_slices_keep_every_modules_rows_in_order() -> None:
    s = filled().sample(num_items=5, n_step=1, gamma=0.9, **DQN_KW)
    slices = split_sample(s, 2)
    for m in MODULES:
        joined = torch.cat([piece.parts[m].columns[Columns.OBS] for piece in slices])
        assert torch.equal(joined, s.parts[m].columns[Columns.OBS]), m
        assert [len(piece.parts[m]) for piece in slices] == [3, 2]


# -- the whole algorithm -------------------------------------------------------------------------------------------
def _dqn(rb_type: str = "MultiAgentPrioritizedEpisodeReplayBuffer") -> DQNConfig:
    return (DQNConfig().environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .multi_agent(policies=set(MODULES), policy_mapping_fn=lambda agent_id, *args, **kwargs: f"p{agent_id}")
            .env_runners(num_env_runners=0, rollout_fragment_length=50)
            .training(replay_buffer_config={"type": rb_type, "capacity": 5000, "alpha": 0.6, "beta": 0.4},
                      num_steps_sampled_before_learning_starts=100, train_batch_size=32, n_step=3)
            .debugging(seed=0))


def _trained(result: dict[str, Any]) -> dict[str, int]:
    return {m: int(result["learners"][m]["num_module_steps_trained"]) for m in MODULES}


@pytest.mark.usefixtures("ray_local")
def test_multi_agent_dqn_trains_every_module_through_conduit_as_rllib_alone_does() -> None:
    trained = {}
    for conduit in (True, False):
        algo = (conduit_rllib.enable(_dqn()) if conduit else _dqn()).build_algo()
        try:
            for _ in range(2):
                result = algo.train()
            trained[conduit] = _trained(result)
            if conduit:
                buf, learner = algo.local_replay_buffer, algo.learner_group._learner
                assert isinstance(buf, ConduitMultiAgentPrioritizedEpisodeReplayBuffer)
                assert learner.conduit_batches > 0 and learner.native_batches == 0
                sampled = result["env_runners"]["num_module_steps_sampled_lifetime"]
                assert {m: buf.get_num_timesteps(m) for m in MODULES} == {m: int(sampled[m]) for m in MODULES}, \
                    "every module step the env runner sampled is stored once"
                assert set(result["replay_buffer"]) == set(MODULES), "each module's buffer metrics"
                saved = learner.get_state(components=REPLAY_COMPONENT)[REPLAY_COMPONENT]
                assert set(saved["modules"]) == set(MODULES)
        finally:
            algo.stop()
    assert trained[True] == trained[False] and min(trained[True].values()) > 0, trained


@pytest.mark.usefixtures("ray_local")
def test_two_remote_learners_train_each_modules_slices_in_order_and_a_restore_brings_the_buffer_back(
        tmp_path: Any) -> None:
    """Learner k trains the k-th contiguous slice of every module's rows, so RLlib's concatenation of the learners'
    TD errors (per module, in learner order) follows each module's sample. A checkpoint saved through the remote
    learners brings every module's buffer back into the driver, and no learner keeps a copy."""
    config = _dqn().learners(num_learners=2).training(store_buffer_in_checkpoints=True)
    algo = conduit_rllib.enable(config).build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        assert min(_trained(result).values()) > 0
        buf = algo.local_replay_buffer
        sample = buf.sample(num_items=10, n_step=1, gamma=0.99, beta=0.4, **DQN_KW)
        results = algo.learner_group.update(episodes=sample)
        views = [r.get() for r in algo.learner_group.foreach_learner(lambda learner: (
            learner.conduit_batches, learner.native_batches,
            {m: h.tolist() for m, h in learner.conduit_last_handles.items()}))]
        assert all(c > 0 and n == 0 for c, n, _ in views), views
        for k, (_, _, handles) in enumerate(views):
            assert handles == {m: sample.parts[m].handles[5 * k:5 * k + 5].tolist() for m in MODULES}, k
        errors = [{m: sum(len(e) for e in r[m][TD_ERROR_KEY].peek()) for m in MODULES} for r in results]
        assert errors == [{"p0": 5, "p1": 5}] * 2, errors
        stored = {m: buf.get_num_timesteps(m) for m in MODULES}
        algo.save_to_path(str(tmp_path))
        algo.restore_from_path(str(tmp_path))
        assert {m: algo.local_replay_buffer.get_num_timesteps(m) for m in MODULES} == stored
        kept = [r.get() for r in algo.learner_group.foreach_learner(lambda lr: lr._conduit_pending_state is None)]
        assert kept == [True, True], "a learner still holds a copy of the buffer's state"
    finally:
        algo.stop()


@pytest.mark.usefixtures("ray_local")
def test_multi_agent_sac_trains_as_rllib_alone_and_its_checkpoint_brings_every_modules_buffer_back(
        tmp_path: Any) -> None:
    """SAC on the uniform kind, its episodes sampled by a remote EnvRunner (they reach the buffer through Ray),
    iterations cut by sampled steps (not by time, SAC's default), so both runs train the same number of times."""
    config = (SACConfig().environment(MultiAgentPendulum, env_config={"num_agents": 2})
              .multi_agent(policies=set(MODULES), policy_mapping_fn=lambda agent_id, *args, **kwargs: f"p{agent_id}")
              .env_runners(num_env_runners=1, rollout_fragment_length=50)
              .training(replay_buffer_config={"type": "MultiAgentEpisodeReplayBuffer", "capacity": 2000},
                        num_steps_sampled_before_learning_starts=100, train_batch_size=32,
                        store_buffer_in_checkpoints=True)
              .reporting(min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=200).debugging(seed=0))
    trained, stored = {}, {}
    for conduit in (True, False):
        algo = (conduit_rllib.enable(config.copy()) if conduit else config.copy()).build_algo()
        try:
            trained[conduit] = _trained(algo.train())
            if conduit:
                assert isinstance(algo.local_replay_buffer, ConduitMultiAgentEpisodeReplayBuffer)
                stored = {m: algo.local_replay_buffer.get_num_timesteps(m) for m in MODULES}
                algo.save_to_path(str(tmp_path))
        finally:
            algo.stop()
    assert trained[True] == trained[False] and min(trained[True].values()) > 0, trained
    restored = Algorithm.from_checkpoint(str(tmp_path))
    try:
        buf = restored.local_replay_buffer
        assert isinstance(buf, ConduitMultiAgentEpisodeReplayBuffer)
        assert {m: buf.get_num_timesteps(m) for m in MODULES} == stored and min(stored.values()) > 0
        assert min(_trained(restored.train()).values()) > 0
    finally:
        restored.stop()


def test_enable_pairs_the_buffer_type_with_the_config() -> None:
    from conduit_rllib.enable import _replay_class

    for rb_type, want in (("MultiAgentEpisodeReplayBuffer", ConduitMultiAgentEpisodeReplayBuffer),
                          ("MultiAgentPrioritizedEpisodeReplayBuffer", ConduitMultiAgentPrioritizedEpisodeReplayBuffer),
                          (ConduitMultiAgentEpisodeReplayBuffer, ConduitMultiAgentEpisodeReplayBuffer)):
        config = conduit_rllib.enable(_dqn(rb_type))  # type: ignore[arg-type]
        assert _replay_class(config) is want
    with pytest.raises(UnsupportedConfigError, match="multi-agent, but .*'PrioritizedEpisodeReplayBuffer'"):
        conduit_rllib.enable(_dqn("PrioritizedEpisodeReplayBuffer"))
