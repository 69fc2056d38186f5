"""Conduit replay buffers that RLlib's off-policy training step uses as its own.

:class:`ConduitEpisodeReplayBuffer` and :class:`ConduitPrioritizedEpisodeReplayBuffer` subclass
RLlib's ``EpisodeReplayBuffer`` / ``PrioritizedEpisodeReplayBuffer`` (so every ``isinstance``
check in RLlib passes) and honour the calls DQN's and SAC's ``training_step`` make: ``add``,
``sample`` (with ``n_step``, ``gamma``, ``beta``, ...), ``get_metrics``,
``update_priorities`` and ``get_state``/``set_state``. Underneath, experience is not kept as
episode objects: every transition is one item of a :class:`conduit.ExperienceDataPlane` with
replay semantics, stored column by column, and ``sample`` returns the train batch already
assembled on the learner's device (:class:`~conduit_rllib.delivery.ConduitSampledEpisodes`).

Semantics, compared with RLlib's buffers of the same kind:

* sampling: uniform over stored transitions, or proportional to ``priority ** alpha`` with
  importance weights ``(N P(i)) ** -beta / max_w``; the same distribution RLlib's buffers draw;
* capacity counts transitions, and eviction is FIFO per transition (RLlib evicts whole episodes);
  one chunk longer than the capacity is refused with :class:`conduit.CapacityError` (RLlib
  holds it over capacity until its next add);
* ``min_batch_length_T`` (DQN's ``burn_in_len``) without sequence sampling is ignored with a
  warning, as RLlib's prioritized buffer ignores it (its uniform buffer skips episode ends);
* ``update_priorities(priorities)`` applies to the last ``sample()``, as in RLlib; priorities
  below 1e-12 are raised to 1e-12, as RLlib does; a NaN or infinite one, or one so large that
  ``priority ** alpha`` summed over ``capacity`` transitions would overflow float64 (e.g. 1e300
  with alpha 2), raises :class:`conduit.PriorityError` instead of corrupting the tree (RLlib's
  trees overflow to inf there: every draw lands on one item, with infinite weights);
* n-step: the return sums up to ``n`` rewards of the same episode and stops at its end or at
  the newest stored step, or before a gap in the episode's chunks; the ``n_step`` column
  carries the steps actually summed, so the learner bootstraps with ``gamma ** n_actual``
  (RLlib's uniform buffer writes the requested ``n`` even when it summed fewer, its
  prioritized one redraws such items).
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
import zlib
from collections.abc import Callable
from numbers import Integral, Real
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    DevicePlacement,
    EmptyBufferError,
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    HostPlacement,
    Placement,
    PrioritizedSampler,
    PriorityError,
    Replay,
    Scheduler,
    UniformSampler,
)
from conduit.checks import is_bool, is_int, is_real
from conduit.scheduling.base import check_scheduler_entry
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics import (
    ACTUAL_N_STEP,
    NUM_ENV_STEPS_ADDED,
    NUM_ENV_STEPS_ADDED_LIFETIME,
    NUM_ENV_STEPS_EVICTED,
    NUM_ENV_STEPS_EVICTED_LIFETIME,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_STORED,
    NUM_EPISODES_ADDED,
    NUM_EPISODES_ADDED_LIFETIME,
    NUM_EPISODES_EVICTED,
    NUM_EPISODES_EVICTED_LIFETIME,
    NUM_EPISODES_STORED,
)
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

from conduit_rllib.delivery import N_STEP, WEIGHTS, ConduitSampledEpisodes
from conduit_rllib.errors import UnsupportedConfigError
from conduit_rllib.transitions import ChunkColumns, chunk_columns, transition_schema

if TYPE_CHECKING:
    from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

__all__ = ["ConduitEpisodeReplayBuffer", "ConduitPrioritizedEpisodeReplayBuffer", "STATE_FORMAT", "fresh_seed",
           "module_seed", "check_state_kind"]

#: tag of the dict ``get_state`` returns
STATE_FORMAT = "conduit-rllib/replay/1"


def fresh_seed() -> int:
    """A seed drawn from the OS's entropy, in [0, 2**31): what a Conduit buffer or PPO feed takes when the config
    has no seed (RLlib's default), so unseeded runs draw differently, as RLlib's unseeded generators do."""
    return int(cast(int, np.random.SeedSequence().entropy) % (2 ** 31))


def module_seed(seed: int, module_id: Any) -> int:
    """The seed of one RLModule's data plane in a multi-agent run: ``seed`` for RLlib's default module (so a
    single-agent run draws as before), else ``seed`` offset by a CRC-32 of the module id, so modules draw apart and
    every run draws the same (Python's ``hash`` of a string changes between processes)."""
    if module_id == DEFAULT_MODULE_ID:
        return seed
    return (seed + zlib.crc32(str(module_id).encode())) % 2 ** 63


def check_state_kind(state: Any, state_format: str, buffer: Any, kind: str) -> None:
    """Raise unless ``state`` is a ``get_state()`` of ``state_format`` saved by a buffer of ``buffer``'s kind and
    capacity. ``kind``: how the message names the buffer (``""``, or ``"multi-agent "``).

    Raises:
        conduit.ConfigurationError: another format (another kind of Conduit buffer, or an RLlib-native state), or
            a uniform state for a prioritized buffer (or the other way round), or another capacity.
    """
    if not isinstance(state, dict) or state.get("format") != state_format:
        raise ConfigurationError(f"This is not a Conduit {kind}replay-buffer state (get_state() of a Conduit {kind}"
                                 f"buffer); other Conduit buffers' and RLlib-native buffer states cannot be loaded "
                                 f"into it.")
    if state.get("prioritized") != buffer.prioritized or state.get("capacity") != buffer.capacity:
        saved = "prioritized" if state.get("prioritized") else "uniform"
        raise ConfigurationError(f"The state was saved by a {saved} {kind}buffer of capacity {state.get('capacity')}; "
                                 f"build the same kind and capacity (this one: prioritized={buffer.prioritized}, "
                                 f"capacity={buffer.capacity}).")


#: RLlib's floor for priorities (``PrioritizedEpisodeReplayBuffer.update_priorities``)
MIN_PRIORITY = 1e-12


class _CheckedState(NamedTuple):
    """A replay state's parts, read and checked by ``_ConduitReplay._checked_state`` (the saved plane aside)."""

    alpha: float
    schema: ExperienceSchema | None  # None: saved before anything was added
    seed: Any
    next: int
    tail: dict[str, int]
    tail_t: dict[str, int]
    ended: dict[str, tuple[int, int]]
    lifetime: dict[str, int]
    links: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None  # succ, rew, done, episode ids
    unlogged: dict[str, int]
    metrics_calls: int
    logged_iteration: int | None
    n_rng: Any
    last_handles: Any
    observation_space: Any
    action_space: Any


class _ConduitReplay:
    """The implementation both Conduit buffers share (the RLlib base class comes second in the MRO)."""

    prioritized: bool = False

    # Set by EpisodeReplayBuffer.__init__ (called on this instance below); declared for the type checker.
    capacity: int
    batch_size_B: int
    metrics: MetricsLogger
    _metrics_num_episodes_for_smoothing: int
    # Per-slot n-step links (successor handle, reward, done), allocated with the EDP in _build.
    _succ: np.ndarray | None
    _rew: np.ndarray | None
    _done: np.ndarray | None
    # Per-slot source episode id (str; None: unknown, from a state saved before ids were kept), with the EDP.
    _eid: np.ndarray | None

    def __init__(self, capacity: int = 10000, *, alpha: float = 1.0, seed: int | None = 0,
                 device: torch.device | str | None = None, placement: Placement | None = None,
                 scheduler: Scheduler | None = None, metrics_every: int = 1, batch_size_B: int = 16,
                 batch_length_T: int = 1, metrics_num_episodes_for_smoothing: int = 100, **kwargs: Any) -> None:
        # any real number (NumPy's too, as RLlib's buffers take), but not a bool, NaN or infinity
        if (isinstance(capacity, bool) or not isinstance(capacity, (int, float, np.integer, np.floating))
                or not math.isfinite(capacity) or int(capacity) <= 0):
            raise ConfigurationError(f"capacity must be a positive number of transitions, got {capacity!r}.")
        # Only the cheap base initialiser: it sets capacity, batch sizes and the MetricsLogger.
        # PrioritizedEpisodeReplayBuffer.__init__ would allocate segment trees nobody uses.
        EpisodeReplayBuffer.__init__(cast(EpisodeReplayBuffer, self), capacity=int(capacity), batch_size_B=batch_size_B,
                                     batch_length_T=batch_length_T,
                                     metrics_num_episodes_for_smoothing=metrics_num_episodes_for_smoothing)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)) or not (
                alpha >= 0 and np.isfinite(alpha)):
            raise ConfigurationError(f"alpha must be a finite number >= 0, got {alpha!r}.")
        self._alpha = float(alpha)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, Integral)
                                 or not 0 <= int(seed) < 2 ** 63):  # (the data plane's range, checked at each add)
            raise ConfigurationError(f"seed must be None (a fresh random seed) or an int in [0, 2**63), got "
                                     f"{seed!r}.")
        self.seed = int(seed) if seed is not None else fresh_seed()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.placement = placement
        self.scheduler = scheduler
        self.edp: ExperienceDataPlane | None = None
        #: the RLModule its samples train (a multi-agent buffer's module buffers each name theirs)
        self.module_id: str = DEFAULT_MODULE_ID
        self.observation_space: Any = None
        self.action_space: Any = None
        self._lock = threading.RLock()
        self._n_rng = np.random.Generator(np.random.PCG64(self.seed + 1))
        self._next = 0  # handle the next ingested transition gets (we are the only producer)
        self._tail: dict[str, int] = {}  # unfinished episode id -> handle of its newest stored step
        # unfinished episode id -> the timestep its next chunk starts at (a chunk starting elsewhere is not linked)
        self._tail_t: dict[str, int] = {}
        # ended episode id -> (handle of its last step, timestep it ended at): a chunk of it that starts before that
        # timestep is refused while that step is stored (forgotten once evicted, as RLlib forgets evicted episodes)
        self._ended: dict[str, tuple[int, int]] = {}
        self._succ = self._rew = self._done = None  # per-slot n-step links, allocated with the EDP
        self._eid = None  # per-slot source episode ids, allocated with the EDP
        self._last_handles: torch.Tensor | None = None
        # episode id -> handle of its newest stored step, in the order of those handles: an episode whose newest
        # step is evicted is evicted whole (RLlib's num_episodes_evicted; rebuilt from the per-slot ids on restore)
        self._newest: dict[str, int] = {}
        self._counts = {"added": 0, "episodes": 0, "evicted": 0, "sampled": 0, "n_step_sum": 0,
                        "episodes_evicted": 0}
        self._lifetime = {"added": 0, "evicted": 0, "sampled": 0, "episodes": 0, "episodes_evicted": 0}
        self._ones: dict[torch.dtype, torch.Tensor] = {}
        if not is_int(metrics_every) or metrics_every < 1:  # (no bool, fraction or string: int() would take them)
            raise ConfigurationError(f"metrics_every must be an int >= 1 (log on every n-th get_metrics call), got "
                                     f"{metrics_every!r}.")
        self.metrics_every = int(metrics_every)
        self._metrics_calls = 0
        #: the training iteration the caller is in (``enable`` sets it to the algorithm's): get_metrics logs on
        #: the first call of each iteration too, so every iteration with an update reports the buffer's metrics
        self.iteration_of: Callable[[], int | None] | None = None
        self._logged_iteration: int | None = None
        self._warned_sequence_options = False

    # -- construction of the data plane ------------------------------------------------------
    def _build(self, schema: ExperienceSchema, alpha: float | None = None) -> ExperienceDataPlane:
        # as RLlib's buffer: an add's weight is not "seen" for later adds' default priority (updates are)
        a = self._alpha if alpha is None else alpha
        sampler = PrioritizedSampler(alpha=a, max_from_ingest=False) if self.prioritized else UniformSampler()
        placement = self.placement or HostPlacement(pin_memory=self.device.type == "cuda")
        try:
            edp = ExperienceDataPlane(schema, capacity=self.capacity, semantics=Replay(sampler, seed=self.seed),
                                      placement=placement, scheduler=self.scheduler, device=self.device)
        except (RuntimeError, MemoryError) as e:  # the columns are preallocated for the whole capacity
            need = self.capacity * schema.fixed_item_bytes / 2 ** 30
            raise CapacityError(f"Could not allocate {self.capacity} transitions of {schema.fixed_item_bytes} bytes "
                                f"(~{need:.1f} GiB) on {placement.describe()}: {e}. Lower "
                                f"replay_buffer_config['capacity'] or choose another placement.") from e
        self._succ = np.full(self.capacity, -1, dtype=np.int64)
        self._rew = np.zeros(self.capacity, dtype=np.float32)
        self._done = np.zeros(self.capacity, dtype=np.bool_)
        self._eid = np.full(self.capacity, None, dtype=object)
        self.edp = edp
        return edp

    def close(self) -> None:
        """Stop the data plane's background work (if its scheduler runs any). ``algo.stop()`` calls it, through
        the learner's ``shutdown`` (:class:`~conduit_rllib.learner.ConduitOffPolicyLearner`).

        Then the buffer takes no more work, as its data plane: ``add``, ``sample``, ``update_priorities``,
        :meth:`set_state` and :meth:`check_state` raise :class:`conduit.ConfigurationError` ("closed"), while
        ``len()``, ``get_metrics`` and :meth:`get_state` still work (restore that state into a new buffer).
        A buffer closed before its first ``add`` holds no data plane, so there is nothing to close: it stays
        usable. A close while another thread restores (:meth:`set_state`) or works on the buffer waits for
        that call, then closes the plane it left.
        """
        with self._lock:  # (set_state may swap the plane: the one it leaves is closed, not the one it replaced)
            if self.edp is not None:
                self.edp.close()

    def _check_open(self, what: str = "restore a state (set_state)") -> None:
        """Raise if this buffer's data plane is closed (see :meth:`close`), saying it cannot ``what``."""
        if self.edp is not None and self.edp.closed:
            raise ConfigurationError(f"This replay buffer is closed (close() ran; an algorithm's stop() closes its "
                                     f"buffer), so it cannot {what}. Build a new buffer and restore this one's "
                                     f"get_state() into it (for an algorithm: build a new one, e.g. "
                                     f"Algorithm.from_checkpoint(path), or restore_from_path into a new one; its "
                                     f"checkpoint holds the buffer only if saved with "
                                     f"store_buffer_in_checkpoints=True).")

    def _discard(self) -> None:
        """Drop the data plane and its links: the buffer is as before its first add."""
        self.close()
        self.edp = None
        self._succ = self._rew = self._done = self._eid = None

    # -- add -----------------------------------------------------------------------------------
    def add(self, episodes: Any, weight: float | None = None) -> None:
        """Store the transitions of ``SingleAgentEpisode`` chunks (one item per step, columnar).

        Chunks of one episode may arrive over several calls; their steps are linked for n-step
        returns when a chunk starts at the timestep right after the episode's newest stored step
        (its ``t_started``; a chunk after a gap, e.g. one dropped on the way, starts a new run: no
        return sums across the gap; one that starts inside the stored steps, e.g. an episode's first
        chunk, ``t_started`` 0, added again, is refused, and so is any chunk of an episode that ended, while
        a step of it is still stored, e.g. a whole episode added twice, or a chunk starting at or after its
        end, as RLlib's buffers refuse it). Once every stored step of an episode is evicted, its id is
        forgotten, as RLlib forgets an evicted episode: a chunk of it is stored (and counted) as a new
        episode, whatever its ``t_started``. ``weight`` is the initial priority
        (prioritized buffer; default: the largest priority an update set, 1.0 at first, as in RLlib: a
        weight given here does not raise later adds' default).

        Raises:
            conduit.SchemaError: observations or actions change shape/dtype, or are nested; an entry that is
                no ``SingleAgentEpisode`` (e.g. an old-API-stack ``SampleBatch``). Nothing of this add is stored.
            UnsupportedConfigError: a ``MultiAgentEpisode``; nothing of this add is stored.
            conduit.ConfigurationError: a weight for the uniform buffer; a chunk that starts inside steps
                of its episode already added, while a step of it is still stored (they would be stored
                twice), ``t_started`` 0 included; any chunk of an episode that ended in an earlier add while
                a step of it is still stored (give new steps a new episode id).
            conduit.PriorityError: a weight that is no number (text and bools too), or is NaN, infinite or negative.
            conduit.CapacityError: one chunk holds more steps than the capacity; nothing of this add
                is stored. (RLlib's buffer keeps such a chunk over capacity until the next add; Conduit's
                storage is preallocated for ``capacity`` transitions. Raise the capacity or add shorter
                chunks.)
        """
        episodes = force_list(episodes)
        chunks, weight = self._prepared(episodes, weight)
        with self._lock:
            self._check_open("store episodes (add)")
            self._check_continuations(chunks)
            if len(chunks) > 1:  # a bad chunk after good ones must not leave the good ones stored
                self._check_chunks(chunks)
            self._store(episodes, chunks, weight)

    def _prepared(self, episodes: list[Any], weight: float | None) -> tuple[list[ChunkColumns], float | None]:
        """``episodes``' chunks and ``weight`` as a float, refused as :meth:`add` says (weights, sizes, schemas)
        before anything is stored; what needs the stored steps is checked under the lock."""
        chunks = [chunk_columns(e) for e in episodes]
        if weight is not None and not self.prioritized:
            raise ConfigurationError("A weight (initial priority) was given to a uniform buffer; use "
                                     "ConduitPrioritizedEpisodeReplayBuffer or drop the weight.")
        if weight is not None:
            try:
                if isinstance(weight, (str, bytes)) or is_bool(weight):  # (float() would parse "2.0", take True)
                    raise TypeError(f"a {type(weight).__name__} is no number")
                weight = float(weight)
            except (TypeError, ValueError) as e:
                raise PriorityError(f"An add's weight is one initial priority for all its steps, a number; got "
                                    f"{weight!r} ({e}).") from e
        for c in chunks:  # before anything is stored
            if c.length > self.capacity:
                raise CapacityError(f"An episode chunk of {c.length} steps is larger than the replay capacity "
                                    f"({self.capacity} transitions). Conduit's buffer cannot hold a chunk over "
                                    f"capacity as RLlib's does for a while: raise replay_buffer_config['capacity'] "
                                    f"to at least {c.length}, or add shorter chunks (e.g. a smaller "
                                    f"rollout_fragment_length).")
        return chunks, weight

    def _store(self, episodes: list[Any], chunks: list[ChunkColumns], weight: float | None) -> None:
        """Store checked chunks (under the lock); the first builds the data plane unless one was built for them."""
        for eps, chunk in zip(episodes, chunks, strict=True):
            if chunk.length == 0:
                continue
            if self.edp is None:
                self._build(transition_schema(chunk))
                try:
                    self._ingest(chunk, weight)
                except BaseException:  # refused (too large, bad weight): the next add decides the schema
                    self._discard()
                    raise
            else:
                self._ingest(chunk, weight)
            if self.observation_space is None:
                self.observation_space = getattr(eps, "observation_space", None)
                self.action_space = getattr(eps, "action_space", None)

    def _check_continuations(self, chunks: list[ChunkColumns]) -> None:
        """Refuse, before anything is stored, a chunk that starts inside steps of its unfinished episode already
        added (e.g. the same chunk added twice: its steps would be stored twice), or after a chunk of the same add
        that ended its episode. A chunk with ``t_started`` 0 of an episode whose steps are already stored is such a
        chunk too (its first chunk added again; RLlib's buffers refuse it as well): a continuation carries the
        timestep it starts at, as the chunks ``episode.cut()`` leaves do. So is any chunk of an episode that ended in
        an earlier add, while a step of it is still stored: one inside its steps (e.g. a whole episode added twice)
        and one that starts at or after its end (an ended episode has no continuation; RLlib's buffers refuse such
        a chunk as well). Once its last step is evicted the id is free again, as RLlib forgets evicted episodes; so is
        an unfinished episode's once all its stored steps are: a chunk of it then starts a new episode, whatever its
        ``t_started`` (its first chunk again included). Eviction is counted chunk by chunk, as the add stores them.

        Raises:
            conduit.ConfigurationError: such a chunk.
        """
        # episode id -> (where its added steps end, ended, the handle of its last step), as this add goes
        ends: dict[str, tuple[int, bool, int]] = {}
        added = 0  # steps of this add's chunks before c
        for c in chunks:
            if not c.length:
                continue
            oldest = self._next + added - self.capacity  # (the oldest handle stored once the chunks before c are)
            added += c.length
            gone = self._ended.get(c.episode_id)
            if gone is not None and gone[0] >= oldest:
                why = ("would store them twice" if c.t_started < gone[1] else
                       "would continue an episode that is over (RLlib's buffers refuse it too)")
                raise ConfigurationError(
                    f"Episode {c.episode_id!r} ended at timestep {gone[1]} in an earlier add and steps of it are "
                    f"still stored, so this chunk of it, starting at timestep {c.t_started}, {why}. Add each "
                    f"episode once; to store steps again (e.g. a transition sample() returned) or to store another "
                    f"episode, give them a new episode id. Nothing of this add was stored.")
            newest = self._tail.get(c.episode_id)  # (an unfinished episode whose steps were all evicted is forgotten)
            known = self._tail_t.get(c.episode_id) if newest is None or newest >= oldest else None
            here = ends.get(c.episode_id)
            if here is not None and here[2] < oldest:  # all its steps this add stored are evicted by now: forgotten
                here = None
            end, ended = here[:2] if here is not None else (known, False)
            if end is not None and (c.t_started < end or ended):
                why = (f"the episode ended at timestep {end} earlier in this add" if ended else
                       f"its steps up to {end - 1} were already added (they would be stored twice)")
                hint = "" if ended else (f", or build a continuation with t_started= the timestep it starts at "
                                         f"({end} here); a transition sample() returned is stored already (give "
                                         f"it a new episode id to store it again)")
                raise ConfigurationError(
                    f"Episode {c.episode_id!r}'s chunk starts at timestep {c.t_started}, but {why}. Add each chunk "
                    f"once, in order; to add an episode in parts, add the chunks episode.cut() leaves (an "
                    f"EnvRunner's samples are such chunks){hint}. Nothing of this add was stored.")
            ends[c.episode_id] = (c.t_started + c.length, c.done, self._next + added - 1)

    def _check_chunks(self, chunks: list[ChunkColumns]) -> None:
        """Validate every chunk of one ``add`` before any is stored (as ``ExperienceDataPlane.ingest`` would)."""
        live = [c for c in chunks if c.length]
        if not live:
            return
        schema = self.edp.schema if self.edp is not None else transition_schema(live[0])
        for c in live:
            ExperienceBatch.checked(c.columns, schema)

    def _ingest(self, chunk: ChunkColumns, weight: float | None) -> None:
        edp = self.edp
        assert edp is not None and self._succ is not None and self._rew is not None and self._done is not None
        assert self._eid is not None
        n = chunk.length
        prio = None if weight is None else torch.full((n,), float(weight), dtype=torch.float64)
        handles = edp.ingest(chunk.columns, priorities=prio)
        first = self._next
        # FIFO per transition: before this add the oldest was first - cap. (The storage's own oldest lags
        # behind with a scheduler that stores in the background, so it would count evictions twice.)
        before = max(0, first - self.capacity)
        if handles is not None and int(handles[0]) != first:
            raise ConfigurationError("The replay data plane was written by another producer; a Conduit RLlib "
                                     "buffer must own its ExperienceDataPlane.")
        self._next = first + n
        cap = self.capacity
        if n == 1:  # the common case (one env step per add): scalar writes
            slot = first % cap
            self._succ[slot] = -1
            self._rew[slot] = float(chunk.columns[Columns.REWARDS][0])
            self._done[slot] = chunk.done
            self._eid[slot] = chunk.episode_id
        else:
            slots = np.arange(first, first + n, dtype=np.int64) % cap
            succ = np.arange(first + 1, first + n + 1, dtype=np.int64)
            succ[-1] = -1
            self._succ[slots] = succ
            self._rew[slots] = chunk.columns[Columns.REWARDS].numpy()
            self._done[slots] = False
            self._done[slots[-1]] = chunk.done
            self._eid[slots] = chunk.episode_id
        oldest = edp.storage.oldest if handles is not None else max(0, self._next - cap)
        tail = self._tail.pop(chunk.episode_id, None)
        expected = self._tail_t.pop(chunk.episode_id, None)
        # a continuation links to the episode's newest step only if it starts right after it: after a chunk that
        # never arrived (e.g. dropped by sample_timeout_s), n-step returns must not sum across the gap. (No expected
        # timestep: a state saved before they were kept, every continuation linked as then.)
        follows = expected is None or chunk.t_started == expected
        if tail is not None and tail >= oldest and follows:
            self._succ[tail % cap] = first
        if tail is None or tail < before:  # (an episode whose stored steps were all evicted comes back as a new one)
            self._counts["episodes"] += 1
        if not chunk.done:
            self._tail[chunk.episode_id] = first + n - 1
            self._tail_t[chunk.episode_id] = chunk.t_started + n
        else:  # (kept in the order of their last steps: the evicted ones are at the front, forgotten here)
            self._ended.pop(chunk.episode_id, None)
            self._ended[chunk.episode_id] = (first + n - 1, chunk.t_started + n)
            ended = self._ended
            while ended and next(iter(ended.values()))[0] < self._next - cap:
                del ended[next(iter(ended))]
        self._counts["added"] += n
        self._counts["evicted"] += max(0, oldest - before)
        newest = self._newest  # (kept in the order of their newest steps: the evicted ones are at the front)
        newest.pop(chunk.episode_id, None)
        newest[chunk.episode_id] = self._next - 1
        while newest and next(iter(newest.values())) < self._next - cap:
            del newest[next(iter(newest))]
            self._counts["episodes_evicted"] += 1
        if len(self._tail) > 4 * cap:  # episodes that never finished (e.g. a dropped EnvRunner)
            self._tail = {k: h for k, h in self._tail.items() if h >= oldest}
            self._tail_t = {k: t for k, t in self._tail_t.items() if k in self._tail}

    # -- sample --------------------------------------------------------------------------------
    def sample(self, num_items: int | None = None, *, batch_size_B: int | None = None,
               batch_length_T: int | None = None, n_step: int | tuple[int, int] | None = None,
               beta: float | None = 0.0, gamma: float = 0.99, include_infos: bool = False,
               include_extra_model_outputs: bool = False, sample_episodes: bool | None = True,
               to_numpy: bool = False, lookback: int = 0, min_batch_length_T: int = 0,
               **kwargs: Any) -> ConduitSampledEpisodes:
        """Draw ``num_items`` transitions (with replacement) and return them as a ready train batch.

        Takes the arguments RLlib's DQN/SAC training step passes. ``n_step`` may be an int or a
        ``(low, high)`` range drawn per item; ``beta`` is the importance-weight exponent
        (prioritized). The result is a sequence of B one-step transitions whose ``columns`` are
        the learner's train batch on its device (see :class:`ConduitSampledEpisodes`).

        Raises:
            conduit.EmptyBufferError: the buffer holds nothing.
            conduit.ConfigurationError: ``num_items`` / ``batch_size_B`` not a whole number >= 1;
                an ``n_step`` that is no int >= 1, or a range not two ints ``1 <= low < high``; a ``gamma``
                that is no finite number; a ``beta`` that is no finite
                number >= 0 (prioritized; the uniform buffer ignores ``beta``, as RLlib's does).
                Refused before anything is drawn.
            UnsupportedConfigError: sequence sampling (stateful modules, ``batch_length_T > 0``),
                infos or extra model outputs were requested.

        ``min_batch_length_T`` (DQN passes its ``burn_in_len``) and ``lookback`` only shape
        sequences; without ``batch_length_T`` they are ignored with a warning (once per buffer),
        as RLlib's prioritized buffer ignores them. RLlib's uniform buffer instead never draws
        the last ``min_batch_length_T`` steps of a stored episode; this buffer draws uniformly
        over all stored transitions.
        """
        if sample_episodes is False:
            raise UnsupportedConfigError("Conduit's RLlib buffer returns one-step (n-step) transitions "
                                         "(sample_episodes=True, as DQN and SAC ask); [B, T] sequence batches "
                                         "are not supported.")
        if batch_length_T:
            raise UnsupportedConfigError("Conduit's RLlib buffer does not sample sequences; stateful (RNN) "
                                         "modules are not supported (batch_length_T must be 0: use a "
                                         "feed-forward model).")
        if include_infos or include_extra_model_outputs:
            raise UnsupportedConfigError("Conduit's RLlib buffer stores no infos or extra model outputs; the "
                                         "DQN and SAC losses do not need them. Call sample() without "
                                         "include_infos/include_extra_model_outputs.")
        b = num_items or batch_size_B or self.batch_size_B  # (0 or None: the next one, as RLlib reads them)
        if isinstance(b, bool) or not isinstance(b, Integral) or b < 1:
            raise ConfigurationError(f"sample() draws a whole number of transitions: num_items / batch_size_B must "
                                     f"be an int >= 1, got {b!r}.")
        b = int(b)
        n_checked = self._check_n_step(n_step)  # before anything is drawn: a refused call draws nothing
        gamma = self._check_gamma(gamma)
        if not self.prioritized:
            beta = None  # as RLlib's uniform buffer: whatever beta the config holds is not used
        elif beta is None:
            beta = 0.0
        else:
            try:
                if isinstance(beta, (str, bytes)) or is_bool(beta):  # (float() would parse "0.4"; the plane's check)
                    raise TypeError(f"a {type(beta).__name__} is no number")
                beta = float(beta)
            except (TypeError, ValueError) as e:
                raise ConfigurationError(f"beta (replay_buffer_config['beta']) must be one number >= 0, got {beta!r} "
                                         f"({e}).") from e
        if (min_batch_length_T or lookback) and not self._warned_sequence_options:
            self._warned_sequence_options = True
            warnings.warn(f"Conduit's RLlib buffer samples one-step (n-step) transitions, so min_batch_length_T="
                          f"{min_batch_length_T} (DQN's burn_in_len) and lookback={lookback} are ignored; they "
                          f"apply to sequence sampling only, as in RLlib's prioritized buffer. (RLlib's uniform "
                          f"buffer also skips the last min_batch_length_T steps of each stored episode; Conduit "
                          f"samples all stored transitions.) Set DQN's burn_in_len to 0 to silence this.",
                          UserWarning, stacklevel=2)
        with self._lock:
            self._check_open("sample")
            edp = self.edp
            if edp is None:
                raise EmptyBufferError("The replay buffer is empty; add episodes before sampling.")
            batch, info = edp.deliver(b, beta=beta)
            handles = info.handles
            steps = self._n_steps(n_checked, b)
            cols = {name: batch.tensor(name) for name in batch}
            if steps is not None and (steps > 1).any():
                actual = self._apply_n_step(cols, handles.numpy(), steps, gamma)
            else:
                actual = None
            cols[WEIGHTS] = (info.weights.to(self.device) if info.weights is not None
                             else self._unit(b, torch.float32))
            cols[N_STEP] = self._unit(b, torch.int64) if actual is None else torch.from_numpy(actual).to(self.device)
            self._last_handles = handles
            self._counts["sampled"] += b
            self._counts["n_step_sum"] += b if actual is None else int(actual.sum())
            return ConduitSampledEpisodes(cols, handles, module_id=self.module_id,
                                          observation_space=self.observation_space, action_space=self.action_space,
                                          episode_ids=functools.partial(self._episode_ids, handles, self._eid))

    def _episode_ids(self, handles: torch.Tensor, eid: np.ndarray) -> np.ndarray:
        """The source episode id of each sampled handle, read from ``eid`` (the per-slot ids when it was sampled):
        None where its slot describes a newer step by now (an item a background ingestion or a prepared draw
        delivered after its slot was reused, or evicted since it was sampled)."""
        with self._lock:
            h = handles.numpy() if handles.device.type == "cpu" else handles.cpu().numpy()
            ids = eid[h % self.capacity]
            stale = h < self._next - self.capacity
            if stale.any():
                ids[stale] = None
            return ids

    def _unit(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """``b`` ones on the learner's device (unit weights, one-step returns), kept between samples."""
        ones = self._ones.get(dtype)
        if ones is None or ones.shape[0] < b:
            ones = self._ones[dtype] = torch.ones(b, dtype=dtype, device=self.device)
        return ones[:b]

    @staticmethod
    def _check_n_step(n_step: int | tuple[int, int] | None) -> int | tuple[int, int] | None:
        """``n_step`` validated: an int n >= 2, a ``(low, high)`` range, or None for one-step returns.

        Raises:
            conduit.ConfigurationError: not an int >= 1 (a bool, float or string too), or a range that is not
                two ints with ``1 <= low < high``.
        """
        def whole(v: Any) -> bool:
            return isinstance(v, Integral) and not isinstance(v, bool)

        if n_step is None:
            return None
        if isinstance(n_step, (tuple, list)):
            if len(n_step) != 2 or not all(whole(v) for v in n_step) or not 1 <= int(n_step[0]) < int(n_step[1]):
                raise ConfigurationError(f"An n_step range must be (low, high): two ints with 1 <= low < high (n is "
                                         f"drawn per item from low..high - 1, as RLlib draws it), got {n_step!r}. Set "
                                         f"config.training(n_step=...) to an int >= 1 or such a range.")
            return int(n_step[0]), int(n_step[1])
        if not whole(n_step) or int(n_step) < 1:
            raise ConfigurationError(f"n_step must be an int >= 1 or a (low, high) range of ints, got {n_step!r}. "
                                     f"Set config.training(n_step=...) to one.")
        return None if int(n_step) == 1 else int(n_step)

    @staticmethod
    def _check_gamma(gamma: Any) -> float:
        """``gamma`` validated: the discount of the n-step returns, a finite real number.

        Raises:
            conduit.ConfigurationError: no real number (None, a string, a bool), NaN or infinite.
        """
        if isinstance(gamma, bool) or not isinstance(gamma, Real) or not math.isfinite(gamma):
            raise ConfigurationError(f"gamma (the discount of the n-step returns) must be a finite number, got "
                                     f"{gamma!r}. Set config.training(gamma=...) to one (e.g. 0.99).")
        return float(gamma)

    def _n_steps(self, n_step: int | tuple[int, int] | None, b: int) -> np.ndarray | None:
        """The n of each of ``b`` items (a range is drawn per item), None for one-step returns."""
        if n_step is None:
            return None
        if isinstance(n_step, tuple):
            return self._n_rng.integers(n_step[0], n_step[1], size=b)
        return np.full(b, n_step, dtype=np.int64)

    def _apply_n_step(self, cols: dict[str, torch.Tensor], handles: np.ndarray, steps: np.ndarray,
                      gamma: float) -> np.ndarray:
        """Replace rewards/next obs/dones with their n-step values; returns the steps actually summed."""
        assert self.edp is not None and self._succ is not None and self._rew is not None and self._done is not None
        cap = self.capacity
        cur = handles.copy()
        # The links of the newest `cap` handles only: an older item may still be stored (and drawn) while a
        # background ingestion, or a prepared draw, lags behind, but its slot's links describe a newer step.
        # Such an item keeps its one-step transition as delivered.
        linked = cur >= self._next - cap
        ret = np.where(linked, self._rew[cur % cap].astype(np.float64), 0.0)
        done = self._done[cur % cap] | ~linked
        k = np.ones_like(cur)
        for step in range(1, int(steps.max())):
            nxt = self._succ[cur % cap]
            ok = ~done & (steps > step) & (nxt >= 0)
            if not ok.any():
                break
            cur = np.where(ok, nxt, cur)
            ret += np.where(ok, gamma ** step * self._rew[cur % cap], 0.0)
            done = np.where(ok, self._done[cur % cap], done)
            k += ok
        moved = cur != handles
        if moved.any():
            # The n-th step's next observation and done flags live in another stored item.
            self.edp.flush()
            rows = self.edp.storage.gather(torch.from_numpy(cur % cap))
            # an unmoved item the flush evicted has another step in its slot now: keep its delivered values
            kept = np.flatnonzero(~moved & (cur < self.edp.storage.oldest))
            for name in (Columns.NEXT_OBS, Columns.TERMINATEDS, Columns.TRUNCATEDS):
                col = rows.tensor(name).to(self.device)
                if kept.size:
                    idx = torch.from_numpy(kept).to(self.device)
                    col[idx] = cols[name][idx]
                cols[name] = col
        rewards = torch.from_numpy(ret.astype(np.float32)).to(self.device)
        if not linked.all():
            rewards = torch.where(torch.from_numpy(linked).to(self.device), rewards, cols[Columns.REWARDS])
        cols[Columns.REWARDS] = rewards
        return k

    # -- priorities ----------------------------------------------------------------------------
    def _update_priorities(self, priorities: Any, handles: Any = None) -> int:
        with self._lock:
            self._check_open("update priorities")
            last = handles is None
            if last:
                handles = self._last_handles
                if handles is None or self.edp is None:
                    raise PriorityError("update_priorities applies to the last sample(); call sample() first (each "
                                        "sample takes one priority update).")
            try:
                p = _real_priorities(priorities)
            except (TypeError, ValueError) as e:
                raise PriorityError(f"Priorities must be real numbers, one per transition (e.g. |td_error|), got "
                                    f"a {type(priorities).__name__} holding something else ({e}). No priority was "
                                    f"changed.") from e
            if not last:
                h = _whole_handles(handles)
            else:
                h = np.asarray(handles.cpu().numpy(), dtype=np.int64).reshape(-1)
            if p.shape[0] != h.shape[0]:
                what = "the last sample of" if last else "the"
                raise PriorityError(f"Got {p.shape[0]} priorities for {what} {h.shape[0]} transitions; pass one "
                                    f"per transition.")
            if self.edp is None:  # nothing added yet: no handle was ever issued (checked as after adds)
                if h.size:
                    raise PriorityError(f"Handle {int(h[0])} was never issued: this buffer holds nothing yet (no "
                                        f"handle was issued); pass the handles a sample() returned. No priority "
                                        f"was changed.")
                return 0
            # RLlib's floor for small (and negative) values; NaN and +-inf go on unchanged, so the data plane
            # refuses them (np.maximum would have turned -inf into the floor)
            applied = self.edp.update_priorities(h, np.where(np.isfinite(p), np.maximum(p, MIN_PRIORITY), p))
            if last:
                self._last_handles = None
            return applied

    # -- sizes and metrics ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_num_timesteps(self, module_id: str | None = None) -> int:
        with self._lock:
            if self.edp is None:
                return 0
            self.edp.flush()
            return len(self.edp)

    def get_num_episodes(self, module_id: str | None = None) -> int:
        """Episodes with at least one live transition (counted over the stored links; O(size)). An episode with
        a gap in its chunks (see :meth:`add`) counts once per linked run."""
        with self._lock:
            if self.edp is None or self._succ is None:
                return 0
            self.edp.flush()  # the links already name steps a background ingestion has not stored yet
            st = self.edp.storage
            live = np.arange(st.oldest, st.next_handle, dtype=np.int64)
            # an episode's last stored step has no successor, or the successor is not stored yet
            ends = (self._succ[live % self.capacity] < 0)
            return int(ends.sum())

    def get_added_timesteps(self, module_id: str | None = None) -> int:
        return self._lifetime["added"] + self._counts["added"]

    def get_sampled_timesteps(self, module_id: str | None = None) -> int:
        return self._lifetime["sampled"] + self._counts["sampled"]

    def get_num_episodes_evicted(self, module_id: str | None = None) -> int:
        """Episodes evicted over the buffer's lifetime (restored with its state), as RLlib's buffers count them.

        Eviction is per transition, so an episode counts as evicted once its last stored step is (RLlib evicts
        the oldest episode whole: while Conduit still holds part of it, RLlib's count is one higher). An episode
        whose id comes back after it was evicted is a new episode (see :meth:`add`), counted again when evicted.
        Single-agent, as RLlib's single-agent buffers: every ``module_id`` reads this one count.
        """
        with self._lock:
            return self._lifetime["episodes_evicted"] + self._counts["episodes_evicted"]

    def get_metrics(self) -> dict[str, Any]:
        """RLlib-style buffer metrics (added/evicted/sampled steps, stored size), reduced: the counts since
        the previous logging call, or an empty dict on a call that does not log.

        RLlib calls this once per learner update, right after ``sample``, and sums what each call
        returns into the iteration's results. With ``metrics_every=1`` (the default, and what ``enable``
        builds) every call logs, so an iteration's sums and the lifetime counts are RLlib's for the same
        adds and samples (adds after an iteration's last call, e.g. before learning starts, are reported by
        the next call, as RLlib's buffers report them); that costs one fold into RLlib's MetricsLogger per
        call (~0.4 ms, what RLlib's own buffers pay). With ``metrics_every=n > 1`` (opt-in, to save that:
        logging and reducing costs several ``sample`` calls) counts
        accumulate and are logged on every n-th call and on the first call of each training iteration
        (:attr:`iteration_of` names it; ``enable`` sets it to the algorithm's iteration). Nothing is
        lost, but the counts are then reported up to ``n - 1`` calls late: an iteration's sums are the
        counts since the previous log, not that iteration's.
        """
        with self._lock:
            self._metrics_calls += 1
            iteration = self.iteration_of() if self.iteration_of is not None else None
            new_iteration = iteration is not None and iteration != self._logged_iteration
            if self._metrics_calls % self.metrics_every and not new_iteration:
                return {}
            if iteration is not None:
                self._logged_iteration = iteration
            c, lt = self._counts, self._lifetime
            log = self.metrics.log_value
            log(NUM_ENV_STEPS_STORED, len(self), reduce="mean", window=self._metrics_num_episodes_for_smoothing)
            # episodes with a stored step (one partly evicted too, which RLlib has dropped whole)
            log(NUM_EPISODES_STORED, len(self._newest), reduce="mean",
                window=self._metrics_num_episodes_for_smoothing)
            log(NUM_ENV_STEPS_ADDED, c["added"], reduce="sum")
            log(NUM_ENV_STEPS_ADDED_LIFETIME, c["added"], reduce="lifetime_sum")
            log(NUM_EPISODES_ADDED, c["episodes"], reduce="sum")
            log(NUM_EPISODES_ADDED_LIFETIME, c["episodes"], reduce="lifetime_sum")
            log(NUM_ENV_STEPS_EVICTED, c["evicted"], reduce="sum")
            log(NUM_ENV_STEPS_EVICTED_LIFETIME, c["evicted"], reduce="lifetime_sum")
            log(NUM_EPISODES_EVICTED, c["episodes_evicted"], reduce="sum")
            log(NUM_EPISODES_EVICTED_LIFETIME, c["episodes_evicted"], reduce="lifetime_sum")
            log(NUM_ENV_STEPS_SAMPLED, c["sampled"], reduce="sum")
            log(NUM_ENV_STEPS_SAMPLED_LIFETIME, c["sampled"], reduce="lifetime_sum")
            if c["sampled"]:
                log(ACTUAL_N_STEP, c["n_step_sum"] / c["sampled"], reduce="mean",
                    window=self._metrics_num_episodes_for_smoothing)
            for k in lt:
                lt[k] += c[k]
            for k in c:
                c[k] = 0
            return self.metrics.reduce()

    # -- checkpoint ----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Everything needed to continue identically: contents, priorities, links, RNG states, counters.

        The counts :meth:`get_metrics` has not logged yet, where it is in its every-n-th-call
        cycle and the iteration it logged last are saved too: a restored buffer reports them, on
        the same call, as this one would. So are the source episode ids of the stored transitions.
        """
        with self._lock:
            state: dict[str, Any] = {"format": STATE_FORMAT, "prioritized": self.prioritized,
                                     "capacity": self.capacity, "alpha": self._alpha, "seed": self.seed,
                                     "next": self._next, "tail": dict(self._tail), "tail_t": dict(self._tail_t),
                                     "ended": {k: list(e) for k, e in self._ended.items()},
                                     "lifetime": {k: self._lifetime[k] + self._counts[k] for k in self._lifetime},
                                     "unlogged": dict(self._counts), "metrics_calls": self._metrics_calls,
                                     "logged_iteration": self._logged_iteration,
                                     "n_rng": self._n_rng.bit_generator.state,
                                     "last_handles": self._last_handles,
                                     "observation_space": self.observation_space,
                                     "action_space": self.action_space, "edp": None}
            if self.edp is not None:
                assert self._succ is not None and self._rew is not None and self._done is not None
                assert self._eid is not None
                state.update(schema=self.edp.schema.to_dict(), edp=self.edp.state_dict(), succ=self._succ.copy(),
                             rew=self._rew.copy(), done=self._done.copy(),
                             episode_ids=self._eid.tolist())  # plain str/None: no object array in a checkpoint
            return state

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise what :meth:`set_state` would for ``state``, changing nothing (e.g. to check it before
        restoring something else that may still refuse its own part, as the learner does with RLlib's).

        Everything :meth:`set_state` checks is checked, the data plane's contents and priorities too: they
        are loaded into a scratch plane on PyTorch's ``"meta"`` device, whose columns take no memory (only a
        prioritized buffer's priority tree is allocated, 16 bytes per slot).

        Raises:
            conduit.ConfigurationError: as :meth:`set_state`.
        """
        self._check_open()
        checked = self._checked_state(state)
        if checked.schema is None:
            return
        edp_state = state["edp"]
        sampler = PrioritizedSampler(alpha=checked.alpha, max_from_ingest=False) if self.prioritized \
            else UniformSampler()
        scratch = ExperienceDataPlane(checked.schema, capacity=self.capacity,
                                      semantics=Replay(sampler, seed=self.seed),
                                      placement=DevicePlacement("meta"), device="meta")
        try:
            scratch.load_state_dict(edp_state)  # the plane's own checks, on the scratch
        finally:
            scratch.close()
        if self.scheduler is not None and "scheduler" in edp_state:  # (the scratch's ignores another kind's)
            check_scheduler_entry(self.scheduler, edp_state["scheduler"])

    def _checked_state(self, state: dict[str, Any]) -> _CheckedState:
        """What :meth:`set_state` restores from ``state``, read and checked; the saved data plane's own
        state is checked by its load (or :meth:`check_state`'s scratch load), not here.

        Raises:
            conduit.ConfigurationError: as :meth:`set_state`.
        """
        check_state_kind(state, STATE_FORMAT, self, "")
        try:  # everything read (and checked) before anything changes
            alpha = state["alpha"]  # (no bool or text: float() would take True or "1.0")
            if not (is_real(alpha) and alpha >= 0 and math.isfinite(alpha)):
                raise ValueError(f"alpha {alpha!r} is not a finite number >= 0")
            alpha = float(alpha)
            has_plane = state["edp"] is not None
            schema = ExperienceSchema.from_dict(state["schema"]) if has_plane else None
            # (the next handle checked as a count: int() would truncate 4.5, parse "4" and take False as 0)
            seed, nxt = state["seed"], _count("next handle", state["next"])
            tail, lifetime = dict(state["tail"]), dict(state["lifetime"])
            if isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= int(seed) < 2 ** 63:
                raise ValueError(f"seed {seed!r} is no int in [0, 2**63)")  # (the data plane's, at the next add)
            if not has_plane and nxt != 0:  # (the plane an add builds hands out 0 first)
                raise ValueError(f"next handle {nxt} for a buffer that holds nothing (0)")
            for eid, newest in tail.items():  # (an add of the episode links its newest step to its own first)
                if isinstance(newest, bool) or not isinstance(newest, Integral) or not 0 <= int(newest) < nxt:
                    raise ValueError(f"unfinished episode {eid!r}'s newest step {newest!r} is no handle in "
                                     f"[0, next {nxt})")
            seed, tail = int(seed), {eid: int(newest) for eid, newest in tail.items()}
            # (a state saved before these were kept: every continuation is linked, as then)
            tail_t = dict(state.get("tail_t", {}))
            for eid, t in tail_t.items():
                if eid not in tail or isinstance(t, bool) or not isinstance(t, Integral) or int(t) < 0:
                    raise ValueError(f"unfinished episode {eid!r}'s next timestep {t!r} is no int >= 0 of an "
                                     f"unfinished episode")
            tail_t = {eid: int(t) for eid, t in tail_t.items()}
            ended: dict[str, tuple[int, int]] = {}  # (a state saved before it was kept: no episode known ended)
            for eid, (last_step, end_t) in dict(state.get("ended", {})).items():
                if not all(isinstance(v, Integral) and not isinstance(v, bool) for v in (last_step, end_t)) or not (
                        0 <= int(last_step) < nxt and int(end_t) >= 1):
                    raise ValueError(f"ended episode {eid!r}'s last step {last_step!r} is no handle in [0, next "
                                     f"{nxt}), or its end timestep {end_t!r} no int >= 1")
                ended[eid] = (int(last_step), int(end_t))
            links = None
            if has_plane:  # one n-step link per slot, and the handle the next add gets is the saved plane's next
                # (a state saved before episode ids were kept: they are unknown, None)
                eids = state.get("episode_ids")
                links = (np.array(state["succ"], dtype=np.int64), np.array(state["rew"], dtype=np.float32),
                         np.array(state["done"], dtype=np.bool_),
                         np.full(self.capacity, None, dtype=object) if eids is None else _episode_id_array(eids))
                shapes = [a.shape for a in links]
                if shapes != [(self.capacity,)] * 4 or nxt != int(state["edp"]["storage"]["next"]):
                    raise ValueError(f"n-step links of shapes {shapes} for {self.capacity} slots and next handle "
                                     f"{nxt} for a plane whose next is {state['edp']['storage']['next']}")
            # (states saved before these two were kept: nothing unlogged, the cycle at its start)
            unlogged = {k: _count(f"unlogged {k}", dict(state.get("unlogged", {})).get(k, 0)) for k in self._counts}
            metrics_calls = _count("metrics_calls", state.get("metrics_calls", 0))
            logged_iteration = state.get("logged_iteration")
            logged_iteration = None if logged_iteration is None else _count("logged_iteration", logged_iteration)
            # (a state saved before evicted episodes were counted: none counted up to it); the lifetime counts
            # include the unlogged ones
            lifetime = {k: _count(f"lifetime {k}", lifetime.get(k, 0) if k == "episodes_evicted" else lifetime[k],
                                  at_least=unlogged[k]) - unlogged[k] for k in self._lifetime}
            np.random.PCG64().state = state["n_rng"]
            last, obs_space, act_space = state["last_handles"], state["observation_space"], state["action_space"]
            if last is not None and not (isinstance(last, torch.Tensor) and last.dim() == 1
                                         and last.dtype == torch.int64):
                raise ValueError(f"the last sample's handles are {type(last).__name__}, not a 1-d int64 tensor")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigurationError(f"This Conduit replay-buffer state is damaged ({type(e).__name__}: {e}); load "
                                     f"an undamaged get_state().") from e
        return _CheckedState(alpha, schema, seed, nxt, tail, tail_t, ended, lifetime, links, unlogged, metrics_calls,
                             logged_iteration, state["n_rng"], last, obs_space, act_space)

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`get_state`'s output into a buffer of the same kind and capacity.

        The saved ``alpha`` replaces this buffer's (the saved priorities were raised to it). A
        refused state changes nothing: contents, links, alpha and counters stay as they were
        (:meth:`check_state` tells without restoring).

        Raises:
            conduit.ConfigurationError: the state is not a Conduit replay state, was written by a
                buffer of another kind or capacity, or is damaged; or this buffer is closed (whatever the
                state: restore it into a new buffer).
        """
        with self._lock:
            self._check_open()
            c = self._checked_state(state)
            if c.schema is not None:
                # (the saved priorities are p ** alpha of the saving buffer: sample and update with its alpha)
                self._load_plane(c.schema, state["edp"], c.alpha)  # checks the saved plane before it changes
                assert c.links is not None
                self._succ, self._rew, self._done, self._eid = c.links
                self._newest = _newest_steps(self._eid, c.next, self.capacity)
            else:
                if self.edp is not None:  # the state was saved before anything was added: drop our contents
                    self._discard()
                self._newest = {}
            self._alpha = c.alpha
            self.seed, self._next = c.seed, c.next
            self._tail = c.tail
            self._tail_t = c.tail_t
            self._ended = c.ended
            self._lifetime = c.lifetime
            self._counts = c.unlogged
            self._metrics_calls = c.metrics_calls
            self._logged_iteration = c.logged_iteration
            self._n_rng.bit_generator.state = c.n_rng
            self._last_handles = c.last_handles
            self.observation_space = c.observation_space
            self.action_space = c.action_space

    def _load_plane(self, schema: ExperienceSchema, edp_state: dict[str, Any], alpha: float) -> None:
        """Load a saved data plane of ``schema`` whose priorities were raised to ``alpha``; a refused load leaves
        the current plane (its sampler's alpha included) and links as they were."""
        edp = self.edp
        if edp is not None and edp.schema == schema:
            sampler = cast(Replay, edp.semantics).sampler
            before = sampler.alpha if isinstance(sampler, PrioritizedSampler) else None
            if isinstance(sampler, PrioritizedSampler):
                sampler.alpha = alpha
            try:
                edp.load_state_dict(edp_state)  # checked before it changes anything
            except BaseException:
                if isinstance(sampler, PrioritizedSampler) and before is not None:
                    sampler.alpha = before
                raise
            return
        links = (self._succ, self._rew, self._done, self._eid)
        kept = edp.state_dict() if edp is not None else None  # our contents, should the saved plane be refused
        self.close()  # a scheduler serves one open plane at a time
        try:
            self._build(schema, alpha).load_state_dict(edp_state)
        except BaseException:
            self._discard()
            if edp is not None:
                self._build(edp.schema).load_state_dict(cast(dict[str, Any], kept))
                self._succ, self._rew, self._done, self._eid = links
            raise


def _count(what: str, value: Any, at_least: int = 0) -> int:
    """A saved counter ``value`` as an int, checked: an integer (not a bool, fraction or text) >= ``at_least``.

    Raises:
        ValueError: anything else (a damaged state: ``int()`` would truncate 2.7 or parse "3", and a negative count
            would be reported as such by get_metrics).
    """
    if not is_int(value) or value < at_least:
        raise ValueError(f"{what} {value!r} is no int >= {at_least}")
    return int(value)


def _real_priorities(priorities: Any) -> np.ndarray:
    """``update_priorities``'s ``priorities`` as a 1-d float64 array, read as the data plane reads them: a floating
    tensor of any dtype (bfloat16 too, which NumPy has no counterpart for) is converted by torch first.

    Raises:
        TypeError: complex values (NumPy would drop their imaginary parts with only a warning), text or bools
            (NumPy would parse "2.0" and take True as 1), or no numbers.
        ValueError: values that form no array of numbers.
    """
    if isinstance(priorities, torch.Tensor):
        if priorities.is_complex():
            raise TypeError("complex values")
        t = priorities.detach()
        raw: Any = (t.to("cpu", torch.float64) if t.is_floating_point() else t.cpu()).numpy()
    else:
        if np.iscomplexobj(priorities):
            raise TypeError("complex values")
        raw = priorities
    arr = np.asarray(raw)
    # (NumPy's float conversion would parse text, "2.0", and take bools as 0 and 1)
    if arr.dtype.kind in "USb" or (arr.dtype.kind == "O" and not all(is_real(v) for v in arr.reshape(-1))):
        raise TypeError(f"{arr.dtype} values")
    return np.asarray(arr, dtype=np.float64).reshape(-1)


def _newest_steps(eid: np.ndarray, nxt: int, capacity: int) -> dict[str, int]:
    """Each stored episode's newest step: episode id -> handle, ordered by handle, from the per-slot ids ``eid`` of
    a buffer whose next handle is ``nxt`` (slots of unknown episodes, None, are left out)."""
    live = np.arange(max(0, nxt - capacity), nxt, dtype=np.int64)
    ids = eid[live % capacity]
    known = np.fromiter((e is not None for e in ids), dtype=np.bool_, count=ids.size)
    ids, live = ids[known][::-1], live[known][::-1]  # newest first: an id's first occurrence is its newest step
    if not ids.size:
        return {}
    unique, first = np.unique(ids, return_index=True)
    handles = live[first]
    order = np.argsort(handles)
    return dict(zip(unique[order].tolist(), handles[order].tolist(), strict=True))


def _whole_handles(handles: Any) -> np.ndarray:
    """``update_priorities``'s ``handles`` as a 1-d int64 array.

    Raises:
        conduit.PriorityError: an entry that is no whole number (a fraction, a string, a bool...): it names no
            transition (NumPy would truncate 1.7 to handle 1, a transition nobody named).
    """
    raw = handles.detach().cpu().numpy() if isinstance(handles, torch.Tensor) else np.asarray(handles)
    raw = raw.reshape(-1)
    if raw.dtype.kind in "iu":
        return raw.astype(np.int64)
    try:
        as_float = raw.astype(np.float64)
        ok = raw.dtype.kind in "f" and bool(np.all(np.isfinite(as_float) & (as_float == np.floor(as_float))))
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise PriorityError(f"handles must be whole numbers, the Conduit handles a sample returned (e.g. "
                            f"sample(...).handles[idx]), got a {type(handles).__name__} of {raw.dtype} "
                            f"values, not all whole. No priority was changed.")
    return as_float.astype(np.int64)


def _episode_id_array(ids: Any) -> np.ndarray:
    """Saved per-slot episode ids as a 1-d object array (each a str, or None where unknown).

    Raises:
        ValueError: not one-dimensional, or an entry that is neither a str nor None.
    """
    out = np.empty(len(ids), dtype=object)
    out[:] = list(ids)
    if not all(e is None or isinstance(e, str) for e in out):
        raise ValueError("episode ids must be str or None")
    return out


# The ignores below: _ConduitReplay's add/sample take the arguments RLlib's DQN/SAC pass but intentionally differ
# from the RLlib bases' signatures (add takes a weight; sample returns ConduitSampledEpisodes).
class ConduitEpisodeReplayBuffer(_ConduitReplay, EpisodeReplayBuffer):  # type: ignore[misc]
    """Uniform replay over transitions, stored in Conduit; RLlib uses it as an ``EpisodeReplayBuffer``.

    Args:
        capacity: transitions kept (FIFO eviction per transition).

    Keyword Args:
        seed: seeds sampling, an int in [0, 2**63) (None: a fresh random seed).
        device: the learner's device; sampled batches are delivered there (Conduit does the copy).
        placement: where the transitions live (default: host memory, pinned when ``device`` is CUDA).
        scheduler: when ingestion/delivery work runs (default: synchronously).
        metrics_every: log metrics on every n-th ``get_metrics`` call; default 1, every call, as RLlib's
            buffers log (and as ``enable`` builds the buffer), so the counts are RLlib's; n > 1 saves the
            per-call fold (~0.4 ms) but reports counts up to n - 1 calls late (see :meth:`get_metrics`).
    """

    prioritized = False


class ConduitPrioritizedEpisodeReplayBuffer(_ConduitReplay, PrioritizedEpisodeReplayBuffer):  # type: ignore[misc]
    """Proportional prioritized replay over transitions, stored in Conduit.

    RLlib sees a ``PrioritizedEpisodeReplayBuffer``, so it calls :meth:`update_priorities` with
    the TD errors of the last sample.

    Args:
        capacity: transitions kept (FIFO eviction per transition).

    Keyword Args:
        alpha: priority exponent (RLlib's ``replay_buffer_config["alpha"]``).
        seed, device, placement, scheduler, metrics_every: as for :class:`ConduitEpisodeReplayBuffer`.
    """

    prioritized = True

    # Intentionally differs from RLlib's: returns how many transitions were updated (RLlib's returns None).
    def update_priorities(  # type: ignore[override]
            self, priorities: Any, module_id: str | None = None, *, handles: Any = None) -> int:
        """New priorities (RLlib passes |TD error|) for the transitions of the last :meth:`sample`.

        Conduit extension: with ``handles`` (Conduit handles, e.g. ``sample(...).handles[idx]``)
        the priorities apply to those transitions instead; evicted ones are ignored.

        Returns:
            How many of the named transitions were still stored (and updated).

        Raises:
            conduit.PriorityError: no sample to update, a length mismatch, priorities that are no numbers or
                are NaN/inf, or handles that are no whole numbers (a fraction, a string) or were never
                issued (before the first add, every handle: none was issued yet). No priority is changed then.
        """
        return self._update_priorities(priorities, handles)
