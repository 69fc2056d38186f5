"""conduit-rllib's conformance endpoints: Conduit reached through RLlib's own interfaces.

* Replay: a :class:`~conduit_rllib.replay.ConduitEpisodeReplayBuffer` /
  :class:`~conduit_rllib.replay.ConduitPrioritizedEpisodeReplayBuffer`, fed with
  ``SingleAgentEpisode`` chunks whose observations and actions carry the item id, and sampled
  with the exact arguments DQN's training step passes; ids are read back from the train batch
  the learner would receive. Priority updates go through ``update_priorities(priorities)``,
  which (as in RLlib) applies to the last sample; checkpoints through ``get_state``/``set_state``.
* Multi-agent replay (:class:`RLlibMultiAgentReplayEndpoint`, run by the package's own conformance tests): the
  same through a :class:`~conduit_rllib.multi_agent.ConduitMultiAgentEpisodeReplayBuffer`, fed with
  ``MultiAgentEpisode`` chunks.
* On-policy: a :class:`~conduit_rllib.on_policy.MinibatchFeed`, the piece PPO's learner uses:
  RLlib ``SampleBatch`` train batches in, ``MultiAgentBatch`` minibatches out; checkpoints between
  rollouts only (the learner's, between updates), through its ``state_dict``/``load_state_dict``.

Registered under the ``conduit.conformance`` entry-point group as ``rllib``.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import gymnasium as gym
import numpy as np
from conduit.testing import (
    CAP_CHECKPOINT,
    CAP_CHECKPOINT_BETWEEN_ROLLOUTS,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    Draw,
    EndpointFactory,
    Minibatch,
    OnPolicyEndpoint,
    ReplayEndpoint,
)
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.policy.sample_batch import SampleBatch

from conduit_rllib.delivery import WEIGHTS
from conduit_rllib.multi_agent import (
    ConduitMultiAgentEpisodeReplayBuffer,
    ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
)
from conduit_rllib.on_policy import MinibatchFeed
from conduit_rllib.replay import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer

__all__ = ["RLlibReplayEndpoint", "RLlibMultiAgentReplayEndpoint", "RLlibOnPolicyEndpoint", "ENDPOINTS", "id_episode",
           "OBS_SPACE", "ACTION_SPACE", "DQN_SAMPLE_KWARGS"]

#: what RLlib 2.60's DQN training step passes to a replay buffer's ``sample()`` besides ``num_items``, ``n_step``,
#: ``gamma`` and ``beta`` (to sample in a test as DQN does: ``buffer.sample(32, n_step=1, **DQN_SAMPLE_KWARGS)``)
DQN_SAMPLE_KWARGS: dict[str, Any] = {"batch_length_T": 0, "lookback": 0, "min_batch_length_T": 0,
                                     "sample_episodes": True}

#: observation = (id, id) as float32 (ids up to 2**24 are exact)
OBS_SPACE = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
#: action = id
ACTION_SPACE: gym.spaces.Discrete = gym.spaces.Discrete(2 ** 31 - 1)
_episode_ids = itertools.count()


def id_episode(ids: np.ndarray, *, episode_id: str | None = None, terminated: bool = False,
               t_started: int = 0) -> SingleAgentEpisode:
    """A numpy ``SingleAgentEpisode`` chunk with one step per id: obs_t = (id_t, id_t), action_t = id_t.

    The last step's next observation is (id_last + 0.5, ...), so it never names a stored item. A later
    chunk of the same ``episode_id`` starts at ``t_started``, the timestep after the steps added before.
    """
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    o = np.append(ids.astype(np.float32), np.float32(ids[-1] + 0.5) if n else np.float32(0.5))
    obs = np.repeat(o[:, None], 2, axis=1)
    # SingleAgentEpisode takes numpy arrays for observations/actions/rewards (RLlib's hints say lists).
    return SingleAgentEpisode(id_=episode_id or f"ids-{next(_episode_ids)}",
                              observations=obs,  # type: ignore[arg-type]
                              infos=[{}] * (n + 1), actions=ids.copy(),  # type: ignore[arg-type]
                              rewards=np.zeros(n, dtype=np.float32),  # type: ignore[arg-type]
                              terminated=terminated, observation_space=OBS_SPACE, action_space=ACTION_SPACE,
                              len_lookback_buffer=0, t_started=t_started)


def _ids_of(columns: dict[str, Any]) -> np.ndarray:
    obs = columns[Columns.OBS].detach().cpu().numpy()
    ids = obs[:, 0].astype(np.int64)
    acts = columns[Columns.ACTIONS].detach().cpu().numpy().astype(np.int64)
    assert np.array_equal(obs[:, 0], obs[:, 1]) and np.array_equal(ids, acts), "a transition's payload was mixed up"
    return ids


class RLlibReplayEndpoint(ReplayEndpoint):
    """A Conduit replay buffer driven as RLlib's DQN/SAC training step drives it."""

    capabilities = frozenset({CAP_PRIORITIZED, CAP_CHECKPOINT, CAP_CONCURRENT_INGEST})
    #: the module whose draws the endpoint reports (and whose priorities it updates)
    module_id = DEFAULT_MODULE_ID
    #: the buffer classes, uniform and prioritized
    kinds: tuple[type, type] = (ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer)

    def __init__(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                 seed: int = 0) -> None:
        self.buffer: Any = self.kinds[prioritized](capacity=capacity, alpha=alpha, seed=seed)
        self.beta = beta
        self._last: Any = None
        self._lock = threading.Lock()

    def insert(self, ids: np.ndarray) -> None:
        self.buffer.add([id_episode(ids)])

    def sample(self, n: int) -> Draw:
        with self._lock:
            batch = self._part(self.buffer.sample(num_items=n, n_step=1, gamma=0.99, beta=self.beta,
                                                  **DQN_SAMPLE_KWARGS))
            self._last = batch
            w = batch.columns[WEIGHTS].detach().cpu().numpy().copy() if self.buffer.prioritized else None
            return Draw(_ids_of(batch.columns), handles=batch.handles, weights=w)

    def _part(self, sample: Any) -> Any:
        """The reported module's part of a sample."""
        return sample

    def _plane_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The reported module's buffer state in the buffer's ``get_state()`` (None: nothing added yet)."""
        return state

    def update_priorities(self, handles: Any, priorities: np.ndarray) -> None:
        assert self.buffer.prioritized
        p = np.asarray(priorities, dtype=np.float64)
        if self._last is not None and handles is self._last.handles:
            # RLlib's call: update_priorities(td_errors, module_id) refers to the last sample()
            self.buffer.update_priorities(p, self.module_id)
        else:  # a subset or an older sample: Conduit's handle-based extension
            self.buffer.update_priorities(p, self.module_id, handles=handles)

    def __len__(self) -> int:
        return self.buffer.get_num_timesteps(self.module_id)

    def contents(self) -> np.ndarray:
        state = self._plane_state(self.buffer.get_state())
        if state is None or state["edp"] is None:
            return np.zeros(0, dtype=np.int64)
        return state["edp"]["storage"]["data"][Columns.OBS][:, 0].numpy().astype(np.int64)

    def state_dict(self) -> Any:
        return self.buffer.get_state()

    def load_state_dict(self, state: Any) -> None:
        self.buffer.set_state(state)

    def close(self) -> None:
        self.buffer.close()


class RLlibMultiAgentReplayEndpoint(RLlibReplayEndpoint):
    """A Conduit multi-agent replay buffer driven as RLlib's multi-agent DQN/SAC training step drives it.

    Every insert is one ``MultiAgentEpisode`` chunk in which agent ``a0`` (module ``p0``) steps through the ids
    and agent ``a1`` (module ``p1``) through the same ids; every sample draws both modules, as RLlib's
    independent replay does, and reports ``p0``'s draw, whose priorities it updates.
    """

    module_id = "p0"
    kinds = (ConduitMultiAgentEpisodeReplayBuffer, ConduitMultiAgentPrioritizedEpisodeReplayBuffer)

    def insert(self, ids: np.ndarray) -> None:
        one = id_episode(ids)  # (its observations and actions, as the single-agent endpoint's)
        obs, acts = one.get_observations(), one.get_actions()
        n = len(acts)
        agents = ("a0", "a1")
        self.buffer.add([MultiAgentEpisode(
            observations=[dict.fromkeys(agents, obs[t]) for t in range(n + 1)],
            actions=[dict.fromkeys(agents, acts[t]) for t in range(n)],
            rewards=[dict.fromkeys(agents, 0.0) for _ in range(n)],
            observation_space=gym.spaces.Dict(dict.fromkeys(agents, OBS_SPACE)),
            action_space=gym.spaces.Dict(dict.fromkeys(agents, ACTION_SPACE)), len_lookback_buffer=0,
            agent_to_module_mapping_fn=lambda agent_id, episode: f"p{str(agent_id)[1:]}")])

    def _part(self, sample: Any) -> Any:
        assert list(sample.parts) == ["p0", "p1"] and len(sample.parts["p1"]) == len(sample.parts["p0"])
        return sample.parts["p0"]

    def _plane_state(self, state: dict[str, Any]) -> dict[str, Any] | None:
        return state["modules"].get("p0")


class RLlibOnPolicyEndpoint(OnPolicyEndpoint):
    """The PPO learner's minibatch feed: SampleBatch rollouts in, MultiAgentBatch minibatches out.

    Checkpoints go through the feed's ``state_dict``/``load_state_dict``, which the PPO learner takes between
    updates: with nothing waiting for delivery (a rollout waiting is refused, not left out of the state).
    """

    capabilities = frozenset({CAP_CHECKPOINT_BETWEEN_ROLLOUTS})

    def __init__(self, *, num_minibatches: int, num_epochs: int, max_staleness: int = 0, on_stale: str = "drop",
                 seed: int = 0) -> None:
        self.feed = MinibatchFeed(num_minibatches=num_minibatches, num_epochs=num_epochs,
                                  max_staleness=max_staleness, on_stale=on_stale, seed=seed)  # type: ignore[arg-type]

    def ingest(self, ids: np.ndarray, version: int) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        obs = np.repeat(ids.astype(np.float32)[:, None], 2, axis=1)
        self.feed.ingest(DEFAULT_MODULE_ID, SampleBatch({Columns.OBS: obs, Columns.ACTIONS: ids}), version=version)

    def end_rollout(self) -> None:
        self.feed.seal()

    def set_policy_version(self, version: int) -> None:
        self.feed.set_policy_version(version)

    def consume(self) -> list[Minibatch]:
        out = []
        for mab in self.feed.minibatches():
            info = self.feed.delivered[-1]
            assert info.version is not None and info.epoch is not None
            ids = _ids_of(dict(mab.policy_batches[DEFAULT_MODULE_ID]))
            out.append(Minibatch(ids, info.version, info.epoch))
        return out

    def state_dict(self) -> Any:
        return self.feed.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.feed.load_state_dict(state)

    def close(self) -> None:
        self.feed.close()


#: conduit-rllib's registration in the ``conduit.conformance`` entry-point group
ENDPOINTS = EndpointFactory("rllib", make_replay=RLlibReplayEndpoint, make_on_policy=RLlibOnPolicyEndpoint)
