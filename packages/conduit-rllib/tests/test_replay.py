"""Conduit's RLlib replay buffers, driven through RLlib's buffer interface (no Ray needed)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from conduit import ConfigurationError, EmptyBufferError, PriorityError, SchemaError
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, UnsupportedConfigError
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from conduit_rllib.testing import id_episode
from ray.rllib.core.columns import Columns
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer
from scipy import stats

SPACE = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
ACTS = gym.spaces.Discrete(1000)


def chunk(episode: str, code: int, t0: int, t1: int, *, terminated: bool = False,
          truncated: bool = False) -> SingleAgentEpisode:
    """Steps t0..t1-1 of an episode: obs_t = code * 100 + t (both dims), action t, reward t + 1."""
    obs = np.array([[code * 100 + t] * 2 for t in range(t0, t1 + 1)], dtype=np.float32)
    e = SingleAgentEpisode(id_=episode, observations=list(obs), actions=list(range(t0, t1)),
                           rewards=[float(t + 1) for t in range(t0, t1)], terminated=terminated, truncated=truncated,
                           observation_space=SPACE, action_space=ACTS, t_started=t0, len_lookback_buffer=0)
    return e.to_numpy()


def fill(buf: ConduitEpisodeReplayBuffer) -> None:
    """Episode A (code 1): steps 0..4 in two chunks, terminated. Episode B (code 2): steps 0..2, truncated."""
    buf.add([chunk("A", 1, 0, 3)])
    buf.add([chunk("B", 2, 0, 3, truncated=True), chunk("A", 1, 3, 5, terminated=True)])


def draw_all(buf: ConduitEpisodeReplayBuffer, n_step: int | tuple[int, int] = 1, gamma: float = 0.9,
             n: int = 400) -> dict[str, np.ndarray]:
    s = buf.sample(num_items=n, n_step=n_step, gamma=gamma, beta=0.4, **DQN_KW)
    return {k: v.numpy().copy() for k, v in s.columns.items()}


def test_one_step_transitions_are_stored_as_added() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=100, seed=0)
    fill(buf)
    assert len(buf) == 8 and buf.get_num_timesteps() == 8
    c = draw_all(buf)
    obs = c[Columns.OBS][:, 0]
    assert set(obs.tolist()) == {100, 101, 102, 103, 104, 200, 201, 202}, "not every stored step was drawn"
    t = obs % 100
    np.testing.assert_array_equal(c[Columns.NEXT_OBS][:, 0], obs + 1)
    np.testing.assert_array_equal(c[Columns.ACTIONS], t)
    np.testing.assert_array_equal(c[Columns.REWARDS], t + 1)
    np.testing.assert_array_equal(c[Columns.TERMINATEDS], obs == 104)
    np.testing.assert_array_equal(c[Columns.TRUNCATEDS], obs == 202)
    np.testing.assert_array_equal(c["weights"], 1.0)
    np.testing.assert_array_equal(c["n_step"], 1)
    assert c[Columns.OBS].dtype == np.float32 and c[Columns.REWARDS].dtype == np.float32


@pytest.mark.parametrize("n_step", [3, (2, 4)])
def test_n_step_returns_follow_the_episode_across_chunks(n_step: int | tuple[int, int]) -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, alpha=0.6, seed=1)
    fill(buf)
    gamma = 0.9
    c = draw_all(buf, n_step=n_step, gamma=gamma)
    ends = {1: 5, 2: 3}
    seen_n = set()
    for o, nobs, r, term, trunc, k in zip(c[Columns.OBS][:, 0], c[Columns.NEXT_OBS][:, 0], c[Columns.REWARDS],
                                          c[Columns.TERMINATEDS], c[Columns.TRUNCATEDS], c["n_step"], strict=True):
        code, t = divmod(int(o), 100)
        if isinstance(n_step, int):
            assert k == min(n_step, ends[code] - t), f"obs {o}: n_step {k}"
        else:
            assert k == min(k, ends[code] - t) and (k in (2, 3) or t + k == ends[code]), f"obs {o}: n_step {k}"
        seen_n.add(int(k))
        expected = sum(gamma ** j * (t + j + 1) for j in range(k))
        assert r == pytest.approx(expected, rel=1e-5), f"obs {o}: {k}-step return"
        assert nobs == o + k, f"obs {o}: next obs {nobs} after {k} steps"
        assert term == (code == 1 and t + k == 5) and trunc == (code == 2 and t + k == 3)
    if not isinstance(n_step, int):
        assert seen_n >= {2, 3}, f"n drawn from [2, 4) per item, saw {seen_n}"


def test_a_sample_is_a_sequence_of_rllib_one_step_episodes() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, alpha=0.6, seed=2)
    native = PrioritizedEpisodeReplayBuffer(capacity=100, alpha=0.6)
    for b in (buf, native):
        fill(b)
    ours = buf.sample(num_items=6, n_step=1, gamma=0.99, beta=0.4, **DQN_KW)
    theirs = native.sample(num_items=6, n_step=1, gamma=0.99, beta=0.4, **DQN_KW)
    assert len(ours) == 6
    for eps in (list(ours), theirs):
        for e in eps:
            assert isinstance(e, SingleAgentEpisode) and len(e) == 1
            assert set(e.extra_model_outputs) == {"weights", "n_step"}
    for i, e in enumerate(ours):
        np.testing.assert_array_equal(e.get_observations(0), ours.columns[Columns.OBS][i].numpy())
        np.testing.assert_array_equal(e.get_observations(1), ours.columns[Columns.NEXT_OBS][i].numpy())
        assert e.get_rewards(0) == float(ours.columns[Columns.REWARDS][i])
        assert e.is_terminated == bool(ours.columns[Columns.TERMINATEDS][i])


def _native_ids(episodes: list[SingleAgentEpisode]) -> np.ndarray:
    return np.array([int(e.get_observations(0)[0]) for e in episodes])


def _set_priorities(buf: object, prio: np.ndarray, ids_of: object) -> None:
    """Every item gets prio[id] through RLlib's interface (update_priorities after each sample)."""
    seen: set[int] = set()
    for _ in range(100):
        s = buf.sample(num_items=500, n_step=1, gamma=0.99, beta=0.4, **DQN_KW)  # type: ignore[attr-defined]
        ids = ids_of(s)  # type: ignore[operator]
        buf.update_priorities(prio[ids], "default_policy")  # type: ignore[attr-defined]
        seen.update(ids.tolist())
        if len(seen) == len(prio):
            return
    pytest.fail("not every item was reached")


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_sampling_distribution_equals_rllibs_native_buffer(prioritized: bool) -> None:
    """Chi-square: Conduit and RLlib's buffer of the same kind draw tagged observations alike."""
    n, alpha, draws = 40, 0.7, 12_000
    if prioritized:
        conduit = ConduitPrioritizedEpisodeReplayBuffer(capacity=1000, alpha=alpha, seed=3)
        native: EpisodeReplayBuffer = PrioritizedEpisodeReplayBuffer(capacity=1000, alpha=alpha)
    else:
        conduit = ConduitEpisodeReplayBuffer(capacity=1000, seed=3)
        native = EpisodeReplayBuffer(capacity=1000)
    native.rng = np.random.default_rng(3)
    for b in (conduit, native):
        b.add([id_episode(np.arange(n), episode_id="tagged")])
    prio = np.linspace(0.2, 4.0, n)
    expected = prio ** alpha if prioritized else np.ones(n)

    def conduit_ids(s: object) -> np.ndarray:
        return s.columns[Columns.OBS][:, 0].numpy().astype(np.int64)  # type: ignore[attr-defined]

    if prioritized:
        _set_priorities(conduit, prio, conduit_ids)
        _set_priorities(native, prio, _native_ids)
    counts = {}
    for name, b, ids_of in (("conduit", conduit, conduit_ids), ("native", native, _native_ids)):
        c = np.zeros(n, dtype=np.int64)
        for _ in range(draws // 1000):
            s = b.sample(num_items=1000, n_step=1, gamma=0.99, beta=0.4, **DQN_KW)
            np.add.at(c, ids_of(s), 1)
            if prioritized:  # keep RLlib's sample/update alternation, with unchanged priorities
                b.update_priorities(prio[ids_of(s)], "default_policy")
        counts[name] = c
        p = stats.chisquare(c, expected * c.sum() / expected.sum()).pvalue
        assert p > 1e-3, f"{name} draws do not follow {'p^alpha' if prioritized else 'uniform'} (p={p:.1e})"
    p2 = stats.chi2_contingency(np.stack([counts["conduit"], counts["native"]])).pvalue
    assert p2 > 1e-3, f"Conduit and RLlib draw differently (p={p2:.1e}): {counts}"


def test_importance_weights_equal_rllibs() -> None:
    n, alpha = 20, 0.6
    conduit = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, alpha=alpha, seed=4)
    native = PrioritizedEpisodeReplayBuffer(capacity=100, alpha=alpha)
    for b in (conduit, native):
        b.add([id_episode(np.arange(n), episode_id="w")])
    prio = np.arange(1, n + 1, dtype=np.float64)
    _set_priorities(conduit, prio, lambda s: s.columns[Columns.OBS][:, 0].numpy().astype(np.int64))
    _set_priorities(native, prio, _native_ids)
    ours = conduit.sample(num_items=300, n_step=1, gamma=0.99, beta=0.5, **DQN_KW)
    theirs = native.sample(num_items=300, n_step=1, gamma=0.99, beta=0.5, **DQN_KW)
    w_ours = dict(zip(ours.columns[Columns.OBS][:, 0].long().tolist(), ours.columns["weights"].tolist(), strict=True))
    w_theirs = {int(e.get_observations(0)[0]): float(e.get_extra_model_outputs("weights", 0)) for e in theirs}
    common = sorted(set(w_ours) & set(w_theirs))
    assert len(common) >= n // 2
    np.testing.assert_allclose([w_ours[i] for i in common], [w_theirs[i] for i in common], rtol=1e-5)


def test_bad_calls_raise_typed_errors_and_change_nothing() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=50, alpha=0.6, seed=5)
    with pytest.raises(EmptyBufferError):
        buf.sample(num_items=4, n_step=1, **DQN_KW)
    with pytest.raises(PriorityError):
        buf.update_priorities(np.ones(4))
    buf.add([id_episode(np.arange(10))])
    before = buf.get_state()
    for kwargs in ({"sample_episodes": False}, {"batch_length_T": 4}, {"include_infos": True},
                   {"include_extra_model_outputs": True}):
        with pytest.raises(UnsupportedConfigError):
            buf.sample(num_items=4, n_step=1, **(DQN_KW | kwargs))
    with pytest.raises(SchemaError):
        buf.add([SingleAgentEpisode(observations=[np.zeros(3, np.float32)] * 2, actions=[0], rewards=[0.0],
                                    len_lookback_buffer=0)])
    with pytest.raises(SchemaError):
        buf.add([SingleAgentEpisode(observations=[{"a": np.zeros(2, np.float32)}] * 2, actions=[0], rewards=[0.0],
                                    len_lookback_buffer=0)])
    s = buf.sample(num_items=8, n_step=1, beta=0.4, **DQN_KW)
    with pytest.raises(PriorityError):
        buf.update_priorities(np.ones(7))
    bad = np.ones(8)
    bad[3] = np.nan
    with pytest.raises(PriorityError):
        buf.update_priorities(bad)
    after = buf.get_state()
    assert len(buf) == 10
    np.testing.assert_array_equal(after["edp"]["semantics"]["sampler"]["leaves"],
                                  before["edp"]["semantics"]["sampler"]["leaves"])
    assert buf.update_priorities(np.full(8, 2.0)) == 8, "a valid update after the failed ones applies"
    assert len(s) == 8
    with pytest.raises(ConfigurationError):
        ConduitEpisodeReplayBuffer(capacity=10).add([id_episode(np.arange(3))], weight=2.0)
    with pytest.raises(ConfigurationError):
        buf.set_state(PrioritizedEpisodeReplayBuffer(capacity=50).get_state())
    with pytest.raises(ConfigurationError):
        ConduitPrioritizedEpisodeReplayBuffer(capacity=60).set_state(buf.get_state())


def test_priorities_by_handle_skip_evicted_items() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, alpha=1.0, seed=6)
    buf.add([id_episode(np.arange(10))])
    s = buf.sample(num_items=20, n_step=1, beta=0.4, **DQN_KW)
    old = s.handles.clone()
    buf.add([id_episode(np.arange(100, 105))])  # evicts ids 0..4
    ids = s.columns[Columns.OBS][:, 0].long()
    applied = buf.update_priorities(np.full(20, 5.0), handles=old)
    assert applied == int((ids >= 5).sum()), "only the still-stored transitions were updated"


def test_state_round_trip_continues_identically() -> None:
    a = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, alpha=0.6, seed=7)
    fill(a)  # 8 steps into 6 slots: the oldest two are evicted
    s = a.sample(num_items=16, n_step=3, gamma=0.9, beta=0.4, **DQN_KW)
    a.update_priorities(np.linspace(1, 3, 16))
    state = a.get_state()
    b = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, alpha=0.6, seed=99)
    b.set_state(state)
    assert len(b) == len(a) == 6
    for _ in range(3):
        x = draw_all(a, n_step=3, n=16)
        y = draw_all(b, n_step=3, n=16)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"column {k} differs after restore")
    a.add([chunk("C", 3, 0, 1, terminated=True)])  # (a new episode: "B" is over, a chunk of it is refused)
    b.add([chunk("C", 3, 0, 1, terminated=True)])
    np.testing.assert_array_equal(draw_all(a, n_step=3)[Columns.REWARDS], draw_all(b, n_step=3)[Columns.REWARDS])
    assert len(s) == 16


def test_metrics_are_exact_and_logged_every_nth_call() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=5, seed=8, metrics_every=3)
    buf.add([id_episode(np.arange(4))])
    buf.add([id_episode(np.arange(4, 8))])  # evicts 3
    buf.sample(num_items=10, n_step=1, **DQN_KW)
    assert buf.get_metrics() == {} and buf.get_metrics() == {}
    m = buf.get_metrics()
    assert m["num_env_steps_added"] == 8 and m["num_env_steps_evicted"] == 3
    assert m["num_env_steps_sampled"] == 10 and m["num_episodes_added"] == 2
    assert buf.get_added_timesteps() == 8 and buf.get_sampled_timesteps() == 10
    assert buf.get_num_episodes() == 2


def test_delivery_lands_on_the_requested_device_without_per_item_objects() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=100, seed=9, device="cpu")
    buf.add([id_episode(np.arange(50))])
    s = buf.sample(num_items=32, n_step=1, **DQN_KW)
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.shape[0] == 32
               for v in s.columns.values())
    mab = s.to_multi_agent_batch()
    assert mab.env_steps() == 32
    assert mab.policy_batches["default_policy"][Columns.OBS] is s.columns[Columns.OBS]


@pytest.mark.gpu
def test_delivery_lands_on_the_gpu() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, seed=9, device="cuda")
    buf.add([id_episode(np.arange(50))])
    s = buf.sample(num_items=32, n_step=3, gamma=0.9, beta=0.4, **DQN_KW)
    assert all(v.device.type == "cuda" for v in s.columns.values())
    ids = s.columns[Columns.OBS][:, 0].long().cpu()
    assert torch.equal(s.columns[Columns.ACTIONS].cpu(), ids)


def test_a_capacity_that_cannot_be_allocated_is_a_typed_error() -> None:
    from conduit import CapacityError

    buf = ConduitEpisodeReplayBuffer(capacity=10 ** 13)
    with pytest.raises(CapacityError, match="replay_buffer_config"):
        buf.add([id_episode(np.arange(3))])
    assert len(buf) == 0 and buf.edp is None
