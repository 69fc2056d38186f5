"""Conduit's RLlib replay buffers against RLlib's native buffers of the same kind (review round 3, no Ray)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import copy  # noqa: E402

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import ConfigurationError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402

WIDE = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)


def wide_episode(eid: str, n: int) -> SingleAgentEpisode:
    """n steps with observations of shape (3,) (id_episode's are (2,)): obs_t = (t, t, t), action t."""
    obs = [np.full(3, t, np.float32) for t in range(n + 1)]
    return SingleAgentEpisode(id_=eid, observations=obs, actions=list(range(n)), rewards=[float(t) for t in range(n)],
                              observation_space=WIDE, action_space=gym.spaces.Discrete(100),
                              len_lookback_buffer=0).to_numpy()


def _damaged(state: dict) -> dict:
    """``state`` with one NaN priority leaf (the data plane refuses to load it)."""
    bad = copy.deepcopy(state)
    leaves = np.array(bad["edp"]["semantics"]["sampler"]["leaves"], dtype=np.float64)
    leaves[0] = np.nan
    bad["edp"]["semantics"]["sampler"]["leaves"] = leaves
    return bad


def _same_draws(a: ConduitPrioritizedEpisodeReplayBuffer, b: ConduitPrioritizedEpisodeReplayBuffer) -> None:
    """Sample/update/sample both buffers alike: handles, columns and weights must agree."""
    for step in range(2):
        x = a.sample(num_items=32, n_step=2, gamma=0.9, beta=0.4, **DQN_KW)
        y = b.sample(num_items=32, n_step=2, gamma=0.9, beta=0.4, **DQN_KW)
        assert torch.equal(x.handles, y.handles), f"draw {step}: the buffer draws differently after a refused restore"
        for k in x.columns:
            assert torch.equal(x.columns[k], y.columns[k]), f"draw {step}: column {k} differs after a refused restore"
        prio = np.linspace(0.5, 4.0, 32)
        a.update_priorities(prio)
        b.update_priorities(prio)


@pytest.mark.parametrize("other_schema", [False, True], ids=["same-schema", "other-schema"])
def test_a_refused_restore_changes_nothing(other_schema: bool) -> None:
    """set_state of a damaged checkpoint is refused (ConfigurationError) and leaves the buffer as it was.

    Before the fix the refused restore had already switched the buffer to the checkpoint's alpha and, for a
    checkpoint of another observation shape, rebuilt the data plane empty: every stored transition was lost.
    """
    src = ConduitPrioritizedEpisodeReplayBuffer(capacity=16, alpha=0.5, seed=3)
    src.add([id_episode(np.arange(100, 104), episode_id="s")])
    bad = _damaged(src.get_state())

    def make() -> ConduitPrioritizedEpisodeReplayBuffer:
        buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=16, alpha=0.9, seed=1)
        buf.add([wide_episode("w", 6) if other_schema else id_episode(np.arange(6), episode_id="d")])
        buf.sample(num_items=8, n_step=1, beta=0.4, **DQN_KW)
        buf.update_priorities(np.arange(1, 9, dtype=np.float64))
        return buf

    a, twin = make(), make()
    with pytest.raises(ConfigurationError, match="damaged"):
        a.set_state(bad)
    assert len(a) == 6, f"the refused restore dropped stored transitions ({len(a)} of 6 left)"
    assert a.get_state()["alpha"] == 0.9, "the refused restore switched the buffer to the checkpoint's alpha"
    assert a.edp is not None and a.edp.schema == twin.edp.schema, "the refused restore changed the schema"
    _same_draws(a, twin)
    a.add([wide_episode("w2", 2) if other_schema else id_episode(np.arange(6, 8), episode_id="d2")])
    twin.add([wide_episode("w2", 2) if other_schema else id_episode(np.arange(6, 8), episode_id="d2")])
    _same_draws(a, twin)


def test_a_state_with_a_missing_entry_is_a_typed_error_and_changes_nothing() -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    buf.add([id_episode(np.arange(4), episode_id="a")])
    state = ConduitEpisodeReplayBuffer(capacity=10, seed=0).get_state()
    del state["tail"]
    with pytest.raises(ConfigurationError, match="damaged"):  # was a raw KeyError
        buf.set_state(state)
    assert len(buf) == 4


@pytest.mark.parametrize("capacity", [np.int64(8), np.float64(8.0)], ids=["numpy-int", "numpy-float"])
def test_a_numpy_capacity_is_accepted_as_by_rllibs_buffers(capacity: object) -> None:
    """RLlib's buffers take a NumPy capacity (e.g. from a tuned config); Conduit's refused it (ConfigurationError)."""
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    native = PrioritizedEpisodeReplayBuffer(capacity=capacity)
    ours = ConduitPrioritizedEpisodeReplayBuffer(capacity=capacity, seed=0)
    assert ours.capacity == native.capacity == 8 and isinstance(ours.capacity, int)
    ours.add([id_episode(np.arange(6), episode_id="a")])
    ours.add([id_episode(np.arange(6, 10), episode_id="a", t_started=6)])
    assert len(ours) == 8, "FIFO per transition: the newest 8 of 10 steps stay"


@pytest.mark.parametrize("capacity", [float("nan"), float("inf"), True, 0, -3, "100"],
                         ids=["nan", "inf", "bool", "zero", "negative", "string"])
def test_a_capacity_that_is_not_a_positive_finite_number_is_a_typed_error(capacity: object) -> None:
    with pytest.raises(ConfigurationError, match="capacity must be a positive number"):  # nan/inf: raw errors
        ConduitEpisodeReplayBuffer(capacity=capacity)  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [None, "0.6", True, float("nan"), -0.1, [0.6]])
def test_an_alpha_that_is_not_a_finite_non_negative_number_is_a_typed_error(alpha: object) -> None:
    with pytest.raises(ConfigurationError, match="alpha must be a finite number >= 0"):
        ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=alpha)  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [0, 0.6, np.float32(0.6), np.int64(1)])
def test_numeric_alphas_are_accepted(alpha: object) -> None:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=alpha)  # type: ignore[arg-type]
    assert buf._alpha == float(alpha)  # type: ignore[arg-type]
