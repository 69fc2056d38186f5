"""What sits between SRL's buffer calls and the Experience Data Plane.

The EDP runs with Conduit's :class:`~conduit.Overlapped` scheduler. By default (``overlap=False``)
``put`` stores a validated sample ``g_ing`` hand-overs at a time before it returns and each delivery
gathers in the caller; with ``overlap=True`` ``put`` hands the sample over and returns, a core
worker stores hand-overs, and each delivery gathers the next ``g_del`` batches ahead (see
:mod:`conduit.scheduling.overlapped` for what a prepared batch may miss). What is SRL-specific stays here:

* **put**: the sample is checked against the first sample's layout and split into items in the
  caller, so a bad sample fails at its ``put`` and nothing of it is stored. On-policy, the
  producing version is read from the sample (``version_field``, the smallest non-negative value);
  a sample older than the newest rollout (open or sealed) is dropped (counted) or refused (``on_stale="raise"``).
* **assembly**: Conduit delivers items ``[B, T, ...]``; SRL's trainers want a record with
  ``[T, B, ...]`` fields that they may keep. An *assembler* thread delivers and transposes the
  next ``prefetch`` entries into fresh (page-locked where CUDA exists) arrays while the trainer
  steps, so ``get`` usually only pops one. It starts after the first ``get`` and refills after
  each; it never prepares past the end of an on-policy rollout. A queue selection (``get``'s own or
  the assembler's) sees every put that returned before it: puts still being stored that would evict
  what it picks are stored first.
* What an entry prepared ahead may miss, and when it is discarded at ``get``: a replay draw is
  discarded when ``get`` asks another batch size or a checkpoint is taken (draws are not data);
  a prioritized one after more than ``prefetch`` priority updates; an on-policy minibatch whose
  version a later ``set_policy_version`` made too stale is dropped (counted), as Conduit drops
  the rest of that rollout, and its selection's permutation draws are given back
  (:meth:`conduit.OnPolicy.take_back_draws`, before the next selection): the rollouts ordered after it
  are shuffled as without prefetch. The assembler never selects ahead from a rollout that went stale
  (``OnPolicy.defer_stale``: ``get()`` drops it, as without prefetch). So the same puts, version
  changes and gets deliver the same on-policy minibatches in the same order whatever ``prefetch`` and
  the assembler's timing. Queue batches and on-policy minibatches are never discarded otherwise
  (they are checkpointed with the buffer). An entry ``get`` delivers for itself (none was ready) is
  handed out as delivered (on-policy staleness as of that delivery): priority updates or version moves
  that other threads make while it is assembled are concurrent with the ``get``, and discarding it for
  them would let a thread that keeps making them hold ``get`` in a loop of redraws.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import torch
from conduit import (
    CapacityError,
    ConduitError,
    ConfigurationError,
    EmptyBufferError,
    ExperienceBatch,
    ExperienceDataPlane,
    OnPolicy,
    Overlapped,
    PrioritizedSampler,
    PriorityError,
    Replay,
    SchemaError,
    StaleExperienceError,
    UniformSampler,
)
from conduit.semantics import SampleInfo
from conduit.semantics.onpolicy import check_version

from conduit_srl.config import BufferConfig
from conduit_srl.errors import BufferFullError
from conduit_srl.fifo import FifoSampler
from conduit_srl.records import RecordLayout

__all__ = ["Assembler", "ReplayEntry", "Stats"]

T = TypeVar("T")


@dataclass
class ReplayEntry:
    """One delivery, with the attributes SRL's trainer reads.

    Attributes:
        sample: a record of the put samples' class, every field ``[T, B, ...]`` host NumPy
            (page-locked when CUDA is available); it owns its memory.
        reuses: how many times these samples were delivered before (mean over the batch).
        sampling_indices: the samples' Conduit handles (int64); give them to ``update_priorities``.
        reuses_left: deliveries left for this batch (queue, on-policy); -1 for replay.
        receive_time: when the entry was assembled (``time.time()``).
        weights: importance weights (prioritized; also ``sample.metadata["sampling_weight"]``).
        info: Conduit's delivery metadata (version, epoch, minibatch, staleness, last, ...).
    """

    sample: Any
    reuses: float
    sampling_indices: np.ndarray
    reuses_left: int
    receive_time: float
    weights: np.ndarray | None = None
    info: SampleInfo | None = None
    #: priority updates seen when it left the EDP (prioritized)
    _stamp: int = field(default=0, repr=False)
    #: on-policy: the samples of the rollout this entry finishes (the plane released their storage when it
    #: delivered the entry; until ``get()`` hands it out they count in ``qsize()``)
    _released: int = field(default=0, repr=False)
    #: on-policy: ``OnPolicy.draw_mark()`` right before this entry's selection (its draws are given back if it is
    #: discarded as stale); None in an entry of an older checkpoint
    _mark: Any = field(default=None, repr=False)


@dataclass
class Stats:
    """Counters of one buffer (``ConduitBuffer.stats()`` adds the semantics' own and the waiting counts).

    Queue and on-policy: each sample in ``samples_put`` is in exactly one of ``samples_delivered``,
    ``late_dropped``, ``stale_dropped``, ``rollout_dropped``, the queue's ``queue_dropped``, or waiting.
    """

    #: samples taken by puts: stored (or on their way to storage), or dropped as late
    samples_put: int = 0
    entries_delivered: int = 0
    #: samples handed out by ``get()`` at least once (counted at their first delivery; replay: drawn at least once
    #: while stored)
    samples_delivered: int = 0
    #: on-policy samples older than the newest rollout (open or sealed), not stored (on_stale="drop")
    late_dropped: int = 0
    #: on-policy samples never handed out, in entries assembled ahead that a version change made too stale
    stale_dropped: int = 0
    #: on-policy samples never handed out (nor assembled ahead) of rollouts dropped as too stale
    rollout_dropped: int = 0
    #: replay entries assembled ahead and discarded (another batch size, priorities, checkpoint)
    redrawn: int = 0


def _semantics(cfg: BufferConfig) -> Any:
    if cfg.semantics == "queue":
        return Replay(FifoSampler(reuses=cfg.reuses), seed=cfg.seed)
    if cfg.semantics == "replay":
        return Replay(UniformSampler(), seed=cfg.seed)
    if cfg.semantics == "prioritized":
        return Replay(PrioritizedSampler(alpha=cfg.alpha, beta=cfg.beta), seed=cfg.seed)
    return OnPolicy(num_minibatches=cfg.num_minibatches, minibatch_size=cfg.minibatch_size,
                    num_epochs=cfg.num_epochs, max_staleness=cfg.max_staleness,
                    on_stale=cfg.on_stale, seed=cfg.seed)  # type: ignore[arg-type]


def _scheduler(cfg: BufferConfig) -> Overlapped:
    return Overlapped(g_ing=cfg.g_ing, g_del=cfg.g_del, overlap=cfg.overlap, queue_depth=cfg.queue_depth,
                      rollout_size=cfg.rollout_size, copy_on_ingest=cfg.copy_on_put)


class Assembler:
    """The state of one Conduit buffer and its assembler thread (see the module docstring)."""

    def __init__(self, cfg: BufferConfig) -> None:
        _semantics(cfg)  # its own arguments (minibatches, epochs, staleness, alpha, ...) are refused here, not at a put
        self.cfg = cfg
        self.layout: RecordLayout | None = None
        self.edp: ExperienceDataPlane | None = None
        self.stats = Stats()
        self.pin = bool(cfg.pin_memory if cfg.pin_memory is not None else torch.cuda.is_available())
        if self.pin and not torch.cuda.is_available():
            raise ConfigurationError("pin_memory=True needs CUDA; leave it None to pin only where CUDA exists.")
        self.prefetch = cfg.resolved_prefetch
        self._cv = threading.Condition()
        self._put_lock = threading.Lock()  # puts one at a time, in call order
        self._seal_lock = threading.Lock()  # plan + store of a put, seal, snapshot (never held while waiting)
        self._deliver_lock = threading.Lock()
        self._ready: deque[ReplayEntry] = deque()
        self._armed = False  # a get() happened: keep entries assembled ahead
        self._starved = False  # the assembler found nothing to deliver; a put wakes it
        self._kicks = 0
        self._closed = False
        self._fault: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._n = cfg.batch_size
        #: on-policy: the version of the newest rollout stored, open or sealed (older samples are late),
        #: and how many samples the open rollout holds (0 after a seal)
        self._open_version: int | None = None
        self._open_count = 0
        self._pending_version: int | None = None
        #: on-policy: a put stored a rollout's last samples but its seal failed; the next put or seal() seals it
        self._seal_owed = False
        self._rollout_open = False  # on-policy: the last delivered minibatch was not its rollout's last
        self._epoch_items = 0  # on-policy: samples of the current rollout's epoch the plane delivered so far
        #: on-policy: samples of the current rollout the plane delivered in its first epoch (handed out, assembled
        #: ahead, or dropped from there), and the plane's count of dropped rollout samples accounted for so far
        self._first_epoch_items = 0
        self._plane_dropped = 0
        self._prio_updates = 0
        self._discarded_seen = 0
        #: on-policy: the mark of the first entry assembled ahead and discarded as stale since the last selection, and
        #: how many were discarded (their draws are given back before the next selection: _take_back_draws)
        self._owed_draws: tuple[Any, int] | None = None
        #: on_full="keep": samples that did not fit, as checked item-major arrays and their count, in put order; stored
        #: (first, before any later put's samples) as deliveries free room
        self._held: deque[tuple[dict[str, np.ndarray], int]] = deque()
        self._held_samples = 0
        self._held_version: int | None = None  # the newest policy version among them (a later sample older is late)
        self._slot_handle: np.ndarray | None = None
        self._slot_uses: np.ndarray | None = None

    # ======================================================================================
    # SRL's calls
    # ======================================================================================
    def put(self, sample: Any, *, batched: bool) -> int:
        """Check ``sample`` and hand it to the EDP; returns the number of samples.

        Puts are stored in call order (``_put_lock``). Planning (versions, rollouts), storing and
        ``seal`` are atomic with each other (``_seal_lock``), but an on-policy put that waits for
        room releases ``_seal_lock`` while it waits and plans again afterwards: a ``seal()`` meanwhile
        seals what was stored before it, and the waiting put's samples go to the next rollout. A put
        that completes a rollout (``rollout_size``, or a newer version: the open rollout is sealed before
        anything of the newer version is stored) and starts another stores through the end of the
        completed one first when only that fits; the rest waits for its delivery to make room.
        With ``on_full="keep"`` nothing waits: what does not fit is kept and stored first later
        (:meth:`_store_or_keep`).
        """
        with self._put_lock:
            with self._cv:
                self._check_open()
                layout = self.layout
            fresh = layout is None  # the first sample fixes the layout only once it is accepted
            if layout is None:
                layout = RecordLayout(sample, batched=batched, drop_fields=self.cfg.drop_fields)
                self._check_version_field(layout, dtype=True)
            arrays, n = layout.split(sample, batched=batched)
            capacity = self.cfg.resolved_capacity
            if n > capacity:
                raise CapacityError(f"A put of {n} samples is larger than the capacity ({capacity}); split it "
                                    f"or raise capacity.")
            if self.cfg.on_full == "keep":
                return self._store_or_keep(arrays, n, layout, fresh)
            try:
                return self._store(arrays, n, layout, fresh)
            except BufferFullError as e:  # (on_full="raise") the buffer keeps nothing it refused: the error carries
                e.sample = sample  # the sample, since a caller such as SRL's native consume_to holds it nowhere else
                raise

    def _store(self, arrays: dict[str, np.ndarray], n: int, layout: RecordLayout, fresh: bool,
               on_taken: Callable[[int], None] | None = None) -> int:
        """Plan and store the ``n`` checked samples ``arrays`` of one put (the caller holds ``_put_lock``).

        ``on_taken(k)`` is called for each part of them taken (stored, or dropped as late), under ``_seal_lock``
        and ``_cv`` where ``samples_put`` counts them, so a snapshot sees each sample in exactly one place.
        """
        done = 0  # samples of this put handed over (on-policy: a put that ends a rollout may wait after it)
        try:
            while True:
                runs: list[tuple[int, int, int | None, bool]] | None = None
                with self._seal_lock:
                    with self._cv:
                        rest = arrays if done == 0 else {p: a[done:] for p, a in arrays.items()}
                        plan = self._plan(rest, n - done) if n else []
                        if fresh:
                            self._check_open()
                            self._start(layout)
                            fresh = False
                        if n == 0:
                            return 0
                        runs = self._runs_with_room(plan, stored_before=done)
                        if runs is not None:
                            before = (self._open_version, self._open_count, self.stats.late_dropped)
                            self._commit_plan(runs)
                    if runs is not None:
                        edp = self.edp
                        assert edp is not None
                        took = runs[-1][1]
                        taken = 0  # samples of these runs dealt with: handed over, or dropped as late
                        sealing = False
                        try:
                            self._pay_owed_seal()
                            for lo, hi, version, seal_after in runs:
                                if version != -1 and hi > lo:  # (an empty run only seals)
                                    whole = (lo, hi) == (0, n - done)
                                    part = rest if whole else {p: a[lo:hi] for p, a in rest.items()}
                                    edp.ingest(part, version=version)
                                taken = hi
                                if seal_after:
                                    sealing = True
                                    edp.seal()
                                    sealing = False
                        except BaseException as e:
                            with self._cv:  # the bookkeeping and counts of exactly the runs dealt with
                                self._recount(before, runs, taken)
                                self.stats.samples_put += taken
                                if on_taken is not None:
                                    on_taken(taken)
                                if sealing:  # (stored, but the rollout it completed is not sealed)
                                    self._seal_owed = True
                            err = self._told_stored(e, done + taken, n, unsealed=sealing)
                            if err is e:
                                raise
                            raise err from e
                        done += took
                        with self._cv:  # (under _seal_lock: a snapshot counts exactly the samples it holds)
                            self.stats.samples_put += took
                            if on_taken is not None:
                                on_taken(took)
                        if done == n:
                            break
                        continue  # the rest of the put starts the next rollout: it waits for room
                if self.cfg.never_waits and self._ingest_pending():  # (no room, and samples of this put
                    self._flush_storage()  # are still being stored: store them, which waits for no get(), then decide)
                    continue
                with self._cv:  # wait for room without _seal_lock, so seal() is never held up by this put
                    self._cv.wait(timeout=0.05)
        except BaseException as e:  # (a put that waited for room after storing a completed rollout)
            if not done or hasattr(e, "samples_stored"):
                raise
            err = self._told_stored(e, done, n, unsealed=False)
            if err is e:
                raise
            raise err from e
        with self._cv:
            if self._armed and self._starved and self._deliverable(extra=n):
                self._kick()
        return n

    # -- on_full="keep": samples that do not fit yet ------------------------------------------
    def _store_or_keep(self, arrays: dict[str, np.ndarray], n: int, layout: RecordLayout, fresh: bool) -> int:
        """Store a checked put, or keep what does not fit (the caller holds ``_put_lock``).

        Samples kept earlier are stored first; while some are still kept, this put's samples are kept
        behind them (after the checks its store would make), so the order of puts is the order of storage.
        """
        self._store_held(raise_errors=True)
        if self._held:
            if n == 0:
                return 0
            self._check_keepable(arrays, n)
            self._keep(arrays, n)
            return n
        try:
            return self._store(arrays, n, layout, fresh)
        except BufferFullError as e:
            k = getattr(e, "samples_stored", 0)
            self._keep({p: a[k:] for p, a in arrays.items()} if k else arrays, n - k)
            return n

    def _check_keepable(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """Refuse, as its store would, a put that is to be kept: versions that are not versions, or (on_stale="raise")
        samples older than the newest kept one (which is stored before them)."""
        if self.cfg.semantics != "on_policy":
            return
        versions = self._item_versions(arrays, n)
        if self.cfg.on_stale != "raise":
            return  # (late samples are dropped and counted when they are stored, as any put's)
        newest = max((v for v in (self._open_version, self._held_version) if v is not None), default=-1)
        before = np.maximum.accumulate(np.concatenate([[newest], versions]))[:-1]  # the newest version ahead of each
        late = np.flatnonzero(versions < before)
        if late.size:
            i = int(late[0])
            raise StaleExperienceError(
                f"A sample of policy version {int(versions[i])} arrived after samples of version {int(before[i])}; "
                f"nothing of this put was stored. Use on_stale='drop' to drop late samples.")

    def _keep(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """Keep ``n`` samples that do not fit yet, behind those kept before (the caller holds ``_put_lock``).

        Kept by value: the put returns, and its arrays are views of the caller's sample where possible, which the
        caller may reuse or change.
        """
        if n <= 0:
            return
        arrays = {p: a.copy() for p, a in arrays.items()}
        newest = None
        if self.cfg.semantics == "on_policy":
            versions = self._item_versions(arrays, n)
            newest = max(v for v in (int(versions.max()), self._held_version, self._open_version) if v is not None)
        with self._cv:
            self._held.append((arrays, n))
            self._held_samples += n
            self._held_version = newest

    def _store_held(self, *, raise_errors: bool) -> None:
        """Store the kept samples, oldest first, until one does not fit (the caller holds ``_put_lock``).

        Part of a kept put that was stored is taken off it. An error other than BufferFullError leaves
        the rest kept and propagates when ``raise_errors`` (a put, flush), else waits for the next put to meet it.
        """
        while self._held:
            arrays, n = self._held[0]
            layout = self.layout
            assert layout is not None  # (only a put that is not the first is kept)
            try:
                self._store(arrays, n, layout, False, on_taken=self._took_held)
            except BaseException as e:
                if isinstance(e, BufferFullError) or (not raise_errors and isinstance(e, Exception)):
                    return
                raise

    def _took_held(self, k: int) -> None:
        """Take the first ``k`` kept samples off the oldest kept put: they were stored (the caller holds ``_cv``)."""
        if k <= 0:
            return
        arrays, n = self._held[0]
        if k < n:
            self._held[0] = ({p: a[k:] for p, a in arrays.items()}, n - k)
        else:
            self._held.popleft()
        self._held_samples -= k
        if not self._held:
            self._held_version = None

    def _drain_held(self) -> None:
        """Store kept samples that fit now (a delivery may have freed room); called by get() and empty()."""
        if self._held:  # (read without the lock: a put that keeps samples stores the older ones itself)
            with self._put_lock:
                self._store_held(raise_errors=False)

    def get(self, n: int | None = None) -> ReplayEntry:
        """The next entry: one assembled ahead that is still usable, or one assembled now (handed out as delivered).

        Entries assembled ahead that aged are discarded, and the next one tried, in one hold of ``_deliver_lock``:
        the assembler thread cannot add entries meanwhile, so a call tries at most the ``prefetch`` entries ready
        when it started and then delivers for itself.
        """
        with self._cv:
            self._check_open()
            if self.edp is None:
                raise EmptyBufferError("Nothing was put into this buffer yet; put samples before get().")
        self._drain_held()
        configured = self.cfg.batch_size
        if isinstance(n, np.integer):  # (a size computed with NumPy is a size)
            n = int(n)
        if n is not None and n != configured:
            if not self.cfg.replay_like:
                raise ConfigurationError(f"This {self.cfg.semantics} buffer delivers batches of its configured "
                                         f"size; call get() without a batch size.")
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ConfigurationError(f"batch size must be a positive int, got {n!r}.")
        want = configured if n is None or n == configured else n  # get() without a size: the configured one
        # One hold of _deliver_lock until an entry is handed out: the entries assembled ahead are tried in order, then
        # this call delivers for itself. (Letting go of the lock after an aged entry let the assembler thread slip
        # another one in front of this call, which could age in turn, for as long as other threads kept that up.)
        with self._deliver_lock:
            while True:
                with self._cv:
                    if want != self._n:
                        self._discard_ready()
                        self._n = want
                    entry = self._ready.popleft() if self._ready else None
                ahead = entry is not None
                if entry is None:
                    entry = self._deliver()
                # (only an entry assembled ahead can have aged: one delivered for this call is handed out as the plane
                # delivered it, since priority updates or version moves on other threads meanwhile are concurrent with
                # this call; discarding it for them would redraw for as long as those threads keep going)
                if not ahead or self._usable(entry):
                    with self._cv:  # (counted in the delivery's hold of _deliver_lock: stats() sees it in one place)
                        self._count_handed_out(entry)
                    break
        with self._cv:
            info = entry.info
            if ahead and self.cfg.semantics == "on_policy" and info is not None and info.version is not None:
                assert self.edp is not None  # (an entry assembled ahead: staleness as of this delivery)
                info.staleness = self.edp.semantics.policy_version - info.version  # type: ignore[attr-defined]
            self._armed = True
            self._kick()
        self._drain_held()  # (the delivery may have freed room)
        return entry

    def _count_handed_out(self, entry: ReplayEntry) -> None:
        """``get()`` hands ``entry`` out: count it, and its samples delivered for the first time (holds ``_cv``)."""
        self.stats.entries_delivered += 1
        if self.cfg.replay_like:
            entry.reuses, first = self._count_reuses(entry.sampling_indices)
            self.stats.samples_delivered += first
        elif entry.info is not None and not entry.info.epoch:  # (queue and on-policy: its batch's first delivery)
            self.stats.samples_delivered += int(entry.sampling_indices.shape[0])

    def empty(self) -> bool:
        """True when ``get()`` has nothing to deliver (samples put before the call count).

        Entries assembled ahead that may no longer be handed out do not count (they are dropped,
        as ``get()`` would); neither do on-policy rollouts that are all too stale with
        ``on_stale="drop"`` (they are dropped here, which frees their storage).

        A queue whose only deliverable batch is one owed reuses has that reuse assembled here (kept for ``get()``,
        delivered as assembled, as an entry the assembler thread prepared is): a put on another thread that evicts
        the batch after this call, before the ``get()`` (SRL's trainer puts on its main thread and calls ``empty()``
        then ``get()`` on its training thread), would otherwise leave that ``get()`` with nothing to deliver.
        """
        with self._cv:
            self._check_open()
            if self.edp is None:
                return True
        self._drain_held()
        with self._cv:
            if self._prune_ready():
                return False
        with self._deliver_lock:  # an entry being assembled right now counts
            if self.cfg.semantics == "queue" and self.cfg.reuses > 1 and self._ingest_pending():
                # samples on their way can only add batches, but their eviction can abandon a reused one
                self.edp.flush()
            with self._cv:
                ready = self._prune_ready()
                could = ready or self._deliverable()
                pin = could and not ready and self._owed_reuse_only()
            if pin:
                return not self._pin_reuse()
            if could:
                return False
            if self._drop_stale_rollouts():
                return False
        if self._held:
            self._drain_held()  # (dropping stale rollouts may have freed room)
            with self._deliver_lock, self._cv:
                if self._prune_ready() or self._deliverable():
                    return False

        def look() -> tuple[int, bool]:
            # one hold of the plane's lock: samples stored since the looks above count once, stored or on their way
            # (read apart, a group stored in between counted as neither, and empty() said True with a batch waiting)
            pending = self._pending_samples()
            return pending, self._deliverable(extra=pending)

        with self._deliver_lock, self._cv:
            pending, could = self.read_plane(look)
            if not pending:
                return not (could or self._prune_ready())
        if self.cfg.semantics != "on_policy" and not could:
            return True  # even with what is on its way to storage, no batch is complete
        # what is on its way completes a batch (or, on-policy, may close a rollout): let it land, then look
        self.edp.flush()
        with self._deliver_lock, self._cv:
            return not (self._prune_ready() or self._deliverable())

    def _owed_reuse_only(self) -> bool:
        """Queue: a delivery now could only be a reuse of a batch delivered before (fewer than a batch of new samples
        wait), which a put evicting that batch can take away; puts never lower the new samples waiting (the
        caller holds ``_cv``)."""
        return self.cfg.semantics == "queue" and self._fifo().undelivered() < (self._n or 1)

    def _pin_reuse(self) -> bool:
        """For ``empty()``: assemble the owed reuse into ``_ready``, so that the next ``get()`` delivers it whatever
        puts evict meanwhile; whether something is deliverable (a put evicted the batch first: what is left). The
        caller holds ``_deliver_lock``."""
        try:
            self._deliver(demand=False)  # (kept in _ready)
        except EmptyBufferError:
            with self._cv:
                return self._prune_ready() or self._deliverable()
        return True

    def qsize(self) -> int:
        """Samples not yet delivered (queue: never delivered; replay: held; on-policy: in unfinished rollouts).

        Samples still on their way to storage count as stored, with the samples their storing evicts
        taken off (queue and replay storage holds at most ``capacity``; on-policy storage never evicts).
        What is on its way and what is stored are read in one hold of the EDP's lock, so a sample being
        stored counts once (Conduit's scheduler marks it stored in the lock hold that stores it).
        """
        if self.edp is None:
            return 0
        if self.cfg.semantics == "on_policy":  # (_deliver_lock: not while a rollout's last minibatch moves to _ready)
            with self._deliver_lock, self._cv:
                return self._qsize_locked()
        with self._cv:  # (a batch assembled ahead leaves the cursor and joins _ready in one step under _cv)
            return self._qsize_locked()

    def _qsize_locked(self) -> int:
        """:meth:`qsize`; the caller holds ``_cv`` (and, on-policy, ``_deliver_lock``)."""
        edp = self.edp
        assert edp is not None
        if self.cfg.semantics == "queue":
            fifo = self._fifo()

            def queued() -> int:
                return min(self._pending_samples() + fifo.undelivered(), edp.capacity)

            fresh = sum(int(e.sampling_indices.shape[0]) for e in self._ready if e.reuses == 0)
            return self.read_plane(queued) + fresh
        if self.cfg.replay_like:
            return self.read_plane(lambda: min(self._pending_samples() + len(edp), edp.capacity))
        return self._on_policy_qsize(self.read_plane(lambda: self._pending_samples() + len(edp)))

    def _on_policy_qsize(self, stored: int) -> int:
        """On-policy :meth:`qsize` from ``stored`` (samples on their way to storage and in it, read under the EDP's
        lock): a rollout's storage is released when the plane delivers its last minibatch, which may wait in _ready
        (counted until get() hands it out); with the samples kept until room is freed (on_full="keep")."""
        return stored + sum(e._released for e in self._ready) + self._held_samples

    def counts(self) -> dict[str, int]:
        """:class:`Stats` and what is waiting, read in one hold of the buffer's locks (see ``ConduitBuffer.stats``).

        ``_seal_lock`` (no put is between handing samples to the plane and counting them), ``_deliver_lock`` (no
        delivery is between leaving the plane and being counted), ``_cv``, then the plane's lock (storing, which
        evicts and counts what it evicted, and the semantics' counters).
        """
        with self._seal_lock, self._deliver_lock, self._cv:
            out: dict[str, int] = dict(vars(self.stats))
            out.update(samples_held=self._held_samples, queue_dropped=0, queue_abandoned=0, samples_waiting=0,
                       qsize=0)
            edp = self.edp
            if edp is None:
                return out
            ready_first = sum(int(e.sampling_indices.shape[0]) for e in self._ready
                              if e.info is not None and not e.info.epoch)  # (their samples' first delivery)
            if self.cfg.semantics == "queue":
                fifo = self._fifo()

                # (prepared selections eviction took: dropped, as their delivery will be; a reused batch it took:
                # abandoned, as it is once the confirmed cursor leaves it)
                def read_queue() -> None:
                    out["queue_dropped"] = fifo.dropped + fifo.held_ahead()
                    out["queue_abandoned"] = fifo.abandoned + fifo.owed_evicted()
                    out["samples_waiting"] = self._pending_samples() + fifo.undelivered() + ready_first

                self.read_plane(read_queue)
                out["qsize"] = self._qsize_locked()
            elif self.cfg.semantics == "on_policy":  # (one read of the plane serves both counts)
                stored = self.read_plane(lambda: self._pending_samples() + len(edp))
                begun = self._first_epoch_items if self._rollout_open else 0  # (of the rollout being delivered)
                out["samples_waiting"] = stored - begun + ready_first
                out["qsize"] = self._on_policy_qsize(stored)
            else:
                out["samples_waiting"] = out["qsize"] = self._qsize_locked()
            return out

    def read_plane(self, read: Callable[[], T]) -> T:
        """``read()`` under the EDP's lock (``ExperienceDataPlane.read_locked``), where ingestion and delivery
        change the storage and the semantics' state; once the EDP is closed (it takes no more work, so they no
        longer change), as it is."""
        edp = self.edp
        assert edp is not None
        try:
            return edp.read_locked(read)
        except ConfigurationError:
            if not edp.closed:
                raise
            return read()

    def flush(self) -> None:
        """Wait until every sample put so far is stored (on_full="keep": except those kept until a delivery frees room;
        the ones that fit now are stored first)."""
        if self._held:
            with self._put_lock:
                self._store_held(raise_errors=True)
        self._flush_storage()

    def _flush_storage(self) -> None:
        """Wait until every sample handed to the EDP is stored (a put holding ``_put_lock`` calls this)."""
        if self.edp is not None:
            self.edp.flush()

    def close(self) -> None:
        """Stop the assembler thread, then store what was handed over and stop Conduit's workers."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if self.edp is not None:
            self.edp.close()

    # -- prioritized / on-policy control ------------------------------------------------------
    def update_priorities(self, handles: Any, priorities: Any) -> int:
        self._check_open()  # as put and get: a closed buffer takes no more calls
        if self.cfg.semantics != "prioritized":
            raise ConfigurationError("update_priorities needs semantics='prioritized'.")
        if self.edp is None:
            raise EmptyBufferError("Nothing was put into this buffer yet; there are no priorities to update.")
        try:  # (float indices are refused: truncated, they would name another sample; tensors of any
            # float width, ones that require grad or carry view bits, and complex priorities are Conduit's to check)
            h = torch.from_numpy(PrioritizedSampler.check_handles(handles))
            p = torch.from_numpy(PrioritizedSampler.check(priorities))
        except (TypeError, ValueError, RuntimeError) as e:  # (PriorityError included: say it in SRL's terms)
            raise PriorityError(f"update_priorities takes entry.sampling_indices and one priority per index: "
                                f"{e}") from None
        applied = self.edp.update_priorities(h, p)
        with self._cv:
            self._prio_updates += 1
        return applied

    def set_policy_version(self, version: int) -> None:
        self._check_open()  # as put and get: a closed buffer takes no more calls
        if self.cfg.semantics != "on_policy":
            raise ConfigurationError("set_policy_version needs semantics='on_policy'.")
        v = check_version(version)
        with self._cv:
            if self.edp is None:
                self._pending_version = v
                return
        self.edp.set_policy_version(v)

    def seal(self) -> None:
        self._check_open()  # as put and get: a closed buffer takes no more calls
        if self.cfg.semantics != "on_policy":
            raise ConfigurationError("seal needs semantics='on_policy'.")
        with self._seal_lock:  # not _put_lock: a put waiting for room must not hold up the seal
            with self._cv:  # (the version stays: a sample older than the sealed rollout is late, as before the seal)
                self._open_count = 0
            if self.edp is not None:
                self.edp.seal()
                with self._cv:
                    self._seal_owed = False
        with self._cv:
            if self._armed and self._starved:
                self._kick()

    @property
    def priority_staleness(self) -> int:
        """How many ``update_priorities`` calls a prioritized draw may precede when it is delivered."""
        if self.cfg.semantics != "prioritized":
            return 0
        core = int(self.edp.scheduler.priority_staleness) if self.edp is not None else (  # type: ignore[attr-defined]
            self.cfg.g_del if self.cfg.overlap else 0)
        return core + self.prefetch

    # -- checkpoint ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Contents, sampler state and undelivered entries, at a point between puts and gets."""
        with self._seal_lock, self._deliver_lock:  # (a put waiting for room does not hold _seal_lock)
            base: dict[str, Any] = {"cfg": self.cfg, "layout": self.layout, "pending_version": self._pending_version}
            if self.edp is None:
                return base
            self._pay_owed_seal()  # (a restored buffer would not know that the open rollout is complete)
            if self.cfg.semantics == "on_policy":
                self._take_back_draws()  # (the checkpoint's generator is the one the next selection draws from)
            edp_state = self.edp.state_dict()  # stores every put first; Conduit drops prepared draws
            if self.cfg.semantics == "queue":  # nothing is prepared now: forget the dropped batches' selections
                self._fifo().rewind()
                self._discarded_seen = self._scheduler().discarded
            with self._cv:
                if self.cfg.replay_like:
                    self._discard_ready()  # draws, not data: the live buffer continues like a restored one,
                    self._armed = False  # which assembles nothing ahead before its first get()
                base.update(edp=edp_state, ready=list(self._ready), stats=replace(self.stats), n=self._n,
                            open=(self._open_version, self._open_count), rollout_open=self._rollout_open,
                            epoch_items=self._epoch_items, first_epoch_items=self._first_epoch_items,
                            held=list(self._held), held_version=self._held_version,
                            prio_updates=self._prio_updates, armed=self._armed,
                            slots=None if self._slot_uses is None else (self._slot_handle.copy(),  # type: ignore[union-attr]
                                                                        self._slot_uses.copy()))
            return base

    @classmethod
    def restore(cls, state: dict[str, Any]) -> Assembler:
        """The inverse of :meth:`snapshot`.

        A damaged checkpoint raises, and leaves no data plane (nor its threads) behind.
        """
        a = cls(state["cfg"])
        a._pending_version = state.get("pending_version")
        if state["layout"] is not None:
            a._start(state["layout"])
            assert a.edp is not None
            try:
                a.edp.load_state_dict(state["edp"])
                a._ready = deque(state["ready"])
                saved = vars(state["stats"])  # (counters a checkpoint of an older version lacks start at 0)
                a.stats = Stats(**{k: v for k, v in saved.items() if k in Stats.__dataclass_fields__})
                a._n = state["n"]
                a._open_version, a._open_count = state["open"]
                a._rollout_open = state["rollout_open"]
                a._epoch_items = state.get("epoch_items", 0)
                a._first_epoch_items = state.get("first_epoch_items", 0)
                if a.cfg.semantics == "on_policy":  # (drops before the checkpoint are in its rollout_dropped)
                    a._plane_dropped = int(a.edp.semantics.dropped_items)  # type: ignore[attr-defined]
                    if "rollout_dropped" not in saved:  # (an older checkpoint: the plane's count is all there is)
                        a.stats.rollout_dropped = a._plane_dropped
                a._held = deque(state.get("held", ()))
                a._held_samples = sum(n for _, n in a._held)
                a._held_version = state.get("held_version")
                a._prio_updates = state["prio_updates"]
                if state["slots"] is not None:
                    a._slot_handle, a._slot_uses = state["slots"]
                a._discarded_seen = a._scheduler().discarded
                if state.get("armed", False):  # (queue, on-policy: a get() happened; replay's snapshot disarms)
                    with a._cv:  # assemble ahead as the live buffer goes on to: a restored buffer that waited for its
                        a._armed = True  # first get() turned no batch a put completed, and later puts evicted it
                        a._kick()  # (dropped) where the live one delivered it as turned
            except BaseException:
                a.close()  # (the data plane started its workers: stop them)
                raise
        return a

    # ======================================================================================
    # internals
    # ======================================================================================
    def _check_open(self) -> None:
        if self._fault is not None:
            raise ConfigurationError(f"This Conduit buffer's assembler thread failed: {self._fault!r}") \
                from self._fault
        if self._closed:
            raise ConfigurationError("This Conduit buffer is closed.")

    def _start(self, layout: RecordLayout) -> None:
        cfg = self.cfg
        self._check_version_field(layout)
        schema = layout.schema()
        cap = cfg.resolved_capacity
        try:
            slots = (np.full(cap, -1, dtype=np.int64), np.zeros(cap, dtype=np.int64)) if cfg.replay_like else None
            edp = ExperienceDataPlane(schema, capacity=cap, semantics=_semantics(cfg), scheduler=_scheduler(cfg))
        except ConduitError:
            raise
        except (MemoryError, ValueError, RuntimeError) as e:  # the storage could not be allocated
            per_sample = sum(math.prod(f.shape) * f.dtype.itemsize for f in schema.values())
            raise CapacityError(f"Storage for capacity={cap} samples of {per_sample} bytes each (T="
                                f"{layout.time_steps}) could not be allocated ({type(e).__name__}: {e}); lower "
                                f"capacity or send shorter samples. Nothing was stored.") from e
        if self._pending_version is not None:
            edp.set_policy_version(self._pending_version)
        if slots is not None:
            self._slot_handle, self._slot_uses = slots
        self.layout, self.edp = layout, edp

    def _check_version_field(self, layout: RecordLayout, *, dtype: bool = False) -> None:
        """On-policy: the layout has the version field (``dtype``: of a numeric dtype, checked on a first put only,
        so a checkpoint taken before that check existed still restores)."""
        cfg = self.cfg
        if cfg.semantics != "on_policy":
            return
        leaf = layout.leaf(cfg.version_field)
        if leaf is None:
            raise SchemaError(f"on_policy needs the policy version in field {cfg.version_field!r}, which the sample "
                              f"does not have; set version_field= to the field that holds it.")
        if dtype and leaf.dtype.kind not in "iuf":
            raise SchemaError(f"on_policy reads policy versions from field {cfg.version_field!r}, which has dtype "
                              f"{leaf.dtype}; send integer versions there (e.g. int64), or set version_field= to "
                              f"the field that holds them.")

    def _scheduler(self) -> Overlapped:
        assert self.edp is not None
        return self.edp.scheduler  # type: ignore[return-value]

    def _fifo(self) -> FifoSampler:
        assert self.edp is not None
        return self.edp.semantics.sampler  # type: ignore[attr-defined,no-any-return]

    def _ingest_pending(self) -> bool:
        return self.edp is not None and bool(self._scheduler().pending())

    def _pending_samples(self) -> int:
        return sum(h.batch.batch_size for h in self._scheduler().pending())

    # -- put: versions, rollouts, room ----------------------------------------------------------
    def _plan(self, arrays: dict[str, np.ndarray], n: int) -> list[tuple[int, int, int | None, bool]]:
        """``(lo, hi, version, seal_after)`` runs of a put; version -1 marks late samples that are dropped.

        A newer version than the open rollout's, while that rollout holds samples, is preceded by an empty run
        ``(lo, lo, open_version, True)`` that seals it: room for the newer samples is then looked for with it
        deliverable (the plane would seal it anyway when it stores the first of them).
        """
        if self.cfg.semantics != "on_policy":
            return [(0, n, None, False)]
        per_item = self._item_versions(arrays, n)
        open_v, count, size = self._open_version, self._open_count, self.cfg.rollout_size
        plan: list[tuple[int, int, int | None, bool]] = []
        lo = 0
        while lo < n:
            ver = int(per_item[lo])
            hi = lo + 1
            while hi < n and per_item[hi] == ver:
                hi += 1
            if open_v is not None and ver < open_v:
                if self.cfg.on_stale == "raise":
                    raise StaleExperienceError(
                        f"A sample of policy version {ver} arrived after a rollout of version {open_v}; "
                        f"nothing of this put was stored. Use on_stale='drop' to drop late samples.")
                plan.append((lo, hi, -1, False))
                lo = hi
                continue
            if ver != open_v:
                if count:  # a new version closes the open rollout, as the plane would once it stores the first sample:
                    plan.append((lo, lo, open_v, True))  # sealed first (an empty run), so that room for this put is
                count = 0  # looked for with that rollout deliverable; a new version starts a new rollout
            open_v = ver
            while lo < hi:
                take = hi - lo if size is None else min(hi - lo, size - count)
                count += take
                full = size is not None and count == size
                plan.append((lo, lo + take, ver, full))
                count = 0 if full else count
                lo += take
        self._next_open = (open_v, count)
        return plan

    def _item_versions(self, arrays: dict[str, np.ndarray], n: int) -> np.ndarray:
        """On-policy: each sample's producing version (the smallest non-negative value of its version field).

        Raises:
            SchemaError: a value that is not a whole number, or a sample without any non-negative one.
        """
        v = arrays[self.cfg.version_field].reshape(n, -1)
        if v.dtype.kind == "f":  # whole numbers only: a cast to int64 would truncate, or wrap a huge value
            v = v.astype(np.float64)
            held = v[v >= 0]  # (negative values mean "no version")
            bad = np.concatenate([v[np.isnan(v)], held[(held != np.floor(held)) | (held >= 2.0 ** 63)]])
            if bad.size:
                raise SchemaError(f"Field {self.cfg.version_field!r} holds {float(bad[0])}, which is not a policy "
                                  f"version; versions are whole numbers >= 0 (negative marks 'no version'). "
                                  f"Nothing of this put was stored.")
            low = np.where(v >= 0, v, np.inf).min(axis=1)  # (compared as floats: a sentinel cast would wrap)
            missing = np.isinf(low)
            per_item = np.where(missing, 0, low).astype(np.int64)
        else:
            none = np.iinfo(np.int64).max
            per_item = np.where(v >= 0, v, none).astype(np.int64, copy=False).min(axis=1)
            missing = per_item == none
        if missing.any():
            raise SchemaError(f"A sample carries no policy version (every {self.cfg.version_field!r} value is "
                              f"negative); on_policy needs the producing version.")
        return per_item  # type: ignore[no-any-return]

    def _commit_plan(self, plan: list[tuple[int, int, int | None, bool]]) -> None:
        if self.cfg.semantics == "on_policy":
            self._open_version, self._open_count = self._next_open
            self.stats.late_dropped += sum(hi - lo for lo, hi, v, _ in plan if v == -1)

    def _recount(self, before: tuple[int | None, int, int], runs: list[tuple[int, int, int | None, bool]],
                 taken: int) -> None:
        """Set the rollout bookkeeping and late-drop count as if only the runs of ``runs`` ending at or before
        ``taken`` had been planned, starting from ``before`` (the caller holds ``_cv``)."""
        open_v, count, late = before
        for lo, hi, version, seal_after in runs:
            if hi > taken:
                break
            if version == -1:
                late += hi - lo
                continue
            if version != open_v:
                count = 0
            open_v = version
            count = 0 if seal_after else count + hi - lo
        if self.cfg.semantics == "on_policy":
            self._open_version, self._open_count, self.stats.late_dropped = open_v, count, late

    @staticmethod
    def _told_stored(e: BaseException, stored: int, n: int, *, unsealed: bool) -> BaseException:
        """``e`` (or one of its type) saying how much of a put of ``n`` samples was taken before it was raised.

        Nothing taken: ``e`` unchanged. Otherwise a Conduit error is rebuilt with the account added to its
        message (other errors get it as a note); either way it carries ``samples_stored``.
        """
        if not stored:
            return e
        told = (f"The first {stored} of this put's {n} samples were taken (stored, or dropped as late: see "
                f"stats()); the other {n - stored} were not stored: put only those again once the cause is dealt "
                f"with.")
        if unsealed:
            told += " The rollout they completed is not sealed yet: the next put or seal() seals it."
        err = e
        if isinstance(e, ConduitError):
            try:
                err = type(e)(f"{e} {told}")
            except TypeError:
                err = e
        if err is e and isinstance(e, Exception) and hasattr(e, "add_note"):
            e.add_note(told)
        try:
            err.samples_stored = stored  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return err

    def _pay_owed_seal(self) -> None:
        """Seal the rollout a put completed when its seal failed (the caller holds ``_seal_lock``)."""
        if self._seal_owed and self.edp is not None:
            self.edp.seal()
            with self._cv:
                self._seal_owed = False

    def _runs_with_room(self, plan: list[tuple[int, int, int | None, bool]], *,
                        stored_before: int) -> list[tuple[int, int, int | None, bool]] | None:
        """The runs of ``plan`` to store now, or None to wait for room (on-policy storage never evicts).

        Every run when they all fit; otherwise, on-policy, the runs up to the end of the last rollout this
        put completes that fit (the rest of the put waits for that rollout's delivery to make room). Raises
        CapacityError when room can never come (decided while no delivery is in flight: one may be about to free a
        rollout's storage). The caller holds ``_cv``; while this returns None it waits
        (without ``_seal_lock``) and plans again. With ``on_full="raise"`` it never waits for a delivery: it raises
        BufferFullError, once the samples on their way to storage are stored (None until then: the caller stores them).
        """
        def stored(runs: list[tuple[int, int, int | None, bool]]) -> int:
            return sum(hi - lo for lo, hi, v, _ in runs if v != -1)

        if self.cfg.semantics != "on_policy" or not stored(plan):
            return plan
        n_rest = plan[-1][1] - plan[0][0]
        self._check_open()
        edp = self.edp
        assert edp is not None
        pending = self._pending_samples()
        cuts = [len(plan)] + [i + 1 for i in reversed(range(len(plan) - 1)) if plan[i][3]]
        for cut in cuts:  # the whole put, then up to the end of each rollout it completes (longest first)
            if pending + len(edp) + stored(plan[:cut]) <= edp.capacity:
                if cut < len(plan):
                    self._next_open = (plan[cut - 1][2], 0)  # the state after that rollout was sealed
                return plan[:cut]
        if pending == 0 and not self._ready and self._rollouts()[0] == 0:
            # A delivery in flight (another thread's get(), the assembler) may have taken a rollout's last minibatch
            # and not yet freed its storage: decide that room can never come only while none is in flight.
            if not self._deliver_lock.acquire(blocking=False):
                return None  # (it notifies _cv when it is done: look again then)
            try:
                never = (len(edp) + stored(plan[:cuts[-1]]) > edp.capacity and not self._ready
                         and self._rollouts()[0] == 0)
            finally:
                self._deliver_lock.release()
            if not never:
                return None  # room was freed meanwhile: plan again
            told = (f"{stored_before} samples of this put were stored, the rest was not" if stored_before else
                    "Nothing of this put was stored")
            err = CapacityError(f"The open on-policy rollout fills the capacity ({edp.capacity} samples) and "
                                f"nothing can be delivered to make room; seal rollouts sooner (seal() or "
                                f"rollout_size=) or raise capacity. {told}.")
            err.samples_stored = stored_before  # type: ignore[attr-defined]
            raise err
        if self.cfg.never_waits and pending == 0:  # (put waits for no get(); the caller stores pending first)
            told = (f"The first {stored_before} samples of this put were taken; the other {n_rest} were not stored"
                    if stored_before else "Nothing of this put was stored")
            full = BufferFullError(
                f"This on-policy buffer has room for {edp.capacity - pending - len(edp)} more samples (capacity "
                f"{edp.capacity}, {pending + len(edp)} held by rollouts not fully delivered) and this put needs "
                f"{stored(plan[:cuts[-1]])}. With on_full='raise' put never waits for room: call get() until a "
                f"rollout's last minibatch is delivered (that frees its samples), then put the samples not stored "
                f"again (this error's .sample is the put's sample); or raise capacity "
                f"(a host that puts and gets on one thread needs room for what one "
                f"consume_to receives plus the rollouts it has not delivered). {told}.")
            full.samples_stored = stored_before  # type: ignore[attr-defined]
            raise full
        return None

    # -- get: delivering and assembling -------------------------------------------------------
    def _deliverable(self, extra: int = 0) -> bool:
        """Whether a delivery would succeed from what is stored (plus ``extra`` samples still being stored)."""
        assert self.edp is not None
        sem = self.cfg.semantics
        if sem == "queue":
            fifo = self._fifo()
            return fifo.can_deliver(self._n or 1) or fifo.undelivered() + extra >= (self._n or 1)
        if sem == "on_policy":
            pending, fresh = self._rollouts()
            return pending > 0 and (self.cfg.on_stale == "raise" or fresh > 0)  # (raise: get() raises the stale error)
        return len(self.edp) + extra >= self.cfg.resolved_warmup

    def _rollouts(self) -> tuple[int, int]:
        """On-policy: sealed rollouts not fully delivered, and of those the ones fresh enough to deliver.

        Stale ones are dropped at delivery, so they are not fresh. Read under the EDP's lock: Conduit's
        prefetch peeks at the next minibatch under that lock, and a read outside it could see the
        rollout being delivered as finished for the time of the peek.
        """
        assert self.edp is not None
        sem = self.edp.semantics

        def probe() -> tuple[int, int]:
            return sem.pending_rollouts, sem.fresh_rollouts  # type: ignore[attr-defined]

        return self.read_plane(probe)

    def _deliver(self, *, demand: bool = True) -> ReplayEntry:
        """One delivery from the EDP, assembled (the caller holds ``_deliver_lock``).

        On demand (a ``get``), samples still on their way to storage are waited for; ahead of
        demand (the assembler thread), only what is stored is looked at, and the entry is appended to
        ``_ready`` in the step that confirms a queue batch (so ``qsize()`` never misses it).
        """
        edp = self.edp
        assert edp is not None
        self._store_pending_before_selecting(demand=demand)
        if not demand and not self._deliverable():
            pending = self._pending_samples()
            if pending and self._deliverable(extra=pending):
                edp.flush()  # a batch is complete once what is on its way is stored
            if not self._deliverable():
                raise EmptyBufferError("Nothing stored is deliverable yet.")
        for attempt in (0, 1):
            try:
                if self.cfg.replay_like and len(edp) < self.cfg.resolved_warmup:
                    raise EmptyBufferError(f"{len(edp)} samples stored, warmup is {self.cfg.resolved_warmup}; put "
                                           f"more before get().")
                if self.cfg.semantics == "queue":
                    fifo = self._fifo()
                    if self.read_plane(fifo.prepared_evicted):  # eviction took a batch prepared ahead: not
                        self._scheduler().invalidate("contents")  # delivered (as without prefetch), dropped
                    seen = self._scheduler().discarded
                    if seen != self._discarded_seen:  # Conduit dropped prepared batches: select them again
                        # (qsize reads the cursors under _cv; the plane's lock: a background store evicts and then
                        # counts what it evicted past the cursor in one hold of it, so a rewind in between would
                        # move the cursor past items that neither it nor the store counts as dropped)
                        with self._cv:
                            self.read_plane(self._fifo().rewind)
                        self._discarded_seen = seen
                mark = None
                if self.cfg.semantics == "on_policy":
                    batch, info, mark = self._deliver_rollout_part(ahead=not demand)
                else:
                    batch, info = edp.deliver(self._n)
                break
            except EmptyBufferError:
                if demand and attempt == 0:
                    if self._ingest_pending():
                        edp.flush()  # samples put before this call count
                    continue  # (and storing may have finished since the selection looked)
                raise
        queue = self.cfg.semantics == "queue"
        try:
            entry = self._assemble(batch, info)
            entry._mark = mark
        except BaseException:
            with self._cv:  # the batch left the plane: delivered (and lost with this error), not selected again
                if queue:
                    self._fifo().confirm(info)
                if self.cfg.semantics == "on_policy":
                    self._count_plane_delivery(info)
                    self._count_released(info)
            raise
        with self._cv:
            if queue:  # confirmed and (ahead of demand) kept in one step: qsize() counts the batch throughout
                self._fifo().confirm(info)
            if self.cfg.semantics == "on_policy":
                self._count_plane_delivery(info)
                entry._released = self._count_released(info)
            if not demand:
                self._ready.append(entry)
            self._cv.notify_all()  # on-policy room may have been freed
        return entry

    def _deliver_rollout_part(self, *, ahead: bool = False) -> tuple[ExperienceBatch, SampleInfo, Any]:
        """On-policy: the plane's next minibatch and the semantics' draw mark before its selection; a failed
        delivery's drops are counted here, a successful one's by the caller with the minibatch
        (:meth:`_count_plane_delivery`). The draws of entries discarded as stale are given back first
        (:meth:`_take_back_draws`). A selection ``ahead`` of demand (the assembler thread's) that finds a rollout
        stale selects nothing (``OnPolicy.defer_stale``: EmptyBufferError): ``get()`` drops it, as without prefetch,
        after the entries discarded from it gave their draws back. The caller holds ``_deliver_lock``."""
        assert self.edp is not None
        sem = self.edp.semantics
        assert isinstance(sem, OnPolicy)

        def defer(on: bool) -> None:
            sem.defer_stale = on
        try:
            self._take_back_draws()
            mark = self.read_plane(sem.draw_mark)  # (no other real selection in between: they hold _deliver_lock)
            if ahead:
                self.read_plane(lambda: defer(True))
            try:
                batch, info = self.edp.deliver()
            finally:
                if ahead:
                    self.read_plane(lambda: defer(False))
            return batch, info, mark
        except BaseException:
            with self._cv:  # (it may have dropped stale rollouts before it found nothing fresh)
                self._count_plane_delivery(None)
            raise

    def _count_plane_delivery(self, info: SampleInfo | None) -> None:
        """On-policy, after a delivery from the plane (``info``; None: it raised): count the rollout samples it dropped.

        The plane drops a stale rollout whole (``OnPolicy.dropped_items``), also the one being delivered whose first
        minibatches it delivered already: those samples are counted where they went (``samples_delivered``, waiting
        in ``_ready``, ``stale_dropped``), so ``rollout_dropped`` gets the rest only. The plane looks at the rollout
        being delivered before any other and drops it first, so any drop while one is open (``_rollout_open``)
        includes it. The caller holds ``_deliver_lock`` (every real selection is made under it) and ``_cv``.
        """
        assert self.edp is not None
        sem = self.edp.semantics
        continued = info is not None and self._rollout_open and bool(info.epoch or info.minibatch)
        # (a delivery that continues the open rollout dropped nothing: the count is read, under the plane's lock, where
        # a prediction changes it only for the time it holds the lock, once per rollout)
        if continued:
            total = self._plane_dropped
        else:
            total = int(self.read_plane(lambda: sem.dropped_items))  # type: ignore[attr-defined]
        new = total - self._plane_dropped
        self._plane_dropped = total
        if new > 0 and self._rollout_open:
            new -= self._first_epoch_items
            self._first_epoch_items = 0
            self._rollout_open = False
        self.stats.rollout_dropped += new
        if info is not None:
            if not info.epoch:
                if not info.minibatch:
                    self._first_epoch_items = 0
                self._first_epoch_items += int(info.handles.shape[0])
            self._rollout_open = not info.last

    def _count_released(self, info: SampleInfo) -> int:
        """On-policy: the samples of the rollout a delivered minibatch finishes (0 unless it is the last one).

        The minibatches of an epoch cover its rollout once, so the rollout's size is what its last epoch
        delivered. The caller holds ``_cv``.
        """
        if not info.minibatch:
            self._epoch_items = 0
        self._epoch_items += int(info.handles.shape[0])
        return self._epoch_items if info.last else 0

    def _store_pending_before_selecting(self, *, demand: bool) -> None:
        """Store the puts still on their way when they could change what the next selection picks.

        A queue selection (in ``get`` or by the assembler thread) sees every put that returned before
        it, as SRL's sequential queue does: puts that overflow the capacity evict samples the selection
        would otherwise pick. Puts that only append to a queue with room cannot change its oldest batch,
        so those are not waited for. A replay draw is taken from what is stored when it is drawn (puts
        still on their way become drawable once stored, as with core's overlapped replay), and
        on-policy puts never evict and only join the open rollout or start a newer one (a get with
        nothing sealed stores them and looks again). Entries selected before the puts returned
        (prepared ahead) keep what they hold.

        Ahead of demand (the assembler thread) a failed background write is left for the producer's
        next call to raise, and nothing is selected.
        """
        edp = self.edp
        assert edp is not None
        if self.cfg.semantics != "queue" or not self._ingest_pending():
            return
        if len(edp) + self._pending_samples() <= edp.capacity:
            return
        if demand:
            edp.flush()
        elif not self._scheduler().drain():
            raise EmptyBufferError("Samples put earlier are not stored yet; get() stores them before selecting.")

    def _usable(self, entry: ReplayEntry) -> bool:
        """Whether an entry may still be handed out (entries assembled ahead can age)."""
        cfg = self.cfg
        if cfg.semantics == "prioritized" and self._prio_updates - entry._stamp > self.prefetch:
            with self._cv:
                self.stats.redrawn += 1
            return False
        if cfg.semantics == "on_policy" and entry.info is not None and entry.info.version is not None:
            assert self.edp is not None
            current = self.edp.semantics.policy_version  # type: ignore[attr-defined]
            if current - entry.info.version > cfg.max_staleness:
                with self._cv:
                    if not entry.info.epoch:  # (a later epoch's samples were handed out in the first one)
                        self.stats.stale_dropped += int(entry.sampling_indices.shape[0])
                    # (entries are discarded oldest first: the first one's mark is where the draws go back to)
                    owed = self._owed_draws
                    self._owed_draws = (entry._mark, 1) if owed is None else (owed[0], owed[1] + 1)
                return False
        return True

    def _take_back_draws(self) -> None:
        """On-policy: give back the permutation draws of the entries discarded as stale since the last selection
        (:meth:`conduit.OnPolicy.take_back_draws`; it gives nothing back unless they are all the selections made since
        the first one's mark and their rollout is done with). The caller holds ``_deliver_lock`` (not ``_cv``), right
        before a selection or a checkpoint."""
        with self._cv:
            owed, self._owed_draws = self._owed_draws, None
        if owed is not None and owed[0] is not None:
            assert self.edp is not None
            sem = self.edp.semantics
            assert isinstance(sem, OnPolicy)
            mark, discarded = owed
            self.read_plane(lambda: sem.take_back_draws(mark, discarded))

    def _drop_stale_rollouts(self) -> bool:
        """On-policy, on_stale="drop": drop pending rollouts that are all too stale now, as ``get()`` would.

        ``empty()`` reports them as nothing to deliver, so no ``get()`` would come to drop them and
        free their storage for a ``put`` waiting for room. Returns whether an entry became ready
        instead (a fresh rollout was sealed meanwhile). The caller holds ``_deliver_lock``.
        """
        edp = self.edp
        assert edp is not None
        if self.cfg.semantics != "on_policy" or self.cfg.on_stale != "drop":
            return False
        pending, fresh = self._rollouts()
        if pending == 0 or fresh > 0:
            return False
        try:
            batch, info, mark = self._deliver_rollout_part()
        except EmptyBufferError:
            with self._cv:
                self._cv.notify_all()  # room was freed
            return False
        try:
            entry = self._assemble(batch, info)
            entry._mark = mark
        except BaseException:
            with self._cv:  # (as in _deliver: the minibatch left the plane)
                self._count_plane_delivery(info)
                self._count_released(info)
            raise
        with self._cv:
            self._count_plane_delivery(info)
            entry._released = self._count_released(info)
            self._ready.append(entry)
            self._cv.notify_all()
        return True

    def _prune_ready(self) -> bool:
        """Drop (and count) entries assembled ahead that may no longer be handed out; whether one is left.

        The caller holds ``_cv``.
        """
        while self._ready and not self._usable(self._ready[0]):
            self._ready.popleft()
        return bool(self._ready)

    def _count_reuses(self, handles: np.ndarray) -> tuple[float, int]:
        """Replay: how many times these samples were handed out before (mean), and how many distinct ones never
        were; counts this delivery (holds ``_cv``)."""
        assert self._slot_handle is not None and self._slot_uses is not None and self.edp is not None
        slots = handles % self.edp.capacity
        fresh = self._slot_handle[slots] != handles
        self._slot_uses[slots[fresh]] = 0
        self._slot_handle[slots] = handles
        reuses = float(self._slot_uses[slots].mean()) if handles.shape[0] else 0.0
        first = int(np.unique(slots[self._slot_uses[slots] == 0]).shape[0])
        np.add.at(self._slot_uses, slots, 1)
        return reuses, first

    def _discard_ready(self) -> None:
        self.stats.redrawn += len(self._ready)
        self._ready.clear()

    def _assemble(self, batch: ExperienceBatch, info: SampleInfo) -> ReplayEntry:
        """Transpose the delivered ``[B, T, ...]`` columns into fresh ``[T, B, ...]`` arrays and build the record."""
        assert self.layout is not None and self.edp is not None
        k = batch.batch_size
        with self.edp.telemetry.span("assemble", k, batch.nbytes()):
            arrays: dict[str, np.ndarray] = {}
            for path in self.layout.paths:
                src = batch.tensor(path)
                out = torch.empty((src.shape[1], k, *src.shape[2:]), dtype=src.dtype, pin_memory=self.pin)
                out.copy_(src.transpose(0, 1))
                arrays[path] = out.numpy()
            record = self.layout.build(arrays)
        handles = info.handles.numpy().copy()
        weights = None if info.weights is None else info.weights.numpy().astype(np.float32)
        if weights is not None and hasattr(record, "register_metadata"):
            record.register_metadata(sampling_weight=weights)
        cfg = self.cfg
        if cfg.semantics in ("queue", "on_policy"):
            uses = int(info.epoch or 0)
            total = cfg.reuses if cfg.semantics == "queue" else cfg.num_epochs
            reuses: float = uses
            left = total - uses - 1
        else:
            reuses = 0.0  # counted when the entry is handed out (_count_reuses): a prepared draw may be discarded
            left = -1
        return ReplayEntry(sample=record, reuses=reuses, sampling_indices=handles, reuses_left=left,
                           receive_time=time.time(), weights=weights, info=info, _stamp=self._prio_updates)

    # -- the assembler thread -----------------------------------------------------------------
    def _kick(self) -> None:
        """Ask the assembler thread to fill up to ``prefetch`` entries (caller holds ``_cv``)."""
        if self.prefetch <= 0 or self._closed:
            return
        self._starved = False
        self._kicks += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="conduit-srl-assembler", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _run(self) -> None:
        seen = 0
        while True:
            with self._cv:
                while not self._closed and (self._kicks == seen or self._starved):
                    self._cv.wait()
                if self._closed:
                    return
                seen = self._kicks
            while True:
                with self._deliver_lock:
                    with self._cv:
                        if self._closed or len(self._ready) >= self.prefetch or (
                                self.cfg.replay_like and not self._armed):  # (a snapshot disarms a pending kick)
                            break
                        if self.cfg.semantics == "on_policy" and not self._rollout_open:
                            break  # never assemble past the end of a rollout
                    try:
                        self._deliver(demand=False)  # (kept in _ready)
                    except ConduitError:
                        # nothing to deliver yet (or an error the next get() meets itself)
                        with self._cv:
                            self._starved = True
                        break
                    except BaseException as e:  # noqa: BLE001 - a bug: every later call raises it
                        with self._cv:
                            self._fault = e
                            self._cv.notify_all()
                        return
