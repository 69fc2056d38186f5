"""Episode chunks -> columnar transitions, the layout Conduit stores for RLlib's off-policy learners.

One stored item is one 1-step transition ``(obs_t, a_t, r_t, obs_{t+1}, terminated, truncated)``
under RLlib's own column names, so a delivered batch is the learner's train batch as is. A
chunk of ``L`` steps becomes ``L`` items with a handful of array views per chunk: no Python
object per transition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from conduit import ConfigurationError, ExperienceSchema, Field, SchemaError
from conduit.batch import as_tensor
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode

from conduit_rllib.errors import UnsupportedConfigError

__all__ = ["TRANSITION_COLUMNS", "ChunkColumns", "chunk_columns", "storable_field", "transition_schema", "torch_dtype"]

#: the stored fields, named as RLlib's DQN/SAC learners read them
TRANSITION_COLUMNS = (Columns.OBS, Columns.NEXT_OBS, Columns.ACTIONS, Columns.REWARDS, Columns.TERMINATEDS,
                      Columns.TRUNCATEDS)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype a NumPy column is stored as; float64 becomes float32, as RLlib's NumpyToTensor does."""
    if dtype == np.float64:
        return torch.float32
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor (float64 as float32; a non-native byte order is converted by value).

    Raises:
        SchemaError: a dtype torch has no counterpart for (e.g. ``np.longdouble``).
    """
    try:
        t = as_tensor(a)
    except TypeError as e:
        raise SchemaError(f"Episode data of dtype {a.dtype} cannot be stored ({e}); give the observation and "
                          f"action spaces a dtype torch supports (e.g. float32).") from e
    return t.to(torch.float32) if t.dtype == torch.float64 else t


#: one-step chunks (the common case) share these read-only flag columns; ingestion copies them
_FLAGS1 = {False: torch.zeros(1, dtype=torch.bool), True: torch.ones(1, dtype=torch.bool)}


def _done_flags(n: int, terminated: bool, truncated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Terminated/truncated per step: only the chunk's last step can carry them."""
    if n == 1:
        return _FLAGS1[terminated], _FLAGS1[truncated]
    term = np.zeros(n, dtype=bool)
    trunc = np.zeros(n, dtype=bool)
    if n:
        term[-1], trunc[-1] = terminated, truncated
    return torch.from_numpy(term), torch.from_numpy(trunc)


@dataclass(frozen=True)
class ChunkColumns:
    """The transitions of one episode chunk, as tensors that share the episode's memory where possible."""

    episode_id: str
    columns: dict[str, torch.Tensor]
    length: int
    done: bool
    #: the episode timestep of the chunk's first step (``SingleAgentEpisode.t_started``; 0 where not tracked)
    t_started: int = 0


def _nested(data: Any) -> bool:
    """Whether an episode's observations or actions are Dict/Tuple data: batched (a numpy'd episode) or a list
    of per-step dicts/tuples (NumPy would turn a list of equal-length tuples into one array)."""
    return isinstance(data, (dict, tuple)) or (isinstance(data, list) and bool(data)
                                               and isinstance(data[0], (dict, tuple)))


def chunk_columns(episode: Any) -> ChunkColumns:
    """Columns of a ``SingleAgentEpisode`` chunk: L transitions from L + 1 observations.

    Raises:
        SchemaError: the observations or actions are not plain arrays (Dict/Tuple spaces, or
            values whose shape differs between steps).
        UnsupportedConfigError: a ``MultiAgentEpisode`` (a multi-agent buffer splits those into their agents').
        SchemaError: anything else that is no ``SingleAgentEpisode`` (e.g. an old-API-stack ``SampleBatch``,
            a dict or an array).
    """
    if isinstance(episode, MultiAgentEpisode):
        raise UnsupportedConfigError("This single-agent replay buffer stores SingleAgentEpisode chunks; this is a "
                                     "MultiAgentEpisode. For a multi-agent config set replay_buffer_config['type'] "
                                     "to 'MultiAgentEpisodeReplayBuffer' or 'MultiAgentPrioritizedEpisodeReplayBuffer' "
                                     "(Conduit installs its own of that kind: ConduitMultiAgentEpisodeReplayBuffer).")
    if not isinstance(episode, SingleAgentEpisode):
        raise SchemaError(f"conduit-rllib's replay buffers store SingleAgentEpisode chunks (what the new API "
                          f"stack's EnvRunners sample); got a {type(episode).__name__}. Pass episodes, e.g. "
                          f"add(episodes) with the list env_runner.sample() returns; SampleBatches of the old "
                          f"API stack are not supported.")
    n = len(episode)
    obs = episode.get_observations()
    acts = episode.get_actions()
    nested = _nested(obs) or _nested(acts)
    if not nested:
        try:
            obs, acts = np.asarray(obs), np.asarray(acts)
        except ValueError as e:  # per-step values of different shapes
            raise SchemaError(f"Episode {episode.id_!r}'s observations or actions do not form one array ({e}); "
                              f"conduit-rllib stores Box/Discrete data of one shape and dtype per episode. "
                              f"Give every step the observation space's shape.") from e
        nested = obs.dtype == object or acts.dtype == object
    if nested:
        raise SchemaError("conduit-rllib stores Box/Discrete observations and actions; this episode has nested "
                          "(Dict/Tuple) data. Flatten the observation space (e.g. with a FlattenObservations "
                          "connector) or run without Conduit.")
    if obs.shape[0] != n + 1:
        raise SchemaError(f"Episode {episode.id_!r} has {obs.shape[0]} observations for {n} steps; expected "
                          f"{n + 1}.")
    o = _as_tensor(obs)
    rewards = torch.from_numpy(np.asarray(episode.get_rewards(), dtype=np.float32).reshape(n))
    term, trunc = _done_flags(n, bool(episode.is_terminated), bool(episode.is_truncated))
    cols = {Columns.OBS: o[:-1], Columns.NEXT_OBS: o[1:], Columns.ACTIONS: _as_tensor(acts),
            Columns.REWARDS: rewards, Columns.TERMINATEDS: term, Columns.TRUNCATEDS: trunc}
    return ChunkColumns(str(episode.id_), cols, n, bool(episode.is_done), int(getattr(episode, "t_started", 0) or 0))


def storable_field(what: str, shape: tuple[int, ...], dtype: torch.dtype) -> Field:
    """The Conduit field for ``what`` (e.g. ``"observations"``), one row of ``shape`` and ``dtype`` per step.

    Raises:
        UnsupportedConfigError: a shape or dtype Conduit cannot store (e.g. a zero-size space, or uint16
            on a torch that cannot gather it); nothing is stored then.
    """
    try:
        return Field(shape, dtype)
    except ConfigurationError as e:
        reason = str(e).split(". ")[0].rstrip(".")  # the schema's reason, without its advice for direct users
        raise UnsupportedConfigError(f"conduit-rllib cannot store {what} of shape {shape} and dtype {dtype} "
                                     f"({reason}). Convert them before they reach Conduit (e.g. cast uint16 images "
                                     f"to int32 or float32 in an environment wrapper or the model), drop them, or "
                                     f"run without Conduit.") from e


def transition_schema(chunk: ChunkColumns) -> ExperienceSchema:
    """The schema of the transitions in ``chunk`` (observation and action shape and dtype from the data).

    Raises:
        UnsupportedConfigError: observations or actions of a shape or dtype Conduit cannot store.
    """
    c = chunk.columns
    obs = storable_field("observations", tuple(c[Columns.OBS].shape[1:]), c[Columns.OBS].dtype)
    act = storable_field("actions", tuple(c[Columns.ACTIONS].shape[1:]), c[Columns.ACTIONS].dtype)
    return ExperienceSchema({
        Columns.OBS: obs,
        Columns.NEXT_OBS: obs,
        Columns.ACTIONS: act,
        Columns.REWARDS: Field((), torch.float32),
        Columns.TERMINATEDS: Field((), torch.bool),
        Columns.TRUNCATEDS: Field((), torch.bool),
    })
