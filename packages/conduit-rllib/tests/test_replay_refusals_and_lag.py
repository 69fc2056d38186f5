"""The RLlib replay buffers: refused calls, restores into another alpha, background ingestion that lags (no Ray)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import CapacityError, ConfigurationError, Overlapped, PriorityError  # noqa: E402
from conduit_rllib import (  # noqa: E402
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
    MinibatchFeed,
    UnsupportedConfigError,
)
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402

SPACE = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
ACTS = gym.spaces.Discrete(1000)


def episode(eid: str, code: int, n: int, *, terminated: bool = True, t_started: int = 0) -> SingleAgentEpisode:
    """n steps: obs_t = (code * 100 + t) in both dims, action t, reward code * 100 + t (a continuation of
    ``eid`` starts at ``t_started``)."""
    obs = [np.full(2, code * 100 + t, np.float32) for t in range(n + 1)]
    return SingleAgentEpisode(id_=eid, observations=obs, actions=list(range(n)),
                              rewards=[float(code * 100 + t) for t in range(n)], terminated=terminated,
                              observation_space=SPACE, action_space=ACTS, len_lookback_buffer=0,
                              t_started=t_started).to_numpy()


def wide_episode(n: int) -> SingleAgentEpisode:
    """Observations of shape (3,), unlike every other episode here."""
    return SingleAgentEpisode(id_="wide", observations=[np.zeros(3, np.float32)] * (n + 1), actions=[0] * n,
                              rewards=[0.0] * n, len_lookback_buffer=0)


@pytest.mark.parametrize(("prioritized", "bad"), [
    (False, {"n_step": 0}), (False, {"n_step": (3, 3)}), (True, {"n_step": -1}), (True, {"n_step": (2, 1)}),
    (True, {"beta": -0.5}), (True, {"beta": float("nan")})],
    ids=["uniform-n_step=0", "uniform-empty-range", "prioritized-n_step<0", "prioritized-reversed-range",
         "prioritized-beta<0", "prioritized-beta=nan"])
def test_a_refused_sample_draws_nothing(prioritized: bool, bad: dict[str, object]) -> None:
    """A sample() refused for its n_step or beta must not advance the sampler: later draws stay identical."""
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    a, b = cls(capacity=100, seed=0), cls(capacity=100, seed=0)
    for buf in (a, b):
        buf.add([id_episode(np.arange(40), episode_id="e")])
    with pytest.raises(ConfigurationError):
        a.sample(num_items=8, **(DQN_KW | {"n_step": 1, "beta": 0.4} | bad))
    x = a.sample(num_items=16, n_step=1, beta=0.4, **DQN_KW)
    y = b.sample(num_items=16, n_step=1, beta=0.4, **DQN_KW)
    assert torch.equal(x.handles, y.handles), "the refused sample() consumed a draw"
    assert a.get_sampled_timesteps() == 16


def test_a_refused_first_add_does_not_decide_the_schema() -> None:
    """A first add refused as too large, or for a bad weight, stores nothing: the next add decides the schema."""
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=5, seed=0)
    with pytest.raises(CapacityError):
        buf.add([id_episode(np.arange(10))])
    with pytest.raises(PriorityError):
        buf.add([id_episode(np.arange(3))], weight=float("nan"))
    assert len(buf) == 0 and buf.edp is None and buf.observation_space is None
    buf.add([wide_episode(3)])  # raised SchemaError ("(3,), the schema says (2,)") before the fix
    assert len(buf) == 3
    s = buf.sample(num_items=4, n_step=1, beta=0.4, **DQN_KW)
    assert tuple(s.columns[Columns.OBS].shape) == (4, 3)


def test_restoring_into_a_buffer_of_another_alpha_continues_identically() -> None:
    """set_state adopts the saved alpha for sampling and later updates, not only in its bookkeeping."""
    src = ConduitPrioritizedEpisodeReplayBuffer(capacity=50, alpha=1.0, seed=1)
    src.add([id_episode(np.arange(20), episode_id="e")])
    src.sample(num_items=20, n_step=1, beta=0.4, **DQN_KW)
    src.update_priorities(np.arange(1, 21, dtype=np.float64))
    dst = ConduitPrioritizedEpisodeReplayBuffer(capacity=50, alpha=0.5, seed=1)
    dst.set_state(src.get_state())
    for buf in (src, dst):  # an update after the restore must use the same alpha
        buf.sample(num_items=20, n_step=1, beta=0.4, **DQN_KW)
        buf.update_priorities(np.arange(20, 0, -1, dtype=np.float64) * 3)
    x = src.sample(num_items=200, n_step=1, beta=0.4, **DQN_KW)
    y = dst.sample(num_items=200, n_step=1, beta=0.4, **DQN_KW)
    assert torch.equal(x.handles, y.handles), "the restored buffer draws differently"
    torch.testing.assert_close(y.columns["weights"], x.columns["weights"])
    assert dst.get_state()["alpha"] == 1.0


def _lagging(capacity: int) -> ConduitEpisodeReplayBuffer:
    """A buffer whose scheduler stores adds four at a time, so storage lags the adds (deterministically)."""
    return ConduitEpisodeReplayBuffer(capacity=capacity, seed=0, scheduler=Overlapped(g_ing=4, g_del=1, overlap=False),
                                      metrics_every=1)


def test_evictions_are_counted_once_when_storage_lags_the_adds() -> None:
    buf = _lagging(4)
    try:
        buf.add([id_episode(np.arange(4), episode_id="first", terminated=True)])
        buf.edp.flush()
        for i in range(1, 4):  # 3 x 2 steps into a full buffer of 4: 6 evicted in all
            buf.add([id_episode(np.arange(10 * i, 10 * i + 2), episode_id=f"e{i}", terminated=True)])
        assert len(buf) == 4
        m = buf.get_metrics()
        assert m["num_env_steps_evicted"] == 6, f"evicted steps counted {m['num_env_steps_evicted']} times, not 6"
        assert m["num_env_steps_added"] == 10
    finally:
        buf.close()


def test_episode_count_includes_steps_not_stored_yet() -> None:
    buf = _lagging(10)
    try:
        buf.add([episode("A", 1, 3, terminated=False)])
        buf.edp.flush()
        buf.add([episode("A", 1, 2, terminated=True, t_started=3)])  # A's continuation, still waiting for storage
        assert buf.get_num_episodes() == 1, "the episode whose continuation is pending was not counted"
        assert len(buf) == 5
    finally:
        buf.close()


def test_n_step_returns_are_right_while_storage_lags_the_adds() -> None:
    """Items still stored while a pending add takes their slots keep their own (one-step) transition."""
    buf = _lagging(4)
    try:
        buf.add([episode("A", 1, 4)])  # obs 100..103, stored
        buf.edp.flush()
        buf.add([episode("B", 2, 2)])  # pending; will take the slots of obs 100 and 101
        s = buf.sample(num_items=64, n_step=2, gamma=1.0, **DQN_KW)
        obs = s.columns[Columns.OBS][:, 0].numpy()
        assert set(obs.tolist()) == {100.0, 101.0, 102.0, 103.0}
        for o, r, nobs, k, term in zip(obs, s.columns[Columns.REWARDS].numpy(), s.columns[Columns.NEXT_OBS][:, 0],
                                       s.columns["n_step"], s.columns[Columns.TERMINATEDS], strict=True):
            t = int(o) - 100
            k = int(k)
            assert 1 <= k <= min(2, 4 - t), f"obs {o}: n_step {k}"
            assert r == pytest.approx(sum(100 + t + j for j in range(k))), f"obs {o}: {k}-step return {r}"
            assert float(nobs) == o + k, f"obs {o}: next obs {float(nobs)} after {k} steps"
            assert bool(term) == (t + k == 4)
    finally:
        buf.close()


@pytest.mark.parametrize("column", [np.array(["a", "b", "c", "d"]), np.array([{}, {}, {}, {}], dtype=object)],
                         ids=["strings", "objects"])
def test_a_non_numeric_train_batch_column_is_a_typed_error_and_stores_nothing(column: np.ndarray) -> None:
    feed = MinibatchFeed(num_minibatches=2, num_epochs=1, prefetch=False)
    try:
        obs = np.arange(8, dtype=np.float32).reshape(4, 2)
        with pytest.raises(UnsupportedConfigError, match="'extra'"):  # was a raw TypeError from torch
            feed.ingest("default_policy", {Columns.OBS: obs, "extra": column}, version=0)
        feed.ingest("default_policy", {Columns.OBS: obs}, version=0)
        feed.seal()
        rows = [r for mab in feed.minibatches()
                for r in mab.policy_batches["default_policy"][Columns.OBS][:, 0].tolist()]
        assert sorted(rows) == [0.0, 2.0, 4.0, 6.0], "the refused ingest stored rows"
    finally:
        feed.close()


def test_an_add_weight_does_not_raise_later_adds_default_priority_as_in_rllib() -> None:
    """RLlib's prioritized buffer gives an add without a weight its largest *updated* priority (1.0 at first):
    a weight passed to an earlier add does not count. Conduit's gave later adds that weight."""
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    ours = ConduitPrioritizedEpisodeReplayBuffer(capacity=20, alpha=0.6, seed=0)
    native = PrioritizedEpisodeReplayBuffer(capacity=20, alpha=0.6)
    for buf in (ours, native):
        buf.add([id_episode(np.arange(4), episode_id="a")], weight=10.0)
        buf.add([id_episode(np.arange(4, 10), episode_id="b")])
    leaves = ours.edp.semantics.sampler._tree.get(np.arange(10))
    expected = np.array([10.0 ** 0.6] * 4 + [1.0] * 6)
    np.testing.assert_allclose(leaves, expected, err_msg="a later add took the earlier add's weight")
    np.testing.assert_allclose(leaves.sum(), native._sum_segment.sum(0, native._sum_segment.capacity), rtol=1e-9)
