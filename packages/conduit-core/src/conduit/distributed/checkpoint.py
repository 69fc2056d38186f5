"""Checkpoints of a :class:`~conduit.distributed.DistributedDataPlane`: the live contents read from the shards,
the handles, the lost ranges and the semantics' state, and their restore onto the live shards.

The plane's ``state_dict`` and ``load_state_dict`` call these; each function takes the plane and works on it as a
method would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.checks import is_int
from conduit.distributed._ray import ray_module, wait_all
from conduit.distributed.errors import ClusterError, ShardLostError
from conduit.distributed.recovery import failure, forget_lost_priorities
from conduit.distributed.wire import to_wire
from conduit.errors import CapacityError, ConduitError, ConfigurationError
from conduit.scheduling.base import check_scheduler_entry, scheduler_entry
from conduit.schema import ExperienceSchema
from conduit.storage.base import MAX_HANDLE
from conduit.storage.columnar import pool_elements

if TYPE_CHECKING:
    from conduit.distributed.plane import DistributedDataPlane

__all__ = ["load_state_dict", "state_dict"]


class _PartlyLoaded(ClusterError):
    """A checkpoint load that stopped part way: the rest of the checkpoint is marked lost."""


def state_dict(plane: DistributedDataPlane) -> dict[str, Any]:
    """:meth:`DistributedDataPlane.state_dict` (its docstring states what is kept): the live items are read from
    the shards under the plane's lock, retried while a read fences a lost shard."""
    plane.scheduler.flush()
    plane.scheduler.invalidate("checkpoint")
    with plane._lock:
        plane._check_open()
        for attempt in range(plane.num_shards + 1):  # each failed read fences a shard: more cannot fail
            h = plane.index.live_handles()
            try:
                batch = plane.read(h)
                break
            except ShardLostError:
                if attempt == plane.num_shards:
                    raise
        data: dict[str, Any] = {}
        for name in plane.schema:
            c = batch[name]
            data[name] = (c.values.clone(), c.lengths.clone()) if isinstance(c, Ragged) else c.clone()
        out = {"format": "conduit.distributed/1", "schema": plane.schema.to_dict(), "capacity": plane.capacity,
               "oldest": plane.index.oldest, "next": plane.index.next_handle, "handles": torch.from_numpy(h),
               "data": data, "semantics": plane.semantics.state_dict()}
    entry = scheduler_entry(plane.scheduler, plane)
    if entry is not None:
        out["scheduler"] = entry
    return out


def load_state_dict(plane: DistributedDataPlane, state: dict[str, Any]) -> None:
    """:meth:`DistributedDataPlane.load_state_dict` (its docstring states the semantics and the errors): every
    check runs before anything changes; the semantics' state is put back when the contents cannot be loaded."""
    keys = ("schema", "capacity", "oldest", "next", "handles", "data", "semantics")
    if (not isinstance(state, Mapping) or state.get("format") != "conduit.distributed/1"
            or any(k not in state for k in keys)):
        raise ConfigurationError("Unknown checkpoint format; it was not written by DistributedDataPlane "
                                 "(expected the dict its state_dict() returns).")
    if state["capacity"] != plane.capacity or ExperienceSchema.from_dict(state["schema"]) != plane.schema:
        raise ConfigurationError("This checkpoint was written by a buffer with another schema or capacity; "
                                 "build the buffer with the same schema and capacity before loading.")
    batch = _check_checkpoint(plane, state)
    # checked before anything changes; applied once the contents are in
    load_scheduler = "scheduler" in state and check_scheduler_entry(plane.scheduler, state["scheduler"])
    plane.scheduler.flush()
    plane.scheduler.invalidate("contents")
    with plane._lock:
        plane._check_open()
        n, live = int(state["handles"].shape[0]), len(plane.alive_shards)
        if n > plane.shard_capacity * live:
            raise CapacityError(f"This checkpoint holds {n} items and the {live} live shards hold at most "
                                f"{plane.shard_capacity * live}; add shard servers or raise shard_capacity.")
        packing = _check_ragged_room(plane, batch, live)
        before = plane.semantics.load_checked(state["semantics"])  # a checkpoint of other semantics: unchanged
        try:
            _load_contents(plane, state, batch, packing)
        except _PartlyLoaded:
            plane.semantics.load_state_dict(state["semantics"])  # the index now describes the checkpoint
            forget_lost_priorities(plane)  # the items not loaded are lost, as a lost shard's
            raise
        except BaseException:
            plane.semantics.load_state_dict(before)
            raise
        plane.semantics.load_state_dict(state["semantics"])  # again: a shard lost while loading forgot priorities
        forget_lost_priorities(plane)  # ... of the items it had loaded there: they stay lost, out of the total
    if load_scheduler:
        plane.scheduler.load_state_dict(state["scheduler"]["state"])


def _check_checkpoint(plane: DistributedDataPlane, state: Mapping[str, Any]) -> ExperienceBatch:
    """Refuse a checkpoint whose parts disagree, before anything changes; returns its items as a batch.

    The items are checked as they are, as :meth:`ExperienceDataPlane.load_state_dict` checks them: columns that
    are not tensors of the schema (e.g. NumPy arrays) are refused, not converted.

    Raises:
        ConfigurationError: handles that are not increasing int64 handles inside ``[oldest, next)``, a
            window larger than the capacity or beyond int64 handles, or data that is not one row per handle
            of the schema.
    """
    h, oldest, nxt = state["handles"], state["oldest"], state["next"]
    ok = (isinstance(h, torch.Tensor) and h.dtype == torch.int64 and h.dim() == 1
          and is_int(oldest) and is_int(nxt) and 0 <= oldest <= nxt <= min(oldest + plane.capacity, MAX_HANDLE)
          and isinstance(state["data"], Mapping) and set(state["data"]) == set(plane.schema))
    if ok and h.numel():
        a = h.numpy()
        ok = bool(a[0] >= oldest and a[-1] < nxt and (np.diff(a) > 0).all())
    batch = None
    if ok:
        try:
            cols = {}
            for name, v in state["data"].items():
                if isinstance(v, tuple) and len(v) != 2:
                    raise TypeError(f"ragged field {name!r} is not a (values, lengths) pair")
                cols[name] = Ragged(v[0], v[1]) if isinstance(v, tuple) else v
            batch = ExperienceBatch(cols, int(h.shape[0]))
            batch.validate(plane.schema)
        except (ConduitError, TypeError, ValueError, IndexError, AttributeError):
            batch = None
    if batch is None:
        raise ConfigurationError("This checkpoint is damaged: its handles, window and data do not agree (the "
                                 "buffer is unchanged); load the dict state_dict() returned, unmodified.")
    return batch


def _check_ragged_room(plane: DistributedDataPlane, batch: ExperienceBatch, live: int) -> np.ndarray | None:
    """Refuse a checkpoint whose ragged elements cannot fit the ``live`` shards' pools, before anything changes;
    returns the packing found (the live shard, by position, of each item: the load stores it there), or None
    without ragged fields.

    An item's elements go to one shard whole, so the elements fitting the pools together is not enough: the items
    must be packed into ``live`` empty pools (and ``shard_capacity`` slots) each. The items in row order, each shard
    taking as many as fit, are such a packing; when they are not, the items are packed largest first, each into
    the first shard with room (first fit decreasing), and the checkpoint is refused when that finds none either.

    Raises:
        CapacityError: a ragged field holds more elements than the live shards' pools together, one item
            more than a shard's pool, or the items cannot be packed into the pools (e.g. 3 items of 300
            elements into 2 pools of 500).
    """
    pool = pool_elements(plane._ragged_capacity, plane.shard_capacity)
    if not plane.schema.ragged:
        return None
    lengths = []
    for name in plane.schema.ragged:
        c = cast(Ragged, batch[name])  # (checked by _check_checkpoint)
        total, longest = int(c.values.shape[0]), int(c.lengths.max()) if c.lengths.numel() else 0
        if total > pool * live or longest > pool:
            raise CapacityError(f"This checkpoint holds {total} elements of ragged field {name!r} (at most "
                                f"{longest} in one item) and the {live} live shards' pools hold {pool} each "
                                f"(the buffer is unchanged); build the buffer with a larger ragged_capacity or "
                                f"add shard servers before loading.")
        lengths.append(c.lengths.cpu().numpy().astype(np.int64))
    packing = _packing(np.stack(lengths, axis=1), live, pool, plane.shard_capacity)
    if packing is None:
        raise CapacityError(f"This checkpoint's {batch.batch_size} items fit the {live} live shards' ragged pools "
                            f"({pool} elements each) in all, but cannot be packed into them item by item (an item's "
                            f"elements stay in one pool; the buffer is unchanged); build the buffer with a larger "
                            f"ragged_capacity or add shard servers before loading.")
    return packing


def _packing(lengths: np.ndarray, bins: int, pool: int, slots: int) -> np.ndarray | None:
    """A packing of items of ``lengths`` (one row per item, one column per ragged field) into ``bins`` shards of
    ``pool`` elements per field and ``slots`` items: the bin of each item. In row order, each shard taking the
    longest run that fits, else first fit decreasing; None when neither finds one (taken as none)."""
    n = lengths.shape[0]
    ends = np.concatenate([np.zeros((1, lengths.shape[1]), np.int64), np.cumsum(lengths, axis=0)])
    out = np.zeros(n, np.int64)
    i = 0
    for b in range(bins):  # in row order
        if i >= n:
            break
        j = min(int(np.searchsorted(ends[:, f], ends[i, f] + pool, side="right")) - 1 for f in range(ends.shape[1]))
        j = min(j, i + slots)
        out[i:j] = b
        i = j
    if i >= n:
        return out
    used, held = np.zeros((bins, lengths.shape[1]), np.int64), np.zeros(bins, np.int64)
    for item in np.argsort(-lengths.max(axis=1), kind="stable"):  # first fit decreasing
        fits = (held < slots) & (used + lengths[item] <= pool).all(axis=1)
        b = int(np.argmax(fits))
        if not fits[b]:
            return None
        used[b] += lengths[item]
        held[b] += 1
        out[item] = b
    return out


def _load_contents(plane: DistributedDataPlane, state: dict[str, Any], batch: ExperienceBatch,
                   packing: np.ndarray | None = None) -> None:
    """Replace every live shard's items and the index by the checkpoint's ``batch`` (under the lock).

    With ``packing`` (the position in the live shards of each item, see :func:`_check_ragged_room`), each item is
    stored on that shard while it is live: the plan places rows by item slots, blind to the ragged pools, and a
    checkpoint that packs into them only grouped otherwise was refused after the shards were emptied."""
    live = plane.alive_shards
    outs = wait_all({s: plane.servers[s].actor.open.remote(plane.buffer_id, plane.schema.to_dict(),
                                                          plane.shard_capacity, plane._ragged_capacity,
                                                          plane._owner)
                     for s in live},
                    plane.timeout)
    h = state["handles"].numpy()
    oldest, nxt = int(state["oldest"]), int(state["next"])
    plane.index.reset(oldest)  # first: a shard lost now held only contents being replaced (none is lost)
    # a shard that answers a probe but whose open failed may or may not have emptied its partition: fenced
    # (the index names nothing there now, so no item is lost with it)
    for s in sorted(plane._settle({s: o for s, o in outs.items() if o.lost})):
        plane._lose(s, f"its partition could not be reopened for the load ({failure(outs[s])})")
    for s in outs:
        plane._local_next[s] = 0
    # the plan places copies by item slots, blind to the ragged pools: with ragged fields every item is stored
    # once first (the extra copies of the first runs would take the pool room later runs need), and replicated
    # below where the pools leave room
    copies = 1 if plane.schema.ragged else plane.replication
    cursor = oldest
    breaks = np.nonzero(np.diff(h) != 1)[0] + 1 if h.size else np.zeros(0, np.int64)
    starts = np.concatenate([[0], breaks]).astype(np.int64) if h.size else np.zeros(0, np.int64)
    ends = np.concatenate([breaks, [h.size]]).astype(np.int64) if h.size else np.zeros(0, np.int64)
    try:
        # (in the try: a put that fails, e.g. a full object store, also stops the load after the reset)
        payload = ray_module().put(to_wire(batch, plane.schema)) if h.size else None
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            first = int(h[a])
            if first > cursor:
                plane.index.add_segment(cursor, first - cursor, [])
                cursor = first  # recorded: a load that stops below must not record it again
            pieces = [(a, b)]
            if packing is not None:  # runs of consecutive items packed into one shard
                cut = (np.nonzero(np.diff(packing[a:b]) != 0)[0] + a + 1).tolist()
                pieces = list(zip([a, *cut], [*cut, b], strict=True))
            runs = [(r, k, plane.learner_node) for c, d in pieces for r, k in plane._pool_runs(batch, c, d)]
            targets = None if packing is None else {r: live[int(packing[r])] for r, _, _ in runs}
            for start, count, reps in plane._store(payload, runs, plane.schema.fixed_item_bytes, oldest, copies,
                                                   targets=targets):
                plane.index.add_segment(first + start - a, count, reps)
            cursor = first + (b - a)
    except Exception as e:  # noqa: BLE001 - whatever stopped it, the buffer must describe the checkpoint
        # the old contents are gone (the shards were reopened): describe the whole checkpoint, the rest
        # of it lost, so the buffer stays consistent and usable
        missing = int((h >= cursor).sum())
        plane.index.add_segment(cursor, nxt - cursor, [])
        plane.index._next = nxt
        raise _PartlyLoaded(f"Loading stopped after {h.size - missing} of the checkpoint's {h.size} items "
                            f"({type(e).__name__}: {e}); the other {missing} are lost (never delivered, not "
                            f"counted by len()). Check the cluster's health, then load again.") from e
    finally:
        plane._release_losses(evicted=True)  # (the writes start at the window's start: they evict nothing)
    if nxt > cursor:
        plane.index.add_segment(cursor, nxt - cursor, [])
    plane.index._next = nxt
    # as an ingestion: items stored with fewer than ``replication`` copies get one on another node where
    # there is room, else they are counted in under_replicated
    short = [r for r in plane.index.live_rows() if 0 < len(plane.index.segment(r)[2]) < plane.replication]
    if short:
        plane._replicate(short)
