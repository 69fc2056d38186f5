"""``num_episodes_stored`` in the replay buffer's metrics, next to RLlib's own buffers (no Ray).

Reported: RLlib's buffers log ``num_episodes_stored`` (the episodes they hold, averaged over the recent logs) and
DQN/SAC users read it under ``replay_buffer`` in every iteration's results; Conduit's buffers did not log it.
Conduit counts the episodes with a stored step, each once: the episode RLlib dropped whole while Conduit holds
part of it counts in Conduit's and not in RLlib's, so the two are equal when eviction falls on episode
boundaries, as here.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.testing import id_episode  # noqa: E402
from ray.rllib.utils.metrics import NUM_EPISODES_STORED  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer  # noqa: E402

KINDS = {"uniform": (ConduitEpisodeReplayBuffer, EpisodeReplayBuffer),
         "prioritized": (ConduitPrioritizedEpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_num_episodes_stored_is_logged_as_rllib_logs_it(kind: str) -> None:
    """Whole episodes of 5 steps into a capacity of 20, ``get_metrics()`` after every add (DQN's rhythm with one
    add per training step): each call reports RLlib's ``num_episodes_stored``. Failed before: the key was
    missing."""
    conduit_cls, rllib_cls = KINDS[kind]
    conduit, native = conduit_cls(capacity=20, seed=0), rllib_cls(capacity=20)
    for i in range(10):
        eps = id_episode(np.arange(5) + 100 * i, terminated=True)
        conduit.add([eps])
        native.add([eps])
        got, want = conduit.get_metrics(), native.get_metrics()
        assert NUM_EPISODES_STORED in got, f"add {i}: {NUM_EPISODES_STORED} not logged ({sorted(got)})"
        assert float(got[NUM_EPISODES_STORED]) == float(want[NUM_EPISODES_STORED]), (
            f"add {i}: conduit {got[NUM_EPISODES_STORED]}, rllib {want[NUM_EPISODES_STORED]}")
