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
from conduit import ExperienceSchema, Field, SchemaError
from ray.rllib.core.columns import Columns

__all__ = ["TRANSITION_COLUMNS", "ChunkColumns", "chunk_columns", "transition_schema", "torch_dtype"]

#: the stored fields, named as RLlib's DQN/SAC learners read them
TRANSITION_COLUMNS = (Columns.OBS, Columns.NEXT_OBS, Columns.ACTIONS, Columns.REWARDS, Columns.TERMINATEDS,
                      Columns.TRUNCATEDS)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype a NumPy column is stored as; float64 becomes float32, as RLlib's NumpyToTensor does."""
    if dtype == np.float64:
        return torch.float32
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
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


def chunk_columns(episode: Any) -> ChunkColumns:
    """Columns of a ``SingleAgentEpisode`` chunk: L transitions from L + 1 observations.

    Raises:
        SchemaError: the observations or actions are not plain arrays (Dict/Tuple spaces).
    """
    n = len(episode)
    obs = episode.get_observations()
    acts = episode.get_actions()
    nested = isinstance(obs, (dict, tuple)) or isinstance(acts, (dict, tuple))
    if not nested:
        obs, acts = np.asarray(obs), np.asarray(acts)
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
    return ChunkColumns(str(episode.id_), cols, n, bool(episode.is_done))


def transition_schema(chunk: ChunkColumns) -> ExperienceSchema:
    """The schema of the transitions in ``chunk`` (observation and action shape and dtype from the data)."""
    c = chunk.columns
    obs, act = c[Columns.OBS], c[Columns.ACTIONS]
    return ExperienceSchema({
        Columns.OBS: Field(tuple(obs.shape[1:]), obs.dtype),
        Columns.NEXT_OBS: Field(tuple(obs.shape[1:]), obs.dtype),
        Columns.ACTIONS: Field(tuple(act.shape[1:]), act.dtype),
        Columns.REWARDS: Field((), torch.float32),
        Columns.TERMINATEDS: Field((), torch.bool),
        Columns.TRUNCATEDS: Field((), torch.bool),
    })
