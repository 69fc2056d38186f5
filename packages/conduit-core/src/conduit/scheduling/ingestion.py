"""The ingestion side of a scheduler: hand-over, coalescing at ``g_ing``, background storing.

Producers hand validated batches over; the data reaches storage in *groups*. A group is
up to ``g_ing`` hand-overs off-policy (rollouts per ingestion call), or up to ``g_ing``
of a rollout's items on-policy (rollout parts per ingestion call), never mixing policy
versions, batches with and without priorities, or batches of different fields (validated either
side of a migration to a new schema: each is stored, an old one transformed, apart), and never holding more
rows than the capacity or more elements of a ragged field than its pool (each batch alone fits: checked at
``ingest``; a group that did not could never be stored). A group of
several batches is staged into one reused buffer and stored with one storage write (one lock hold, one semantics
update): the per-call overhead is paid once per group.

In the background (``background=True``) one worker thread stores groups; ``handover``
returns as soon as the batch is queued. The queue is bounded (``queue_depth`` batches):
a full queue blocks the producer (backpressure). A group is stored when it is complete,
when the queue is full, when a version changes, or when :meth:`flush` asks for it.

Nothing is lost: a batch whose storing fails stays at the head of the queue (with
everything after it, in order), storing pauses, and the error is raised once from the
producer's next ``handover``, ``flush`` or ``close``. The next ``flush`` (``seal`` flushes)
or ``close`` retries it, and raises again if it still fails. While paused, hand-overs
are queued until the queue is full, then refused with the reason. ``close`` drains the
queue or raises, leaving the unstored batches readable through :meth:`Ingestion.pending`.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.errors import ConduitError, ConfigurationError
from conduit.scheduling.base import wait_refused
from conduit.semantics.onpolicy import OnPolicy
from conduit.storage.columnar import empty_column

if TYPE_CHECKING:
    from conduit.edp import ExperienceDataPlane

__all__ = ["Ingestion", "Handover"]

log = logging.getLogger("conduit.scheduling")


@dataclass
class Handover:
    """One validated batch waiting to be stored."""

    batch: ExperienceBatch
    version: int | None
    priorities: torch.Tensor | None


def _same_fields(a: ExperienceBatch, b: ExperienceBatch) -> bool:
    """Whether ``a`` and ``b`` have the same fields, each ragged in both or in neither, of one dtype and item shape:
    batches that can be staged into one (a batch validated against the schema a migration replaced cannot)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if isinstance(x, Ragged) != isinstance(y, Ragged):
            return False
        tx = x.values if isinstance(x, Ragged) else x
        ty = y.values if isinstance(y, Ragged) else y
        if tx.dtype != ty.dtype or tx.shape[1:] != ty.shape[1:]:
            return False
    return True


class _Size:
    """The rows of a group and, when the storage has ragged pools (``pool`` elements each), each ragged field's
    elements: what a group may grow to (:meth:`fits`)."""

    __slots__ = ("pool", "rows", "elements")

    def __init__(self, pool: int | None) -> None:
        self.pool = pool
        self.rows = 0
        self.elements: dict[str, int] = {}

    def add(self, batch: ExperienceBatch) -> None:
        self.rows += batch.batch_size
        if self.pool is not None:
            for name, c in batch.items():
                if isinstance(c, Ragged):
                    self.elements[name] = self.elements.get(name, 0) + int(c.values.shape[0])

    def fits(self, batch: ExperienceBatch, capacity: int) -> bool:
        """Whether this group and ``batch`` together stay within ``capacity`` rows and every ragged pool."""
        if self.rows + batch.batch_size > capacity:
            return False
        if self.pool is not None:
            for name, c in batch.items():
                if isinstance(c, Ragged) and self.elements.get(name, 0) + int(c.values.shape[0]) > self.pool:
                    return False
        return True


class Ingestion:
    """Queue, coalesce and store handed-over batches (in a worker thread or in the caller).

    Args:
        edp: the buffer whose ``ingest_now`` stores a group.

    Keyword Args:
        g_ing: off-policy, hand-overs per storage write (int); on-policy, the fraction of
            a rollout's items per write (``1/M .. 1``).
        on_policy: the buffer has on-policy semantics.
        background: store in a worker thread (True) or in the producer's call (False).
        queue_depth: hand-overs that may wait before ``handover`` blocks.
        rollout_size: on-policy items per rollout (default: learned from the rollouts seen).
        on_write: a weak reference (e.g. ``weakref.WeakMethod``) to a function called after every write that
            stored a group, on the thread that stored it (possibly under the buffer's lock): it must not block
            (a prefetching scheduler re-arms a prefetch that found nothing stored there). An exception it raises
            is logged, never raised into the write.
    """

    def __init__(self, edp: ExperienceDataPlane, *, g_ing: float, on_policy: bool, background: bool,
                 queue_depth: int, rollout_size: int | None = None,
                 on_write: Callable[[], Callable[[], object] | None] | None = None) -> None:
        # held weakly: the worker thread must not keep a buffer its owner dropped alive (see abandon())
        self._edp = weakref.ref(edp)
        self._capacity = edp.capacity  # (a migration keeps it; read on every hand-over)
        self.g_ing = g_ing
        self.on_policy = on_policy
        self.background = background
        self.queue_depth = max(int(queue_depth), 1 if on_policy else int(g_ing), 1)
        self.rollout_size = rollout_size
        self._learned = 0  # largest whole rollout seen (on-policy, when rollout_size is not given)
        #: the rollout the last write went into (OnPolicy.open_rollout, else its version) and its items so far
        self._cur_rollout: object = None
        self._cur_items = 0
        self._mutex = threading.RLock()  # the condition's lock, entered directly on the producer's hot path
        self._cv = threading.Condition(self._mutex)
        #: the buffer's lock (re-entrant, held by every write): a caller storing groups takes it first (_store_ready)
        self._buffer_lock = edp.lock
        self._writer = threading.Lock()  # held by the caller storing groups (sequential mode), inside the buffer's lock
        self._storer: int | None = None  # that caller's thread
        self._pending: deque[Handover] = deque()
        self._inflight: list[Handover] = []
        #: groups taken for a write so far, and the number of the last one whose write has stored it (marked
        #: under the buffer's lock by ``ingest_now``; numbers, so no group is held after its write)
        self._taken = 0
        self._stored = 0
        #: hand-overs accepted so far, and stored so far (by writes that returned): a flush waits for those accepted
        #: before it, not for an empty queue (which producers that keep handing over might never leave)
        self._handed = 0
        self._landed = 0
        self._error: BaseException | None = None
        #: the last background write failure (kept after it was raised: a flush that waited for the write
        #: raises it too, when another caller took ``_error`` first)
        self._last_error: BaseException | None = None
        self._paused = False
        self._force = 0
        self._closing = False
        #: close() was called on the worker and returned without waiting; no close() waits for the worker now
        self._close_unwaited = False
        self._stopped = False  # the worker thread has exited (after close)
        self._stage: dict[str, torch.Tensor] = {}
        self._on_write = on_write
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="conduit-ingest", daemon=True)
            self._thread.start()

    @property
    def edp(self) -> ExperienceDataPlane:
        """The buffer this ingestion stores into.

        Raises:
            ConfigurationError: the buffer was garbage-collected.
        """
        edp = self._edp()
        if edp is None:
            raise ConfigurationError("The buffer this scheduler stored into was garbage-collected; build a new one.")
        return edp

    def abandon(self) -> None:
        """The buffer was garbage-collected without ``close()``: drop what waits and let the worker end
        (callable from any thread, as a finalizer; nothing of the buffer is left to store into)."""
        with self._cv:
            self._pending.clear()
            self._closing = True
            self._cv.notify_all()

    # -- producer side ---------------------------------------------------------------------
    def handover(self, item: Handover) -> None:
        """Queue one batch (blocks while the queue is full). Raises an earlier background failure first."""
        with self._mutex:
            if self._closing:  # before a failure: the error of close()'s last try is close()'s to raise
                raise ConfigurationError("This scheduler is closed; build a new buffer to ingest more.")
            if self._error is not None:
                self._raise_failure()
            if self.on_policy and item.version is not None:
                # the newest queued batch with items: an empty one opens no rollout (stored, it changes nothing), so
                # a later batch is checked as it will be once that one is stored, and as Synchronous checks it
                last = next((h for h in itertools.chain(reversed(self._pending), reversed(self._inflight))
                             if h.batch.batch_size), None)
                if last is not None and last.version is not None and item.version < last.version:
                    raise ConfigurationError(f"Version {item.version} arrived after version {last.version}; "
                                             f"on-policy versions must not go backwards.")
                sem = self.edp.semantics
                if last is None and isinstance(sem, OnPolicy):
                    # nothing queued: all handed over is stored, and may have been since ingest() checked
                    sem.check_version_order(item.version)
            while self.background and len(self._pending) >= self.queue_depth and self._error is None:
                if self._paused:
                    raise ConfigurationError(
                        f"Ingestion is paused after a failed background write and its queue is full "
                        f"({len(self._pending)} batches); call flush() to retry them. This batch was not accepted.")
                self.refuse_wait("ingest() into a full queue")
                self._refuse_on_worker("ingest() into a full queue")
                self._cv.wait()
            if self._closing:  # closed while this producer waited for room: the worker may be gone
                raise ConfigurationError("This scheduler was closed while this batch waited for room in the "
                                         "ingestion queue; it was not accepted. Build a new buffer to ingest more.")
            if self._error is not None:
                self._raise_failure()
            self._pending.append(item)
            self._handed += 1
            if self.background and self._due(force=False) is not None:
                self._cv.notify_all()  # wake the worker only when it has a group to store
        if not self.background:
            try:
                self._store_ready(force=False, own=item)
            except BaseException:
                with self._cv:  # (raised before a write, e.g. interrupted waiting for the writer lock)
                    self._drop(item)
                raise

    def regroup(self, g_ing: float) -> None:
        """Store groups of ``g_ing`` from now on. In the background, groups of what is queued that are complete at a
        smaller ``g_ing`` are stored at once (the worker is woken), not only after the next hand-over; in the
        caller's mode they are stored by the producer's next ``handover`` or ``flush``, as every group is."""
        with self._cv:
            self.g_ing = g_ing
            self.queue_depth = max(self.queue_depth, int(max(1, g_ing)))
            if self.background and self._due(force=False) is not None:
                self._cv.notify_all()

    def flush(self) -> None:
        """Return once every batch handed over before the call is stored (or raise why one cannot be).

        Batches other producers hand over meanwhile are not waited for (they may be stored by then or not): a
        flush returns while producers keep the queue busy.

        Refused (:class:`ConfigurationError`, nothing changed) from a callback inside a write of this buffer, on
        the worker or (sequential mode) in the caller storing: it could not return before that write does.
        """
        if not self.background:
            self._store_ready(force=True)
            self._rollout_done()
            return
        self._refuse_on_worker("flush() (seal(), state_dict(), load_state_dict() and a delivery with nothing stored "
                              "yet flush first)")
        with self._cv:
            self._raise_failure()  # an unreported failure is reported first; the retry is the next flush
            stopped = self._stopped
            if stopped:
                self._paused = False  # a flush retries
        if stopped:  # a close that could not store everything stopped the worker: retry in the caller
            self._store_ready(force=True)
            self._rollout_done()
            return
        with self._cv:
            # (before the pause is lifted: a refused flush changes nothing)
            self.refuse_wait("flush() (seal(), state_dict() and load_state_dict() flush first)")
            self._paused = False
            self._wait_stored()
            self._raise_failure()
            if self._paused and (self._pending or self._inflight) and self._last_error is not None:
                # a write failed while this flush waited, and a producer's call raised it first
                raise self._failure(self._last_error, closing=False) from self._last_error
        self._rollout_done()

    def drain(self) -> bool:
        """Store everything handed over, as :meth:`flush` does, but never raise: when storing fails (or
        is paused after a failure), the batches stay queued in order, the failure stays for the
        producer's next ``handover``/``flush``/``close`` to raise, and False is returned. Called on the worker
        (a callback inside one of its writes), it stores nothing and returns False (the caller retries later)."""
        if not self.background:
            try:
                self._store_ready(force=True)
            except Exception:  # noqa: BLE001 - the batches stay queued; the producer's next call meets it
                return False
            self._rollout_done()
            return True
        with self._cv:
            if self._error is not None or self._paused or self._stopped:
                return not (self._pending or self._inflight)
            if self._would_wait_forever() or self.on_worker:  # (the caller retries later, as after a failure)
                return False
            ok = self._wait_stored() and self._error is None
        if ok:
            self._rollout_done()
        return ok

    def _wait_stored(self) -> bool:
        """Have the worker store everything queued now, and wait until what was queued is stored or a write failed
        (the caller holds the lock). Returns whether it is stored."""
        target = self._handed
        self._force += 1
        self._cv.notify_all()
        try:
            while (self._landed < target and (self._pending or self._inflight) and self._error is None
                   and not self._paused):
                self._cv.wait()  # (paused: a write failed, and its error may have been raised to a producer)
        finally:
            self._force -= 1
        return self._landed >= target or not (self._pending or self._inflight)

    def close(self) -> None:
        """Drain the queue and stop the worker; raise if some batches could not be stored.

        Called on the worker thread itself (from a callback that runs inside a background write, e.g. a
        semantics or loss callback), it cannot wait for the queue: it returns at once, and the worker
        stores the rest of the queue after the current group, in order, then stops. A write that fails
        then stops it; the batches not stored stay in :meth:`pending` and the next ``close`` (from
        another thread) retries them, raising while that fails. As no call is there to raise that
        failure, the worker logs it as a warning (logger ``conduit.scheduling``) when it stops.
        """
        if not self.background:
            with self._cv:
                self._closing = True
            self._store_ready(force=True)
            return
        with self._cv:
            if not self.on_worker:  # (on the worker it returns at once: see above)
                self.refuse_wait("close()")
            self._closing = True
            self._paused = False  # one last try
            self._error = None
            self._close_unwaited = self.on_worker  # (else this close waits for the worker and raises its failure)
            self._cv.notify_all()
            stopped = self._stopped
        if stopped:  # an earlier close could not store everything and stopped the worker: retry in the caller
            try:
                self._store_ready(force=True)
            except Exception as e:
                with self._cv:
                    raise self._failure(e, closing=True) from e
            return
        assert self._thread is not None
        if self.on_worker:
            return  # inside the worker's own write: it drains the queue once that write returns (see above)
        self._thread.join()
        self._stage.clear()
        with self._cv:
            if self._error is not None:
                e, self._error = self._error, None
                raise self._failure(e, closing=True) from e

    def _would_wait_forever(self) -> bool:
        """Whether waiting for the worker to store the queue would never end (under the lock): batches wait for it (or
        it is storing one) while this thread holds the buffer's lock, which the worker's write needs."""
        if not (self._pending or self._inflight) or self._stopped:
            return False
        edp = self._edp()
        return edp is not None and edp.holds_lock()

    def refuse_wait(self, call: str) -> None:
        """:class:`ConfigurationError` for ``call`` when waiting for the worker would never end: the calling thread
        holds the buffer's lock, which the worker needs to store what is queued (:meth:`_would_wait_forever`)."""
        with self._cv:
            if self.background and self._would_wait_forever():
                raise wait_refused(call, "ingestion worker (it has batches to store)")

    def _refuse_on_worker(self, call: str) -> None:
        """:class:`ConfigurationError` for ``call``, which waits for the worker's writes, when made on the worker
        itself (a callback inside one of its writes, e.g. a loss callback): that write cannot end before the
        call returns."""
        if self.background and self.on_worker:
            raise ConfigurationError(f"{call} was called from a callback inside a write of this buffer on its "
                                     f"ingestion worker, and would wait for that write, which cannot finish before "
                                     f"the callback returns: it would wait forever. Nothing was changed; call it "
                                     f"after the write returns (from another thread).")

    def pending(self) -> list[Handover]:
        """Handed-over batches not stored yet, in order.

        Read under the buffer's lock (``edp.read_locked``) it agrees exactly with the storage: a group being
        written counts here until the write that stores it marks it, in the same lock hold, so never twice.
        """
        with self._cv:
            inflight = [] if self._stored == self._taken else self._inflight
            return list(inflight) + list(self._pending)

    @property
    def on_worker(self) -> bool:
        """Whether the calling thread is the worker (a callback inside one of its writes)."""
        return self._thread is not None and self._thread is threading.current_thread()

    @property
    def stored(self) -> int:
        """Writes that stored a group so far (a count set under the buffer's lock, in the hold that stored it)."""
        return self._stored

    def _wrote(self) -> None:
        """A write stored a group: call ``on_write`` (see the class; a failure there is logged, not raised)."""
        ref = self._on_write
        fn = None if ref is None else ref()
        if fn is None:
            return
        try:
            fn()
        except Exception:  # noqa: BLE001 - a notification: the write itself succeeded, and its caller goes on
            log.warning("A scheduler's notification after a write failed; the write itself succeeded.", exc_info=True)

    @property
    def waiting(self) -> bool:
        with self._cv:
            return bool(self._pending or self._inflight)

    # -- grouping --------------------------------------------------------------------------
    def _target(self) -> float:
        """Units per group: hand-overs off-policy, items on-policy."""
        if not self.on_policy:
            return self.g_ing
        if not self.rollout_size:
            self._rollout_done()
        n = self.rollout_size or self._learned
        if not n:
            return 1
        # k/M of a rollout is a whole number of items when M divides it, however the float k/M rounds (9/11 of 77
        # items comes out as 63.00000000000001, which must not make a write wait for a 64th item)
        items = self.g_ing * n
        whole = round(items)
        return max(1, whole if math.isclose(items, whole, rel_tol=1e-9) else math.ceil(items))

    def _group(self) -> tuple[list[Handover], bool]:
        """The group at the head of the queue, and whether it is complete (must be called under the lock)."""
        head = self._pending[0]
        group = [head]
        units = head.batch.batch_size if self.on_policy else 1
        size = _Size(self._pool())
        size.add(head.batch)
        target = self._target()
        for h in itertools.islice(self._pending, 1, None):
            if units >= target:
                return group, True
            if (h.version != head.version or (h.priorities is None) != (head.priorities is None)
                    or not _same_fields(h.batch, head.batch) or not size.fits(h.batch, self._capacity)):
                return group, True  # the next hand-over starts another group
            group.append(h)
            units += h.batch.batch_size if self.on_policy else 1
            size.add(h.batch)
        return group, units >= target

    def _pool(self) -> int | None:
        """Elements each ragged field's pool holds in the storage now (None: no pools, or the buffer is gone)."""
        edp = self._edp()
        return None if edp is None else getattr(edp.storage, "ragged_capacity", None)

    def _due(self, force: bool) -> list[Handover] | None:
        """The group to store now, or None while it may still grow (must be called under the lock)."""
        if not self._pending or self._error is not None or self._paused:
            return None
        group, complete = self._group()
        if not (complete or force or self._force or self._closing or len(self._pending) >= self.queue_depth
                or self._seals_open_rollout(group[0])):
            return None
        return group

    def _seals_open_rollout(self, head: Handover) -> bool:
        """On-policy: storing ``head`` ends the rollout storage has open (items of another version seal it, see
        :mod:`conduit.semantics.onpolicy`), which then becomes deliverable. Such a group is stored at once, as a
        synchronous buffer stores it, instead of once it holds ``g_ing`` of its own rollout: else the rollout
        before it stays open, and undeliverable, until then (with ``g_ing = 1``, until the next one is whole)."""
        if not self.on_policy or head.version is None:
            return False
        edp = self._edp()
        sem = None if edp is None else edp.semantics
        rollout = sem.open_rollout if isinstance(sem, OnPolicy) else None
        return rollout is not None and rollout[0] != head.version

    def _take(self, force: bool) -> list[Handover] | None:
        group = self._due(force)
        if group is None:
            return None
        for _ in group:
            self._pending.popleft()
        self._inflight = group
        self._taken += 1
        return group

    # -- storing ---------------------------------------------------------------------------
    def _store(self, group: list[Handover]) -> None:
        head = group[0]
        number = self._taken  # (one writer at a time: the group it took last is this one)

        def stored() -> None:  # called by ingest_now under the buffer's lock, once the group is in storage
            self._stored = number

        if len(group) == 1:
            self.edp.ingest_now(head.batch, version=head.version, priorities=head.priorities, on_stored=stored)
        else:
            t0 = time.perf_counter()
            batch = self._concat([h.batch for h in group])
            prios = None if head.priorities is None else torch.cat([torch.as_tensor(h.priorities).reshape(-1)
                                                                    for h in group])
            self.edp.telemetry.record("stage", batch.batch_size, batch.nbytes(), t0, time.perf_counter())
            self.edp.ingest_now(batch, version=head.version, priorities=prios, on_stored=stored)
        if self.on_policy:
            with self._cv:
                sem = self.edp.semantics  # (a seal or another write waits for this one: the rollout is this group's)
                rollout = sem.open_rollout if isinstance(sem, OnPolicy) else head.version
                if rollout != self._cur_rollout:  # a new rollout: the previous one is whole
                    self._learned = max(self._learned, self._cur_items)
                    self._cur_rollout, self._cur_items = rollout, 0
                self._cur_items += sum(h.batch.batch_size for h in group)

    def _concat(self, batches: list[ExperienceBatch]) -> ExperienceBatch:
        """One batch of all rows, fixed fields staged in reused buffers."""
        n = sum(b.batch_size for b in batches)
        cols: dict[str, torch.Tensor | Ragged] = {}
        for name in batches[0]:
            first = batches[0][name]
            if isinstance(first, Ragged):
                parts = cast("list[Ragged]", [b[name] for b in batches])
                cols[name] = Ragged(torch.cat([p.values for p in parts]), torch.cat([p.lengths for p in parts]))
                continue
            buf = self._stage.get(name)
            if (buf is None or buf.shape[0] < n or buf.shape[1:] != first.shape[1:] or buf.dtype != first.dtype
                    or buf.device != first.device):
                pin = (torch.cuda.is_available() and first.device.type == "cpu"
                       and self.edp.storage.device.type == "cuda")
                buf = empty_column((n, *first.shape[1:]), first.dtype, first.device, pin_memory=pin)
                self._stage[name] = buf
            with torch.no_grad():  # (values only: torch refuses cat(out=) of tensors that require grad)
                torch.cat([b[name] for b in batches], out=buf[:n])  # type: ignore[misc]
            cols[name] = buf[:n]
        return ExperienceBatch(cols, n)

    def _rollout_done(self) -> None:
        """On-policy: when the rollout the last write went into is no longer open (sealed: ``seal`` flushes,
        then seals), it is whole; remember the largest whole rollout seen. A flush part way through a
        rollout (``state_dict``, the caller) leaves it open: its items keep counting."""
        if not self.on_policy:
            return
        sem = self.edp.semantics
        if not isinstance(sem, OnPolicy):
            return  # (a rollout then ends at a new version only, see _store)
        with self._cv:
            if self._cur_rollout is not None and sem.open_rollout != self._cur_rollout:
                self._learned = max(self._learned, self._cur_items)
                self._cur_rollout, self._cur_items = None, 0

    def _store_ready(self, force: bool, own: Handover | None = None) -> None:
        """Store complete groups in the caller (sequential mode).

        One caller stores at a time (``_writer``): concurrent producers' groups then reach storage in
        queue order, share the staging buffers one after the other, and a ``flush`` returns only
        after a group another thread is storing is in storage. When a write fails, the group goes
        back to the head of the queue except ``own`` (the batch of the ``handover`` that raises, so
        not accepted), taken out before another producer waiting for ``_writer`` can store it.

        The buffer's lock is taken before ``_writer`` (every write needs it): a thread that holds it already
        (inside ``read_locked``) stores at once, what other producers handed over before it included, instead
        of waiting for a producer that holds ``_writer`` and waits for that lock. Re-entered from a callback
        inside this thread's own write, it stores nothing: the loop stores what is due after that write, in
        order; a ``flush`` there is refused (it could not return with the write in progress).
        """
        if self._storer == threading.get_ident():
            if force and not self._closing:
                raise ConfigurationError("flush() (seal(), state_dict() and load_state_dict() flush first) was called "
                                         "from a callback inside a write of this buffer, which cannot finish before "
                                         "that write does. Nothing was changed; call it after the write returns.")
            return
        if not force:
            with self._cv:  # nothing due (the group may still grow): no wait for the lock a delivery may hold
                if self._error is None and self._due(force=False) is None:
                    return
        with self._buffer_lock, self._writer:
            self._storer = threading.get_ident()
            try:
                while True:
                    with self._cv:
                        self._raise_failure()
                        group = self._take(force)
                    if group is None:
                        return
                    try:
                        self._store(group)
                    except BaseException:
                        with self._cv:
                            self._pending.extendleft(reversed(group))
                            self._inflight = []
                            if own is not None:
                                self._drop(own)
                        raise
                    with self._cv:
                        self._inflight = []
                        self._landed += len(group)
                    self._wrote()
            finally:
                self._storer = None

    def _drop(self, item: Handover) -> None:
        """Take ``item`` out of the queue, if it is there (under the lock)."""
        if any(h is item for h in self._pending):
            self._pending = deque(h for h in self._pending if h is not item)
            self._handed -= 1

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    group = self._take(force=False)
                    if group is not None:
                        break
                    if self._closing and (not self._pending or self._error is not None or self._paused):
                        self._stopped = True
                        self._cv.notify_all()
                        if self._close_unwaited and self._pending and self._error is not None:
                            self._warn_unstored(self._error)
                        return
                    self._cv.wait()
            err: BaseException | None = None
            try:
                self._store(group)
            except BaseException as e:  # noqa: BLE001 - kept and raised in the producer's thread
                err = e
            with self._cv:
                if err is not None:
                    self._pending.extendleft(reversed(group))
                    self._error = self._last_error = err
                    self._paused = True
                else:
                    self._landed += len(group)  # (once its write returned: callbacks inside it included)
                self._inflight = []
                self._cv.notify_all()
            if err is None:
                self._wrote()

    # -- failures --------------------------------------------------------------------------
    def _warn_unstored(self, e: BaseException) -> None:
        """Log a write failure that no call will raise: close() ran on the worker and returned (under the lock)."""
        n = len(self._pending) + len(self._inflight)
        log.warning("Background ingestion stopped after close() was called from a callback on its worker: a write "
                    "failed (%s: %s) and %d handed-over batches are not stored. They stay in scheduler.pending(); "
                    "the next close() retries them and raises while storing fails.", type(e).__name__, e, n)

    def _raise_failure(self) -> None:
        """Raise a background failure once (under the lock); storing stays paused until a flush."""
        if self._error is None:
            return
        e, self._error = self._error, None
        self._cv.notify_all()
        raise self._failure(e, closing=False) from e

    def _failure(self, e: BaseException, *, closing: bool) -> BaseException:
        n = len(self._pending) + len(self._inflight)
        what = ("they stay in scheduler.pending()" if closing
                else "they stay queued in order and flush() retries them; this call's batch was not accepted")
        msg = f"Background ingestion failed ({type(e).__name__}: {e}); {n} handed-over batches are not stored: {what}."
        if isinstance(e, ConduitError):
            try:
                return type(e)(msg)
            except TypeError:
                return e
        # another library's error keeps its type (callers may catch it); a note says where it came from, once
        if not any(note.startswith("Background ingestion failed") for note in getattr(e, "__notes__", ())):
            e.add_note(msg)
        return e
