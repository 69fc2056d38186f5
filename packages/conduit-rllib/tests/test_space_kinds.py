"""The observation/action spaces and data kinds an RLlib user runs, through Conduit's replay buffers and
on-policy feed: stored and delivered as RLlib's own buffers would, or refused with a typed error that
changes nothing. No Ray is started (episodes are built directly)."""

from __future__ import annotations

import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from conduit import ConduitError, ConfigurationError, Field, PriorityError, SchemaError
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, UnsupportedConfigError
from conduit_rllib.on_policy import MinibatchFeed
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer


def episode(obs_space: gym.Space, act_space: gym.Space, n: int, *, seed: int, terminated: bool = False,
            truncated: bool = False, numpy: bool = True) -> SingleAgentEpisode:
    """n random steps of the given spaces; reward t + 100 * seed (tags the step)."""
    obs_space.seed(seed)
    act_space.seed(seed)
    e = SingleAgentEpisode(observations=[obs_space.sample() for _ in range(n + 1)],
                           actions=[act_space.sample() for _ in range(n)],
                           rewards=[float(t + 100 * seed) for t in range(n)], terminated=terminated,
                           truncated=truncated, observation_space=obs_space, action_space=act_space,
                           len_lookback_buffer=0)
    return e.to_numpy() if numpy else e


def as_learner_tensor(x: Any) -> np.ndarray:
    """What RLlib's NumpyToTensor makes of a column value: float64 becomes float32, other dtypes stay."""
    a = np.asarray(x)
    return a.astype(np.float32) if a.dtype == np.float64 else a


def key(*parts: Any) -> tuple[Any, ...]:
    return tuple((str(np.asarray(p).dtype), np.asarray(p).shape, np.asarray(p).tobytes()) for p in parts)


SPACES = {
    "box-f32/discrete": (gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(4)),
    "box-f64/box-f64": (gym.spaces.Box(-1, 1, (3,), np.float64), gym.spaces.Box(-2, 2, (2,), np.float64)),
    "uint8-chw/discrete": (gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(6)),
    "uint8-hwc/multidiscrete": (gym.spaces.Box(0, 255, (84, 84, 3), np.uint8), gym.spaces.MultiDiscrete([3, 5])),
    "discrete/box-f32": (gym.spaces.Discrete(7), gym.spaces.Box(-1, 1, (2,), np.float32)),
}


@pytest.mark.parametrize("kind", list(SPACES))
def test_every_transition_is_the_one_rllibs_buffer_stores(kind: str) -> None:
    """Same episodes (lengths 1 and 3, terminated and truncated, one continued over two adds) into RLlib's
    EpisodeReplayBuffer and Conduit's: the set of one-step transitions drawn is the same, with the dtypes
    RLlib's learner connector would give them."""
    obs_space, act_space = SPACES[kind]
    long = episode(obs_space, act_space, 5, seed=1, terminated=True)
    first, rest = long[:3], long[3:]  # one episode in two chunks
    eps = [episode(obs_space, act_space, 1, seed=2, truncated=True), episode(obs_space, act_space, 1, seed=3,
                                                                              terminated=True), first]
    native = EpisodeReplayBuffer(capacity=1000)
    ours = ConduitEpisodeReplayBuffer(capacity=1000, seed=0)
    native.add(eps)
    ours.add(eps)
    native.add([rest])
    ours.add([rest])
    assert len(ours) == native.get_num_timesteps() == 7

    expected = set()
    for e in native.sample(num_items=300, n_step=1, gamma=0.9, **DQN_KW):
        o = e.get_observations()
        expected.add(key(as_learner_tensor(o[0]), as_learner_tensor(o[-1]), as_learner_tensor(e.get_actions()[0]),
                         np.float32(e.get_rewards()[0]), e.is_terminated, e.is_truncated))
    s = ours.sample(num_items=300, n_step=1, gamma=0.9, **DQN_KW)
    c = {k: v.numpy() for k, v in s.columns.items()}
    got = {key(c[Columns.OBS][i], c[Columns.NEXT_OBS][i], c[Columns.ACTIONS][i], c[Columns.REWARDS][i],
               bool(c[Columns.TERMINATEDS][i]), bool(c[Columns.TRUNCATEDS][i])) for i in range(300)}
    assert len(expected) == 7, "RLlib's buffer did not yield all 7 transitions in 300 draws"
    assert got == expected, f"{kind}: Conduit's transitions differ from RLlib's ({len(got ^ expected)} differ)"
    # iterating the sample yields episodes of the buffer's spaces
    first_ep = s[0]
    assert first_ep.observation_space == obs_space and first_ep.action_space == act_space


def test_length_one_episodes_end_the_n_step_sum_terminated_or_truncated() -> None:
    space, acts = gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Discrete(3)
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, alpha=0.6, seed=0)
    buf.add([episode(space, acts, 1, seed=1, terminated=True), episode(space, acts, 1, seed=2, truncated=True)])
    c = {k: v.numpy() for k, v in buf.sample(num_items=50, n_step=3, gamma=0.5, beta=0.4, **DQN_KW).columns.items()}
    assert set(c[Columns.REWARDS].tolist()) == {100.0, 200.0}, "a one-step episode's return took another's reward"
    np.testing.assert_array_equal(c["n_step"], 1)
    np.testing.assert_array_equal(c[Columns.TERMINATEDS], c[Columns.REWARDS] == 100.0)
    np.testing.assert_array_equal(c[Columns.TRUNCATEDS], c[Columns.REWARDS] == 200.0)
    assert buf.get_num_episodes() == 2


def test_infos_and_extra_model_outputs_of_any_dtype_are_not_stored_and_not_delivered() -> None:
    n = 3
    e = SingleAgentEpisode(observations=[np.full(2, t, np.float32) for t in range(n + 1)], actions=[0, 1, 2],
                           rewards=[1.0, 2.0, 3.0], infos=[{"s": "x", "o": object(), "c": 1 + 2j}] * (n + 1),
                           extra_model_outputs={"f16": [np.float16(1)] * n, "u64": [np.uint64(2 ** 63)] * n,
                                                "s": ["text"] * n}, len_lookback_buffer=0)
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    buf.add(e)
    s = buf.sample(num_items=4, **DQN_KW)
    assert set(s.columns) == {Columns.OBS, Columns.NEXT_OBS, Columns.ACTIONS, Columns.REWARDS, Columns.TERMINATEDS,
                              Columns.TRUNCATEDS, "weights", "n_step"}
    with pytest.raises(UnsupportedConfigError, match="infos"):
        buf.sample(num_items=4, include_infos=True, **DQN_KW)
    with pytest.raises(UnsupportedConfigError, match="extra model outputs"):
        buf.sample(num_items=4, include_extra_model_outputs=True, **DQN_KW)


def test_big_endian_observations_are_stored_by_value() -> None:
    obs = np.arange(8, dtype=">f4").reshape(4, 2)
    e = SingleAgentEpisode(observations=list(obs), actions=[0, 1, 2], rewards=[0.0, 1.0, 2.0], terminated=True,
                           len_lookback_buffer=0).to_numpy()
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    buf.add(e)
    c = buf.sample(num_items=20, **DQN_KW).columns
    t = c[Columns.REWARDS].numpy().astype(int)
    np.testing.assert_array_equal(c[Columns.OBS].numpy(), obs[t].astype(np.float32))
    np.testing.assert_array_equal(c[Columns.NEXT_OBS].numpy(), obs[t + 1].astype(np.float32))


# -- refused kinds: a typed error, nothing stored ---------------------------------------------------------------

def assert_unchanged(buf: ConduitEpisodeReplayBuffer, steps: int) -> None:
    assert len(buf) == steps and buf.get_added_timesteps() == steps, "a refused add changed the buffer"


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy-episode", "list-episode"])
@pytest.mark.parametrize("space", [
    gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Discrete(4))),
    gym.spaces.Tuple((gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Box(-1, 1, (2,), np.float32))),
    gym.spaces.Tuple((gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Discrete(3))),
    gym.spaces.Dict({"a": gym.spaces.Box(-1, 1, (2,), np.float32), "b": gym.spaces.Discrete(3)}),
    gym.spaces.Dict({"x": gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Dict({"y": gym.spaces.Discrete(2)})))}),
], ids=["tuple-discrete", "tuple-box", "tuple-mixed", "dict", "nested"])
def test_nested_observations_are_refused_with_a_schema_error(space: gym.Space, numpy: bool) -> None:
    """Before: a list episode of Tuple observations was silently stored as one array (a (2,) int or a (2, 2)
    float observation the learner's Tuple model cannot read), or failed with NumPy's raw ValueError."""
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    buf.add(episode(gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Discrete(2), 2, seed=1))
    with pytest.raises(SchemaError, match="nested"):
        buf.add(episode(space, gym.spaces.Discrete(2), 2, seed=2, numpy=numpy))
    assert_unchanged(buf, 2)
    empty = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    with pytest.raises(SchemaError, match="nested"):
        empty.add(episode(space, gym.spaces.Discrete(2), 1, seed=2, numpy=numpy))
    assert_unchanged(empty, 0)


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy-episode", "list-episode"])
def test_tuple_actions_are_refused_with_a_schema_error(numpy: bool) -> None:
    acts = gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Discrete(3)))
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    with pytest.raises(SchemaError, match="nested"):
        buf.add(episode(gym.spaces.Box(-1, 1, (2,), np.float32), acts, 2, seed=1, numpy=numpy))
    assert_unchanged(buf, 0)


def test_observations_whose_shape_changes_within_an_episode_are_a_schema_error() -> None:
    """Before: NumPy's raw ValueError ("inhomogeneous shape")."""
    e = SingleAgentEpisode(observations=[np.zeros(2, np.float32), np.zeros(3, np.float32)], actions=[0],
                           rewards=[1.0], len_lookback_buffer=0)
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    with pytest.raises(SchemaError, match="one array"):
        buf.add(e)
    assert_unchanged(buf, 0)


def test_a_multi_agent_episode_is_refused_as_unsupported_and_says_so() -> None:
    """Before: a SchemaError telling the user to flatten a Dict/Tuple observation space."""
    obs = np.zeros(2, np.float32)
    ma = MultiAgentEpisode(observations=[{"a": obs, "b": obs}, {"a": obs + 1, "b": obs + 1}],
                           actions=[{"a": 0, "b": 1}], rewards=[{"a": 1.0, "b": 2.0}], len_lookback_buffer=0)
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    buf.add(episode(gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Discrete(2), 2, seed=1))
    with pytest.raises(UnsupportedConfigError, match="MultiAgentEpisode"):
        buf.add(ma)
    assert_unchanged(buf, 2)


# -- priorities ------------------------------------------------------------------------------------------------

def prioritized_with_four(alpha: float = 1.0) -> ConduitPrioritizedEpisodeReplayBuffer:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, alpha=alpha, seed=0)
    obs = [np.full(1, t, np.float32) for t in range(5)]
    buf.add(SingleAgentEpisode(observations=obs, actions=[0, 1, 2, 3], rewards=[0.0, 1.0, 2.0, 3.0],
                               terminated=True, len_lookback_buffer=0).to_numpy())
    return buf


def test_extreme_valid_priorities_are_drawn_and_weighed_without_overflow() -> None:
    buf = prioritized_with_four()
    buf.sample(num_items=4, beta=0.4, **DQN_KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow/underflow RuntimeWarning either
        assert buf.update_priorities(np.array([0.0, 1e-300, 1e300, 1.0]), handles=np.arange(4)) == 4
        for beta in (0.0, 0.4, 1.0):
            c = buf.sample(num_items=64, beta=beta, **DQN_KW).columns
            # p ** alpha: 1e-12 (floored), 1e-12, 1e300, 1: step 2 holds all but ~1e-300 of the mass
            np.testing.assert_array_equal(c[Columns.REWARDS].numpy(), 2.0)
            w = c["weights"].numpy().astype(np.float64)
            # (min p / p_i) ** beta = (1e-12 / 1e300) ** beta: 1 at beta 0, below float32's range otherwise
            np.testing.assert_array_equal(w, 1.0 if beta == 0.0 else np.float32((1e-312) ** beta))
            assert np.isfinite(w).all() and (w >= 0).all() and (w <= 1).all()
            buf.update_priorities(np.array([0.0, 1e-300, 1e300, 1.0]), handles=np.arange(4))


@pytest.mark.parametrize("bad", [-np.inf, np.inf, np.nan])
def test_non_finite_priorities_are_refused_and_change_nothing(bad: float) -> None:
    """Before: -inf went through as RLlib's floor 1e-12 (np.maximum), though the buffer promises a
    PriorityError for every non-finite priority."""
    buf = prioritized_with_four()
    buf.sample(num_items=4, beta=0.4, **DQN_KW)
    buf.update_priorities(np.array([1.0, 1.0, 1.0, 1.0]), handles=np.arange(4))
    buf.sample(num_items=4, beta=0.4, **DQN_KW)
    with pytest.raises(PriorityError):
        buf.update_priorities(np.array([bad, 1.0, 1.0, 1.0]), handles=np.arange(4))
    with pytest.raises(PriorityError):  # the last sample's update is refused too, and can be retried
        buf.update_priorities(torch.tensor([bad, 1.0, 1.0, 1.0], dtype=torch.float64))
    assert buf.update_priorities(np.ones(4)) == 4
    w = buf.sample(num_items=64, beta=1.0, **DQN_KW).columns["weights"].numpy()
    np.testing.assert_array_equal(w, 1.0, err_msg="a refused priority update still changed a priority")


def test_negative_and_tiny_priorities_take_rllibs_floor() -> None:
    buf = prioritized_with_four()
    buf.sample(num_items=4, beta=0.4, **DQN_KW)
    assert buf.update_priorities(np.array([-1.0, 0.0, 5e-324, 1.0]), handles=np.arange(4)) == 4
    c = buf.sample(num_items=64, beta=1.0, **DQN_KW).columns
    np.testing.assert_array_equal(c[Columns.REWARDS].numpy(), 3.0)  # the others weigh 1e-12 each
    np.testing.assert_allclose(c["weights"].numpy(), 1e-12, rtol=1e-6)


# -- on-policy train batches ------------------------------------------------------------------------------------

def feed_rows(extra: dict[str, Any], n: int = 6) -> list[dict[str, np.ndarray]]:
    feed = MinibatchFeed(minibatch_size=4, num_epochs=1, shuffle=False, seed=0, prefetch=False)
    try:
        feed.ingest("default_policy", {"advantages": torch.arange(n, dtype=torch.float32), **extra}, version=0)
        feed.seal()
        return [{k: torch.as_tensor(v).numpy().copy() for k, v in mb.policy_batches["default_policy"].items()}
                for mb in feed.minibatches()]
    finally:
        feed.close()


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.bool_, np.float16, np.float64, np.complex64])
def test_train_batch_columns_of_odd_dtypes_are_delivered_as_given(dtype: type) -> None:
    col = (np.arange(6 * 3).reshape(6, 3) % 2).astype(dtype)
    mbs = feed_rows({"extra": col})
    got = np.concatenate([m["extra"] for m in mbs])[:6]
    assert got.dtype == col.dtype
    np.testing.assert_array_equal(got, col)


def test_a_big_endian_train_batch_column_is_delivered_by_value() -> None:
    """Before: torch's raw ValueError (non-native byte order)."""
    col = (np.arange(6) * 1.5).astype(">f8")
    assert not col.dtype.isnative
    mbs = feed_rows({"extra": col})
    np.testing.assert_array_equal(np.concatenate([m["extra"] for m in mbs])[:6], col)


def test_a_train_batch_column_torch_cannot_hold_is_a_typed_error_naming_it() -> None:
    """Before: torch's raw TypeError ("can't convert np.ndarray of type numpy.longdouble")."""
    if np.dtype(np.longdouble).itemsize == 8:
        pytest.skip("np.longdouble is float64 on this platform")
    with pytest.raises(UnsupportedConfigError, match="'extra'"):
        feed_rows({"extra": np.ones(6, dtype=np.longdouble)})


@pytest.mark.parametrize("column", [{"obs": [np.zeros(6)]}, {"extra": np.array(["x"] * 6)},
                                    {"extra": np.array([object()] * 6, dtype=object)}], ids=["list", "str", "object"])
def test_list_or_non_numeric_train_batch_columns_are_refused(column: dict[str, Any]) -> None:
    with pytest.raises(ConduitError):
        feed_rows(column)


def storable(dtype: torch.dtype) -> bool:
    try:
        Field((), dtype)
    except ConfigurationError:
        return False
    return True


@pytest.mark.skipif(storable(torch.uint16), reason="this torch gathers uint16 rows: such observations are stored")
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_observations_conduit_cannot_store_are_refused_in_rllib_terms(dtype: type) -> None:
    """16-bit depth images: before, the schema's ConfigurationError (no column named, advice to .view() the
    field back after delivery, which an RLlib user cannot do); now an UnsupportedConfigError saying what to
    convert, and the buffer stays empty."""
    space = gym.spaces.Box(0, 1000, (8, 8), dtype)
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    with pytest.raises(UnsupportedConfigError, match=r"observations of shape \(8, 8\).*environment wrapper"):
        buf.add(episode(space, gym.spaces.Discrete(2), 2, seed=1))
    assert_unchanged(buf, 0)
    assert buf.edp is None
    buf.add(episode(gym.spaces.Box(0, 1000, (8, 8), np.int32), gym.spaces.Discrete(2), 2, seed=1))
    assert len(buf) == 2, "the buffer did not take a storable episode after the refusal"


@pytest.mark.skipif(storable(torch.uint32), reason="this torch gathers uint32 rows: such columns are stored")
def test_a_train_batch_column_conduit_cannot_store_is_refused_by_name() -> None:
    """An RLModule's extra model output of dtype uint32: before, the schema's error, naming no column."""
    with pytest.raises(UnsupportedConfigError, match="'hash'"):
        feed_rows({"hash": np.arange(6, dtype=np.uint32)})


@pytest.mark.parametrize(("alpha", "priorities"), [(1.0, [1e308, 1e308, 1.0, 1.0]), (2.0, [1e300, 1.0, 1.0, 1.0])],
                         ids=["sum-overflows", "power-overflows"])
def test_priorities_whose_power_or_sum_overflows_are_refused_and_change_nothing(alpha: float,
                                                                                 priorities: list[float]) -> None:
    """Finite priorities whose ``p ** alpha`` (or its sum over the buffer) overflows float64. Before: accepted;
    the sum tree held inf, every draw landed on the first transition, and every importance weight was inf."""
    buf = prioritized_with_four(alpha)
    with pytest.raises(PriorityError, match="overflows float64"):
        buf.update_priorities(np.array(priorities), handles=np.arange(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = buf.sample(num_items=200, beta=1.0, **DQN_KW).columns
    np.testing.assert_array_equal(c["weights"].numpy(), 1.0, err_msg="a refused priority update changed a priority")
    assert set(c[Columns.REWARDS].tolist()) == {0.0, 1.0, 2.0, 3.0}, "draws are no longer uniform over equal priorities"
    # the largest safe value is taken (a full buffer of it sums to under half of float64's largest)
    safe = (np.finfo(np.float64).max / 2 / buf.capacity) ** (1 / alpha) * 0.99
    assert buf.update_priorities(np.full(4, safe), handles=np.arange(4)) == 4
    w = buf.sample(num_items=50, beta=1.0, **DQN_KW).columns["weights"].numpy()
    assert np.isfinite(w).all() and (w > 0).all() and (w <= 1).all()


def test_an_add_weight_whose_power_overflows_is_refused_and_stores_nothing() -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, alpha=2.0, seed=0)
    space = gym.spaces.Box(-1, 1, (2,), np.float32)
    with pytest.raises(PriorityError, match="overflows float64"):
        buf.add(episode(space, gym.spaces.Discrete(2), 3, seed=1), weight=1e300)
    assert_unchanged(buf, 0)
    buf.add(episode(space, gym.spaces.Discrete(2), 3, seed=1), weight=1e150)
    assert len(buf) == 3


@pytest.mark.parametrize(("rows", "size", "epochs"), [(1, 4, 2), (1, 1, 3), (2, 4, 1), (3, 2, 1), (5, 4, 3)])
def test_tiny_rollouts_are_cut_as_rllibs_cyclic_iterator_cuts_them(rows: int, size: int, epochs: int) -> None:
    """A rollout of 1-5 rows (an episode of length 1) with a larger minibatch: RLlib's MiniBatchCyclicIterator
    repeats rows to fill each minibatch; Conduit's feed delivers the same rows in the same order."""
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
    from ray.rllib.utils.minibatch_utils import MiniBatchCyclicIterator

    obs = np.arange(rows * 2, dtype=np.uint8).reshape(rows, 2)
    batch = MultiAgentBatch({"default_policy": SampleBatch({"obs": obs})}, env_steps=rows)
    stock = [mb.policy_batches["default_policy"]["obs"].tolist()
             for mb in MiniBatchCyclicIterator(batch, num_epochs=epochs, minibatch_size=size,
                                               shuffle_batch_per_epoch=False)]
    feed = MinibatchFeed(minibatch_size=size, num_epochs=epochs, shuffle=False, seed=0)
    try:
        feed.ingest("default_policy", {"obs": obs}, version=0)
        feed.seal()
        ours = [torch.as_tensor(mb.policy_batches["default_policy"]["obs"]).tolist() for mb in feed.minibatches()]
    finally:
        feed.close()
    assert ours == stock
