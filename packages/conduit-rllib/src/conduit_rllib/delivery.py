"""What a Conduit replay buffer's ``sample()`` hands RLlib: the train batch, already assembled.

RLlib's off-policy training step passes ``sample()``'s result unchanged to
``learner_group.update(episodes=...)``. Conduit returns a :class:`ConduitSampledEpisodes`:
a sequence of B one-step transitions (so it stands where RLlib expects a list of one-step
episodes) that carries them as columns on the learner's device. Conduit's learner
(:mod:`conduit_rllib.learner`) recognises it and uses the columns as the train batch, so the
delivery path builds no Python object per transition. Code that iterates it anyway gets real
``SingleAgentEpisode`` objects, built on demand.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

__all__ = ["ConduitSampledEpisodes", "ConduitMultiAgentSample", "CONDUIT_SAMPLES", "WEIGHTS", "N_STEP"]

#: importance-weight column the DQN/SAC losses read
WEIGHTS = "weights"
#: n-step column the DQN/SAC losses read (gamma ** n_step bootstraps)
N_STEP = "n_step"


class ConduitSampledEpisodes(Sequence[SingleAgentEpisode]):
    """B sampled transitions as a ready train batch.

    Attributes:
        columns: RLlib column name -> tensor ``[B, ...]`` on the learner's device: ``obs``,
            ``new_obs``, ``actions``, ``rewards``, ``terminateds``, ``truncateds``, ``weights``,
            ``n_step``. Fixed fields are Conduit's reused delivery buffers: valid until the
            buffer's second next ``sample()``.
        handles: the Conduit handles of the sampled items (what ``update_priorities`` names).
        module_id: the RLModule the batch trains.
        episode_ids: per transition, the id of the episode it was stored from (None where unknown);
            transition ``i`` as a ``SingleAgentEpisode`` carries it as its ``id_``, as RLlib's buffers'
            samples carry their source episode's id. Looked up on first read (the training step never
            reads it), so like the columns it is exact while the batch is valid.
    """

    __slots__ = ("columns", "handles", "module_id", "observation_space", "action_space", "_eids")

    def __init__(self, columns: dict[str, torch.Tensor], handles: torch.Tensor, *,
                 module_id: str = DEFAULT_MODULE_ID, observation_space: Any = None, action_space: Any = None,
                 episode_ids: Sequence[str | None] | Callable[[], Sequence[str | None]] | None = None) -> None:
        """``episode_ids``: the ids, or a function that looks them up when they are first read."""
        self.columns = columns
        self.handles = handles
        self.module_id = module_id
        self.observation_space = observation_space
        self.action_space = action_space
        self._eids: list[str | None] | Callable[[], Sequence[str | None]] | None = (
            episode_ids if episode_ids is None or callable(episode_ids) else list(episode_ids))

    @property
    def episode_ids(self) -> list[str | None]:
        """Per transition, its source episode's id (None where unknown)."""
        if not isinstance(self._eids, list):
            self._eids = [None] * len(self) if self._eids is None else list(self._eids())
        return self._eids

    def __len__(self) -> int:
        return int(self.handles.shape[0])

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={list(v.shape)}" for k, v in self.columns.items())
        return f"ConduitSampledEpisodes(B={len(self)}, {shapes})"

    def to_multi_agent_batch(self) -> MultiAgentBatch:
        """The train batch RLlib's learner consumes (wraps the columns; copies nothing)."""
        return MultiAgentBatch({self.module_id: SampleBatch(self.columns)}, env_steps=len(self))

    @overload
    def __getitem__(self, i: int) -> SingleAgentEpisode: ...

    @overload
    def __getitem__(self, i: slice) -> list[SingleAgentEpisode]: ...

    def __getitem__(self, i: int | slice) -> SingleAgentEpisode | list[SingleAgentEpisode]:
        """Transition ``i`` as the one-step ``SingleAgentEpisode`` RLlib's own buffers return (slow path).

        Its ``id_`` is its source episode's id, the same on every access (where the source is unknown, an id
        made on the first access and kept).
        """
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"transition {i} of {len(self)}")
        i %= len(self)
        eid = self.episode_ids[i]
        if eid is None:
            eid = self.episode_ids[i] = uuid.uuid4().hex
        c = {k: v[i].detach().cpu().numpy() for k, v in self.columns.items()}
        return SingleAgentEpisode(
            id_=eid, module_id=self.module_id,
            observation_space=self.observation_space, action_space=self.action_space,
            observations=[c[Columns.OBS], c[Columns.NEXT_OBS]], actions=[c[Columns.ACTIONS]],
            rewards=[float(c[Columns.REWARDS])], terminated=bool(c[Columns.TERMINATEDS]),
            truncated=bool(c[Columns.TRUNCATEDS]),
            extra_model_outputs={WEIGHTS: [float(c[WEIGHTS])], N_STEP: [int(c[N_STEP])]},
            len_lookback_buffer=0)

    def __iter__(self) -> Iterator[SingleAgentEpisode]:
        for i in range(len(self)):
            yield self[i]


class ConduitMultiAgentSample(Sequence[SingleAgentEpisode]):
    """A multi-agent replay sample: each RLModule's B transitions as a ready train batch of its own.

    What :class:`~conduit_rllib.multi_agent.ConduitMultiAgentEpisodeReplayBuffer` hands RLlib where its
    ``MultiAgentEpisodeReplayBuffer`` returns a list of one-step episodes, B per module, grouped by module.
    Iterating it gives those episodes (each with its ``module_id``), module after module.

    Attributes:
        parts: module id -> that module's sample (a :class:`ConduitSampledEpisodes`), in the order sampled.
    """

    __slots__ = ("parts",)

    def __init__(self, parts: dict[str, ConduitSampledEpisodes]) -> None:
        self.parts = parts

    @property
    def handles(self) -> dict[str, torch.Tensor]:
        """Module id -> the Conduit handles of its sampled items (what its ``update_priorities`` names)."""
        return {m: p.handles for m, p in self.parts.items()}

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts.values())

    def __repr__(self) -> str:
        return f"ConduitMultiAgentSample({', '.join(f'{m}: B={len(p)}' for m, p in self.parts.items())})"

    def to_multi_agent_batch(self) -> MultiAgentBatch:
        """The train batch RLlib's learner consumes: one ``SampleBatch`` per module (wraps the columns; copies
        nothing). Its env steps are all modules' rows together, as RLlib's learner counts a list of one-step
        episodes."""
        return MultiAgentBatch({m: SampleBatch(p.columns) for m, p in self.parts.items()}, env_steps=len(self))

    @overload
    def __getitem__(self, i: int) -> SingleAgentEpisode: ...

    @overload
    def __getitem__(self, i: slice) -> list[SingleAgentEpisode]: ...

    def __getitem__(self, i: int | slice) -> SingleAgentEpisode | list[SingleAgentEpisode]:
        """Transition ``i`` (counted module after module) as a one-step ``SingleAgentEpisode`` (slow path)."""
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"transition {i} of {len(self)}")
        i %= len(self)
        for part in self.parts.values():
            if i < len(part):
                return part[i]
            i -= len(part)
        raise AssertionError("unreachable: i < len(self)")

    def __iter__(self) -> Iterator[SingleAgentEpisode]:
        for part in self.parts.values():
            yield from part


#: what a Conduit replay buffer's ``sample()`` returns: the types Conduit's learners train on directly
CONDUIT_SAMPLES = (ConduitSampledEpisodes, ConduitMultiAgentSample)
