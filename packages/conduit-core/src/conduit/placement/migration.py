"""Online migration: move a live buffer to another placement without losing anything.

The live items are copied oldest first, in chunks, into a storage built by the new
placement and positioned at the same handle, with the same capacity: every item keeps its
handle and its slot (``handle % capacity``), so sampler state keyed by slot (priorities,
the RNG, on-policy rollouts) stays valid as it is; nothing is re-prioritised, lost or
duplicated. Ingestion and delivery keep running between chunks (each chunk holds the
buffer's lock for one gather + one write); the last chunk, the check that both storages
hold exactly the same live range, and the swap run under the lock. Items evicted while
the copy runs are dropped from the new storage as well, and a checkpoint loaded into the buffer
meanwhile (``load_state_dict``) starts the copy over from its items. Once the items live when the copy
began are copied, chunks go on only while what is left shrinks: if ingestion adds items
faster than chunks copy them, the rest (at most the capacity) is copied in that last hold,
so a migration always ends. A ``close()`` meanwhile ends it too (the buffer keeps its storage, closed).
Once the swap commits, the old storage is closed at once (the disk tier's files are deleted then, not when it is
collected); a migration that fails keeps it, and the buffer goes on with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from conduit.batch import ExperienceBatch
from conduit.checks import is_int
from conduit.errors import CapacityError, ConduitError, ConfigurationError, PlacementError, SchemaError
from conduit.schema import ExperienceSchema
from conduit.storage.base import Storage
from conduit.storage.columnar import pool_elements

if TYPE_CHECKING:
    from conduit.edp import ExperienceDataPlane
    from conduit.placement.base import Placement

__all__ = ["MigrationReport", "migrate"]


@dataclass(frozen=True)
class MigrationReport:
    """What one migration did and how long ingestion and delivery were blocked."""

    source: str
    target: str
    #: live items moved (every item live at the swap)
    items: int
    #: bytes read from the old storage (including items evicted while copying)
    nbytes: int
    #: wall time of the whole migration
    seconds: float
    #: the longest single hold of the buffer's lock (ingest/deliver wait at most this long)
    max_blocked_s: float
    #: chunks copied
    chunks: int
    #: the live handle range ``[oldest, next)`` at the swap
    oldest: int
    next_handle: int

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "items": self.items, "nbytes": self.nbytes,
                "seconds": self.seconds, "max_blocked_s": self.max_blocked_s, "chunks": self.chunks,
                "oldest": self.oldest, "next_handle": self.next_handle}


def _position(storage: Storage, schema: ExperienceSchema, handle: int) -> None:
    """Empty ``storage`` and make ``handle`` the next handle it assigns."""
    storage.load_state_dict({"schema": schema.to_dict(), "capacity": storage.capacity, "oldest": handle,
                             "next": handle, "data": {}})


def transformed(transform: Callable[[ExperienceBatch], Any], batch: ExperienceBatch,
                schema: ExperienceSchema) -> ExperienceBatch:
    """``transform(batch)``, validated against ``schema`` and holding one item per item of ``batch``.

    Raises:
        SchemaError: the output does not match ``schema`` or has another number of items, or the
            transform itself raised (its error is the cause).
    """
    try:
        raw = transform(batch)
    except ConduitError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's transform: report it typed
        raise SchemaError(f"The migration transform failed on {batch.batch_size} items ({type(e).__name__}: {e}); "
                          f"fix the transform. Nothing was stored.") from e
    out = ExperienceBatch.checked(raw, schema)
    if out.batch_size != batch.batch_size:
        raise SchemaError(f"The migration transform returned {out.batch_size} items for {batch.batch_size}; "
                          f"return one item per input item.")
    return out


def _describe(storage: Storage) -> str:
    devs = getattr(storage, "devices", None)
    where = ",".join(str(d) for d in devs) if devs else str(storage.device)
    return f"{storage.tier}[{where}]"


def migrate(edp: ExperienceDataPlane, placement: Placement, *, schema: ExperienceSchema | None = None,
            transform: Callable[[ExperienceBatch], Any] | None = None,
            chunk_bytes: int = 4 << 20, progress: Callable[[int, int], None] | None = None,
            ragged_capacity: int | None = None) -> MigrationReport:
    """Move ``edp``'s live items into storage built by ``placement`` (see the module docstring).

    Args:
        edp: the buffer.
        placement: builds the new storage (same capacity; the ragged pools: see ``ragged_capacity``).

    Keyword Args:
        schema: a new schema (e.g. a larger observation); needs ``transform``. While such a
            migration runs, keep ingesting the old schema; new-schema batches are accepted
            once it returns. Old-schema batches that reach storage after the swap (handed
            to a background scheduler, or validated just before it) go through ``transform``
            as the migrated items did.
        transform: maps each chunk (an old-schema :class:`ExperienceBatch`) to a mapping
            of the new schema with the same number of items (e.g. zero-padding).
        chunk_bytes: bytes copied per lock hold (about: ragged items are sized by the mean bytes per item
            of those copied so far, starting from one item).
        progress: called between chunks, outside the lock, with (chunks copied, handle copied up to).
        ragged_capacity: elements in each ragged pool of the new storage (default: the old storage's; None
            to ``placement`` when the old schema has no ragged fields). Pools that cannot hold the live
            items fail the migration (PlacementError).

    Raises:
        ConfigurationError: a new schema without a transform, or a transform with the schema unchanged; a
            ``ragged_capacity`` that is no int; a ``chunk_bytes``
            that is no int >= 1, or a ``progress`` that is not callable; the buffer was
            closed (also by a ``close()`` on another thread while the items were copied: the copy stops, the new
            storage is let go); called holding
            the buffer's lock (inside ``read_locked()``) while the scheduler could drop its prepared deliveries only
            by waiting for that lock (e.g. a prefetch job waits for it): migrate outside ``read_locked()``.
        SchemaError: the transform's output does not match the new schema.
        PlacementError: the new placement cannot hold the buffer, or builds a storage of another capacity
            (a custom placement: the slots would move), or another migration of ``edp`` replaced its storage
            meanwhile (the buffer keeps that one's result).
        Any of these leaves the buffer exactly as it was.
    """
    from conduit.placement.base import Placement as PlacementRole
    from conduit.placement.base import release_storage

    if not isinstance(placement, PlacementRole):
        raise ConfigurationError(f"migrate needs a Placement instance (e.g. HostPlacement()), got {placement!r}.")
    if schema is not None and not isinstance(schema, ExperienceSchema):
        raise ConfigurationError(f"schema must be a conduit.ExperienceSchema (or None to keep the current one), got "
                                 f"{type(schema).__name__}.")
    if transform is not None and not callable(transform):
        raise ConfigurationError(f"transform must be a callable old_batch -> new_batch, got {transform!r}.")
    if not is_int(chunk_bytes) or chunk_bytes < 1:
        raise ConfigurationError(f"chunk_bytes must be an int >= 1 (bytes copied per hold of the buffer's lock), got "
                                 f"{chunk_bytes!r}.")
    if progress is not None and not callable(progress):
        raise ConfigurationError(f"progress must be a callable (chunks copied, handle copied up to) -> None, or None; "
                                 f"got {progress!r}.")
    if ragged_capacity is not None:  # refused as the buffer's constructor refuses it, ragged fields or not
        pool_elements(ragged_capacity, edp.capacity)
    new_schema = schema if schema is not None else edp.schema
    if new_schema != edp.schema and transform is None:
        raise ConfigurationError("Migrating to a new schema needs transform=old_batch -> new_batch (e.g. zero-pad "
                                 "the grown fields); or migrate with the current schema.")
    if new_schema == edp.schema and transform is not None:  # (it would rewrite the stored items, not those in flight)
        raise ConfigurationError("transform= maps old-schema batches to a new schema, and the schema is unchanged: "
                                 "batches still on their way to storage would not go through it. Drop transform=, "
                                 "or pass the new schema= it maps to.")
    edp.flush()
    if edp.holds_lock():
        # called holding the buffer's lock (inside read_locked, or a callback), a scheduler may be
        # unable to drop its prepared deliveries (a prefetch job waits for that lock): it is asked now, so that it
        # refuses before anything changes, not after the swap (which would leave batches of the old storage, in the
        # old schema, to be delivered). Nothing else can prepare meanwhile: this thread holds the lock throughout.
        edp.scheduler.invalidate("contents")
    t0 = time.perf_counter()
    lock = edp.lock
    with lock:
        old = edp.storage
        start = old.oldest
    cap = old.capacity
    if ragged_capacity is None and edp.schema.ragged:
        ragged_capacity = getattr(old, "ragged_capacity", None)
    new = placement.storage(new_schema, cap, ragged_capacity=ragged_capacity if new_schema.ragged else None)
    try:
        if new.capacity != cap:  # (a custom placement): items would change slots under the sampler's state
            raise PlacementError(
                f"{placement.describe()} built a storage of {new.capacity} items for this buffer of capacity {cap}; "
                f"a migration keeps the capacity (every item keeps its slot, handle % capacity, which the sampler's "
                f"priorities and on-policy positions are keyed by). Make its storage() return exactly the capacity "
                f"asked for. The buffer was not changed.")
        items, o, nx, nbytes, chunks, max_blocked = _copy_and_swap(edp, placement, old, new, start, new_schema,
                                                                  transform, chunk_bytes, progress)
    except BaseException:
        placement.storage_abandoned(new)  # the buffer keeps its storage (AdaptivePlacement forgets ``new``)
        raise
    # committed: nothing uses the old storage any more (every read and write takes ``edp.storage`` under the lock,
    # and a concurrent migration checks the swap before it copies again), so what it holds until it is collected
    # (the disk tier's files) goes now, not whenever the last reference to it is dropped
    release_storage(old)
    # prepared deliveries hold the same items, but in buffers sized and placed for the old storage
    edp.scheduler.invalidate("contents")
    t1 = time.perf_counter()
    edp.telemetry.record("migrate", items, nbytes, t0, t1)
    return MigrationReport(_describe(old), _describe(new), items, nbytes, t1 - t0, max_blocked, chunks, o, nx)


def _copy_and_swap(edp: ExperienceDataPlane, placement: Placement, old: Storage, new: Storage, start: int,
                   new_schema: ExperienceSchema, transform: Callable[[ExperienceBatch], Any] | None,
                   chunk_bytes: int, progress: Callable[[int, int], None] | None
                   ) -> tuple[int, int, int, int, int, float]:
    """:func:`migrate` once ``new`` is built: copy, check, swap (raises before the swap, changing nothing).

    Returns:
        (live items, oldest handle, next handle) at the swap, bytes read, chunks copied, longest lock hold.
    """
    lock = edp._lock
    cap = old.capacity
    _position(new, new_schema, start)
    # items per chunk: from the fixed fields' bytes; with ragged fields, whose sequences the schema does not size,
    # one item first, then from the mean bytes per item copied so far (so a hold copies about chunk_bytes)
    ragged = bool(edp.schema.ragged)
    first = 1 if ragged else max(1, min(cap, chunk_bytes // max(1, edp.schema.fixed_item_bytes)))
    stats = {"bytes": 0, "chunks": 0, "items": 0, "chunk": first}

    def copy(lo: int, hi: int) -> None:
        a = lo
        while a < hi:
            b = min(hi, a + stats["chunk"])
            slots = torch.arange(a, b, dtype=torch.int64) % cap
            part = old.gather(slots)
            stats["bytes"] += part.nbytes()
            stats["chunks"] += 1
            stats["items"] += b - a
            if ragged:
                per_item = max(1, stats["bytes"] // stats["items"])
                stats["chunk"] = max(1, min(cap, chunk_bytes // per_item))
            if transform is not None:
                part = transformed(transform, part, new_schema)
            try:
                new.append(part, evict=True)
            except CapacityError as e:  # live items [a, b) bring more elements than a new ragged pool holds
                pool = getattr(new, "ragged_capacity", None)
                raise PlacementError(
                    f"The new placement cannot hold the {len(old)} live items: items [{a}, {b}) alone bring more "
                    f"elements of a ragged field than its pools hold ({pool}); migrate with a larger "
                    f"ragged_capacity. The buffer was not changed.") from e
            a = b

    copied = start
    max_blocked = 0.0
    with lock:
        target = old.next_handle  # the live range when the copy began
        rewrites = old.rewrites
    gap = None  # items left to copy after the previous chunk
    while True:
        if stats["chunks"]:
            if progress is not None:
                progress(stats["chunks"], copied)
            time.sleep(0)  # let a waiting ingest or deliver take the lock between chunks
        lock.acquire()
        t_hold = time.perf_counter()
        try:
            edp._check_open()  # a close() meanwhile (another thread) ends the copy, changing nothing
            if edp.storage is not old:  # another migration swapped the storage: copying on would drop its items
                raise PlacementError(
                    f"another migration replaced the buffer's storage while this one copied it; the buffer keeps "
                    f"that migration's placement ({edp.placement.describe()}). Run one migration at a time, or "
                    f"migrate again now.")
            hi, oldest = old.next_handle, old.oldest
            if old.rewrites != rewrites:  # a checkpoint was loaded meanwhile: the copied handles hold other items
                rewrites = old.rewrites
                _position(new, new_schema, oldest)
                copied, target, gap = oldest, hi, None
            elif oldest > copied:  # all copied items were evicted meanwhile: start over at the oldest live one
                _position(new, new_schema, oldest)
                copied = oldest
            # chunk by chunk while catching up; once the range live at the start is copied, only while the
            # rest shrinks (ingestion faster than the copy would otherwise keep it going for ever)
            chunk = stats["chunk"]
            if hi - copied > chunk and (copied < target or gap is None or hi - copied < gap):
                copy(copied, copied + chunk)
                copied += chunk
                gap = hi - copied
                continue
            # last chunk, check, swap: ingestion and delivery wait for this part only
            copy(copied, hi)
            new.release(old.oldest)
            if (new.oldest, new.next_handle) != (old.oldest, old.next_handle):
                # the new ragged pools evicted more than the old ones hold (fragmentation): copy anew, packed
                _position(new, new_schema, old.oldest)
                copy(old.oldest, old.next_handle)
                if (new.oldest, new.next_handle) != (old.oldest, old.next_handle):
                    raise PlacementError(
                        f"The new placement cannot hold all {len(old)} live items (it keeps {len(new)}); raise "
                        f"ragged_capacity or the capacity. The buffer was not changed.")
            items, o, nx = len(new), new.oldest, new.next_handle
            edp._check_open()  # (the transform, run in this hold, may have closed the buffer)
            edp._adopt_storage(new, placement, new_schema, transform)
            break
        finally:
            max_blocked = max(max_blocked, time.perf_counter() - t_hold)
            lock.release()
    return items, o, nx, stats["bytes"], stats["chunks"], max_blocked
