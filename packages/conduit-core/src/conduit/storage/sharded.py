"""Storage sharded over several devices (the paper's "shared-GPU" placement).

Slots are interleaved over the shards: slot ``s`` lives in shard ``s % K`` at row ``s // K``.
Every append therefore spreads over all shards (each gets a contiguous block of rows, read
from the batch with stride ``K``) and a uniform sample draws about ``n / K`` rows from each
shard, so the shards' links carry the delivery in parallel.

The ring bookkeeping (handles, FIFO eviction, on-policy release) is the same as for every
storage: live handles are ``[oldest, next_handle)`` and ``slot = handle % capacity``.
Ragged fields, when the schema has any, are kept in one packed pool on the first device
(their lengths and offsets are host bookkeeping anyway); fixed fields are sharded.

Host batches bound for GPU shards are staged: each shard's rows are gathered into a
page-locked buffer of that shard and copied with ``non_blocking=True``, so the copies to
different GPUs run at once over their own host links (the cost model's staged ingestion).

The logic is device-agnostic: with several ``"cpu"`` shards it runs (and is tested) on a
machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.checks import is_int
from conduit.errors import CapacityError, ConfigurationError
from conduit.schema import ExperienceSchema
from conduit.storage.base import AppendResult, Storage
from conduit.storage.columnar import ColumnarStorage, empty_column, index_copy_dtype, pool_elements

__all__ = ["ShardedStorage"]


class _Staging:
    """Page-locked staging buffers per (shard, field) for host-to-GPU shard writes.

    A shard's rows are gathered (strided read of the batch) into its buffer, then copied to
    the GPU without blocking, on that GPU's current stream: later reads of the shard on that
    stream are ordered after the copy, and the copies to different GPUs overlap. A buffer is
    rewritten only after its previous copy finished (one event per shard).
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}
        self._events: dict[int, Any] = {}

    def copy(self, shard: int, name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        ev = self._events.pop(shard, None)
        if ev is not None:
            ev.synchronize()
        c = int(src.shape[0])
        buf = self._bufs.get((shard, name))
        if buf is None or buf.shape[0] < c:
            buf = empty_column((c, *src.shape[1:]), src.dtype, pin_memory=True)  # (not an inference tensor)
            self._bufs[(shard, name)] = buf
        buf[:c].copy_(src)
        dst.copy_(buf[:c], non_blocking=True)

    def record(self, shard: int, device: torch.device) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self._events[shard] = ev


def as_devices(devices: Sequence[torch.device | str], error: type[Exception]) -> list[torch.device]:
    """``devices`` as torch devices, or ``error`` for one torch does not know or a single device name
    (a string is no sequence of devices: ``"cpu"`` would be read as the devices ``c``, ``p``, ``u``)."""
    if isinstance(devices, (str, torch.device)):
        raise error(f"devices must be a sequence with one device per shard, e.g. ['cuda:0', 'cuda:1'], got "
                    f"{devices!r}; pass [{str(devices)!r}] for one shard.")
    try:
        return [torch.device(d) for d in devices]
    except (RuntimeError, TypeError) as e:
        raise error(f"The devices {list(devices)!r} include one torch does not know ({e}); pass device names "
                    f"such as 'cuda:0' or 'cpu'.") from None


def _even_step(positions: np.ndarray) -> int:
    """The step between ``positions`` (ascending) when they are evenly spaced (1 for one position), else 0."""
    if positions.size == 1:
        return 1
    step = int(positions[1] - positions[0])
    return step if bool((np.diff(positions) == step).all()) else 0


class ShardedStorage(Storage):
    """A FIFO ring whose fixed-field columns are split over ``devices`` (interleaved slots).

    Args:
        schema: the fields.
        capacity: number of item slots (over all shards).
        devices: one torch device per shard (repeats allowed, e.g. ``["cpu"] * 4`` for tests).

    Keyword Args:
        ragged_capacity: elements in each ragged field's pool (default ``capacity * 64``).
        tier: the tier name reported by placement (default ``"sharded"``).

    Raises:
        ConfigurationError: a capacity that is no positive int, no devices or more devices than slots,
            ``devices`` that is one name instead of a sequence, or a device name torch does not know.
    """

    def __init__(self, schema: ExperienceSchema, capacity: int, devices: Sequence[torch.device | str], *,
                 ragged_capacity: int | None = None, tier: str = "sharded") -> None:
        if not is_int(capacity) or capacity <= 0:  # (NumPy's 8 is a count, as everywhere in core; True is none)
            raise ConfigurationError(f"capacity must be a positive int, got {capacity!r}.")
        capacity = int(capacity)
        devs = as_devices(devices, ConfigurationError)
        if not devs:
            raise ConfigurationError("ShardedStorage needs at least one device.")
        if len(devs) > capacity:
            raise ConfigurationError(f"{len(devs)} shards for a capacity of {capacity}: give at most one shard "
                                     f"per slot (fewer devices or a larger capacity).")
        pool_elements(ragged_capacity, capacity)  # refuses one that is no int, with ragged fields or without
        self.schema = schema
        self.capacity = capacity
        self.devices = devs
        self.device = devs[0]
        self.tier = tier
        k = len(devs)
        #: rows in shard i: the slots s < capacity with s % K == i
        self.shard_rows = [(capacity - i + k - 1) // k for i in range(k)]
        self._shards = [{n: empty_column((rows, *schema[n].shape), schema[n].dtype, dev) for n in schema.fixed}
                        for rows, dev in zip(self.shard_rows, devs, strict=True)]
        self._ragged: ColumnarStorage | None = None
        if schema.ragged:
            sub = ExperienceSchema({n: schema[n] for n in schema.ragged})
            self._ragged = ColumnarStorage(sub, capacity, devs[0], ragged_capacity=ragged_capacity, tier=tier)
        self._oldest = 0
        self._next = 0
        self._staging = _Staging() if any(d.type == "cuda" for d in devs) else None
        #: fields whose rows gather copies as raw bits (a same-width integer view): torch lacks index_copy_ for them
        self._bits = {n: b for n in schema.fixed if (b := index_copy_dtype(schema[n].dtype)) is not None}

    # -- ring ------------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self.devices)

    @property
    def ragged_capacity(self) -> int | None:
        """Elements in each ragged field's pool (None without ragged fields)."""
        return self._ragged.ragged_capacity if self._ragged is not None else None

    @property
    def oldest(self) -> int:
        return self._ragged.oldest if self._ragged is not None else self._oldest

    @property
    def next_handle(self) -> int:
        return self._ragged.next_handle if self._ragged is not None else self._next

    def nbytes(self) -> int:
        fixed = sum(c.numel() * c.element_size() for shard in self._shards for c in shard.values())
        return fixed + (self._ragged.nbytes() if self._ragged is not None else 0)

    def append(self, batch: ExperienceBatch, *, evict: bool = True) -> AppendResult:
        """Store ``batch`` after the newest item (see :meth:`Storage.append`).

        A write that fails on one shard after others took their rows stores none of the batch: its
        handles are free again for the next append (items evicted to make room stay evicted).
        """
        n = batch.batch_size
        if self._ragged is not None:
            # The ragged pool decides evictions (capacity and pool room) and validates first.
            sub = ExperienceBatch({k: batch[k] for k in self.schema.ragged}, n)
            res = self._ragged.append(sub, evict=evict)
        else:
            if n > self.capacity:
                raise CapacityError(f"A batch of {n} items is larger than the capacity ({self.capacity}); "
                                    f"split it or raise capacity.")
            k = max(0, self._next - self._oldest + n - self.capacity)
            if k and not evict:
                raise CapacityError(f"Storing {n} more items needs {k} live items evicted, and this buffer may "
                                    f"not evict (on-policy data not yet consumed). Consume first or raise capacity.")
            res = AppendResult(self._next, n, self._oldest, self._oldest + k)
            self._oldest += k
            self._next += n
        s = res.first % self.capacity
        a = min(n, self.capacity - s)
        try:
            self._write(batch, s, 0, a)
            if a < n:
                self._write(batch, 0, a, n - a)
        except BaseException:
            # a shard refused its rows (after others took theirs): none of the batch is stored, as if it had
            # never been appended; the evictions made room and stay made (their rows may be overwritten)
            if self._ragged is not None:
                self._ragged.truncate(res.first)
            else:
                self._next = res.first
            raise
        return res

    def _write(self, batch: ExperienceBatch, slot: int, offset: int, count: int) -> None:
        """Write items ``offset .. offset+count-1`` of ``batch`` to slots ``slot .. slot+count-1`` (no wrap)."""
        k = self.num_shards
        end = slot + count
        for i in range(k):
            s_i = slot + (i - slot) % k  # first slot of the range that lives in shard i
            if s_i >= end:
                continue
            c = (end - s_i + k - 1) // k
            j0 = offset + (s_i - slot)
            r0 = s_i // k
            staged = False
            for name in self.schema.fixed:
                src = batch[name]
                assert isinstance(src, torch.Tensor)
                if src.requires_grad:  # stored by value: a copy_ would put the shard in src's autograd graph
                    src = src.detach()
                rows, dst = src[j0:j0 + (c - 1) * k + 1:k], self._shards[i][name][r0:r0 + c]
                if self._staging is not None and dst.is_cuda and not rows.is_cuda:
                    self._staging.copy(i, name, rows, dst)
                    staged = True
                else:
                    dst.copy_(rows)
            if staged:
                assert self._staging is not None
                self._staging.record(i, self.devices[i])

    def release(self, upto: int) -> None:
        if self._ragged is not None:
            self._ragged.release(upto)
        else:
            self._oldest = max(self._oldest, min(int(upto), self._next))

    # -- read ------------------------------------------------------------------------------
    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> ExperienceBatch:
        """Rows ``slots`` of every field (see :meth:`Storage.gather`).

        A shard whose rows take evenly spaced positions of the batch (one shard, consecutive slots, one row) selects
        them straight into that strided view of the output on its own device; other shards select theirs into a
        temporary and copy it to the output's positions (``index_copy_``).
        """
        slots = slots.to("cpu", torch.int64)
        n = int(slots.shape[0])
        k = self.num_shards
        cols: dict[str, torch.Tensor | Ragged] = {}
        dst = out if out is not None else {
            name: torch.empty((n, *self.schema[name].shape), dtype=self.schema[name].dtype, device=self.device)
            for name in self.schema.fixed}
        s = slots.numpy()
        shard_of = s % k
        for i, shard in enumerate(self._shards):
            where = np.flatnonzero(shard_of == i)  # positions in the batch served by shard i
            if where.size == 0:
                continue
            step = _even_step(where)
            pos = torch.from_numpy(where)
            r = torch.from_numpy(s[where] // k)
            if self.devices[i].type != "cpu":
                r = r.to(self.devices[i], non_blocking=True)
            for name, col in shard.items():
                target = dst[name]
                bits = self._bits.get(name) if self._bits else None
                if step and target.device == col.device:
                    view = target[int(where[0]):int(where[-1]) + 1:step]
                    if bits is not None:
                        col, view = col.view(bits), view.view(bits)
                    torch.index_select(col, 0, r, out=view)
                    continue
                part = torch.index_select(col, 0, r)
                if target.device != part.device:
                    # non-blocking only towards a GPU, whose stream orders the index_copy_ after it: a host
                    # target is read by index_copy_ at once, before an asynchronous copy would have landed
                    part = part.to(target.device, non_blocking=target.device.type == "cuda")
                if bits is not None:
                    target, part = target.view(bits), part.view(bits)
                target.index_copy_(0, pos if target.device.type == "cpu" else pos.to(target.device), part)
        for name in self.schema.fixed:
            cols[name] = dst[name]
        if self._ragged is not None:
            rag = self._ragged.gather(slots)
            for name in self.schema.ragged:
                cols[name] = rag[name]
        ordered = {name: cols[name] for name in self.schema}
        return ExperienceBatch(ordered, n)

    # -- checkpoint ------------------------------------------------------------------------
    def ragged_layout(self) -> dict[str, Any] | None:
        return self._ragged.ragged_layout() if self._ragged is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        oldest, batch, layout = self.checkpoint_contents(state)
        self.rewrites += 1
        if self._ragged is not None:
            sub = ExperienceSchema({k: self.schema[k] for k in self.schema.ragged})
            self._ragged.load_state_dict({"schema": sub.to_dict(), "capacity": self.capacity,
                                          "oldest": oldest, "next": oldest, "data": {}})
        self._oldest = self._next = oldest
        if batch.batch_size:
            self.append(batch, evict=False)
        if self._ragged is not None and layout is not None:
            self._ragged.place_ragged(batch, layout)
