"""The overlapped scheduler: granularity, background ingestion and delivery prefetch.

``Overlapped(g_ing=..., g_del=...)`` runs the experience path off the critical path:

* **ingestion** -- ``ingest`` hands the validated batch to a bounded queue and returns;
  a worker thread stores it, ``g_ing`` rollouts (off-policy) or ``g_ing`` of a rollout
  (on-policy) per storage write. See :mod:`conduit.scheduling.ingestion`.
* **delivery** -- each delivery call prepares a *chunk* of ``g_del`` batches (one locked
  select-and-gather into a reused buffer); while the learner updates on one batch, a
  worker thread prepares the next chunk (double/triple buffering, see
  :mod:`conduit.scheduling.buffers`). With a GPU learner and host storage the chunk is
  gathered into page-locked staging and copied by a side CUDA stream; with storage on a GPU
  the gather itself runs on that stream, ordered both ways against ingestion writes (see
  the stream order in :mod:`conduit.scheduling.buffers`). A prefetch whose
  draw finds nothing to deliver yet (a sampler that waits for new items, such as a queue,
  while the items it needs are handed over but not stored) is tried again as soon as the
  ingestion stores more, not only at the next delivery call.

With ``overlap=False`` the same granularity runs sequentially in the caller: that is
"granularity alone" (the paper's sequential configuration).

Semantics kept, per kind of buffer:

* **on-policy** -- ``g_del`` is ``1/M``: one minibatch per delivery call. The next
  minibatch of the *current* rollout is predicted (a peek that leaves the semantics'
  state untouched) and gathered ahead; at delivery the real selection is made and the
  prepared rows are used only if they are exactly the selected items. So prefetch never
  crosses a rollout or a policy version, staleness is checked at delivery time, and the
  delivered sequence is the synchronous one.
* **prioritized replay** -- a prefetched batch is drawn before the learner's latest
  priority updates reach the tree. It misses at most ``max_priority_staleness`` (default
  ``g_del``) ``update_priorities`` calls; a prepared batch that would miss more is
  discarded and drawn again. Importance weights use the ``beta`` of the delivery call.
* **uniform replay** -- a prepared batch was drawn from the contents at most one chunk
  (``g_del`` deliveries) earlier: it can hold items evicted since, and items ingested
  since become drawable from the next chunk on.

Against :class:`~conduit.scheduling.Synchronous` (same seed, same calls), replay draws are:

* sequential (``overlap=False``): deterministic, the same run after run. With ``g_ing = g_del = 1``
  they are the synchronous draws (weights included), also with ingests and priority updates
  between deliveries. With ``g_del > 1`` a chunk's batches are all drawn at its first delivery
  call, so what is ingested or updated between that chunk's deliveries reaches the draws from
  the next chunk on (they are the draws of a synchronous buffer that delivers the chunk's
  batches back to back); with ``g_ing > 1`` an ingested batch reaches storage with its group's
  write (every ``g_ing`` ingests, or ``flush``). A call for another batch size or other options
  gives the draws prepared for the earlier ones back (they are made again, for this call).
* with overlap (``overlap=True``, whether ingestion is in the background or in the caller):
  the worker draws the next chunk right after a delivery, while the caller goes on, so draws
  are not reproducible when anything is ingested or priorities are updated between deliveries
  (within the bounds above: uniform, at most one chunk old; prioritized, at most
  ``max_priority_staleness`` updates). Deliveries with nothing ingested or updated between
  them (e.g. after a ``flush``) draw the synchronous items, in order, also when the batch size
  changes (prioritized weights are then equal up to float32 rounding, being drawn with beta = 1
  and raised to the call's beta).

On-policy deliveries are the synchronous ones always.
"""

from __future__ import annotations

import atexit
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from conduit.batch import ExperienceBatch
from conduit.checks import is_bool, is_int, is_real
from conduit.errors import ConfigurationError, EmptyBufferError
from conduit.scheduling.base import Scheduler, unattached, wait_refused
from conduit.scheduling.buffers import ChunkRing, Fill, buffers_needed, storage_devices
from conduit.scheduling.ingestion import Handover, Ingestion
from conduit.scheduling.worker import Job, Worker
from conduit.semantics.base import SampleInfo, Selection
from conduit.semantics.onpolicy import OnPolicy
from conduit.semantics.replay import PrioritizedSampler, Replay

if TYPE_CHECKING:
    from conduit.edp import ExperienceDataPlane

__all__ = ["Overlapped"]

_Key = tuple[Any, ...]

#: how often a call that holds the buffer's lock and waits for the delivery lock checks whether the delivery holding
#: it has come to need the buffer's lock (see Overlapped._enter)
_RECHECK_S = 0.001


class _LockWait:
    """Marks, while entered, that the calling thread (holding ``Overlapped._mu``) waits for the buffer's lock
    (:attr:`waiter`; cleared under that lock by ``Overlapped._has_buffer_lock``, or on exit). A plain object reused
    for every call: the delivery path enters it once or twice per call. (It keeps the mark itself, not in its
    scheduler: a reference back would make a cycle, and a dropped scheduler would wait for the cyclic garbage
    collector to free its delivery buffers.)"""

    __slots__ = ("waiter",)

    def __init__(self) -> None:
        #: the thread holding ``_mu`` while it waits for the buffer's lock, or None
        self.waiter: int | None = None

    def __enter__(self) -> None:
        self.waiter = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self.waiter = None


class _Ticket:
    """One prefetch job's cancellation mark, read by the job under the buffer's lock as it enters (see
    :meth:`Overlapped._await_job`), and what its draw found (see :meth:`Overlapped._rearm`)."""

    __slots__ = ("cancelled", "seen", "starved", "rearming", "drawn_from")

    def __init__(self) -> None:
        self.cancelled = False
        #: the ingestion's writes stored when the job's draw began (read under the buffer's lock); None: not drawn
        self.seen: int | None = None
        #: the semantics' draw state before the job's draw (:meth:`Semantics.draw_state`; None: not drawn, or
        #: semantics that cannot give draws back), for a job that fails after drawing (see Overlapped._await_job)
        self.drawn_from: Any = None
        #: the draw found nothing to deliver (EmptyBufferError): a later write re-arms the prefetch
        self.starved = False
        #: a re-arm check waits on the prefetch worker
        self.rearming = False


def _whole(g: Any) -> bool:
    """``g`` is a finite whole number (a count of rollouts or batches; NumPy's too)."""
    return is_real(g) and math.isfinite(g) and int(g) == g


def _number(g: Any) -> float:
    """A granularity checked by :func:`is_real` as a plain Python number (an int stays an int)."""
    return int(g) if is_int(g) else float(g)


def _count(v: Any, least: int) -> bool:
    """``v`` is an integer (not a bool) of at least ``least``."""
    return is_int(v) and int(v) >= least


@dataclass
class _Prepared:
    """One batch prepared ahead of its delivery."""

    key: _Key
    batch: ExperienceBatch
    info: SampleInfo
    selection: Selection
    buf: int
    #: priority-update count when it was drawn (prioritized replay)
    prio_epoch: int
    #: CUDA event of its copy to the learner's device (None off CUDA)
    event: Any = None
    #: the chunk's last batch frees the chunk's buffer when it leaves
    frees_buffer: bool = False
    #: prioritized: weights drawn with beta = 1, to be raised to the delivery's beta (False: drawn with it)
    reweigh: bool = True


class Overlapped(Scheduler):
    """Background ingestion and delivery prefetch at chosen granularities.

    Keyword Args:
        g_ing: ingestion granularity. Off-policy: rollouts (``ingest`` calls) per storage
            write, an int >= 1. On-policy: the part of a rollout per write, in ``(0, 1]``
            (``1/M`` pipelines minibatch-sized parts, ``1`` writes whole rollouts).
        g_del: delivery granularity. Off-policy: batches prepared per delivery call, an
            int >= 1. On-policy it is ``1/M`` (one minibatch per call); pass ``1`` or ``1/M``.
        overlap: run ingestion and delivery preparation in worker threads (True), or
            sequentially in the caller at the same granularity (False).
        background_ingest: store ingested batches on a worker thread (default: ``overlap``).
            ``False`` with ``overlap=True`` keeps ingestion in the caller (at ``g_ing``) while
            delivery still prefetches: the better choice when each ``ingest`` call is small
            (a few env steps), where handing a batch over costs about what storing it does and
            the second worker only competes with the prefetch for the interpreter.
        queue_depth: handed-over batches that may wait for storage before ``ingest``
            blocks (backpressure). At least ``g_ing`` off-policy.
        max_priority_staleness: prioritized replay only: how many ``update_priorities``
            calls a delivered batch's draw may precede (default ``g_del``). A chunk then holds at
            most ``max_priority_staleness + 1`` batches: a smaller bound draws smaller chunks than
            ``g_del`` asks (``g_del=4, max_priority_staleness=1`` draws two batches at a time).
        output_depth: deliveries a delivered batch stays valid for (default 2).
        rollout_size: on-policy items per rollout, for ``g_ing`` (default: learned).
        copy_on_ingest: copy each batch in ``ingest`` before handing it over, so the
            producer may overwrite its arrays at once. Off by default: the producer must
            not write into a handed-over batch until ``flush()``.

    Before it serves a buffer (passed as ``scheduler=``), nothing was handed over or prepared: ``flush``,
    ``close``, ``release_buffers`` and ``trim_buffers`` do nothing, ``pending()`` is empty and ``prepared`` is 0;
    ``retune`` and ``priority_staleness``, which depend on the buffer's kind, raise
    :class:`~conduit.errors.ConfigurationError`.

    Examples:
        >>> import torch
        >>> from conduit import ExperienceDataPlane, ExperienceSchema, Field, Overlapped
        >>> edp = ExperienceDataPlane(ExperienceSchema(obs=Field((3,))), capacity=64,
        ...                           scheduler=Overlapped(g_ing=1, g_del=2))
        >>> _ = edp.ingest({"obs": torch.ones(10, 3)})
        >>> edp.flush()
        >>> batch, info = edp.deliver(4)
        >>> batch["obs"].shape
        torch.Size([4, 3])
        >>> edp.close()
    """

    _ingestion: Ingestion  # (set by _attach)

    def __init__(self, *, g_ing: float = 1, g_del: float = 1, overlap: bool = True, queue_depth: int = 8,
                 max_priority_staleness: int | None = None, output_depth: int = 2,
                 rollout_size: int | None = None, copy_on_ingest: bool = False,
                 background_ingest: bool | None = None) -> None:
        if not is_real(g_ing) or not g_ing > 0:  # (NumPy numbers too: a granularity read from a config array)
            raise ConfigurationError(f"g_ing must be a positive number, got {g_ing!r}.")
        if not is_real(g_del) or not g_del > 0:
            raise ConfigurationError(f"g_del must be a positive number, got {g_del!r}.")
        g_ing, g_del = _number(g_ing), _number(g_del)
        if not _count(output_depth, 1):
            raise ConfigurationError(f"output_depth must be an int >= 1, got {output_depth!r}.")
        if max_priority_staleness is not None and not _count(max_priority_staleness, 0):
            raise ConfigurationError(f"max_priority_staleness must be None or an int >= 0, got "
                                     f"{max_priority_staleness!r}.")
        if not _count(queue_depth, 1):
            raise ConfigurationError(f"queue_depth must be an int >= 1, got {queue_depth!r}.")
        if rollout_size is not None and not _count(rollout_size, 1):
            raise ConfigurationError(f"rollout_size must be None (learned) or an int >= 1, got {rollout_size!r}.")
        for name, flag, none_ok in (("overlap", overlap, False), ("background_ingest", background_ingest, True),
                                    ("copy_on_ingest", copy_on_ingest, False)):
            if not is_bool(flag) and not (none_ok and flag is None):  # ("false" from a config is truthy)
                raise ConfigurationError(f"{name} must be True or False{' (or None: as overlap)' if none_ok else ''}, "
                                         f"got {flag!r}.")
        self.g_ing = g_ing
        self.g_del = g_del
        #: g_del as asked for (the constructor's or retune's): on-policy, ``_attach`` replaces g_del by 1/M of
        #: the buffer served, and a buffer served after it (another M, or off-policy) checks this one instead
        self._g_del_arg: float = g_del
        self.overlap = bool(overlap)
        self.background_ingest = self.overlap if background_ingest is None else bool(background_ingest)
        self.queue_depth = int(queue_depth)
        self.output_depth = int(output_depth)
        self.rollout_size = None if rollout_size is None else int(rollout_size)
        self.copy_on_ingest = bool(copy_on_ingest)
        self._max_prio_stale = max_priority_staleness
        #: prepared batches discarded undelivered (replay: key change, staleness, checkpoint)
        self.discarded = 0
        #: deliveries served from a prepared batch / prepared in the delivery call
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self._closed = False
        self._closer: threading.Thread | None = None  # stops the prefetch after a close on the ingestion worker

    # -- set-up ----------------------------------------------------------------------------
    def _attach(self, edp: ExperienceDataPlane) -> None:
        closer = self._closer
        if closer is not None and not self._ingestion.on_worker:  # (a close on the ingestion worker: see close)
            closer.join()
        sem = edp.semantics
        self.on_policy = isinstance(sem, OnPolicy)
        self.prioritized = isinstance(sem, Replay) and sem.sampler.prioritized
        if isinstance(sem, OnPolicy):
            m = sem.num_minibatches
            if self.g_ing > 1:
                raise ConfigurationError(f"On-policy g_ing is a part of one rollout, in (0, 1]; got {self.g_ing}. "
                                         f"Batching several rollouts would mix policy versions.")
            if self._g_del_arg not in (1, 1 / m if m else 1):
                raise ConfigurationError(f"On-policy g_del is 1/M (one minibatch per delivery call) for freshness; "
                                         f"got {self._g_del_arg}. Pass g_del=1 or g_del=1/M.")
            self.g_del = 1 / m if m else 1
            self._chunk = 1
        else:
            for name, g in (("g_ing", self.g_ing), ("g_del", self._g_del_arg)):
                if not _whole(g):
                    raise ConfigurationError(f"Off-policy {name} counts rollouts or batches: an int >= 1, got {g}.")
            self.g_ing, self.g_del = int(self.g_ing), int(self._g_del_arg)
            self._chunk = int(self.g_del)
        s = self._max_prio_stale
        self.max_priority_staleness = self._chunk if s is None else int(s)
        if self.prioritized:
            # a chunk drawn inside a delivery call misses up to chunk - 1 updates: cap it
            self._chunk = max(1, min(self._chunk, self.max_priority_staleness + 1))
        self._ring = ChunkRing(edp.schema, edp.storage.device, edp.device,
                               count=buffers_needed(self._chunk, self.output_depth), output_depth=self.output_depth)
        self._ingestion = Ingestion(edp, g_ing=self.g_ing, on_policy=self.on_policy,
                                    background=self.background_ingest, queue_depth=self.queue_depth,
                                    rollout_size=self.rollout_size, on_write=weakref.WeakMethod(self._rearm))
        self._pool = Worker("conduit-prefetch") if self.overlap else None
        # a buffer dropped without close() stops the threads (they hold neither it nor this scheduler)
        weakref.finalize(edp, _abandon, self._ingestion, self._pool)
        self._mu = threading.RLock()
        self._ready: deque[_Prepared] = deque()
        self._job: Job[list[_Prepared]] | None = None
        self._job_key: _Key | None = None  # the key the job in flight prepares for
        self._ticket = _Ticket()  # the job in flight's cancellation mark
        self._cancelled: Job[list[_Prepared]] | None = None  # the last job cancelled (it may wait for the lock yet)
        #: the job in flight has entered its hold of the buffer's lock (see _await_job); set under that lock
        self._job_entered = False
        #: the thread holding ``_mu`` while it waits for the buffer's lock (``waiter``, reset under that lock), and
        #: the job it waits for: what a call holding the buffer's lock checks before it waits for ``_mu`` (see _enter)
        self._lock_wait = _LockWait()
        self._awaited: Job[list[_Prepared]] | None = None
        self._delivered = 0
        self._prio_epoch = 0
        self._prio_lock = threading.Lock()
        self._last: SampleInfo | None = None
        self._closed = False  # (a scheduler whose buffer was closed serves a new one afresh)
        self._closer = None
        #: close() stopped the prefetch worker (else a close interrupted part way left that to the next close)
        self._prefetch_stopped = False
        self.discarded = self.prefetch_hits = self.prefetch_misses = 0
        _OPEN.add(self)

    def trim_buffers(self, max_bytes: float, batch: int, item_bytes: float, *, room_for_a_chunk: bool) -> None:
        """Let go of idle delivery buffers until they hold at most ``max_bytes`` (of items of ``item_bytes``),
        leaving room for the chunk the next call prepares for batches of ``batch`` items when
        ``room_for_a_chunk`` (see :meth:`ChunkRing.trim`; prepared batches and delivered ones stay valid). Items
        of no bytes (a schema of ragged fields only, which the buffers do not hold) never exceed ``max_bytes``.

        Raises:
            ConfigurationError: ``max_bytes`` or ``item_bytes`` is negative or not a number (``item_bytes`` also when
                infinite), or ``batch`` is not an int >= 0 (nothing changed).
        """
        if not (is_real(item_bytes) and math.isfinite(item_bytes) and item_bytes >= 0):
            raise ConfigurationError(f"item_bytes must be a number >= 0 (the bytes of one item's fixed fields), "
                                     f"got {item_bytes!r}.")
        if not (is_real(max_bytes) and max_bytes >= 0):
            raise ConfigurationError(f"max_bytes must be a number >= 0 (the bytes the idle buffers may keep), got "
                                     f"{max_bytes!r}.")
        if not _count(batch, 0):
            raise ConfigurationError(f"batch must be an int >= 0 (items per delivered batch), got {batch!r}.")
        if not self._serves:
            return  # (no buffers yet)
        self._enter("trim_buffers()")
        try:
            rows = self._chunk * batch
            limit = (max_bytes / item_bytes if item_bytes else math.inf) - (rows if room_for_a_chunk else 0)
            self._ring.trim(limit, keep_rows=rows, delivered=self._delivered)
        finally:
            self._leave()

    def release_buffers(self) -> None:
        """Let go of every idle delivery buffer (e.g. while this scheduler waits unused; delivered batches stay
        valid, and the next fills allocate afresh)."""
        if not self._serves:
            return  # (no buffers yet)
        self._enter("release_buffers()")
        try:
            self._ring.trim(0, keep_rows=0, delivered=self._delivered)  # (room for no rows: every idle one goes)
        finally:
            self._leave()

    def retune(self, *, g_ing: float | None = None, g_del: float | None = None) -> None:
        """Change the granularities from the next ingestion write / delivery chunk on.

        Off-policy ``g_del`` (batches per call) and either kind's ``g_ing`` may change; the
        semantics' bounds are checked as in the constructor. Prepared batches stay valid.
        Both values are checked before either changes: a refused call changes nothing. With background
        ingestion, handed-over batches that make complete groups at a smaller ``g_ing`` are stored now,
        not left waiting for the next ``ingest`` (in the caller's mode, that ``ingest`` or a ``flush``
        stores them, as it stores every group).

        Raises:
            ConfigurationError: a value outside the safe range, or this scheduler serves no buffer yet (the range
                depends on its kind: pass the granularities to the constructor instead).
        """
        if not self._serves:
            raise unattached(self, "retune()")
        if g_ing is not None:
            if self.on_policy:
                ok = is_real(g_ing) and 0 < g_ing <= 1
            else:
                ok = _whole(g_ing) and g_ing >= 1
            if not ok:
                raise ConfigurationError(f"g_ing={g_ing} is outside the safe range for this buffer.")
        new_g_del = g_del is not None and g_del != self.g_del
        if g_del is not None and new_g_del and (self.on_policy or not _whole(g_del) or g_del < 1):
            raise ConfigurationError(f"g_del={g_del} is outside the safe range for this buffer (on-policy it "
                                     f"is fixed at 1/M).")
        if new_g_del:
            self._enter("retune()")  # (before anything changes: it may refuse)
        try:
            if g_ing is not None:
                self.g_ing = _number(g_ing) if self.on_policy else int(g_ing)
                self._ingestion.regroup(self.g_ing)  # (a smaller g_ing may complete queued groups: see regroup)
            if new_g_del:
                assert g_del is not None
                self.g_del = self._g_del_arg = int(g_del)
                chunk = self.g_del
                if self._max_prio_stale is None:
                    self.max_priority_staleness = chunk
                if self.prioritized:
                    chunk = max(1, min(chunk, self.max_priority_staleness + 1))
                self._chunk = chunk
        finally:
            if new_g_del:
                self._leave()

    @property
    def prepared(self) -> int:
        """Batches prepared and not yet delivered (a job in flight not counted; 0 before it serves a buffer)."""
        return len(self._ready) if self._serves else 0

    @property
    def priority_staleness(self) -> int:
        """How many ``update_priorities`` calls a delivered batch's draw may precede (0: none).

        Raises:
            ConfigurationError: this scheduler serves no buffer yet (the bound depends on its kind).
        """
        if not self._serves:
            raise unattached(self, "priority_staleness")
        if not self.prioritized:
            return 0
        return self.max_priority_staleness if self.overlap else self._chunk - 1

    def __repr__(self) -> str:
        extra = "" if self.background_ingest == self.overlap else f", background_ingest={self.background_ingest}"
        return f"Overlapped(g_ing={self.g_ing}, g_del={self.g_del}, overlap={self.overlap}{extra})"

    # -- ingestion -------------------------------------------------------------------------
    def ingest(self, batch: ExperienceBatch, *, version: int | None,
               priorities: torch.Tensor | None) -> torch.Tensor | None:
        if self.copy_on_ingest:
            batch = batch.clone()
            priorities = None if priorities is None else torch.as_tensor(priorities).clone()
        self._ingestion.handover(Handover(batch, version, priorities))
        return None

    def flush(self) -> None:
        if self._serves:  # (else nothing was handed over)
            self._ingestion.flush()

    def drain(self) -> bool:
        """Store everything handed over unless storing fails; then keep it queued (and the failure for the
        producer's next call) and return False. See :meth:`Ingestion.drain`."""
        if not self._serves:
            return True  # (nothing was handed over)
        if self._job is not None and not self._job_entered and not self._job.done() and self.edp.holds_lock():
            return False  # (the prefetch job waits for the lock this thread holds: storing would wait forever too)
        return self._ingestion.drain()

    def pending(self) -> list[Handover]:
        """Handed-over batches not in storage yet, in order (after a failed ``close``: what was not stored).

        Read under the buffer's lock (``edp.read_locked``) it agrees exactly with the storage: a batch being
        stored counts either here (its write has not stored it yet) or in the storage, never in both.
        Empty before this scheduler serves a buffer.
        """
        return self._ingestion.pending() if self._serves else []

    # -- delivery --------------------------------------------------------------------------
    def deliver(self, n: int | None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        if not self._ready and len(self.edp.storage) == 0 and self._ingestion.waiting:
            self._ingestion.flush()  # nothing stored yet: handed-over data must not stay invisible
        if not self._mu.acquire(blocking=False):  # (the common case inline: a delivery is on the critical path)
            self._enter("This delivery")
        try:
            if self._ring.cuda:
                self._ring.call_started(self._delivered)
            if self.on_policy:
                return self._deliver_on_policy(n, kwargs)
            return self._deliver_replay(n, kwargs)
        finally:
            self._leave()

    def _enter(self, call: str) -> None:
        """Take ``_mu`` (deliveries and what changes prepared batches hold it), waiting for another thread that holds
        it; refuse ``call``, changing nothing, only when waiting could last forever.

        That is the case on the prefetch worker (a callback inside a prefetch job) while the thread holding ``_mu``
        waits for a prefetch job, which cannot end before this call returns; and when this thread holds the buffer's
        lock (inside ``read_locked()``, or a callback the buffer runs under it) and the thread holding ``_mu`` waits
        for that lock, directly or through a prefetch job that has not taken it yet (``_mu`` is taken before the
        buffer's lock everywhere else). A thread holding ``_mu`` marks such waits (:meth:`_wanting_buffer_lock`,
        ``_awaited``) before it starts them, and a wait that has begun lasts while this thread holds the lock. So
        the outcome does not depend on timing: a delivery that does not need the buffer's lock any more (e.g.
        handing out a prepared batch) is waited for, and this call goes on after it; one that needs it gets the lock
        once this thread lets go of it, and this call is refused.
        """
        if self._mu.acquire(blocking=False):  # (free now: a caller may have found it held a moment ago)
            return
        pool = self._pool
        on_pool = pool is not None and pool.on_thread
        if not on_pool and not self.edp.holds_lock():
            self._mu.acquire()
            return
        # (re-checked as the holder goes on: it marks a wait for the buffer's lock only while it holds _mu)
        while not self._mu.acquire(timeout=_RECHECK_S):
            if on_pool and self._holder_awaits_job():
                # a callback inside the prefetch job: the holder waits for that job (or one queued behind it)
                self._refuse_on_prefetch_worker(call)
            if (not on_pool or self.edp.holds_lock()) and self._holder_wants_buffer_lock():
                raise wait_refused(call, "close() running on another thread (it stops the prefetch worker)"
                                   if self._closed else "delivery running on another thread")

    def _holder_awaits_job(self) -> bool:
        """Whether the thread holding ``_mu`` waits for a prefetch job that has not ended (see :meth:`_await_job`;
        ``close`` marks a cancelled job it waits for likewise)."""
        job = self._awaited
        return job is not None and not job.done()

    def _holder_wants_buffer_lock(self) -> bool:
        """Whether the thread holding ``_mu`` waits for the buffer's lock, or for a job that has yet to take it."""
        job = self._awaited
        return self._lock_wait.waiter is not None or (job is not None and not self._job_entered and not job.done())

    def _wanting_buffer_lock(self) -> _LockWait:
        """Around a call that takes the buffer's lock while this thread holds ``_mu``: this thread waits for that
        lock until the call runs :meth:`_has_buffer_lock` under it (see :meth:`_enter`)."""
        return self._lock_wait

    def _has_buffer_lock(self) -> bool:
        """Run under the buffer's lock (a ``when`` or ``out`` callback of the buffer's primitives): the calling
        thread no longer waits for it. Returns True (as a ``when`` that lets the call go on)."""
        lw = self._lock_wait
        if lw.waiter == threading.get_ident():
            lw.waiter = None
        return True

    def _release(self, sel: Selection) -> None:
        """``edp.release_now(sel)``, marked as a wait for the buffer's lock (see :meth:`_enter`)."""
        with self._wanting_buffer_lock():
            self.edp.release_now(sel, when=self._has_buffer_lock)

    def _deliver_replay(self, n: int | None, kwargs: dict[str, Any]) -> tuple[ExperienceBatch, SampleInfo]:
        beta = kwargs.pop("beta", None) if self.prioritized else None
        if beta is not None:  # checked before anything is handed over
            PrioritizedSampler.check_beta(beta)
        if type(n) is not int and not is_int(n):
            # not a key to compare: the semantics refuse it
            with self._wanting_buffer_lock():
                self.edp.select_now([n], peek=True, when=self._has_buffer_lock, **kwargs)
        key: _Key = (n, tuple(sorted(kwargs.items())) if kwargs else ())
        ready = self._ready
        if not ready or ready[0].key != key or self._too_stale(ready[0]):
            prepared_for = ready[0].key if ready else self._job_key if self._job is not None else key
            if prepared_for != key:
                # another request discards what was prepared: the semantics check it first (a peek, which
                # changes nothing), so that a request they refuse leaves the prepared batches as they are
                with self._wanting_buffer_lock():
                    self.edp.select_now([n], peek=True, when=self._has_buffer_lock, **kwargs)
            # the prepared batch at the head is not usable (or there is none): wait for the job in flight,
            # then drop what does not fit this call. A usable head is older than the job's batches, so
            # taking it without waiting keeps the order of draws.
            self._await_job(cancel=True)
            first = ready[0].selection.drawn_from if ready else None
            while ready and (ready[0].key != key or self._too_stale(ready[0])):
                self._discard(ready.popleft())
            if first is not None and not ready:
                # every prepared draw was dropped: given back (as by invalidate), so this call and the next draw
                # what a synchronous buffer would, instead of skipping the dropped draws
                self._rewind(first)
        if ready:
            p = ready.popleft()
            self.prefetch_hits += 1
        else:
            # a single batch drawn for this call is weighted with its beta, exactly as a synchronous delivery
            exact = [beta] if self.prioritized and self._chunk == 1 else None
            with self._wanting_buffer_lock():
                chunk = self._prepare(key, self._ring.acquire(self._delivered, inside_call=True), exact)
            p = chunk[0]
            self._ready.extend(chunk[1:])
            self.prefetch_misses += 1
        self._handover(p)
        info = self._reweight(p.info, beta) if p.reweigh else p.info
        self._start_prefetch(key)
        return p.batch, info

    def _deliver_on_policy(self, n: int | None, kwargs: dict[str, Any]) -> tuple[ExperienceBatch, SampleInfo]:
        self._await_job(cancel=True)
        pred = self._ready.popleft() if self._ready else None
        try:
            with self._wanting_buffer_lock():  # (the semantics refuse an n or an option, as a synchronous delivery)
                sels = self.edp.select_now([n], when=self._has_buffer_lock, **kwargs)
        except BaseException:
            if pred is not None:  # state unchanged: the prediction may still come true later
                self._ready.appendleft(pred)
            raise
        assert sels is not None
        sel = sels[0]
        if pred is not None and torch.equal(pred.info.handles, sel.info.handles):
            p = _Prepared(pred.key, pred.batch, sel.info, sel, pred.buf, 0, pred.event, True)
            self.prefetch_hits += 1
        else:
            if pred is not None:
                self._discard(pred)
            ring = self._ring
            buf = ring.acquire(self._delivered, inside_call=True)
            try:
                with ring.filling(buf) as fill:
                    out, swapped = self._target(ring, buf, fill)
                    with self._wanting_buffer_lock(), self._gathering(ring, fill):
                        batch = self.edp.gather_now([sel], out)
                    (batch,) = self._to_device(ring, buf, [batch], swapped)
                    event = ring.filled(buf)
            except BaseException:  # a read that failed consumed the selection: hand it over, or on-policy storage
                self._release(sel)  # under it (and every later rollout's) would never be freed
                ring.free(buf)  # (it holds nothing prepared: kept busy, every failed read would add a buffer)
                raise
            p = _Prepared((None, ()), batch, sel.info, sel, buf, 0, event, True)
            self.prefetch_misses += 1
        self._release(sel)
        self._handover(p)
        self._last = sel.info
        if not sel.info.last:
            self._start_prefetch((None, ()))
        return p.batch, sel.info

    def _handover(self, p: _Prepared) -> None:
        self._ring.handover(p.batch, p.event)
        self._ring.delivered(p.buf, self._delivered)
        if p.frees_buffer:
            self._ring.free(p.buf)
        self._delivered += 1

    # -- preparing chunks -------------------------------------------------------------------
    def _prepare(self, key: _Key, buf: int, call_beta: list[float | None] | None = None,
                 ticket: _Ticket | None = None) -> list[_Prepared]:
        """Select and gather one chunk into buffer ``buf`` (in the caller or in the worker).

        Prioritized draws are weighted with beta = 1 (see :meth:`_reweight`), or with ``call_beta[0]``
        when given (a batch drawn for the delivery call that hands it out). A job (``ticket`` given) that a
        delivery cancelled before it took the buffer's lock draws nothing and prepares nothing, and so does a job
        that starts after the buffer was freed (the scheduler holds it weakly: see :attr:`Scheduler.edp`).
        """
        ring = self._ring
        edp = getattr(self, "edp", None)  # (held until the chunk is prepared)
        if edp is None:
            ring.free(buf)
            return []
        try:
            n, kw = key
            epoch = [0]
            with ring.filling(buf) as fill:
                target, swapped = self._target(ring, buf, fill)
                if self.on_policy:
                    with self._gathering(ring, fill):
                        res = self.edp.prepare_now([None], target, peek=True,
                                                   when=lambda: self._entered_same_rollout(ticket))
                else:
                    draw_beta = 1.0 if call_beta is None else call_beta[0]
                    extra: dict[str, Any] = {"beta": draw_beta} if self.prioritized else {}

                    def stamp() -> bool:
                        if ticket is not None and ticket.cancelled:
                            return False  # (a delivery prepared this chunk in its call instead)
                        epoch[0] = self._prio_epoch
                        self._job_entered = True
                        if ticket is not None:
                            ticket.seen = self._ingestion.stored
                            ticket.drawn_from = self.edp.semantics.draw_state()
                        return self._has_buffer_lock()

                    try:
                        with self._gathering(ring, fill):
                            res = self.edp.prepare_now([n] * self._chunk, target, when=stamp, **dict(kw), **extra)
                    except EmptyBufferError:
                        if ticket is not None:  # nothing to draw yet: a later write re-arms the prefetch (_rearm)
                            ticket.starved = True
                        raise
                if res is None:
                    ring.free(buf)
                    return []
                batch, sels = res
                parts, row = [], 0
                for s in sels:
                    k = int(s.slots.shape[0])
                    parts.append(batch.select(slice(row, row + k)))
                    row += k
                parts = self._to_device(ring, buf, parts, swapped)
                event = ring.filled(buf)
        except BaseException:
            ring.free(buf)
            raise
        out = [_Prepared(key, b, s.info, s, buf, epoch[0], event, reweigh=call_beta is None)
               for b, s in zip(parts, sels, strict=True)]
        out[-1].frees_buffer = True
        return out

    def _target(self, ring: ChunkRing, buf: int, fill: Fill | None
                ) -> tuple[Callable[[int], dict[str, torch.Tensor] | None], list[bool]]:
        """Buffer ``buf`` as a gather's output, checked where the gather runs (under the buffer's lock).

        A migration swaps the storage, then tells the scheduler (which rebuilds its buffers for the new
        schema or device); a gather in between gets ``None`` (fresh memory from the storage) instead of
        buffers sized and placed for the old storage, and the flag returned is set. Either way the gather's
        stream is first ordered after the writes stored so far (``fill``: see :meth:`ChunkRing.before_gather`).
        """
        host = ring.host(buf)
        edp = self.edp
        swapped = [False]

        def get(rows: int) -> dict[str, torch.Tensor] | None:
            self._has_buffer_lock()
            ring.before_gather(fill, storage_devices(edp.storage))
            if ((ring.schema is not edp.schema and ring.schema != edp.schema)
                    or ring.storage_device != edp.storage.device):
                swapped[0] = True
                return None
            return host(rows)
        return get, swapped

    @contextmanager
    def _gathering(self, ring: ChunkRing, fill: Fill | None) -> Iterator[None]:
        """Hold the buffer's lock around a fill's select-and-gather (the body), and run
        :meth:`ChunkRing.after_gather` at its end in the same hold, so that a write stored after the gather is
        ordered after it on the GPU (see :mod:`conduit.scheduling.buffers`). The body takes the same lock again
        (it is re-entrant); the marks of waiting for it (``_job_entered``, :meth:`_has_buffer_lock`) are set in
        the body's callbacks under it, as before."""
        with self.edp.lock:
            try:
                yield
            finally:
                ring.after_gather(fill)

    def _to_device(self, ring: ChunkRing, buf: int, parts: list[ExperienceBatch],
                   swapped: list[bool]) -> list[ExperienceBatch]:
        """The gathered batches on the learner's device (not through ``ring`` when the gather bypassed it)."""
        if swapped[0]:
            return [b.to(self.edp.device) for b in parts]
        return ring.to_device(buf, parts)

    def _entered_same_rollout(self, ticket: _Ticket | None) -> bool:
        """:meth:`_same_rollout`, noting that the preparation holds the buffer's lock (see :meth:`_await_job`);
        False for a job cancelled before it took that lock."""
        if ticket is not None and ticket.cancelled:
            return False
        self._job_entered = True
        self._has_buffer_lock()
        return self._same_rollout()

    def _same_rollout(self) -> bool:
        """On-policy peek guard (under the buffer's lock): the rollout just delivered from goes on, fresh."""
        sem = self.edp.semantics
        last = self._last
        return (last is not None and not last.last and last.version is not None and isinstance(sem, OnPolicy)
                and sem.policy_version - last.version <= sem.max_staleness)

    def _start_prefetch(self, key: _Key) -> None:
        if not self.overlap or self._closed:
            return
        job = self._job
        if job is not None:
            if not job.done():
                return
            self._await_job()  # collect the finished job's batches (behind the ones already ready)
        ahead = len(self._ready)
        if ahead >= self._chunk:
            return
        if self.prioritized and ahead + self._chunk > self.max_priority_staleness:
            return
        buf = self._ring.acquire(self._delivered, inside_call=False)
        assert self._pool is not None
        self._job_entered = False
        self._ticket = ticket = _Ticket()
        self._job = self._pool.submit(self._prepare, key, buf, None, ticket)
        self._job_key = key

    def _rearm(self) -> None:
        """Have a prefetch that found nothing to deliver tried again once a write stored more.

        A job whose draw found nothing (:class:`~conduit.errors.EmptyBufferError`: a sampler that waits for new
        items, such as a queue, while the items it needs are handed over but not stored yet) would otherwise leave
        the next delivery to draw in its call. The ingestion calls this after every write that stored a group (on
        the thread that stored it), and a call that held ``_mu`` calls it as it lets go (:meth:`_leave`). When the
        job in flight drew before a write stored more and found nothing (or may have: it has not ended yet), a
        check is queued on the prefetch worker, behind that job (:meth:`_rearm_now`). It never blocks.
        """
        t = self._ticket
        if t.seen is None or t.rearming or t.cancelled or self._closed or self._ingestion.stored <= t.seen:
            return  # (the common case, on every write: the job has not drawn, or nothing was stored since it did)
        job, pool = self._job, self._pool
        if job is None or pool is None or (job.done() and not t.starved):
            return  # collected already (a delivery took over), or its draw found something
        t.rearming = True
        try:
            pool.submit(self._rearm_now, t)
        except ConfigurationError:  # the worker was stopped (close() on another thread): nothing more to prefetch
            t.rearming = False

    def _rearm_now(self, t: _Ticket) -> None:
        """On the prefetch worker, after the job of ticket ``t`` ended: when that job found nothing to deliver and
        is still the one in flight, start the next prefetch (:meth:`_start_prefetch`, with its bounds: the chunks
        ahead, the priority staleness). It never waits for ``_mu``: a call holding it asks again as it lets go
        (:meth:`_leave`), and a delivery starts the next prefetch itself."""
        t.rearming = False
        if not t.starved or self._closed or not self._mu.acquire(blocking=False):
            return
        try:
            key = self._job_key
            if self._ticket is t and self._job is not None and key is not None and not self._closed:
                self._start_prefetch(key)
        except Exception:  # noqa: BLE001 - prefetch is speculative: the next delivery meets the failure in its call
            pass
        finally:
            self._mu.release()

    def _leave(self) -> None:
        """Let go of ``_mu`` (taken by a delivery or another call that changes prepared batches), then ask again for
        a re-arm the prefetch worker could not start while it was held (see :meth:`_rearm`)."""
        self._mu.release()
        if self._ticket.starved:
            self._rearm()

    def _await_job(self, *, cancel: bool = False) -> None:
        """Collect the job in flight's batches; a failed job prepared nothing and raises nothing here.

        Prefetch is speculative: whatever made it fail (nothing to draw yet, a storage error) is
        met again by the delivery call that prepares in the caller, and raised there, to the
        call it concerns, instead of from a later call (or ``close``/``invalidate``) that has
        its own work done. A job that failed after it drew (a read error) gives its draws back
        (:meth:`_rewind`), so that the call draws what a synchronous delivery would, instead of
        skipping them. A job that found nothing to draw is tried again when a write stores
        more before that delivery (see :meth:`_rearm`).

        When this thread holds the buffer's lock (inside ``read_locked()``, or a callback the buffer runs under
        it) and the job has not taken that lock, the job cannot go on, and has drawn nothing: a delivery
        (``cancel``) cancels it (it will prepare nothing) and prepares in the call what the job would have, the
        next draws in order, as a synchronous delivery does; any other call is refused (waiting would last
        forever). Whether the job took the lock first is worker timing; the outcome for a delivery is the same.
        """
        job = self._job
        if job is None:
            return
        if not job.done():
            self._refuse_on_prefetch_worker("This call (a delivery that needs the prepared batches, state_dict(), "
                                            "load_state_dict(), migrate() or close())")
        if not self._job_entered and not job.done() and self.edp.holds_lock():
            # the job waits for the lock this thread holds (read with it held: it cannot enter meanwhile)
            if cancel:
                self._ticket.cancelled = True  # (its buffer is freed by the job itself, when it gets the lock)
                self._job, self._cancelled = None, job
                return
            raise wait_refused("This call (state_dict(), load_state_dict() or close())",
                               "prefetch worker (it prepares the next batch)")
        self._awaited = job  # (a job that has not taken the buffer's lock yet: see _enter)
        try:
            # the job stays in flight until it has ended: a wait interrupted here (Ctrl-C's KeyboardInterrupt) leaves
            # its batches to the next call, instead of dropping draws it made (a queue's items would be skipped)
            job.wait()
            self._job = None
            self._ready.extend(job.result())
        except Exception:  # noqa: BLE001 - see the docstring: the caller's own preparation reports it
            del job  # (the job holds the error, whose traceback holds this frame: no cycle through the job)
            drawn, self._ticket.drawn_from = self._ticket.drawn_from, None
            if drawn is not None and not self.edp.closed:  # (its draws come after those of the batches prepared)
                self._rewind(drawn)
        finally:
            self._awaited = None

    def _refuse_on_prefetch_worker(self, call: str) -> None:
        """:class:`ConfigurationError` for ``call``, which waits for the prefetch job, when made on the prefetch
        worker itself (a callback inside the job's select-and-gather, e.g. a storage tier's or a sampler's hook): the
        job cannot end before the call returns, so it would wait forever. Nothing was changed."""
        pool = self._pool
        if pool is not None and pool.on_thread:
            raise ConfigurationError(f"{call} was called from a callback inside a read of this buffer on its "
                                     f"prefetch worker (it prepares the next batch), and would wait for that read, "
                                     f"which cannot finish before the callback returns: it would wait forever. "
                                     f"Nothing was changed; call it after the read returns (from another thread).")

    def _too_stale(self, p: _Prepared) -> bool:
        """A prepared draw missed more priority updates than :attr:`priority_staleness` declares now (after a
        ``retune`` to a smaller ``g_del``, batches drawn for the larger chunk may)."""
        return self.prioritized and self._prio_epoch - p.prio_epoch > self.priority_staleness

    def _discard(self, p: _Prepared) -> None:
        self.discarded += 1
        if p.frees_buffer:
            self._ring.free(p.buf)

    def _rewind(self, drawn: Any) -> None:
        """Give back the draws made since ``drawn`` (a prepared batch's ``Selection.drawn_from``; none of them is
        kept prepared): the sampler's RNG goes back to before them (:meth:`Semantics.rewind_draws`)."""
        sem = self.edp.semantics

        def rewind() -> None:
            self._has_buffer_lock()
            sem.rewind_draws(drawn)
        with self._wanting_buffer_lock():
            self.edp.read_locked(rewind)

    def _discard_all(self) -> None:
        self._await_job()
        while self._ready:
            self._discard(self._ready.popleft())

    def _reweight(self, info: SampleInfo, beta: float | None) -> SampleInfo:
        """Prioritized draws are prepared with beta = 1; weights for another beta are a power of those."""
        if not self.prioritized or info.weights is None:
            return info
        sem = self.edp.semantics
        assert isinstance(sem, Replay)
        b = float(getattr(sem.sampler, "beta", 1.0)) if beta is None else float(beta)
        if b == 1.0:
            return info
        return SampleInfo(handles=info.handles, weights=info.weights.pow(b), probabilities=info.probabilities)

    # -- invalidation and shutdown ---------------------------------------------------------
    def invalidate(self, reason: str = "contents") -> None:
        """Priority updates age prepared draws; a policy change is checked at delivery; else drop all.

        Dropped draws are given back: the sampler's RNG is rewound to before the first of them (see
        :meth:`Semantics.draw_state`), so a checkpoint (``"checkpoint"``: ``state_dict`` is about to read
        the semantics), a migration or a scheduler switch (``"contents"``) leaves the buffer drawing
        next exactly what a synchronous one would, instead of skipping the dropped draws.
        """
        if not self._serves:
            return  # (nothing prepared)
        if reason == "priorities":
            with self._prio_lock:
                self._prio_epoch += 1
            return
        if reason == "policy":
            return  # on-policy predictions are confirmed against the real selection at delivery
        self._enter("This call (state_dict(), load_state_dict(), migrate() or close())")
        try:
            self._await_job()
            drawn = self._ready[0].selection.drawn_from if self._ready else None
            self._discard_all()
            if drawn is not None:  # the draws prepared but not delivered are made again next (see above)
                self._rewind(drawn)
            edp = self.edp
            ring = self._ring
            if (ring.schema != edp.schema or ring.storage_device != edp.storage.device
                    or ring.device != edp.device):  # migrated: new tier or a grown schema
                self._ring = ChunkRing(edp.schema, edp.storage.device, edp.device, count=len(ring.slots),
                                       output_depth=self.output_depth)
        finally:
            self._mu.release()

    def close(self) -> None:
        """Stop prefetching, then store everything handed over (or raise, keeping it in ``pending()``).

        Calling it again after it raised retries storing what is left (and raises again while that fails).
        Called from a callback on the ingestion worker (inside a background write) it cannot wait for that
        write: it returns at once and the worker stores the rest of the queue, then stops (see
        :meth:`Ingestion.close`); a later ``close`` waits for that and raises what could not be stored.

        Stopping the prefetch worker waits for a job a delivery inside ``read_locked()`` cancelled, which ends once it
        has the buffer's lock: a delivery (or other call that waits for this scheduler) made meanwhile from inside
        ``read_locked()`` on another thread is refused (:func:`~conduit.scheduling.base.wait_refused`, nothing
        changed), as it is while a delivery waits for that lock, instead of waiting forever.

        Called from a callback on the prefetch worker (inside the prefetch job's read) it is refused
        (:class:`~conduit.errors.ConfigurationError`, nothing changed): stopping that worker waits for the job, as
        does any call that needs the job's batches (a delivery, ``state_dict``, ``migrate``).

        A close interrupted while it stopped the prefetch (Ctrl-C's ``KeyboardInterrupt``) is finished by the next
        one. Before this scheduler serves a buffer there is nothing to close: it returns at once.
        """
        if not self._serves:
            return
        on_worker = self._ingestion.on_worker
        if not on_worker:  # refused before anything changes (not once the prefetch stopped)
            self._refuse_on_prefetch_worker("close()")  # (stopping the prefetch worker waits for the job it runs)
            self._ingestion.refuse_wait("close()")
        if self._closed and (on_worker or self._closer is not None or self._prefetch_stopped):
            if self._closer is not None and not on_worker:
                self._closer.join()  # (a close on the ingestion worker stopped the prefetch on its own thread)
            self._ingestion.close()  # nothing left after a close that returned: then this returns at once
            return
        # (the first close, or one after a close interrupted while it stopped the prefetch: this one finishes that)
        if not on_worker:  # (refused before anything changes when waiting for a delivery could last forever)
            self._enter("close()")
            cancelled = self._cancelled
            if cancelled is not None and not cancelled.done() and self.edp.holds_lock():
                # stopping the worker waits for a job a delivery cancelled here: it ends once it has the lock
                self._mu.release()
                raise wait_refused("close()", "prefetch worker (it ends a cancelled job)")
        try:
            self._closed = True
            _OPEN.discard(self)
            if on_worker:
                # a callback inside a background write, which holds the buffer's lock: a delivery (holding _mu) or
                # the prefetch job may be waiting for that lock, so stopping the prefetch waits on its own thread
                # (a later close() joins it); the ingestion worker stores the rest of its queue, then stops
                self._closer = threading.Thread(target=self._stop_prefetch, args=(self._mu, self._pool),
                                                name="conduit-close", daemon=True)
                self._closer.start()
            else:
                # stopping the worker waits for a job a delivery cancelled, which ends only once it has the buffer's
                # lock: marked as a wait for that lock (as a job awaited is), so that a call holding the lock that
                # meets _mu here is refused instead of waiting forever (see _enter)
                self._awaited = cancelled
                self._stop_prefetch(self._mu, self._pool)
        finally:
            if not on_worker:
                self._awaited = None
                self._mu.release()
        self._ingestion.close()

    def _stop_prefetch(self, mu: Any, pool: Worker | None) -> None:
        """Drop what was prepared and stop the prefetch worker (``mu`` and ``pool``: the closed buffer's)."""
        with mu:  # (a delivery from another thread runs wholly before or after: it indexes the slots)
            if self._mu is mu:  # (else a callback served a new buffer before this ran: nothing here is its)
                self._discard_all()
                self._ring.slots.clear()  # delivered batches the caller still holds keep their own memory alive
        if pool is not None:
            pool.shutdown()
        if self._mu is mu:
            self._prefetch_stopped = True


def _abandon(ingestion: Ingestion, pool: Worker | None) -> None:
    """Stop a garbage-collected buffer's worker threads (what they had queued has nowhere to go)."""
    ingestion.abandon()
    if pool is not None:
        pool.stop()


#: schedulers to drain at interpreter exit (daemon workers would otherwise die with data queued)
_OPEN: weakref.WeakSet[Overlapped] = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for s in list(_OPEN):
        try:
            s.close()
        except Exception:  # noqa: BLE001 - nothing else can be done at exit
            pass
