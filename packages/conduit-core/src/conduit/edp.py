"""The Experience Data Plane: ingest -> place -> deliver, with each step a pluggable role."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.checks import first_line, is_int, out_of_memory
from conduit.errors import AllocationError, CapacityError, ConfigurationError, NotCopyableError, SchemaError
from conduit.placement.base import HostPlacement, Placement
from conduit.scheduling.base import (
    Scheduler,
    Synchronous,
    check_scheduler_entry,
    lock_held,
    scheduler_entry,
    thread_flag,
)
from conduit.schema import ExperienceSchema
from conduit.semantics.base import SampleInfo, Selection, Semantics, check_unshared, claim, select_many
from conduit.semantics.onpolicy import OnPolicy, check_version
from conduit.semantics.replay import Replay
from conduit.storage.base import AppendResult, Storage
from conduit.storage.columnar import empty_column, pool_elements
from conduit.telemetry import Telemetry

if TYPE_CHECKING:
    from conduit.placement.migration import MigrationReport

__all__ = ["ExperienceDataPlane"]

T = TypeVar("T")


#: smallest delivery (bytes over its fixed fields) for which an unreferenced output buffer is reused
_REUSE_MIN_BYTES = 1 << 20


class _OutputRing:
    """Preallocated delivery buffers for the fixed fields, rotated over ``depth`` slots.

    With ``reuse_free`` (host buffers that are the delivery's final destination), the buffer
    returned last is handed out again when nothing references it any more: no tensor, view,
    NumPy array, storage object or autograd node holds any of its fields. A loop that drops each batch before
    asking for the next one then writes into one cache-warm buffer instead of ``depth``
    alternating ones, and a batch that is still held is never overwritten before ``depth``
    further deliveries, as without it. (Not for buffers an asynchronous device copy may still
    read: no reference is left once such a copy is enqueued.) Checked only for batches of at
    least ``_REUSE_MIN_BYTES``: smaller ones stay in cache either way, and the check costs about
    a microsecond per field.
    """

    def __init__(self, schema: ExperienceSchema, device: torch.device, depth: int, pin: bool,
                 reuse_free: bool = False) -> None:
        self.schema, self.device, self.depth, self.pin = schema, device, max(1, depth), pin
        self.reuse_free = reuse_free and self.depth > 1 and _OWNER_COUNTS
        self._bufs: list[dict[str, torch.Tensor]] = []
        self._held: list[_Held] = []
        self._free: list[tuple[int, ...]] = []
        self._rows = 0
        self._i = 0
        #: (page-locked rings) per buffer, the CUDA event after the copies out of it (:meth:`copied`), or None
        self._copies: list[Any] = [None] * self.depth
        #: the buffer :meth:`next` returned last (read under the caller's lock, as ``next`` is called)
        self.last = 0

    def next(self, n: int) -> dict[str, torch.Tensor]:
        if n > self._rows:
            # (rows set once the buffers are: an allocation that fails leaves the ring as it was)
            self._bufs = [{k: empty_column((n, *self.schema[k].shape), self.schema[k].dtype, self.device,
                                           pin_memory=self.pin) for k in self.schema.fixed}
                          for _ in range(self.depth)]
            self._rows = n
            # what "nobody else holds it" reads as, taken while that is certain (the counts an
            # interpreter reports for a loop variable or an argument differ between Python versions)
            big = n * self.schema.fixed_item_bytes >= _REUSE_MIN_BYTES
            self._held = [_held(b) for b in self._bufs] if self.reuse_free and big else []
            self._free = [_owners(h) for h in self._held]
            self._copies = [None] * self.depth  # (the old buffers: the caching host allocator keeps them for them)
        elif not (self._free and _owners(self._held[self._i]) == self._free[self._i]):
            self._i = (self._i + 1) % self.depth
        ev = self._copies[self._i]
        if ev is not None:  # the GPU may lag: the CPU must not rewrite a buffer an enqueued copy has yet to read
            ev.synchronize()
            self._copies[self._i] = None
        self.last = self._i
        buf = self._bufs[self._i]
        if n == self._rows:
            return buf
        return {k: v[:n] for k, v in buf.items()}

    def copied(self, i: int, device: torch.device) -> None:
        """Buffer ``i`` (page-locked) was just read by ``non_blocking`` copies enqueued on ``device``'s current
        stream: :meth:`next` waits for them before it hands the buffer out again (no-op for other rings)."""
        if self.pin and device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
            self._copies[i] = ev


#: a buffer's tensors, each with its storage object (held, so that a check makes no new one)
_Held = tuple[tuple[torch.Tensor, torch.UntypedStorage], ...]


def _held(buf: dict[str, torch.Tensor]) -> _Held:
    return tuple((t, t.untyped_storage()) for t in buf.values())


def _owners(held: _Held) -> tuple[int, ...]:
    """Per tensor: its Python references, its TensorImpl's owners (autograd, other tensors), its
    storage's owners (views, NumPy arrays) and the references to its storage object (torch keeps
    one Python object per storage, so ``held``'s is the one anybody else would get)."""
    out: list[int] = []
    for t, st in held:
        out += (sys.getrefcount(t), t._use_count(),  # type: ignore[attr-defined]  # private torch API
                torch._C._storage_Use_Count(st._cdata), sys.getrefcount(st))
    return tuple(out)


def _owner_counts_work() -> bool:
    """Whether this torch has the private owner counts :func:`_owners` reads, and they see a view.

    Without them (a torch that renamed or dropped them), delivery buffers just rotate: the
    reuse is an optimisation, never a reason for a delivery to fail.
    """
    try:
        held = _held({"t": torch.zeros(2)})
        before = _owners(held)
        view = held[0][0][1:]
        return _owners(held) != before and view.shape[0] == 1
    except (AttributeError, RuntimeError, TypeError):
        return False


#: checked once at import; False turns the output ring's reuse off
_OWNER_COUNTS = _owner_counts_work()


_get_ident = threading.get_ident


def check_roles(*, semantics: object = None, placement: object = None, scheduler: object = None,
                device: object = None) -> torch.device | None:
    """Refuse roles of the wrong kind (e.g. ``semantics="replay"``), unknown devices and CUDA devices this machine
    does not have with a :class:`ConfigurationError` before a buffer builds anything; returns ``device`` as a torch
    device (None stays None).
    """
    roles = (("semantics", semantics, Semantics, "Replay() or OnPolicy(...)"),
             ("placement", placement, Placement, "HostPlacement(), DevicePlacement(...), ..."),
             ("scheduler", scheduler, Scheduler, "Synchronous(), Overlapped(...) or Automatic()"))
    for name, role, kind, e in roles:
        if role is not None and not isinstance(role, kind):
            raise ConfigurationError(f"{name} must be a conduit {kind.__name__} (e.g. {e}), got {role!r}.")
    if device is None:
        return None
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"device must be a torch device or its name (e.g. 'cpu', 'cuda:0'), got "
                                 f"{device!r}.") from exc
    if dev.type == "cuda":  # (refused here: the first delivery would fail untyped, after its draw)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ConfigurationError(f"device {str(dev)!r} is not on this machine ({count} CUDA device(s) visible); "
                                     f"give a device it has (e.g. 'cpu', or 'cuda:0' on a machine with a GPU).")
    return dev


class ExperienceDataPlane:
    """The object a framework adapter holds: one buffer of experience and its three control points.

    * **ingest** (actor -> buffer): validate a batch against the schema, then store it
      in the placed tier, when the scheduler says so.
    * **placement**: the :class:`~conduit.placement.Placement` role builds the storage
      (host memory by default).
    * **deliver** (buffer -> learner): the :class:`~conduit.semantics.Semantics` role
      selects items (replay sample or on-policy minibatch), the storage gathers them into
      reused output buffers, and they move to ``device``.

    Delivered fixed-field tensors live in reused buffers: a delivered batch stays valid
    until ``scheduler.output_depth`` further deliveries (the second one after it by
    default). Call :meth:`ExperienceBatch.clone` to keep one longer.

    All public methods are thread-safe. Bad input raises a typed
    :class:`~conduit.ConduitError` and leaves the buffer unchanged.

    After :meth:`close` the buffer takes no more work: ingesting, delivering, the scheduler
    primitives (``*_now``), sealing, setting the policy version, updating priorities, migrating
    and ``load_state_dict`` raise :class:`~conduit.ConfigurationError` ("closed"); build a new
    buffer. Reading still works: ``len()``, the properties, :meth:`flush` and :meth:`state_dict`
    (the contents as ``close`` left them, to load into the new buffer), and ``close()`` again is harmless.

    Args:
        schema: the fields of one item.

    Keyword Args:
        capacity: item slots.
        semantics: ``Replay(...)`` (default: uniform) or ``OnPolicy(...)``; one object (and sampler) per buffer: one
            that another open buffer holds is refused (:class:`ConfigurationError`).
        placement: where the storage lives (default: host memory).
        scheduler: when work runs (default: synchronously in the caller).
        device: the learner's device delivered batches land on (default: the storage's).
        ragged_capacity: elements per ragged field's pool. Default: sized by the placement when it was planned
            for ragged fields (``Plan.build()`` of a ragged workload, or an
            :class:`~conduit.placement.AdaptivePlacement`: ``capacity`` items of the planned mean length);
            otherwise ``capacity`` items of 64 elements (``64 * capacity``), whatever the sequences' lengths (the
            schema carries no mean length). Set it for longer sequences: a batch with
            more elements than a pool is refused (:class:`CapacityError`), and when the pool wraps, replay evicts
            the oldest items before the slots are full (on-policy refuses the write until items are consumed).

    Raises:
        AllocationError: the storage of ``capacity`` items (and ragged pools) cannot be allocated where the
            placement puts it (too little memory; a :class:`CapacityError` and a ``MemoryError``); lower capacity or
            choose another placement. The semantics stay free for another buffer.

    Examples:
        >>> import torch
        >>> from conduit import ExperienceDataPlane, ExperienceSchema, Field
        >>> edp = ExperienceDataPlane(ExperienceSchema(obs=Field((3,))), capacity=8)
        >>> handles = edp.ingest({"obs": torch.ones(5, 3)})
        >>> batch, info = edp.deliver(4)
        >>> batch["obs"].shape, len(edp)
        (torch.Size([4, 3]), 5)
    """

    def __init__(self, schema: ExperienceSchema, *, capacity: int, semantics: Semantics | None = None,
                 placement: Placement | None = None, scheduler: Scheduler | None = None,
                 device: torch.device | str | None = None, ragged_capacity: int | None = None) -> None:
        if not isinstance(schema, ExperienceSchema):
            raise ConfigurationError("schema must be a conduit.ExperienceSchema.")
        device = check_roles(semantics=semantics, placement=placement, scheduler=scheduler, device=device)
        if is_int(capacity):  # a NumPy integer is a count too: a Python int before any size is computed from it
            capacity = int(capacity)
        if semantics is not None:  # (before anything is built: a buffer open with them would lose them)
            check_unshared(semantics)
        self.schema = schema
        self.semantics: Semantics = semantics if semantics is not None else Replay()
        self.placement: Placement = placement if placement is not None else HostPlacement()
        self.storage: Storage = self.placement.storage(schema, capacity, ragged_capacity=ragged_capacity)
        self.semantics.bind(self.storage)
        self.device = torch.device(device) if device is not None else self.storage.device
        self.telemetry = Telemetry()
        self._lock = threading.RLock()
        #: (replaced schema, its migration's transform), oldest first: see :meth:`_current`
        self._upgrades: list[tuple[ExperienceSchema, Callable[[ExperienceBatch], Any]]] = []
        self._replay = isinstance(self.semantics, Replay)
        #: on-policy: a write re-checks its version's order under the lock (see ingest_now)
        self._versioned: OnPolicy | None = self.semantics if isinstance(self.semantics, OnPolicy) else None
        #: set by close(): the scheduler may then serve another buffer, and this one takes no more work
        self.closed = False
        #: per thread: ``finishing`` (inside close()/flush(), whose scheduler may still store what was handed over
        #: before close)
        self._tls = threading.local()
        #: the thread inside ingest_now's write (which holds the lock), or None
        self._writer: int | None = None
        #: the thread that closed this buffer from inside one of its writes (a callback): its scheduler may store
        #: the rest of its queue on that thread after close() returned
        self._drainer: int | None = None
        self.scheduler: Scheduler = scheduler if scheduler is not None else Synchronous()
        self._build_outputs()
        self.scheduler.attach(self)
        claim(self.semantics, self)  # (once built: a build that failed claims nothing)

    def _build_outputs(self) -> None:
        same = self.device == self.storage.device
        pin = self.storage.device.type == "cpu" and self.device.type == "cuda"
        depth = self.scheduler.output_depth
        host_final = same and self.device.type == "cpu"
        self._gather_out = _OutputRing(self.schema, self.storage.device, depth, pin, reuse_free=host_final)
        self._device_out = None if same else _OutputRing(self.schema, self.device, depth, False)

    def _nbytes(self, batch: ExperienceBatch) -> int:
        """Bytes of ``batch`` (from the schema when every field is fixed-size)."""
        return batch.batch_size * self.schema.fixed_item_bytes if not self.schema.ragged else batch.nbytes()

    # -- properties ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.storage.capacity

    def __len__(self) -> int:
        with self._lock:
            return len(self.storage)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse ``pickle``, ``copy.copy`` and ``copy.deepcopy``: the buffer owns its storage, locks and scheduler
        threads, which a copy could neither own nor share. Its :meth:`state_dict` (tensors and plain values) is
        what pickles; :meth:`load_state_dict` puts it into a new buffer built with the same schema and capacity."""
        raise NotCopyableError(
            "An ExperienceDataPlane cannot be pickled or copied (it owns its storage, locks and scheduler threads). "
            "Save its contents with edp.state_dict() (torch.save or pickle take it) and load them with "
            "load_state_dict() into a new ExperienceDataPlane built with the same schema and capacity.")

    def __repr__(self) -> str:
        return (f"ExperienceDataPlane({self.schema!r}, capacity={self.capacity}, "
                f"semantics={type(self.semantics).__name__}, tier={self.storage.tier}, device={self.device})")

    # -- ingestion -------------------------------------------------------------------------
    def ingest(self, batch: Mapping[str, Any] | ExperienceBatch, *, version: int | None = None,
               priorities: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hand a batch of items to the buffer.

        Args:
            batch: one row per item for every schema field (tensors, NumPy arrays, ``Ragged``
                or lists of sequences for ragged fields).

        Keyword Args:
            version: the policy version that produced the batch (required on-policy; replay semantics keep no versions
                and ignore it, so that one producer can feed either kind of buffer).
            priorities: initial priorities (prioritized replay only; default: the max seen).

        Returns:
            The items' handles (int64), or None when the scheduler stores the batch later: it then still reads the
            batch's tensors and arrays, so do not write into them until :meth:`flush` (or build the scheduler with
            ``copy_on_ingest=True``, ``Overlapped`` and ``Automatic`` take it, to let the producer reuse them at once).

        Raises:
            SchemaError: fields, dtypes or shapes do not match the schema.
            CapacityError: the batch is larger than the capacity (or a ragged field's pool).
            PriorityError: a priority is NaN, infinite or negative.
            ConfigurationError: a version or priority the semantics cannot take; the buffer is closed.
        """
        self._check_open()
        t0 = time.perf_counter()
        if type(batch) is dict and version is None and priorities is None and type(self.scheduler) is Synchronous:
            handles = self._ingest_rows(batch, t0)
            if handles is not None:
                return handles
        schema = self.schema
        b = ExperienceBatch.checked(batch, schema)
        n = b.batch_size
        if n > self.storage.capacity:
            raise CapacityError(f"A batch of {n} items is larger than the capacity ({self.storage.capacity}); "
                                f"split it or raise capacity.")
        storage = self.storage
        # refused here, not in a background write: it could never be stored. (Against the storage of the schema it
        # was validated for: after a migration to a new schema swapped them meanwhile, the batch is transformed
        # when it is stored, and the storage checks what the transform made.)
        if schema.ragged and storage.schema == schema:
            try:
                storage.check_ragged_fits(b)
            except CapacityError as exc:
                raise CapacityError(f"{exc} {self._pool_hint()}") from None
        self.semantics.check_ingest(n, version=version, priorities=priorities)
        try:
            out = self.scheduler.ingest(b, version=version, priorities=priorities)
        except BaseException:  # the caller waited for the call all the same (e.g. for room in a full queue)
            self.telemetry.record("ingest_wait", 0, 0, t0, time.perf_counter())  # (no items: none accepted)
            raise
        # the caller's whole call (validation, and storing or handing over); see conduit.exposure
        self.telemetry.record("ingest_wait", n, 0, t0, time.perf_counter())
        return out

    def _ingest_rows(self, columns: dict[str, Any], t0: float) -> torch.Tensor | None:
        """:meth:`ingest`, for the common case in one step: synchronous replay and a dict that the storage checks
        and stores whole (:meth:`Storage.append_rows`: the host ring's compiled row store takes exact tensors of the
        schema's fields). Stores, evicts, updates the sampler and records telemetry as the general path does, without
        building an :class:`ExperienceBatch`. None, with nothing changed, for any other buffer or batch: the general
        path then validates it, and stores or refuses it. Also after a migration to a new schema: the storage takes
        only a dict of the current schema's fields, which the general path stores untransformed too (a batch of a
        replaced schema goes the general path)."""
        if type(self.semantics) is not Replay:  # (Replay.check_ingest refuses nothing without priorities)
            return None
        with self._lock:
            if self.closed:
                return None
            outer, self._writer = self._writer, _get_ident()
            try:
                res = self.storage.append_rows(columns)
                if res is None:
                    return None
                self.semantics.on_append(res, version=None, priorities=None)
            finally:
                self._writer = outer
        t1 = time.perf_counter()
        n = res.count
        self.telemetry.record("ingest", n, n * self.schema.fixed_item_bytes, t0, t1)
        # the caller's whole call, as ingest() records it (see conduit.exposure)
        self.telemetry.record("ingest_wait", n, 0, t0, t1)
        return torch.from_numpy(np.arange(res.first, res.first + n, dtype=np.int64))

    def _pool_hint(self) -> str:
        """What sets the ragged pools' size, for the error of a batch that does not fit them."""
        pool = getattr(self.storage, "ragged_capacity", None)
        default = " (the default: 64 per item of capacity)" if pool == pool_elements(None, self.capacity) else ""
        return (f"Each ragged field's pool holds {pool} elements{default}; build the buffer with "
                f"ExperienceDataPlane(..., ragged_capacity=N), N about capacity x the mean sequence length (or "
                f"AdaptivePlacement(..., mean_ragged_length=L)). The buffer is unchanged.")

    def ingest_now(self, batch: ExperienceBatch, *, version: int | None = None,
                   priorities: torch.Tensor | None = None,
                   on_stored: Callable[[], None] | None = None) -> torch.Tensor:
        """Store an already validated batch now (the scheduler's primitive).

        ``on_stored`` is called under the buffer's lock, in the hold that stored the batch (a scheduler
        marks the batch stored there, so what it reports pending agrees with the storage under that lock).

        After :meth:`close` only the scheduler's own storing of what was handed over before it runs (from
        ``close()`` or ``flush()``, or on the thread that closed the buffer from inside a write); any other
        call raises :class:`ConfigurationError`.

        A call that raises records its ``ingest`` span all the same, with no items (a failed write on a scheduler's
        worker is that worker's experience-path time, see :mod:`conduit.exposure`).
        """
        t0 = time.perf_counter()
        try:
            res, batch = self._store_now(batch, version, priorities, on_stored)
        except BaseException:
            self.telemetry.record("ingest", 0, 0, t0, time.perf_counter())  # (no items: none stored)
            raise
        self.telemetry.record("ingest", res.count, self._nbytes(batch), t0, time.perf_counter())
        return torch.from_numpy(np.arange(res.first, res.first + res.count, dtype=np.int64))

    def _store_now(self, batch: ExperienceBatch, version: int | None, priorities: torch.Tensor | None,
                   on_stored: Callable[[], None] | None) -> tuple[AppendResult, ExperienceBatch]:
        """:meth:`ingest_now`'s write, without its telemetry: what it stored, and the batch as stored (in the
        current schema)."""
        with self._lock:
            if self.closed and not getattr(self._tls, "finishing", False) and _get_ident() != self._drainer:
                self._check_open()
            if self._versioned is not None and version is not None:
                # ingest() checked the order before taking the lock: another producer's newer version may have
                # been stored since (concurrent Synchronous producers); nothing of this batch is stored then
                self._versioned.check_version_order(version)
            if self._upgrades:
                batch = self._current(batch)
            outer, self._writer = self._writer, _get_ident()
            oldest = self.storage.oldest
            try:
                try:
                    res = self.storage.append(batch, evict=self._replay)
                except BaseException:
                    if self.storage.oldest > oldest:
                        # a write that failed part way kept the evictions it made (nothing of the batch is live): the
                        # semantics drop those items, so no draw returns an evicted handle
                        self.semantics.on_append(AppendResult(self.storage.next_handle, 0, oldest,
                                                              self.storage.oldest), version=None, priorities=None)
                    raise
                self.semantics.on_append(res, version=version, priorities=priorities)
                if on_stored is not None:
                    on_stored()
            finally:
                self._writer = outer
        return res, batch

    def _current(self, batch: ExperienceBatch) -> ExperienceBatch:
        """``batch`` in the current schema (call under the lock).

        A batch validated against a schema that a migration has replaced since (a producer
        between validation and storing, or a batch queued for background storage) is mapped
        through that migration's transform, and any later one's, as the migrated items were.

        Raises:
            SchemaError: the batch fits neither the current schema nor a replaced one, or a
                transform fails on it (nothing is stored).
        """
        from conduit.placement.migration import transformed

        if _fits(batch, self.schema):
            return batch
        for i, (old, _) in enumerate(self._upgrades):
            if not _fits(batch, old):
                continue
            targets = [s for s, _ in self._upgrades[i + 1:]] + [self.schema]
            for (_, transform), target in zip(self._upgrades[i:], targets, strict=True):
                batch = transformed(transform, batch, target)
            return batch
        raise SchemaError("This batch matches neither the buffer's schema nor one a migration replaced; it was "
                          "not stored.")

    def flush(self) -> None:
        """Block until every batch handed to ``ingest`` before the call is in storage.

        Batches other threads hand over meanwhile are not waited for, so a flush returns while producers
        keep ingesting (``seal``, ``state_dict`` and ``migrate`` flush first).

        After :meth:`close` it waits for what the scheduler still stores for this buffer (a close from
        inside a write leaves the rest of the queue to the ingestion worker), and returns at once when the
        scheduler serves another buffer by then.
        """
        if not self.closed:
            if type(self.scheduler) is Synchronous:  # (stores in ingest: nothing to wait for)
                self.scheduler.flush()
                return
            t0 = time.perf_counter()
            try:
                self.scheduler.flush()
            finally:  # the caller's wait for the scheduler's writes (exposed time: see conduit.exposure)
                self.telemetry.record("flush_wait", 0, 0, t0, time.perf_counter())
            return
        if getattr(self.scheduler, "edp", None) is self:
            with self._finishing():
                self.scheduler.flush()

    def _check_open(self) -> None:
        """:class:`ConfigurationError` once :meth:`close` ran."""
        if self.closed:
            raise ConfigurationError("This ExperienceDataPlane is closed; build a new one (load a state_dict() taken "
                                     "before close() into it to keep the contents).")

    # -- delivery --------------------------------------------------------------------------
    def deliver(self, n: int | None = None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        """The next batch for the learner, on ``device``.

        Replay: ``n`` items drawn by the sampler (keyword ``replace=True``, ``beta=None``; ``beta``, the
        importance-weight exponent, is for prioritized replay only: a uniform buffer refuses it).
        On-policy: the next minibatch of the oldest sealed rollout (call with no ``n``).

        Raises:
            EmptyBufferError: nothing to deliver.
            CapacityError: a draw without replacement larger than the contents; a replay delivery too large for
                memory (its indices or rows cannot be allocated), refused with nothing drawn (the sampler's RNG as
                before the call) as :class:`~conduit.errors.AllocationError`, a ``CapacityError`` and a ``MemoryError``.
            StaleExperienceError: on-policy data too stale and ``on_stale="raise"``.
            ConfigurationError: the buffer is closed; an option the semantics do not take (e.g. ``beta`` on a
                uniform buffer). Nothing is drawn then.
        """
        self._check_open()
        t0 = time.perf_counter()
        try:
            batch, info = self.scheduler.deliver(n, **kwargs)
        except BaseException:  # the caller waited for the call all the same (e.g. for a flush or a prefetch job)
            self.telemetry.record("deliver_wait", 0, 0, t0, time.perf_counter())  # (no items: none delivered)
            raise
        # the caller's whole call (selecting and gathering, or taking a prepared batch); see conduit.exposure
        self.telemetry.record("deliver_wait", batch.batch_size, 0, t0, time.perf_counter())
        return batch, info

    def deliver_now(self, n: int | None = None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        """Select and gather now (the scheduler's primitive).

        A call that raises records its ``deliver`` span all the same, with no items (see :meth:`ingest_now`)."""
        t0 = time.perf_counter()
        try:
            batch, info, k = self._deliver_now(n, kwargs)
        except BaseException:
            self.telemetry.record("deliver", 0, 0, t0, time.perf_counter())  # (no items: none delivered)
            raise
        self.telemetry.record("deliver", k, self._nbytes(batch), t0, time.perf_counter())
        return batch, info

    def _deliver_now(self, n: int | None, kwargs: dict[str, Any]) -> tuple[ExperienceBatch, SampleInfo, int]:
        """:meth:`deliver_now`'s selection and gather, without its telemetry: the batch, its info and its items."""
        with self._lock:
            self._check_open()
            gather_out = self._gather_out
            # a replay delivery too large for memory (its draw, or its rows) is refused with its draw given back;
            # only one larger than every delivery before it can be (the output buffers then grow)
            drawn = self.semantics.draw_state() if is_int(n) and n > gather_out._rows else None
            try:
                sel = self.semantics.select(n, **kwargs)
            except (MemoryError, RuntimeError) as e:
                self._refuse_if_too_large(e, n, drawn)
                raise
            k = int(sel.slots.shape[0])
            try:
                try:
                    rows = gather_out.next(k)
                except (MemoryError, ValueError, RuntimeError) as e:
                    self._refuse_if_too_large(e, n, drawn)
                    raise
                batch = self.storage.gather(sel.slots, rows)
            finally:  # handed over either way: a read that failed consumed the selection (the error says so)
                self.semantics.after_gather(sel)
            # taken under the lock: a migration may swap the ring, and concurrent deliveries get distinct buffers
            source = gather_out.last
            dev_bufs = self._device_out.next(k) if self._device_out is not None else None
        if dev_bufs is not None:
            batch = self._to_device(batch, dev_bufs)
            gather_out.copied(source, self.device)
        return batch, sel.info, k

    def _refuse_if_too_large(self, e: BaseException, n: int | None, drawn: Any) -> None:
        """:class:`AllocationError` when ``e`` is a replay delivery of ``n`` items that did not fit in memory (its
        indices or its rows), with the sampler's RNG put back to ``drawn`` (its :meth:`Semantics.draw_state` before
        the draw): the buffer's next samples are those it would have drawn without the call. Returns otherwise
        (another error, or semantics that cannot give a draw back), for the caller to raise ``e``."""
        if drawn is None or not out_of_memory(e):
            return
        self.semantics.rewind_draws(drawn)
        raise AllocationError(f"A delivery of {n} items does not fit in memory ({first_line(e)}); "
                              f"deliver fewer items per call. Nothing was drawn.") from e

    # -- primitives for prefetching schedulers -----------------------------------------------
    def select_now(self, sizes: Sequence[int | None], *, peek: bool = False, when: Callable[[], bool] | None = None,
                   **kwargs: Any) -> list[Selection] | None:
        """Select ``len(sizes)`` deliveries in order, exactly as that many ``deliver_now`` calls would.

        Nothing is gathered and consumed data is not released (see :meth:`release_now`).
        With ``peek=True`` the semantics' state is restored afterwards, so the selections
        only *predict* the next deliveries (on-policy prefetch confirms a prediction with a
        real selection at delivery time). When ``when`` is given it is checked under the
        same lock first; ``None`` is returned, and nothing selected, when it is false.

        On-policy, hand every real selection over with :meth:`release_now` once its rows are read: storage of
        a rollout consumed meanwhile (finished, or dropped as stale) under it stays live until then.
        """
        with self._lock:
            self._check_open()
            if when is not None and not when():
                return None
            return select_many(self.semantics, sizes, peek=peek, **kwargs)

    def read_locked(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` under the buffer's lock and return its result.

        It is the lock ``ingest_now``, ``deliver_now`` and ``select_now`` hold while they change the
        storage and the semantics: ``fn`` sees them between two such steps, never part way through one
        (e.g. counts and cursors that agree with each other). ``fn`` runs on the calling thread; the lock is
        re-entrant, so ``fn`` may call the buffer's methods, but it should be short (it holds up ingestion
        and delivery). A call in ``fn`` that would wait for a scheduler's worker thread, which needs this lock
        (e.g. ``flush``, ``seal`` or ``state_dict`` while batches wait for background storing, or ``state_dict`` or
        ``close`` while a prefetch job waits for this lock), raises :class:`ConfigurationError` and changes nothing,
        instead of waiting forever. A ``deliver`` in ``fn`` never waits for a prefetch job that has not taken this
        lock: it cancels the job (which has drawn nothing) and draws the batch in the call, as a synchronous delivery
        would, so its draws are the same whether or not the job took the lock before ``fn`` began. A ``deliver`` (or
        ``state_dict``, ``close``) in ``fn`` while a prefetching scheduler's delivery runs on another thread waits for
        that delivery when it needs this lock no more (e.g. it hands out a prepared batch), and is refused when that
        delivery waits for this lock (or for a prefetch job yet to take it): which one follows from where that
        delivery is, not from timing. Ingestion in the caller (``Synchronous``, or
        ``Overlapped(background_ingest=False)``) stores from ``fn`` at once, with what other producers handed over
        before it (a producer waiting to store waits for ``fn`` to return).

        Raises:
            ConfigurationError: the buffer is closed (as ``select_now`` is refused then); ``fn`` did not run.
        """
        with self._lock:
            self._check_open()
            return fn()

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The buffer's re-entrant lock, as a context manager: the one :meth:`read_locked`, ``ingest_now``,
        ``deliver_now`` and ``select_now`` hold.

        For a scheduler role that stores or prepares under it together with locks of its own: take this one first
        (the order every write keeps), and use :meth:`read_locked` for everything else. Unlike ``read_locked``,
        entering it works after :meth:`close` (a scheduler stores there what was handed over before ``close``).
        """
        return self._lock

    def holds_lock(self) -> bool:
        """Whether the calling thread holds the buffer's lock (inside :meth:`read_locked`'s function, or a callback of a
        write). A scheduler's worker thread needs that lock to store or prepare, so a call that would wait for the
        worker there is refused instead of waiting forever (:func:`conduit.scheduling.base.wait_refused`)."""
        return lock_held(self._lock)

    def gather_now(self, selections: Sequence[Selection],
                   out: dict[str, torch.Tensor] | Callable[[int], dict[str, torch.Tensor] | None] | None = None,
                   ) -> ExperienceBatch:
        """The rows of ``selections``, back to back, into ``out`` (or ``out(rows)``, called under the buffer's
        lock; ``None`` there: fresh memory), on the storage's device. A call that raises records its ``deliver``
        span all the same, with no items (see :meth:`ingest_now`)."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._check_open()
                batch = self._gather(selections, out)
        except BaseException:
            self.telemetry.record("deliver", 0, 0, t0, time.perf_counter())  # (no items: none gathered)
            raise
        self.telemetry.record("deliver", batch.batch_size, batch.nbytes(), t0, time.perf_counter())
        return batch

    def prepare_now(self, sizes: Sequence[int | None],
                    out: dict[str, torch.Tensor] | Callable[[int], dict[str, torch.Tensor] | None] | None = None, *,
                    peek: bool = False, when: Callable[[], bool] | None = None,
                    **kwargs: Any) -> tuple[ExperienceBatch, list[Selection]] | None:
        """:meth:`select_now` and :meth:`gather_now` under one lock hold (no ingestion in between). A call that
        raises records its ``deliver`` span all the same, with no items (see :meth:`ingest_now`).

        Raises:
            AllocationError: replay selections whose rows cannot be allocated (too large for memory; a
                :class:`CapacityError` and a ``MemoryError``); their draws are given back, as if none were made.
        """
        t0 = time.perf_counter()
        try:
            with self._lock:
                sels = self.select_now(sizes, peek=peek, when=when, **kwargs)
                if sels is None:
                    return None
                try:
                    batch = self._gather(sels, out)
                except (MemoryError, ValueError, RuntimeError) as e:  # (real replay draws are given back then)
                    self._refuse_if_too_large(e, sizes[0], sels[0].drawn_from if sels else None)
                    raise
        except BaseException:
            self.telemetry.record("deliver", 0, 0, t0, time.perf_counter())  # (no items: none gathered)
            raise
        self.telemetry.record("deliver", batch.batch_size, batch.nbytes(), t0, time.perf_counter())
        return batch, sels

    def release_now(self, selection: Selection, *, when: Callable[[], object] | None = None) -> None:
        """Tell the semantics a selection was handed over (on-policy frees a finished rollout here, and storage
        held back for the selection). ``when`` runs first, under the buffer's lock (as the other primitives'
        callbacks do: a scheduler clears there a mark that it waits for that lock)."""
        with self._lock:
            if when is not None:
                when()
            self._check_open()
            self.semantics.after_gather(selection)

    def _gather(self, sels: Sequence[Selection],
                out: dict[str, torch.Tensor] | Callable[[int], dict[str, torch.Tensor] | None] | None
                ) -> ExperienceBatch:
        slots = sels[0].slots if len(sels) == 1 else torch.cat([s.slots for s in sels])
        k = int(slots.shape[0])
        bufs = out(k) if callable(out) else out
        view = None if bufs is None else {name: t[:k] for name, t in bufs.items()}
        return self.storage.gather(slots, view)

    def _to_device(self, batch: ExperienceBatch, out: dict[str, torch.Tensor]) -> ExperienceBatch:
        """``batch`` on the learner's device: fixed fields into ``out``, ragged ones into new tensors.

        To a GPU the copies are ``non_blocking`` (ordered before the learner's work on its current stream; a
        page-locked source is kept until they ran, see :meth:`_OutputRing.copied`). To the host they are
        synchronous: a ``non_blocking`` copy from a GPU into host memory (``.to`` makes that memory page-locked)
        returns before the bytes arrived, and the host learner would read them early."""
        cols: dict[str, torch.Tensor | Ragged] = {}
        non_blocking = self.device.type != "cpu"
        for name in self.schema:
            c = batch[name]
            if isinstance(c, Ragged):
                cols[name] = c.to(self.device, non_blocking=non_blocking)
            else:
                cols[name] = out[name].copy_(c, non_blocking=non_blocking)
        return ExperienceBatch(cols, batch.batch_size)

    def update_priorities(self, handles: torch.Tensor | np.ndarray, priorities: torch.Tensor | np.ndarray) -> int:
        """New priorities for delivered items, by handle (tensors or NumPy arrays).

        Returns:
            How many handles were live; updates for evicted handles are ignored.

        Raises:
            PriorityError: NaN, infinite or negative priorities, priorities that are no numbers (bools, strings),
                a length mismatch, or a handle this buffer never issued (negative, or beyond the last item
                ingested); no priority changes then.
            ConfigurationError: the buffer is not prioritized.
        """
        if not isinstance(self.semantics, Replay):
            raise ConfigurationError("update_priorities needs Replay semantics with a PrioritizedSampler.")
        with self._lock:
            self._check_open()
            applied = self.semantics.update_priorities(handles, priorities)
        self.scheduler.invalidate("priorities")
        return applied

    # -- on-policy control -------------------------------------------------------------------
    def _on_policy(self) -> OnPolicy:
        if not isinstance(self.semantics, OnPolicy):
            raise ConfigurationError("This call needs OnPolicy semantics.")
        return self.semantics

    def seal(self) -> None:
        """Close the open on-policy rollout so it can be delivered."""
        sem = self._on_policy()
        self._check_open()
        self.flush()
        with self._lock:
            self._check_open()
            sem.seal()

    def drop_stale(self) -> int:
        """Drop the sealed rollouts too stale to deliver at the current policy version (see
        :meth:`OnPolicy.drop_stale`): the way on after a delivery refused one with ``on_stale="raise"``,
        which leaves it waiting, so that every later delivery raises again.

        Returns:
            The items dropped (0 when nothing is stale).

        Raises:
            ConfigurationError: the buffer is not on-policy, or is closed.
        """
        sem = self._on_policy()
        with self._lock:
            self._check_open()
            return sem.drop_stale()

    def set_policy_version(self, version: int) -> None:
        """Tell the buffer which policy version the learner is at (staleness is measured against it).

        The version may also go back (a learner that reverts to an older policy, or a retry of a
        delivery refused as stale): staleness is measured against it, so it can come out negative
        for rollouts newer than the policy, and such rollouts are never stale.

        Raises:
            ConfigurationError: ``version`` is not an integer (a NumPy or 0-d tensor integer is fine);
                the version is then unchanged.
        """
        sem = self._on_policy()
        v = check_version(version)
        with self._lock:
            self._check_open()
            sem.policy_version = v
        self.scheduler.invalidate("policy")

    # -- placement ---------------------------------------------------------------------------
    def migrate(self, placement: Placement, *, schema: ExperienceSchema | None = None,
                transform: Callable[[ExperienceBatch], Any] | None = None,
                ragged_capacity: int | None = None) -> MigrationReport:
        """Move every live item, online, to storage built by ``placement`` (same capacity; ragged pools of
        ``ragged_capacity`` elements, default: the current pools').

        Handles, slots, priorities, the sampler's RNG and on-policy progress are kept:
        nothing is lost, duplicated or re-prioritised. Ingestion and delivery continue
        between copied chunks and wait only for the last chunk and the swap (the report's
        ``max_blocked_s``). With a new ``schema`` (experience grew), ``transform`` maps
        each old-schema chunk to the new schema. Once it commits, the old storage is closed (the disk tier's
        files are deleted then); a migration that fails keeps it in use. See :mod:`conduit.placement.migration`.

        Raises:
            PlacementError: the new placement cannot hold the buffer (the buffer is unchanged).
            ConfigurationError, SchemaError: a bad schema or transform (the buffer is unchanged).
        """
        from conduit.placement.migration import migrate

        self._check_open()
        return migrate(self, placement, schema=schema, transform=transform, ragged_capacity=ragged_capacity)

    def _adopt_storage(self, storage: Storage, placement: Placement, schema: ExperienceSchema,
                       transform: Callable[[ExperienceBatch], Any] | None = None) -> None:
        """Swap in a storage holding the same live handles (call under the lock).

        With a new ``schema``, ``transform`` (old-schema batch -> new schema) is kept for the
        old-schema batches still on their way to storage (:meth:`_current`).

        The semantics are re-pointed, not re-bound: ``bind`` would reset the sampler, and
        slots are unchanged (same capacity), so priorities and RNG state stay valid. The
        caller tells the scheduler afterwards, outside the lock.
        """
        if schema != self.schema:
            if transform is None:
                raise ConfigurationError("A new schema needs the transform that maps old-schema batches to it.")
            self._upgrades.append((self.schema, transform))
        self.storage = storage
        self.placement = placement
        self.schema = schema
        self.semantics.storage = storage
        sampler = getattr(self.semantics, "sampler", None)
        if sampler is not None:
            sampler.storage = storage
        self._build_outputs()

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Contents, handles and sampler state (RNG included); exact round trip.

        A ``"scheduler"`` entry is added when the scheduler has state to keep (:meth:`Scheduler.state_dict`,
        e.g. :class:`~conduit.scheduling.Automatic`'s calibrated decision): a buffer whose scheduler is of the
        same kind then goes on with it after :meth:`load_state_dict`.

        Also after :meth:`close` (read only): the buffer as ``close`` left it, everything handed over stored
        and the draws a prefetching scheduler had prepared given back (unless ``close`` ran from a callback
        inside a write), so a new buffer that loads it goes on exactly as this one would have (the scheduler,
        free to serve another buffer by then, is not touched; its state is kept unless it serves another buffer).
        """
        self.flush()
        if not self.closed:
            self.scheduler.invalidate("checkpoint")
        with self._lock:
            out = {"format": 1, "storage": self.storage.state_dict(), "semantics": self.semantics.state_dict()}
        entry = scheduler_entry(self.scheduler, self)
        if entry is not None:
            out["scheduler"] = entry
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved into a buffer built with the same schema and capacity.

        The checkpoint loads whatever this buffer's scheduler is. Its ``"scheduler"`` entry (absent in
        checkpoints of schedulers with nothing to keep) is applied only when this buffer's scheduler is of
        the kind that saved it (e.g. a new ``Automatic`` takes the saved decision instead of calibrating);
        with another kind it is ignored.

        Raises:
            ConfigurationError: ``state`` is not what :meth:`state_dict` returns, or is damaged (wrong
                types, dtypes or shapes, handles outside its live range, a damaged ``"scheduler"`` entry);
                the buffer is unchanged.
            CapacityError: a ragged field's live elements exceed this buffer's ragged pool (unchanged).
            ConfigurationError: the buffer is closed (load into a new one).
        """
        self._check_open()
        if (not isinstance(state, Mapping) or state.get("format") != 1
                or not isinstance(state.get("storage"), Mapping) or not isinstance(state.get("semantics"), Mapping)):
            raise ConfigurationError("Unknown checkpoint format; it was not written by ExperienceDataPlane "
                                     "(expected the dict its state_dict() returns).")
        # checked before anything changes; applied once the contents are in
        load_scheduler = "scheduler" in state and check_scheduler_entry(self.scheduler, state["scheduler"])
        self.flush()
        with self._lock:  # checked before prepared deliveries are dropped: a refused load changes nothing
            self._check_open()
            oldest, batch = self.storage.checkpoint_batch(state["storage"])
            before = self.semantics.load_checked(state["semantics"])
            try:
                self.semantics.check_live(oldest, oldest + batch.batch_size)
            finally:
                self.semantics.load_state_dict(before)
        self.scheduler.invalidate("contents")
        with self._lock:  # (the storage's load checks its checkpoint again before it changes anything)
            before = self.semantics.load_checked(state["semantics"])
            try:
                self.storage.load_state_dict(state["storage"])
            except BaseException:
                self.semantics.load_state_dict(before)
                raise
        if load_scheduler:
            self.scheduler.load_state_dict(state["scheduler"]["state"])

    def close(self) -> None:
        """Stop background work, storing everything handed over first (then the scheduler is free to serve
        another buffer, and this buffer takes no more work: see the class docstring).

        Closing again is harmless: while the scheduler still serves this buffer it finishes what the first
        close left (e.g. waits for the queue a close from inside a write left to the ingestion worker, and
        raises what could not be stored), else it does nothing. A close that raised leaves the buffer open.
        """
        if self.closed and getattr(self.scheduler, "edp", None) is not self:
            return  # the scheduler serves another buffer now: nothing of this one is left in it
        inside_write = self._writer == threading.get_ident()
        if not self.closed and not inside_write:
            # prepared draws are given back (as for a checkpoint) before the scheduler drops them, so that a
            # state_dict() after close continues exactly (not from a callback inside a write: a delivery may
            # wait for the lock that write holds, and the scheduler's close stops prefetching on its own then)
            self.scheduler.invalidate("checkpoint")
        with self._finishing():
            self.scheduler.close()
        with self._lock:
            self.closed = True
            if inside_write:  # the scheduler may store the rest of its queue on this thread, after this returns
                self._drainer = threading.get_ident()
            elif self._drainer is not None and self._drainer != threading.get_ident():
                self._drainer = None  # (the scheduler's close from here waited for that thread's queue)

    @contextmanager
    def _finishing(self) -> Iterator[None]:
        """Mark this thread as finishing the buffer's work (close/flush): the scheduler may store then."""
        with thread_flag(self._tls, "finishing"):
            yield

    def __enter__(self) -> ExperienceDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fits(batch: ExperienceBatch, schema: ExperienceSchema) -> bool:
    try:
        batch.validate(schema)
    except SchemaError:
        return False
    return True
