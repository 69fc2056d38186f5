"""The off-policy (DQN/SAC) learner's state: a refused part leaves both parts as they were.

``ConduitOffPolicyLearner.set_state`` restored the Conduit replay buffer before RLlib's part: a state whose RLlib
part RLlib refused left the buffer restored (half a checkpoint). Now the buffer's part is checked first
(``check_state``), RLlib's part restored, then the buffer's applied. No Ray cluster: the learner is built locally.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import conduit_rllib  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import ConfigurationError  # noqa: E402
from conduit.scheduling import Automatic  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.learner import REPLAY_COMPONENT, ConduitDQNTorchLearner  # noqa: E402
from conduit_rllib.testing import id_episode  # noqa: E402
from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402
from ray.rllib.core import DEFAULT_MODULE_ID  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_replay_restore_and_capacity import DQN_KW, _damaged  # noqa: E402

Buffer = ConduitEpisodeReplayBuffer | ConduitPrioritizedEpisodeReplayBuffer


@pytest.fixture(scope="module")
def learner() -> Iterator[ConduitDQNTorchLearner]:
    config = conduit_rllib.enable(DQNConfig().environment("CartPole-v1").debugging(seed=0)
                                  .training(store_buffer_in_checkpoints=True))  # the learner state holds the buffer
    built = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(built, ConduitDQNTorchLearner)
    yield built


def filled(kind: type[Buffer], first: int, n: int, *, capacity: int = 10) -> Buffer:
    buf = kind(capacity=capacity, seed=0)
    if n:
        buf.add([id_episode(np.arange(first, first + n), episode_id=f"e{first}")])
    return buf


def same(a: Any, b: Any, where: str = "state") -> None:
    """Assert two (nested) states are equal, tensors and arrays exactly."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        assert type(a) is type(b) and np.array_equal(np.asarray(a), np.asarray(b)), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def weights(learner: ConduitDQNTorchLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.module[DEFAULT_MODULE_ID].parameters()]


def weights_unchanged(learner: ConduitDQNTorchLearner, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, learner.module[DEFAULT_MODULE_ID].parameters(), strict=True))


def damaged_rllib_part(learner: ConduitDQNTorchLearner, replay_state: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A learner state with a valid replay part and a weight saved with a shape the module lacks (RLlib refuses)."""
    name = next(iter(learner.get_state(components="rl_module")["rl_module"][DEFAULT_MODULE_ID]))
    return {REPLAY_COMPONENT: replay_state, "rl_module": {DEFAULT_MODULE_ID: {name: torch.zeros(3, 1, 1)}}}, name


@pytest.mark.parametrize("kind", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer])
@pytest.mark.parametrize("stored", [0, 3], ids=["empty", "3-steps"])
def test_a_state_whose_rllib_part_is_refused_leaves_the_replay_buffer_as_it_was(
        learner: ConduitDQNTorchLearner, kind: type[Buffer], stored: int) -> None:
    buf = filled(kind, 50, stored)
    learner.conduit_attach_replay(buf)
    before, w = buf.get_state(), weights(learner)
    state, name = damaged_rllib_part(learner, filled(kind, 0, 6).get_state())
    with pytest.raises(RuntimeError, match=f"size mismatch for {name}"):
        learner.set_state(state)
    assert len(buf) == stored, f"RLlib refused the state, yet the buffer now holds {len(buf)} steps (had {stored})"
    same(buf.get_state(), before, "the buffer after a refused learner state")
    assert weights_unchanged(learner, w), "RLlib's part changed"


def test_a_state_refused_before_the_buffer_is_attached_leaves_nothing_to_restore_later(
        learner: ConduitDQNTorchLearner) -> None:
    learner.conduit_replay = None  # as before enable's on_algorithm_init attached the driver's buffer
    learner._conduit_pending_state = None
    state, _ = damaged_rllib_part(learner, filled(ConduitEpisodeReplayBuffer, 0, 6).get_state())
    with pytest.raises(RuntimeError, match="size mismatch"):
        learner.set_state(state)
    buf = filled(ConduitEpisodeReplayBuffer, 50, 3)
    learner.conduit_attach_replay(buf)
    assert len(buf) == 3, "the replay part of a refused learner state was restored once the buffer was attached"


def _column_row_missing(state: dict[str, Any]) -> dict[str, Any]:
    bad = copy.deepcopy(state)
    data = bad["edp"]["storage"]["data"]
    name = next(iter(data))
    data[name] = data[name][:-1]  # only the data plane's own load notices
    return bad


def _tail_missing(state: dict[str, Any]) -> dict[str, Any]:
    bad = copy.deepcopy(state)
    del bad["tail"]
    return bad


#: (buffer kind, damage): damaged in the replay buffer's own fields, or only inside the saved data plane
DAMAGES = [
    pytest.param(ConduitEpisodeReplayBuffer, _tail_missing, "damaged", id="uniform-missing-entry"),
    pytest.param(ConduitEpisodeReplayBuffer, _column_row_missing, "do not match its schema", id="uniform-plane-column"),
    pytest.param(ConduitPrioritizedEpisodeReplayBuffer, _damaged, "priorities are damaged", id="prioritized-NaN-leaf"),
    pytest.param(ConduitPrioritizedEpisodeReplayBuffer, _column_row_missing, "do not match its schema",
                 id="prioritized-plane-column"),
]


@pytest.mark.parametrize(("kind", "damage", "message"), DAMAGES)
def test_a_state_whose_replay_part_is_refused_leaves_rllibs_part_as_it_was(
        learner: ConduitDQNTorchLearner, kind: type[Buffer], damage: Any, message: str) -> None:
    buf = filled(kind, 50, 3)
    learner.conduit_attach_replay(buf)
    saved = learner.get_state()
    saved[REPLAY_COMPONENT] = damage(filled(kind, 0, 6).get_state())
    with torch.no_grad():  # the learner moves on from the saved weights
        for p in learner.module[DEFAULT_MODULE_ID].parameters():
            p.add_(1.0)
    w, before = weights(learner), buf.get_state()
    with pytest.raises(ConfigurationError, match=message):
        learner.set_state(saved)
    assert weights_unchanged(learner, w), "the replay part was refused, yet RLlib's part (the weights) was restored"
    same(buf.get_state(), before, "the buffer after its refused state")


def test_a_state_of_another_capacity_is_refused_before_rllibs_part_is_restored(
        learner: ConduitDQNTorchLearner) -> None:
    learner.conduit_attach_replay(filled(ConduitEpisodeReplayBuffer, 50, 3))
    saved = learner.get_state()
    saved[REPLAY_COMPONENT] = filled(ConduitEpisodeReplayBuffer, 0, 6, capacity=20).get_state()
    with torch.no_grad():
        for p in learner.module[DEFAULT_MODULE_ID].parameters():
            p.mul_(2.0)
    w = weights(learner)
    with pytest.raises(ConfigurationError, match="capacity 20"):
        learner.set_state(saved)
    assert weights_unchanged(learner, w), "RLlib's part was restored from a state whose replay part was refused"


@pytest.mark.parametrize("kind", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer])
def test_the_learner_state_round_trip_is_still_exact(learner: ConduitDQNTorchLearner, kind: type[Buffer]) -> None:
    buf = filled(kind, 0, 6)
    buf.add([id_episode(np.arange(6, 12), episode_id="e0", t_started=6)])  # wraps the ring of 10
    if buf.prioritized:
        buf.sample(num_items=4, n_step=2, gamma=0.9, beta=0.4, **DQN_KW)
        buf.update_priorities(np.array([0.5, 1.5, 2.5, 3.5]))
    learner.conduit_attach_replay(buf)
    saved = learner.get_state()
    saved_weights = weights(learner)
    twin = kind(capacity=10, seed=0)
    twin.set_state(saved[REPLAY_COMPONENT])
    with torch.no_grad():
        for p in learner.module[DEFAULT_MODULE_ID].parameters():
            p.sub_(1.0)
    buf.add([id_episode(np.arange(12, 15), episode_id="e0", t_started=12)])  # the buffer moves on too
    buf.sample(num_items=4, n_step=1, gamma=0.9, beta=0.4, **DQN_KW)
    learner.set_state(saved)
    assert weights_unchanged(learner, saved_weights), "RLlib's part was not restored"
    same(learner.get_state()[REPLAY_COMPONENT], saved[REPLAY_COMPONENT], "the restored buffer")
    x = buf.sample(num_items=16, n_step=2, gamma=0.9, beta=0.4, **DQN_KW)
    y = twin.sample(num_items=16, n_step=2, gamma=0.9, beta=0.4, **DQN_KW)
    assert torch.equal(x.handles, y.handles), "the restored buffer draws otherwise than one restored on its own"


# -- check_state itself (no learner) ---------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "damage", "message"), [
    *DAMAGES,
    pytest.param(ConduitEpisodeReplayBuffer, lambda s: {**s, "format": "x"}, "not a Conduit", id="format"),
    pytest.param(ConduitEpisodeReplayBuffer, lambda s: {**s, "edp": {"format": 7}}, "damaged|Unknown checkpoint",
                 id="plane-format"),
    pytest.param(ConduitPrioritizedEpisodeReplayBuffer, lambda s: {**s, "prioritized": False}, "uniform buffer",
                 id="kind"),
    pytest.param(ConduitEpisodeReplayBuffer, lambda s: {**s, "edp": {**s["edp"], "scheduler": {"kind": 5}}},
                 "'scheduler' entry is damaged", id="plane-scheduler-entry"),
])
def test_check_state_refuses_what_set_state_refuses_and_changes_nothing(kind: type[Buffer], damage: Any,
                                                                        message: str) -> None:
    good = filled(kind, 0, 6).get_state()
    bad = damage(good)
    for stored in (0, 3):
        buf = filled(kind, 50, stored)
        before = buf.get_state()
        with pytest.raises(ConfigurationError, match=message):
            buf.check_state(bad)
        same(buf.get_state(), before, "the buffer after check_state refused a state")
        with pytest.raises(ConfigurationError, match=message):
            buf.set_state(bad)  # the same verdict
        buf.check_state(good)  # an undamaged state passes, and is not restored by the check
        same(buf.get_state(), before, "the buffer after check_state of an undamaged state")
        buf.set_state(good)
        same(buf.get_state(), good, "the buffer after set_state")


def test_check_state_refuses_what_a_closed_buffer_cannot_load() -> None:
    good = filled(ConduitEpisodeReplayBuffer, 0, 6).get_state()
    buf = filled(ConduitEpisodeReplayBuffer, 50, 3)
    buf.close()
    with pytest.raises(ConfigurationError, match="closed"):
        buf.set_state(good)
    with pytest.raises(ConfigurationError, match="closed"):
        buf.check_state(good)


def test_check_state_refuses_a_damaged_entry_of_the_buffers_own_scheduler_kind() -> None:
    """The scratch plane's scheduler ignores an entry of another kind; the buffer's own scheduler checks it."""
    scheduler = Automatic()
    good = filled(ConduitEpisodeReplayBuffer, 0, 6).get_state()
    bad = {**good, "edp": {**good["edp"], "scheduler": {"kind": f"{Automatic.__module__}.{Automatic.__qualname__}",
                                                        "state": {"not-a-decision": 1}}}}
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0, scheduler=scheduler)
    try:
        buf.add([id_episode(np.arange(50, 53), episode_id="b")])
        with pytest.raises(ConfigurationError, match="not-a-decision"):
            buf.set_state(bad)
        with pytest.raises(ConfigurationError, match="not-a-decision"):
            buf.check_state(bad)
        assert len(buf) == 3
    finally:
        buf.close()
