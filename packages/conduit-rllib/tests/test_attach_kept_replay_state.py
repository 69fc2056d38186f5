"""A replay part kept by the learner's ``set_state`` before a buffer was attached, and closed buffers' ``set_state``.

* ``ConduitOffPolicyLearner.conduit_attach_replay`` attached the buffer before restoring the kept replay part: a
  part the buffer refused (another capacity, damaged) left the buffer attached, empty, and the part dropped,
  so the checkpoint's buffer was silently lost. Now a refused part leaves the buffer unattached and the part
  kept (a ConfigurationError says what to do; ``conduit_drop_kept_replay_state`` gives it up).
* ``set_state`` on a closed Conduit replay buffer rebuilt (reopened) its data plane when the saved layout
  differed, or when the state was saved before anything was added, but was refused when the layout was the
  same. A closed buffer now refuses every ``set_state`` (and ``check_state``), changing nothing; a ``close`` while
  ``set_state`` swaps the plane waits for it (it closed the replaced plane, leaving the new one open).
* Also: a learner restored and saved again before its buffer was attached saves the kept replay part; damaged
  ``tail``/``seed``/``next``/``last_handles`` entries are refused by ``set_state`` (they were taken, to fail
  later with a raw error); a seed the data plane cannot take is refused when the buffer is built.

No Ray cluster: the learner is built locally.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import conduit_rllib  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit import ConfigurationError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.enable import InstallReplayBuffer  # noqa: E402
from conduit_rllib.learner import REPLAY_COMPONENT, ConduitDQNTorchLearner  # noqa: E402
from conduit_rllib.testing import id_episode  # noqa: E402
from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_offpolicy_learner_state import _column_row_missing, filled, same  # noqa: E402
from test_replay_restore_and_capacity import DQN_KW, wide_episode  # noqa: E402

Buffer = ConduitEpisodeReplayBuffer | ConduitPrioritizedEpisodeReplayBuffer


@pytest.fixture(scope="module")
def config() -> DQNConfig:
    return conduit_rllib.enable(DQNConfig().environment("CartPole-v1").debugging(seed=0)
                                .training(replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 10},
                                          store_buffer_in_checkpoints=True))


@pytest.fixture(scope="module")
def learner(config: DQNConfig) -> Iterator[ConduitDQNTorchLearner]:
    built = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(built, ConduitDQNTorchLearner)
    yield built


def unattached(learner: ConduitDQNTorchLearner, replay_state: dict[str, Any]) -> None:
    """The learner as before enable's on_algorithm_init attached a buffer, with ``replay_state`` restored (kept)."""
    learner.conduit_replay = None
    learner._conduit_pending_state = None
    learner.set_state({REPLAY_COMPONENT: replay_state})
    assert learner.conduit_replay is None


# -- 1. a kept replay part the attached buffer refuses ------------------------------------------------------------


def test_a_kept_replay_part_of_another_capacity_leaves_the_buffer_unattached_and_the_part_kept(
        learner: ConduitDQNTorchLearner) -> None:
    saved = filled(ConduitEpisodeReplayBuffer, 0, 6, capacity=20).get_state()
    unattached(learner, saved)
    small = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    with pytest.raises(ConfigurationError, match=r"capacity 20(.|\n)*not attached"):
        learner.conduit_attach_replay(small)
    assert learner.conduit_replay is None, "the buffer that refused the checkpoint's replay part was attached anyway"
    assert len(small) == 0
    right = ConduitEpisodeReplayBuffer(capacity=20, seed=0)
    learner.conduit_attach_replay(right)  # the kept part is restored into a buffer like the one that saved it
    assert learner.conduit_replay is right
    assert len(right) == 6, "the kept replay part was dropped when a buffer refused it"
    same(right.get_state(), saved, "the buffer attached after a refused one")


@pytest.mark.parametrize("kind", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer])
def test_a_damaged_replay_part_is_refused_before_it_is_kept_and_the_buffer_attaches_unchanged(
        learner: ConduitDQNTorchLearner, kind: type[Buffer]) -> None:
    # (session 24: a damaged part is refused by set_state itself, not kept to fail at the attach)
    learner.conduit_replay = None
    learner._conduit_pending_state = None
    with pytest.raises(ConfigurationError, match="do not match its schema"):
        learner.set_state({REPLAY_COMPONENT: _column_row_missing(filled(kind, 0, 6).get_state())})
    assert learner._conduit_pending_state is None, "a damaged replay part was kept"
    buf = filled(kind, 50, 3)
    before = buf.get_state()
    learner.conduit_attach_replay(buf)
    assert learner.conduit_replay is buf
    same(buf.get_state(), before, "the buffer attached after a refused replay part")


def test_a_refused_kept_replay_part_can_be_dropped_to_attach_the_buffer_empty(
        learner: ConduitDQNTorchLearner) -> None:
    unattached(learner, filled(ConduitEpisodeReplayBuffer, 0, 6, capacity=20).get_state())
    small = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    with pytest.raises(ConfigurationError, match="conduit_drop_kept_replay_state"):
        learner.conduit_attach_replay(small)
    assert learner.conduit_drop_kept_replay_state() is True
    assert learner.conduit_drop_kept_replay_state() is False, "nothing is kept any more"
    learner.conduit_attach_replay(small)
    assert learner.conduit_replay is small and len(small) == 0


def test_a_learner_saved_before_its_buffer_is_attached_saves_the_kept_replay_part(
        learner: ConduitDQNTorchLearner) -> None:
    saved = filled(ConduitPrioritizedEpisodeReplayBuffer, 0, 6).get_state()
    unattached(learner, saved)
    state = learner.get_state()
    assert REPLAY_COMPONENT in state, "restored, then saved again before a buffer was attached: the replay part is lost"
    same(state[REPLAY_COMPONENT], saved, "the kept replay part, saved again")
    assert REPLAY_COMPONENT not in learner.get_state(not_components=REPLAY_COMPONENT)
    learner.conduit_drop_kept_replay_state()
    assert REPLAY_COMPONENT not in learner.get_state(), "a dropped replay part is still saved"


class _Algorithm:
    """What ``InstallReplayBuffer`` reads of an Algorithm (a real local LearnerGroup; weak-referencable)."""

    def __init__(self, config: DQNConfig, group: Any) -> None:
        self.config, self.learner_group, self.iteration = config, group, 0
        self.local_replay_buffer: Any = "RLlib's buffer"


def test_on_algorithm_init_leaves_the_algorithms_buffer_alone_when_the_kept_replay_part_is_refused(
        config: DQNConfig) -> None:
    group = config.build_learner_group(env=gym.make("CartPole-v1"))
    try:
        learner = group._learner
        unattached(learner, filled(ConduitEpisodeReplayBuffer, 0, 6, capacity=20).get_state())
        algorithm = _Algorithm(config, group)
        with pytest.raises(ConfigurationError, match="capacity 20"):
            InstallReplayBuffer()(algorithm=algorithm)
        assert algorithm.local_replay_buffer == "RLlib's buffer", \
            "the algorithm samples from a Conduit buffer the learner did not attach (nor save)"
        assert learner.conduit_replay is None
    finally:
        group.shutdown()


# -- 2. set_state on a closed buffer ------------------------------------------------------------------------------


def _closed(kind: type[Buffer]) -> Buffer:
    buf = filled(kind, 50, 3)
    buf.close()
    return buf


SAVED = [
    pytest.param(lambda kind: filled(kind, 0, 6).get_state(), id="same-layout"),
    pytest.param(lambda kind: _wide(kind).get_state(), id="other-layout"),
    pytest.param(lambda kind: filled(kind, 0, 0).get_state(), id="saved-empty"),
]


def _wide(kind: type[Buffer]) -> Buffer:
    buf = kind(capacity=10, seed=0)
    buf.add([wide_episode("w", 4)])
    return buf


@pytest.mark.parametrize("kind", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer])
@pytest.mark.parametrize("saved", SAVED)
def test_a_closed_buffer_refuses_every_set_state_and_changes_nothing(kind: type[Buffer], saved: Any) -> None:
    state = saved(kind)
    buf = _closed(kind)
    before, plane = buf.get_state(), buf.edp
    with pytest.raises(ConfigurationError, match="closed"):
        buf.check_state(state)
    with pytest.raises(ConfigurationError, match="closed"):
        buf.set_state(state)
    assert buf.edp is plane and plane is not None and plane.closed, "set_state replaced (reopened) the closed plane"
    same(buf.get_state(), before, "the closed buffer after a refused set_state")
    with pytest.raises(ConfigurationError, match="closed"):
        buf.add([id_episode(np.arange(60, 62), episode_id="after")])  # still closed: it takes no work
    fresh = kind(capacity=10, seed=0)  # what the message says to do
    fresh.set_state(state)
    same(fresh.get_state(), state, "a new buffer restored from the state")


def test_a_closed_buffer_refuses_the_learners_set_state_before_rllibs_part(learner: ConduitDQNTorchLearner) -> None:
    learner._conduit_pending_state = None  # (what an earlier test kept)
    buf = filled(ConduitEpisodeReplayBuffer, 50, 3)
    learner.conduit_attach_replay(buf)
    saved = learner.get_state()
    saved[REPLAY_COMPONENT] = _wide(ConduitEpisodeReplayBuffer).get_state()
    buf.close()
    before = buf.get_state()
    with pytest.raises(ConfigurationError, match="closed"):
        learner.set_state(saved)
    same(buf.get_state(), before, "the closed buffer after the learner's refused set_state")


def test_a_buffer_closed_before_its_first_add_holds_no_plane_and_still_restores() -> None:
    """``close`` on a buffer without a data plane stops nothing: the buffer stays usable (as ``add`` shows)."""
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=0)
    buf.close()
    state = filled(ConduitEpisodeReplayBuffer, 0, 6).get_state()
    buf.check_state(state)
    buf.set_state(state)
    same(buf.get_state(), state, "an empty buffer closed before its first add, restored")
    assert len(buf.sample(num_items=4, n_step=1, gamma=0.9, **DQN_KW)) == 4


# -- damaged entries set_state took, to fail later (a raw error, or an add stored and then refused) ---------------


def _with(**entries: Any) -> Any:
    return lambda state: {**state, **entries}


def _sampled_prioritized() -> dict[str, Any]:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=10, seed=0)
    buf.add([id_episode(np.arange(0, 4), episode_id="open")])  # unfinished: a tail entry
    buf.sample(num_items=2, n_step=1, gamma=0.9, beta=0.4, **DQN_KW)  # last_handles
    return buf.get_state()


def _saved_empty() -> dict[str, Any]:
    return ConduitPrioritizedEpisodeReplayBuffer(capacity=10, seed=0).get_state()


@pytest.mark.parametrize(("saved", "damage"), [
    pytest.param(_sampled_prioritized, _with(tail={"open": "3"}), id="tail-handle-not-int"),
    pytest.param(_sampled_prioritized, _with(tail={"open": 4}), id="tail-handle-not-stored-yet"),
    pytest.param(_sampled_prioritized, _with(last_handles="x"), id="last-handles-not-a-tensor"),
    pytest.param(_sampled_prioritized, _with(seed="abc"), id="seed-not-int"),
    pytest.param(_saved_empty, _with(seed=-1), id="empty-seed-negative"),
    pytest.param(_saved_empty, _with(next=5), id="empty-next-not-0"),
    pytest.param(_saved_empty, _with(tail={"open": 0}), id="empty-with-a-tail"),
])
def test_a_damaged_entry_is_refused_by_set_state_not_by_a_later_call(saved: Any, damage: Any) -> None:
    bad = damage(saved())
    buf = filled(ConduitPrioritizedEpisodeReplayBuffer, 50, 3)
    before = buf.get_state()
    with pytest.raises(ConfigurationError, match="damaged"):
        buf.check_state(bad)
    with pytest.raises(ConfigurationError, match="damaged"):
        buf.set_state(bad)
    same(buf.get_state(), before, "the buffer after a refused damaged state")
    buf.set_state(saved())  # the undamaged state still loads, and the buffer works on from it
    buf.add([id_episode(np.arange(4, 6), episode_id="open", t_started=4)])
    buf.sample(num_items=2, n_step=2, gamma=0.9, beta=0.4, **DQN_KW)
    buf.update_priorities(np.array([1.0, 2.0]))


@pytest.mark.parametrize("seed", [-1, -2, 2 ** 63, "x", True, 1.5])
def test_a_seed_the_data_plane_cannot_take_is_refused_when_the_buffer_is_built(seed: Any) -> None:
    """Such a seed was taken, then refused by every add (or a raw ValueError came from NumPy)."""
    with pytest.raises(ConfigurationError, match="seed"):
        ConduitEpisodeReplayBuffer(capacity=10, seed=seed)


@pytest.mark.parametrize("seed", [0, 2 ** 63 - 1, np.int64(7), None])
def test_a_seed_the_data_plane_takes_still_builds_a_working_buffer(seed: Any) -> None:
    buf = ConduitEpisodeReplayBuffer(capacity=10, seed=seed)
    buf.add([id_episode(np.arange(3), episode_id="a")])
    assert len(buf.sample(num_items=2, n_step=1, gamma=0.9, **DQN_KW)) == 2


def test_a_close_during_a_set_state_that_rebuilds_the_plane_closes_the_rebuilt_plane() -> None:
    """close() from another thread while set_state swapped the plane closed the old plane only: the buffer it had
    just closed was open again (the plane set_state built). close now waits for set_state, then closes."""
    closer: list[threading.Thread] = []

    class ClosedMidway(ConduitEpisodeReplayBuffer):
        def _build(self, schema: Any, alpha: float | None = None) -> Any:
            edp = super()._build(schema, alpha)
            if not closer:  # set_state's rebuild: close from another thread now
                closer.append(threading.Thread(target=self.close))
                closer[0].start()
                closer[0].join(timeout=0.5)  # (returns at once where close does not wait for set_state)
            return edp

    state = _wide(ConduitEpisodeReplayBuffer).get_state()
    buf = ClosedMidway(capacity=10, seed=0)
    closer.append(threading.Thread())  # the first build (this add's) is not set_state's
    buf.add([id_episode(np.arange(50, 53), episode_id="b")])
    closer.clear()
    buf.set_state(state)
    closer[0].join(timeout=10)
    assert not closer[0].is_alive()
    assert buf.edp is not None and buf.edp.closed, "close() returned, yet the buffer's data plane is open"
    with pytest.raises(ConfigurationError, match="closed"):
        buf.add([id_episode(np.arange(60, 62), episode_id="after")])
