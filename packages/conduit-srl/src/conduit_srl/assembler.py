"""The background assembler behind a Conduit buffer: one ordered executor for ingest and delivery.

SRL calls a buffer from two threads: ``put`` on the consuming thread (inside ``consume_to``) and
``empty``/``get`` on the training thread. Here both only hand work to one executor thread, which
runs it **in call order**:

* ``put`` validates the sample in the caller (errors surface at the call), then queues an
  *ingest*. Consecutive queued ingests are stored in one ``ExperienceDataPlane.ingest`` call
  (ingestion granularity grows with the backlog, bounded by capacity).
* ``get`` returns a delivery prepared earlier, or queues one and waits for it. After each
  ``get`` the executor *prepares* the next ``prefetch`` deliveries (select, gather, transpose
  into ``[T, B, ...]`` arrays, build the record), overlapping the trainer's step.
* Everything else that reads or changes the buffer (priority updates, policy version, seal,
  checkpoints) is queued the same way, so the result is a function of the call order alone.

What a prepared delivery may miss, and when it is dropped:

* replay/prioritized: a prepared draw is made from the contents at preparation time. It is
  dropped (and redrawn) when an ingest evicts one of its items, when a ``get`` asks another
  batch size, and, with ``exact_priorities``, after a priority update. Dropping a draw loses no data.
* queue/on-policy: a prepared delivery has consumed its items; it is never dropped, except an
  on-policy one that a later ``set_policy_version`` makes too stale (``on_stale="drop"``; counted).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    PrioritizedSampler,
    Replay,
    SchemaError,
    StaleExperienceError,
    UniformSampler,
)
from conduit.semantics import SampleInfo

from conduit_srl.config import BufferConfig
from conduit_srl.fifo import FifoSampler
from conduit_srl.records import RecordLayout

__all__ = ["Assembler", "ReplayEntry"]


@dataclass
class ReplayEntry:
    """One delivery, with the attributes SRL's trainer reads.

    Attributes:
        sample: a record of the put samples' class, every field ``[T, B, ...]`` host NumPy
            (page-locked when CUDA is available).
        reuses: how many times these samples were delivered before (mean over the batch).
        sampling_indices: the samples' Conduit handles (int64); give them to ``update_priorities``.
        reuses_left: deliveries left for this batch (queue, on-policy); -1 for replay.
        receive_time: when the delivery was prepared (``time.time()``).
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


@dataclass
class _Command:
    kind: str  # "ingest" | "prepare" | "call"
    n: int = 0
    arrays: dict[str, np.ndarray] | None = None
    version: int | None = None
    demand: bool = False
    fn: Callable[[], Any] | None = None
    box: list[Any] = field(default_factory=list)


@dataclass
class Stats:
    """Counters of one buffer (read with ``ConduitBuffer.stats()``)."""

    samples_put: int = 0
    entries_delivered: int = 0
    #: on-policy samples older than the open rollout, not stored (on_stale="drop")
    late_dropped: int = 0
    #: on-policy samples in prepared minibatches that a version change made too stale
    stale_dropped: int = 0
    #: prepared replay draws discarded (eviction, batch-size change, priority update)
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


class Assembler:
    """The state and the executor thread of one Conduit buffer (see the module docstring)."""

    def __init__(self, cfg: BufferConfig) -> None:
        self.cfg = cfg
        self.layout: RecordLayout | None = None
        self.edp: ExperienceDataPlane | None = None
        self.stats = Stats()
        self.pin = bool(cfg.pin_memory if cfg.pin_memory is not None else torch.cuda.is_available())
        if self.pin and not torch.cuda.is_available():
            raise ConfigurationError("pin_memory=True needs CUDA; leave it None to pin only where CUDA exists.")
        self._cv = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._ready: deque[ReplayEntry | BaseException] = deque()
        self._inflight = 0
        self._enqueued = 0
        self._done = 0
        self._staged = 0
        self._want_prefetch = False
        self._fault: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._n = cfg.batch_size
        self._open_version: int | None = None
        self._open_count = 0
        self._counts: np.ndarray | None = None
        self._pending_version: int | None = None

    # ======================================================================================
    # caller side (any thread)
    # ======================================================================================
    def put(self, sample: Any, *, batched: bool) -> int:
        """Validate ``sample`` now and queue it for storage; returns the number of samples."""
        with self._cv:
            self._check_open()
            if self.layout is None:
                self._start(RecordLayout(sample, batched=batched, drop_fields=self.cfg.drop_fields))
        assert self.layout is not None and self.edp is not None
        arrays, n = self.layout.split(sample, batched=batched)
        if n == 0:
            return 0
        cap = self.edp.capacity
        if n > cap:
            raise CapacityError(f"A put of {n} samples is larger than the capacity ({cap}); split it or raise "
                                f"capacity.")
        runs = self._runs(arrays, n)
        with self._cv:
            self._check_open()
            self._wait_for_room(n)
            plan = self._plan_versions(runs)
            for lo, hi, version, seal_after in plan:
                if version == -1:
                    continue
                part = arrays if (lo, hi) == (0, n) else {p: a[lo:hi] for p, a in arrays.items()}
                self._enqueue(_Command("ingest", n=hi - lo, arrays=part, version=version))
                self._staged += hi - lo
                if seal_after:
                    self._enqueue(_Command("call", fn=self._seal_now))
            self.stats.samples_put += n
        return n

    def get(self, n: int | None = None) -> ReplayEntry:
        """The next delivery: a prepared one, or one prepared now."""
        with self._cv:
            self._check_open()
            if self.edp is None:
                raise EmptyBufferError("Nothing was put into this buffer yet; put samples before get().")
            if n is not None and n != self._n:
                if not self.cfg.replay_like:
                    raise ConfigurationError(f"This {self.cfg.semantics} buffer delivers batches of its configured "
                                             f"size; call get() without a batch size.")
                if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                    raise ConfigurationError(f"batch size must be a positive int, got {n!r}.")
                self._wait(lambda: self._inflight == 0)
                self.stats.redrawn += sum(isinstance(e, ReplayEntry) for e in self._ready)
                self._ready.clear()
                self._n = n
            while not self._ready:
                if self._inflight == 0:
                    self._enqueue(_Command("prepare", n=self._n or 0, demand=True))
                    self._inflight += 1
                self._wait(lambda: bool(self._ready) or self._inflight == 0)
                self._check_open()
            item = self._ready.popleft()
            if isinstance(item, BaseException):
                self._want_prefetch = False
                raise item
            self.stats.entries_delivered += 1
            self._refill()
            return item

    def empty(self) -> bool:
        """True when ``get()`` has nothing to deliver.

        Unless a prepared delivery is waiting, this first lets the work handed over before the call
        (puts, preparations) finish, so a sample put before ``empty()`` counts.
        """
        with self._cv:
            self._check_open()
            if self.edp is None:
                return True
            target = self._enqueued
            self._wait(lambda: bool(self._ready) or self._done >= target)
            if self._ready:
                return False
            return not self._deliverable()

    def qsize(self) -> int:
        """Samples not yet delivered (queue: never delivered; replay: held; on-policy: in unfinished rollouts)."""
        with self._cv:
            if self.edp is None:
                return self._staged
            if self.cfg.semantics == "queue":
                sampler = self._fifo()
                fresh = sum(e.sampling_indices.shape[0] for e in self._ready
                            if isinstance(e, ReplayEntry) and e.reuses == 0)
                return self._staged + sampler.unread + fresh
            return self._staged + len(self.edp)

    def flush(self) -> None:
        """Wait until every call made before this one has run."""
        with self._cv:
            if self._fault is not None:
                raise self._fault
            target = self._enqueued
            self._wait(lambda: self._done >= target)
            if self._fault is not None:
                raise self._fault

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the executor after everything queued before; return its result or raise its error."""
        with self._cv:
            self._check_open()
            cmd = _Command("call", fn=fn)
            self._enqueue(cmd)
            self._wait(lambda: bool(cmd.box))
        ok, value = cmd.box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Run what is queued, then stop the executor thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- on-policy / prioritized control (queued, so ordered with puts and gets) --------------
    def update_priorities(self, handles: Any, priorities: Any) -> int:
        if self.cfg.semantics != "prioritized":
            raise ConfigurationError("update_priorities needs semantics='prioritized'.")
        h = torch.as_tensor(np.asarray(handles, dtype=np.int64).reshape(-1))
        p = torch.as_tensor(np.asarray(priorities, dtype=np.float64).reshape(-1))
        if self.edp is None:
            raise EmptyBufferError("Nothing was put into this buffer yet; there are no priorities to update.")

        def apply() -> int:
            assert self.edp is not None
            applied = self.edp.update_priorities(h, p)
            if self.cfg.exact_priorities:
                self._drop_ready_draws(lambda e: True)
            return applied

        return int(self.call(apply))

    def set_policy_version(self, version: int) -> None:
        if self.cfg.semantics != "on_policy":
            raise ConfigurationError("set_policy_version needs semantics='on_policy'.")
        v = int(version)
        if self.edp is None:
            self._pending_version = v
            return

        def apply() -> None:
            assert self.edp is not None
            self.edp.set_policy_version(v)
            with self._cv:
                keep: deque[ReplayEntry | BaseException] = deque()
                for e in self._ready:
                    if isinstance(e, ReplayEntry) and e.info is not None and e.info.version is not None \
                            and v - e.info.version > self.cfg.max_staleness:
                        self.stats.stale_dropped += int(e.sampling_indices.shape[0])
                    else:
                        keep.append(e)
                self._ready = keep

        self.call(apply)

    def seal(self) -> None:
        if self.cfg.semantics != "on_policy":
            raise ConfigurationError("seal needs semantics='on_policy'.")
        with self._cv:
            self._check_open()
            if self.edp is None:
                return
            self._open_version = None
            self._open_count = 0
            self._enqueue(_Command("call", fn=self._seal_now))

    # -- checkpoint -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything needed to rebuild this buffer, taken in call order (pending puts stored first)."""
        if self.edp is None:
            return {"cfg": self.cfg, "layout": None, "pending_version": self._pending_version}

        def take() -> dict[str, Any]:
            assert self.edp is not None
            with self._cv:
                ready = [e for e in self._ready if isinstance(e, ReplayEntry)]
                state = {"cfg": self.cfg, "layout": self.layout, "edp": self.edp.state_dict(), "ready": ready,
                         "counts": None if self._counts is None else self._counts.copy(), "stats": self.stats,
                         "n": self._n, "open_version": self._open_version, "open_count": self._open_count,
                         "want_prefetch": self._want_prefetch}
            return state

        return dict(self.call(take))

    @classmethod
    def restore(cls, state: dict[str, Any]) -> Assembler:
        """The inverse of :meth:`snapshot`."""
        a = cls(state["cfg"])
        a._pending_version = state.get("pending_version")
        if state["layout"] is not None:
            a._start(state["layout"])
            assert a.edp is not None
            a.edp.load_state_dict(state["edp"])
            a._ready = deque(state["ready"])
            a._counts = state["counts"]
            a.stats = state["stats"]
            a._n = state["n"]
            a._open_version, a._open_count = state["open_version"], state["open_count"]
            a._want_prefetch = state["want_prefetch"]
        return a

    # -- internals (caller side, under self._cv) ----------------------------------------------
    def _check_open(self) -> None:
        if self._fault is not None:
            raise self._fault
        if self._closed:
            raise ConfigurationError("This Conduit buffer is closed.")

    def _wait(self, pred: Callable[[], bool]) -> None:
        while not pred():
            if self._fault is not None:
                raise self._fault
            self._cv.wait()

    def _enqueue(self, cmd: _Command) -> None:
        self._commands.append(cmd)
        self._enqueued += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="conduit-srl-assembler", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _refill(self) -> None:
        want = self.cfg.resolved_prefetch - len(self._ready) - self._inflight
        for _ in range(max(0, want)):
            self._enqueue(_Command("prepare", n=self._n or 0))
            self._inflight += 1

    def _start(self, layout: RecordLayout) -> None:
        cfg = self.cfg
        if cfg.semantics == "on_policy" and layout.leaf(cfg.version_field) is None:
            raise SchemaError(f"on_policy needs the policy version in field {cfg.version_field!r}, which the sample "
                              f"does not have; set version_field= to the field that holds it.")
        edp = ExperienceDataPlane(layout.schema(), capacity=cfg.resolved_capacity, semantics=_semantics(cfg))
        self.layout, self.edp = layout, edp
        if cfg.replay_like:
            self._counts = np.zeros(cfg.resolved_capacity, dtype=np.int64)
        if self._pending_version is not None:
            edp.set_policy_version(self._pending_version)

    def _runs(self, arrays: dict[str, np.ndarray], n: int) -> list[tuple[int, int, int | None]]:
        """Split a put into runs of one policy version (on-policy), else one run without a version."""
        if self.cfg.semantics != "on_policy":
            return [(0, n, None)]
        v = arrays[self.cfg.version_field].reshape(n, -1)
        masked = np.where(v >= 0, v, np.iinfo(np.int64).max).astype(np.int64, copy=False)
        per_item = masked.min(axis=1)
        if (per_item == np.iinfo(np.int64).max).any():
            raise SchemaError(f"A sample carries no policy version (every {self.cfg.version_field!r} value is "
                              f"negative); on_policy needs the producing version.")
        runs: list[tuple[int, int, int | None]] = []
        lo = 0
        for i in range(1, n + 1):
            if i == n or per_item[i] != per_item[lo]:
                runs.append((lo, i, int(per_item[lo])))
                lo = i
        return runs

    def _plan_versions(self, runs: list[tuple[int, int, int | None]]) -> list[tuple[int, int, int | None, bool]]:
        """Decide, before anything is queued, what happens to each run (late runs: drop or raise)."""
        if self.cfg.semantics != "on_policy":
            return [(lo, hi, v, False) for lo, hi, v in runs]
        open_v, count = self._open_version, self._open_count
        plan: list[tuple[int, int, int | None, bool]] = []
        for lo, hi, v in runs:
            assert v is not None
            if open_v is not None and v < open_v:
                if self.cfg.on_stale == "raise":
                    raise StaleExperienceError(
                        f"A sample of policy version {v} arrived while the rollout of version {open_v} is open; "
                        f"nothing of this put was stored. Use on_stale='drop' to drop late samples.")
                plan.append((lo, hi, -1, False))
                continue
            if v != open_v:
                count = 0  # a new version starts a new rollout
            open_v = v
            size = self.cfg.rollout_size
            while lo < hi:
                take = hi - lo if size is None else min(hi - lo, size - count)
                count += take
                full = size is not None and count == size
                plan.append((lo, lo + take, v, full))
                if full:
                    count = 0
                lo += take
        late = sum(hi - lo for lo, hi, v, _ in plan if v == -1)
        self.stats.late_dropped += late
        self._open_version, self._open_count = open_v, count
        return plan

    def _wait_for_room(self, n: int) -> None:
        """Back-pressure: wait while too much is handed over but not stored (on-policy: not yet consumed)."""
        assert self.edp is not None
        cap = self.edp.capacity
        while True:
            self._check_open()
            if self.cfg.semantics == "on_policy":
                if self._staged + len(self.edp) + n <= cap:
                    return
                stuck = (self._staged == 0 and self._inflight == 0 and not self._ready
                         and self.edp.semantics.pending_rollouts == 0)  # type: ignore[attr-defined]
                if stuck:
                    raise CapacityError(f"The open on-policy rollout fills the capacity ({cap} samples) and nothing "
                                        f"can be delivered to make room; seal rollouts sooner (seal() or "
                                        f"rollout_size=) or raise capacity.")
            elif self._staged == 0 or self._staged + n <= self.cfg.resolved_max_staged:
                return
            self._cv.wait()

    def _deliverable(self) -> bool:
        assert self.edp is not None
        sem = self.cfg.semantics
        if sem == "queue":
            return self._fifo().can_deliver(self._n or 1)
        if sem == "on_policy":
            return self.edp.semantics.pending_rollouts > 0  # type: ignore[attr-defined]
        return len(self.edp) >= self.cfg.resolved_warmup

    def _fifo(self) -> FifoSampler:
        assert self.edp is not None
        return self.edp.semantics.sampler  # type: ignore[attr-defined,no-any-return]

    # ======================================================================================
    # executor side
    # ======================================================================================
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._closed:
                    self._cv.wait()
                if not self._commands:
                    return
                batch = [self._commands.popleft()]
                if batch[0].kind == "ingest":
                    total = batch[0].n
                    cap = self.edp.capacity if self.edp is not None else 0
                    while (self._commands and self._commands[0].kind == "ingest"
                           and self._commands[0].version == batch[0].version and total + self._commands[0].n <= cap):
                        total += self._commands[0].n
                        batch.append(self._commands.popleft())
            try:
                self._execute(batch)
            except BaseException as e:  # noqa: BLE001 - an executor failure is raised to every later caller
                with self._cv:
                    if isinstance(e, ConduitError):
                        self._fault = e
                    else:
                        self._fault = ConfigurationError(f"The Conduit buffer's assembler failed: {e!r}")
                        self._fault.__cause__ = e
            with self._cv:
                self._done += len(batch)
                self._cv.notify_all()

    def _execute(self, batch: list[_Command]) -> None:
        kind = batch[0].kind
        if kind == "ingest":
            self._ingest(batch)
        elif kind == "prepare":
            self._prepare(batch[0])
        else:
            cmd = batch[0]
            assert cmd.fn is not None
            try:
                result: tuple[bool, Any] = (True, cmd.fn())
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                result = (False, e)
            with self._cv:
                cmd.box.append(result)

    def _ingest(self, cmds: list[_Command]) -> None:
        assert self.edp is not None and self.layout is not None
        n = sum(c.n for c in cmds)
        arrays: dict[str, np.ndarray] = {}
        for path in self.layout.paths:
            parts = [c.arrays[path] for c in cmds]  # type: ignore[index]
            a = parts[0]
            if len(parts) > 1:
                a = np.concatenate(parts, axis=0)
            elif not (a.flags.c_contiguous and a.flags.writeable):
                a = np.ascontiguousarray(a) if a.flags.writeable else np.array(a, order="C")
            arrays[path] = a
        storage = self.edp.storage
        before = storage.oldest
        handles = self.edp.ingest(arrays, version=cmds[0].version)
        if self._counts is not None and handles is not None:
            self._counts[(handles % storage.capacity).numpy()] = 0
        evicted_to = storage.oldest
        with self._cv:
            self._staged -= n
            if self.cfg.replay_like and evicted_to > before:
                self._drop_ready_draws(lambda e: int(e.sampling_indices.min()) < evicted_to)
            if self._want_prefetch:
                self._want_prefetch = False
                self._refill()
            self._cv.notify_all()

    def _seal_now(self) -> None:
        assert self.edp is not None
        self.edp.seal()
        with self._cv:
            if self._want_prefetch:
                self._want_prefetch = False
                self._refill()

    def _drop_ready_draws(self, pred: Callable[[ReplayEntry], bool]) -> None:
        """Discard prepared replay draws matching ``pred`` and prepare replacements (caller holds no lock)."""
        with self._cv:
            keep: deque[ReplayEntry | BaseException] = deque()
            dropped = 0
            for e in self._ready:
                if isinstance(e, ReplayEntry) and pred(e):
                    dropped += 1
                else:
                    keep.append(e)
            if dropped:
                self._ready = keep
                self.stats.redrawn += dropped
                self._refill()

    def _prepare(self, cmd: _Command) -> None:
        assert self.edp is not None
        try:
            if self.cfg.semantics == "on_policy":
                batch, info = self.edp.deliver()
            else:
                batch, info = self.edp.deliver(cmd.n)
            entry = self._assemble(batch, info)
        except EmptyBufferError as e:
            with self._cv:
                self._inflight -= 1
                if cmd.demand:
                    self._ready.append(e)
                else:
                    self._want_prefetch = True
                self._cv.notify_all()
            return
        except ConduitError as e:
            with self._cv:
                self._inflight -= 1
                self._ready.append(e)
                self._cv.notify_all()
            return
        with self._cv:
            self._inflight -= 1
            self._ready.append(entry)
            self._cv.notify_all()

    def _assemble(self, batch: ExperienceBatch, info: SampleInfo) -> ReplayEntry:
        """Transpose the gathered ``[B, T, ...]`` columns into fresh ``[T, B, ...]`` arrays and build the record."""
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
        weights = None if info.weights is None else info.weights.numpy().copy()
        if weights is not None and hasattr(record, "register_metadata"):
            record.register_metadata(sampling_weight=weights)
        sem = self.cfg.semantics
        if sem == "queue":
            uses = int(info.epoch or 0)
            reuses: float = uses
            left = self.cfg.reuses - uses - 1
        elif sem == "on_policy":
            uses = int(info.epoch or 0)
            reuses, left = uses, self.cfg.num_epochs - uses - 1
        else:
            assert self._counts is not None
            slots = handles % self.edp.capacity
            reuses = float(self._counts[slots].mean()) if k else 0.0
            np.add.at(self._counts, slots, 1)
            left = -1
        return ReplayEntry(sample=record, reuses=reuses, sampling_indices=handles, reuses_left=left,
                           receive_time=time.time(), weights=weights, info=info)
