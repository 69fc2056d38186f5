"""The off-policy replay path: checkpoints, metrics, refused inputs, RLlib hooks.

Buffer-level tests drive Conduit's buffers through the calls RLlib's DQN/SAC training step makes
(no Ray needed); the test marked with ``ray_local`` builds a real (tiny) DQN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from conduit_rllib.testing import id_episode


def _values(metrics: dict[str, Any]) -> dict[str, float]:
    """The reduced buffer metrics as plain numbers (RLlib's reduce() hands back Stats objects)."""
    out = {}
    for k, v in metrics.items():
        peek = getattr(v, "peek", None)
        out[k] = float(peek() if callable(peek) else v)
    return out


@pytest.mark.parametrize("prioritized", [False, True])
def test_metrics_not_yet_logged_at_a_checkpoint_are_reported_by_the_restored_buffer(prioritized: bool) -> None:
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    a = cls(capacity=10, seed=0, metrics_every=4)
    a.add([id_episode(np.arange(5))])
    a.sample(num_items=7, n_step=1, beta=0.4, **DQN_KW)
    assert a.get_metrics() == {}, "the first of every 4 calls logs nothing"
    b = cls(capacity=10, seed=0, metrics_every=4)
    b.set_state(a.get_state())
    for buf in (a, b):  # both go on identically: one more add and sample
        buf.add([id_episode(np.arange(5, 8))])
        buf.sample(num_items=3, n_step=1, beta=0.4, **DQN_KW)
    reports = {name: [_values(buf.get_metrics()) for _ in range(3)] for name, buf in (("saved", a), ("restored", b))}
    assert [bool(r) for r in reports["restored"]] == [bool(r) for r in reports["saved"]] == [False, False, True], (
        f"the restored buffer must log on the same call as the saved one: {reports}")
    got, want = reports["restored"][2], reports["saved"][2]
    for key in ("num_env_steps_added", "num_env_steps_sampled", "num_episodes_added", "num_env_steps_evicted"):
        assert got[key] == want[key], f"{key}: restored buffer reports {got[key]}, the saved one {want[key]}"
    assert want["num_env_steps_added"] == 8 and want["num_env_steps_sampled"] == 10
    assert b.get_added_timesteps() == a.get_added_timesteps() == 8
    assert b.get_sampled_timesteps() == a.get_sampled_timesteps() == 10


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("capacity", [float("nan"), None, "100"])
def test_a_uniform_replay_capacity_that_is_no_number_is_a_typed_error_at_build(capacity: object) -> None:
    # RLlib's own uniform buffer (built first) takes any capacity; Conduit's must refuse it typed, not
    # raise int()'s raw ValueError/TypeError or turn the string "100" into a capacity.
    import conduit_rllib
    from conduit import ConfigurationError
    from conduit_rllib.workloads import dqn_large_obs

    config = dqn_large_obs(4, steps=10, batch=8, capacity=60, learning_starts=5, prioritized=False)
    config.replay_buffer_config["capacity"] = capacity
    conduit_rllib.enable(config)
    with pytest.raises(ConfigurationError, match="capacity must be a positive number"):
        config.build_algo()


def test_a_renamed_dqn_training_step_is_reported_as_a_moved_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    # a newer RLlib that renames the new-stack training step must fail typed and by name, not with AttributeError
    from conduit_rllib import compat
    from conduit_rllib.compat import RLlibCompatibilityError
    from ray.rllib.algorithms.dqn.dqn import DQN

    monkeypatch.delattr(DQN, "_training_step_new_api_stack")
    found = compat.problems()
    # the five hooks that read the training step
    assert sum("_training_step_new_api_stack" in p for p in found) == 5, found
    assert not any("on_algorithm_init" in p or "Learner" in p for p in found), f"other hooks still hold: {found}"
    with pytest.raises(RLlibCompatibilityError, match="_training_step_new_api_stack"):
        compat.check()


@pytest.mark.parametrize("weight", ["high", [1.0, 2.0], object()])
def test_an_add_weight_that_is_no_number_is_a_priority_error_and_stores_nothing(weight: object) -> None:
    from conduit import PriorityError

    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, seed=1)
    with pytest.raises(PriorityError, match="weight"):
        buf.add([id_episode(np.arange(2))], weight=weight)  # type: ignore[arg-type]
    assert len(buf) == 0 and buf.get_added_timesteps() == 0
    buf.add([id_episode(np.arange(3))], weight=2.0)
    with pytest.raises(PriorityError, match="weight"):
        buf.add([id_episode(np.arange(3, 5)), id_episode(np.arange(5, 6))], weight=weight)  # type: ignore[arg-type]
    assert len(buf) == 3 and buf.get_added_timesteps() == 3, "a refused add stored nothing"


@pytest.mark.parametrize("damage", ["short links", "next handle", "alpha"])
def test_a_state_with_damaged_links_or_alpha_is_refused_typed_and_changes_nothing(damage: str) -> None:
    from conduit import ConfigurationError

    src = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    src.add([id_episode(np.arange(4), episode_id="s")])
    state = src.get_state()
    if damage == "short links":
        state["succ"] = state["succ"][:3]
    elif damage == "next handle":
        state["next"] += 1
    else:
        state["alpha"] = float("nan")
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    buf.add([id_episode(np.arange(10, 15), episode_id="b")])
    twin = ConduitPrioritizedEpisodeReplayBuffer(capacity=6, seed=0)
    twin.set_state(buf.get_state())
    with pytest.raises(ConfigurationError, match="damaged"):
        buf.set_state(state)
    # unchanged: adds and n-step samples go on as in its twin
    for b in (buf, twin):
        b.add([id_episode(np.arange(15, 17), episode_id="b", t_started=5)])
    x = buf.sample(num_items=32, n_step=3, gamma=0.5, beta=0.4, **DQN_KW)
    y = twin.sample(num_items=32, n_step=3, gamma=0.5, beta=0.4, **DQN_KW)
    for k in x.columns:
        assert np.array_equal(x.columns[k].numpy(), y.columns[k].numpy()), f"column {k} differs from the twin"
    assert len(buf) == 6 and buf.get_added_timesteps() == 7


def test_a_beta_that_is_no_number_is_ignored_by_the_uniform_buffer_and_refused_typed_by_the_prioritized() -> None:
    from conduit import ConfigurationError

    schedule = [[0, 0.4], [1000, 1.0]]  # not a beta RLlib's buffers take: its uniform one never reads it
    uniform = ConduitEpisodeReplayBuffer(capacity=8, seed=2)
    uniform.add([id_episode(np.arange(4))])
    assert len(uniform.sample(num_items=5, n_step=1, beta=schedule, **DQN_KW)) == 5
    buf, twin = (ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=0.6, seed=2) for _ in range(2))
    for b in (buf, twin):
        b.add([id_episode(np.arange(4))])
    with pytest.raises(ConfigurationError, match="beta"):
        buf.sample(num_items=5, n_step=(1, 3), beta=schedule, **DQN_KW)
    x = buf.sample(num_items=5, n_step=(1, 3), beta=0.4, **DQN_KW)
    y = twin.sample(num_items=5, n_step=(1, 3), beta=0.4, **DQN_KW)
    for k in x.columns:
        assert np.array_equal(x.columns[k].numpy(), y.columns[k].numpy()), f"the refused sample drew: {k} differs"


def test_a_moved_rllib_module_is_reported_as_a_moved_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import ray.rllib.utils.replay_buffers as replay_buffers
    from conduit_rllib import compat
    from conduit_rllib.compat import RLlibCompatibilityError

    # what an RLlib that moved ray.rllib.utils.replay_buffers.utils looks like to an import
    monkeypatch.delattr(replay_buffers, "utils")
    monkeypatch.setitem(sys.modules, "ray.rllib.utils.replay_buffers.utils", None)
    found = compat.problems()
    assert len(found) == 1 and "replay_buffers" in found[0], found
    with pytest.raises(RLlibCompatibilityError, match="replay_buffers"):
        compat.check()


@pytest.mark.parametrize("num_items", [2.5, "3", "abc", -1, True])
def test_a_num_items_that_is_no_whole_number_is_refused_typed_and_draws_nothing(num_items: object) -> None:
    """sample(num_items=2.5) drew 2, "3" drew 3 and "abc" raised a raw ValueError."""
    from conduit import ConfigurationError

    buf, twin = (ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=0.6, seed=2) for _ in range(2))
    for b in (buf, twin):
        b.add([id_episode(np.arange(4))])
    with pytest.raises(ConfigurationError, match="whole number"):
        buf.sample(num_items=num_items, n_step=1, beta=0.4, **DQN_KW)
    x = buf.sample(num_items=5, n_step=1, beta=0.4, **DQN_KW)
    y = twin.sample(num_items=5, n_step=1, beta=0.4, **DQN_KW)
    for k in x.columns:
        assert np.array_equal(x.columns[k].numpy(), y.columns[k].numpy()), f"the refused sample drew: {k} differs"
