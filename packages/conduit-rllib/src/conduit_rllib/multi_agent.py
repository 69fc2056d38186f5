"""Conduit replay buffers for multi-agent DQN/SAC: one data plane per RLModule.

:class:`ConduitMultiAgentEpisodeReplayBuffer` and :class:`ConduitMultiAgentPrioritizedEpisodeReplayBuffer` subclass
RLlib's ``MultiAgentEpisodeReplayBuffer`` / ``MultiAgentPrioritizedEpisodeReplayBuffer``, the types a multi-agent
DQN/SAC config names, and honour the calls RLlib's training step makes on them. Each RLModule's transitions live
in a Conduit single-agent buffer of their own (:class:`~conduit_rllib.replay.ConduitEpisodeReplayBuffer` or its
prioritized kind, built at the module's first add), so every module keeps that buffer's semantics: columnar
storage, chunk linking and n-step returns per agent episode, FIFO eviction per transition, the same refusals.

Semantics, compared with RLlib's multi-agent buffers in their ``"independent"`` replay mode (RLlib's default):

* ``add``: every ``MultiAgentEpisode`` chunk is split into its agents' ``SingleAgentEpisode`` chunks, and each
  goes to the module its agent maps to (``episode.module_for(agent_id)``). Two agents of one module are two
  episodes of that module, as in RLlib. All or nothing: every module's chunks are checked (and a new module's
  storage allocated) before any is stored, so a refused add stores nothing for any module.
* ``capacity`` counts each module's transitions: every module keeps up to ``capacity`` (RLlib counts the env
  steps of whole multi-agent episodes, all modules together).
* ``sample(num_items=B)``: B transitions of every module (or of ``modules_to_sample``), each module drawn from its
  own plane, uniformly or in proportion to its own priorities, as RLlib's independent mode draws B per module.
  The result is a :class:`~conduit_rllib.delivery.ConduitMultiAgentSample`: each module's train batch, already
  assembled on the learner's device. ``replay_mode="synchronized"`` is refused.
* ``update_priorities(priorities, module_id)`` applies to that module's last sample, as in RLlib.
* metrics and ``get_state`` are per module; ``get_num_episodes`` counts agent episodes.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from conduit import (
    ConfigurationError,
    EmptyBufferError,
    Placement,
    PriorityError,
    Scheduler,
    SchemaError,
)
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.utils import force_list
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer import (
    MultiAgentPrioritizedEpisodeReplayBuffer,
)

from conduit_rllib.delivery import ConduitMultiAgentSample
from conduit_rllib.errors import UnsupportedConfigError
from conduit_rllib.replay import (
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
    _ConduitReplay,
    check_state_kind,
    module_seed,
)
from conduit_rllib.transitions import transition_schema

if TYPE_CHECKING:
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

__all__ = ["ConduitMultiAgentEpisodeReplayBuffer", "ConduitMultiAgentPrioritizedEpisodeReplayBuffer",
           "MULTI_AGENT_STATE_FORMAT"]

#: tag of the dict ``get_state`` returns
MULTI_AGENT_STATE_FORMAT = "conduit-rllib/multi-agent-replay/1"


class _ConduitMultiAgentReplay:
    """The implementation both multi-agent buffers share (the RLlib base class comes second in the MRO)."""

    prioritized: bool = False
    #: the single-agent buffer each module's transitions live in
    _single: type[_ConduitReplay] = ConduitEpisodeReplayBuffer

    # Set by EpisodeReplayBuffer.__init__ (called on this instance below); declared for the type checker.
    capacity: int
    batch_size_B: int
    metrics: MetricsLogger

    def __init__(self, capacity: int = 10000, *, alpha: float = 1.0, seed: int | None = 0,
                 device: torch.device | str | None = None, placement: Placement | None = None,
                 scheduler: Callable[[], Scheduler] | None = None, metrics_every: int = 1, batch_size_B: int = 16,
                 batch_length_T: int = 1, metrics_num_episodes_for_smoothing: int = 100, **kwargs: Any) -> None:
        """Arguments as for the single-agent buffers (each module's buffer gets them), except ``scheduler``.

        Keyword Args:
            scheduler: a zero-argument factory for each module's scheduler (a scheduler serves one data plane), or
                None (synchronous).
            placement: where each module's transitions live; every module's plane is built by a copy of it.

        Raises:
            conduit.ConfigurationError: what a single-agent buffer refuses (capacity, alpha, seed,
                metrics_every), a ``scheduler`` that is a Scheduler instance or not callable, a ``placement``
                that is no Placement.
        """
        if scheduler is not None and (isinstance(scheduler, Scheduler) or not callable(scheduler)):
            raise ConfigurationError(f"A multi-agent buffer builds one data plane per module, and a scheduler serves "
                                     f"one plane: pass scheduler= a zero-argument factory (e.g. lambda: "
                                     f"conduit.Overlapped(g_del=2, background_ingest=False)), got {scheduler!r}.")
        if placement is not None and not isinstance(placement, Placement):
            raise ConfigurationError(f"placement= takes a conduit Placement (e.g. conduit.HostPlacement()), or None "
                                     f"for host memory; got {placement!r}.")
        # every single-agent argument checked as each module's buffer will check it (and an unseeded run's seed drawn)
        probe = self._single(capacity, alpha=alpha, seed=seed, device=device, metrics_every=metrics_every,
                             batch_size_B=batch_size_B, batch_length_T=batch_length_T,
                             metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        EpisodeReplayBuffer.__init__(cast(EpisodeReplayBuffer, self), capacity=probe.capacity,
                                     batch_size_B=batch_size_B, batch_length_T=batch_length_T,
                                     metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        self.seed = probe.seed
        self.device = probe.device
        self.placement = placement
        self.scheduler = scheduler
        self._module_kwargs: dict[str, Any] = {
            "alpha": alpha, "device": probe.device, "metrics_every": metrics_every, "batch_size_B": batch_size_B,
            "batch_length_T": batch_length_T, "metrics_num_episodes_for_smoothing": metrics_num_episodes_for_smoothing}
        #: module id -> the buffer its transitions live in, in the order modules were first added
        self.buffers: dict[str, _ConduitReplay] = {}
        self._lock = threading.RLock()
        self._closed = False
        #: the training iteration the caller is in (``enable`` sets it): passed on to every module's buffer
        self.iteration_of: Callable[[], int | None] | None = None

    def _new_module(self, module_id: str) -> _ConduitReplay:
        """An empty buffer for ``module_id``'s transitions (its plane is built at its first add, or restore)."""
        buffer = self._single(self.capacity, seed=module_seed(self.seed, module_id),
                              placement=copy.deepcopy(self.placement), **self._module_kwargs)
        buffer.module_id = module_id
        return buffer

    def _module(self, module_id: str) -> _ConduitReplay:
        """``module_id``'s buffer, or a new empty one (not registered: :meth:`add` registers it once it stored)."""
        buffer = self.buffers.get(module_id)
        return self._new_module(module_id) if buffer is None else buffer

    def _give_scheduler(self, buffer: _ConduitReplay) -> None:
        """Give ``buffer`` a scheduler of its own from the factory, before its plane is built."""
        if self.scheduler is None:
            return
        scheduler = self.scheduler()
        if not isinstance(scheduler, Scheduler):
            raise ConfigurationError(f"The scheduler factory returned {scheduler!r}, not a conduit Scheduler; make it "
                                     f"return a new one per call.")
        buffer.scheduler = scheduler

    def close(self) -> None:
        """Close every module's data plane (see ``ConduitEpisodeReplayBuffer.close``); then ``add``, ``sample``,
        ``update_priorities`` and restores are refused, while ``len()``, ``get_metrics`` and ``get_state`` work."""
        with self._lock:
            self._closed = True
            for buffer in self.buffers.values():
                buffer.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ConfigurationError(f"This replay buffer is closed (close() ran; an algorithm's stop() closes its "
                                     f"buffer), so it cannot {what}. Build a new buffer and restore this one's "
                                     f"get_state() into it.")

    # -- add -----------------------------------------------------------------------------------
    @staticmethod
    def _by_module(episodes: Any) -> dict[str, list[Any]]:
        """The agents' episode chunks of ``episodes``, grouped by the module each agent maps to (empty ones left
        out), in the order they come.

        Raises:
            conduit.SchemaError: an entry that is no ``MultiAgentEpisode``, or an agent mapped to no module.
        """
        groups: dict[str, list[Any]] = {}
        for episode in force_list(episodes):
            if not isinstance(episode, MultiAgentEpisode):
                raise SchemaError(f"A multi-agent replay buffer stores MultiAgentEpisode chunks (what a multi-agent "
                                  f"EnvRunner samples); got a {type(episode).__name__}. A single-agent config takes "
                                  f"'EpisodeReplayBuffer' or 'PrioritizedEpisodeReplayBuffer'. Nothing was stored.")
            for agent_id, chunk in episode.agent_episodes.items():
                if len(chunk) == 0:
                    continue
                module_id = episode.module_for(agent_id)
                if module_id is None:
                    raise SchemaError(f"Agent {agent_id!r} of episode {episode.id_!r} maps to no module, so its "
                                      f"transitions have no buffer to go to; check the policy_mapping_fn. Nothing "
                                      f"was stored.")
                groups.setdefault(module_id, []).append(chunk)
        return groups

    def add(self, episodes: Any, weight: float | None = None) -> None:
        """Store the agents' transitions of ``MultiAgentEpisode`` chunks, each in its module's buffer.

        ``weight`` (prioritized): the initial priority of every stored step. All or nothing: every module's
        chunks are checked (and a new module's storage allocated) before any is stored.

        Raises:
            conduit.SchemaError: an entry that is no ``MultiAgentEpisode``, an agent mapped to no module, or what
                a single-agent buffer refuses for a chunk (see ``ConduitEpisodeReplayBuffer.add``).
            conduit.ConfigurationError, conduit.PriorityError, conduit.CapacityError: as the single-agent
                buffers raise them (a repeated chunk, a bad weight, a chunk over capacity, ...).
            Nothing of this add is stored for any module then.
        """
        groups = self._by_module(episodes)
        with self._lock:
            self._check_open("store episodes (add)")
            buffers = {m: self._module(m) for m in groups}
            prepared = {}
            for m, chunks_in in groups.items():  # every module checked before anything is stored
                chunks, w = buffers[m]._prepared(chunks_in, weight)
                buffers[m]._check_continuations(chunks)
                buffers[m]._check_chunks(chunks)
                prepared[m] = (chunks_in, chunks, w)
            built = []
            try:  # a new module's storage allocated before anything is stored (allocation may fail)
                for m, (_, chunks, _w) in prepared.items():
                    if buffers[m].edp is None:
                        self._give_scheduler(buffers[m])
                        built.append(buffers[m])
                        buffers[m]._build(transition_schema(next(c for c in chunks if c.length)))
            except BaseException:
                for buffer in built:
                    buffer._discard()
                raise
            for m, (chunks_in, chunks, w) in prepared.items():
                buffers[m]._store(chunks_in, chunks, w)
                self.buffers.setdefault(m, buffers[m])

    # -- sample --------------------------------------------------------------------------------
    def sample(self, num_items: int | None = None, *, replay_mode: str = "independent",
               modules_to_sample: Any = None, **kwargs: Any) -> ConduitMultiAgentSample:
        """Draw ``num_items`` transitions (with replacement) of every module, or of ``modules_to_sample``.

        Every other argument is a single-agent buffer's ``sample`` argument (``n_step``, ``gamma``, ``beta``,
        ``batch_size_B``, ...), applied to each module's draw; modules come in the order they were first added.

        Raises:
            UnsupportedConfigError: ``replay_mode`` other than ``"independent"``, or what the single-agent
                ``sample`` refuses (sequences, infos).
            conduit.EmptyBufferError: nothing was added yet.
            conduit.ConfigurationError: a module in ``modules_to_sample`` this buffer holds nothing of, or an
                argument the single-agent ``sample`` refuses (checked before any module draws).
        """
        if replay_mode != "independent":
            raise UnsupportedConfigError(f"Conduit's multi-agent buffer draws each module's transitions independently "
                                         f"(replay_mode='independent', RLlib's default); replay_mode={replay_mode!r} "
                                         f"is not supported.")
        with self._lock:
            self._check_open("sample")
            modules = list(self.buffers)
            if modules_to_sample is not None:
                wanted = set(force_list(modules_to_sample))
                unknown = sorted(map(str, wanted.difference(modules)))
                if unknown:
                    raise ConfigurationError(f"modules_to_sample names {unknown}, of which this buffer holds no "
                                             f"transitions (it holds {modules}). Nothing was drawn.")
                modules = [m for m in modules if m in wanted]
            if not modules:
                raise EmptyBufferError("The replay buffer is empty; add episodes before sampling.")
            return ConduitMultiAgentSample({m: self.buffers[m].sample(num_items, **kwargs) for m in modules})

    # -- sizes and metrics ---------------------------------------------------------------------
    def get_module_ids(self) -> list[str]:
        """The modules this buffer holds transitions of, in the order they were first added."""
        return list(self.buffers)

    def _total(self, count: Callable[[_ConduitReplay], int], module_id: str | None) -> int:
        with self._lock:
            if module_id is not None:
                buffer = self.buffers.get(module_id)
                return 0 if buffer is None else count(buffer)
            return sum(count(b) for b in self.buffers.values())

    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_num_timesteps(self, module_id: str | None = None) -> int:
        """Stored transitions of ``module_id``, or of all modules."""
        return self._total(lambda b: b.get_num_timesteps(), module_id)

    def get_num_agent_timesteps(self) -> int:
        return self.get_num_timesteps()

    def get_num_episodes(self, module_id: str | None = None) -> int:
        """Agent episodes with a stored transition, of ``module_id`` or of all modules."""
        return self._total(lambda b: b.get_num_episodes(), module_id)

    def get_added_timesteps(self, module_id: str | None = None) -> int:
        return self._total(lambda b: b.get_added_timesteps(), module_id)

    def get_added_agent_timesteps(self) -> int:
        return self.get_added_timesteps()

    def get_sampled_timesteps(self, module_id: str | None = None) -> int:
        return self._total(lambda b: b.get_sampled_timesteps(), module_id)

    def get_num_episodes_evicted(self, module_id: str | None = None) -> int:
        return self._total(lambda b: b.get_num_episodes_evicted(), module_id)

    def get_metrics(self) -> dict[str, Any]:
        """Each module's buffer metrics (see ``ConduitEpisodeReplayBuffer.get_metrics``) under its module id;
        modules whose buffer does not log on this call are left out."""
        with self._lock:
            out = {}
            for m, buffer in self.buffers.items():
                buffer.iteration_of = self.iteration_of
                metrics = buffer.get_metrics()
                if metrics:
                    out[m] = metrics
            return out

    # -- checkpoint ----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Every module's buffer state (see ``ConduitEpisodeReplayBuffer.get_state``), by module id."""
        with self._lock:
            return {"format": MULTI_AGENT_STATE_FORMAT, "prioritized": self.prioritized, "capacity": self.capacity,
                    "modules": {m: b.get_state() for m, b in self.buffers.items()}}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise what :meth:`set_state` would for ``state``, changing nothing.

        Raises:
            conduit.ConfigurationError: as :meth:`set_state`.
        """
        with self._lock:
            self._check_open("restore a state (set_state)")
            self._checked(state)

    def _checked(self, state: Any) -> dict[str, _ConduitReplay]:
        """Module id -> the buffer each saved module's state goes into (this buffer's, or a new one), every saved
        module's state checked by it."""
        check_state_kind(state, MULTI_AGENT_STATE_FORMAT, self, "multi-agent ")
        modules = state.get("modules")
        if not isinstance(modules, dict):
            raise ConfigurationError(f"This Conduit multi-agent replay-buffer state is damaged (its modules are a "
                                     f"{type(modules).__name__}, not a dict); load an undamaged get_state().")
        into = {}
        for m, part in modules.items():
            buffer = self._module(m)
            try:
                buffer.check_state(part)
            except ConfigurationError as e:
                raise ConfigurationError(f"Module {m!r}: {e}") from e
            into[m] = buffer
        return into

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`get_state`'s output into a buffer of the same kind and capacity: every saved module's
        buffer as saved; a module this buffer holds that the state lacks is dropped (closed). Every module's part
        is checked before anything changes.

        Raises:
            conduit.ConfigurationError: the state is no Conduit multi-agent replay state, was saved by a buffer
                of another kind or capacity, or a module's part is damaged; or this buffer is closed.
        """
        with self._lock:
            self._check_open("restore a state (set_state)")
            into = self._checked(state)
            for m, buffer in into.items():
                if buffer.edp is None and state["modules"][m].get("edp") is not None:
                    self._give_scheduler(buffer)
                buffer.set_state(state["modules"][m])
            for m, buffer in self.buffers.items():
                if m not in into:
                    buffer.close()
            self.buffers = into


# The ignores below: as for the single-agent buffers, add/sample take the arguments RLlib's DQN/SAC pass but
# intentionally differ from the RLlib bases' signatures (sample returns ConduitMultiAgentSample).
class ConduitMultiAgentEpisodeReplayBuffer(_ConduitMultiAgentReplay, MultiAgentEpisodeReplayBuffer):  # type: ignore[misc]
    """Uniform replay per RLModule, stored in Conduit; RLlib uses it as a ``MultiAgentEpisodeReplayBuffer``.

    Args:
        capacity: transitions kept per module (FIFO eviction per transition).

    Keyword Args:
        seed: seeds sampling (each module's plane draws from its own seed, derived from it); None: a fresh one.
        device: the learner's device; sampled batches are delivered there.
        placement: where each module's transitions live (default: host memory, pinned when ``device`` is CUDA).
        scheduler: a zero-argument factory for each module's scheduler (default: synchronous).
        metrics_every: as for :class:`~conduit_rllib.replay.ConduitEpisodeReplayBuffer`.
    """

    prioritized = False
    _single = ConduitEpisodeReplayBuffer


class ConduitMultiAgentPrioritizedEpisodeReplayBuffer(  # type: ignore[misc]
        _ConduitMultiAgentReplay, MultiAgentPrioritizedEpisodeReplayBuffer):
    """Proportional prioritized replay per RLModule, stored in Conduit.

    RLlib sees a ``MultiAgentPrioritizedEpisodeReplayBuffer``, so it calls :meth:`update_priorities` with each
    module's TD errors of the last sample.

    Args:
        capacity: transitions kept per module (FIFO eviction per transition).

    Keyword Args:
        alpha: priority exponent (RLlib's ``replay_buffer_config["alpha"]``), for every module.
        seed, device, placement, scheduler, metrics_every: as for :class:`ConduitMultiAgentEpisodeReplayBuffer`.
    """

    prioritized = True
    _single = ConduitPrioritizedEpisodeReplayBuffer

    def update_priorities(  # type: ignore[override]
            self, priorities: Any, module_id: str, *, handles: Any = None) -> int:
        """New priorities for ``module_id``'s transitions of the last :meth:`sample` (or, with ``handles``, for
        those of its transitions; see ``ConduitPrioritizedEpisodeReplayBuffer.update_priorities``).

        Returns:
            How many of the named transitions were still stored (and updated).

        Raises:
            conduit.PriorityError: a module this buffer holds nothing of, or what the single-agent buffer refuses.
        """
        with self._lock:
            self._check_open("update priorities")
            buffer = self.buffers.get(module_id)
            if buffer is None:
                raise PriorityError(f"Module {module_id!r} has no transitions in this buffer (it holds "
                                    f"{list(self.buffers)}); no priority was changed.")
            return cast(ConduitPrioritizedEpisodeReplayBuffer, buffer).update_priorities(priorities, handles=handles)
