"""Preallocated columnar ring storage on one torch device (host, pinned host, one GPU, disk)."""

from __future__ import annotations

import ctypes
import functools
import operator
import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from conduit._native import load_kernels
from conduit.batch import ExperienceBatch, Ragged, ranges
from conduit.checks import first_line, is_int, out_of_memory
from conduit.errors import AllocationError, CapacityError, ConfigurationError
from conduit.schema import ExperienceSchema, same_width_integer
from conduit.storage.base import AppendResult, Storage

__all__ = ["ColumnarStorage", "Allocator", "empty_column", "pool_elements", "index_copy_dtype"]

#: ``allocate(shape, dtype, name)`` returns an uninitialised tensor for one column.
Allocator = Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor]


#: mean ragged length from which a gather copies whole segments instead of indexing every element
_SEGMENT_COPY_MIN_MEAN = 64


def _copy_segments(pool: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``pool[starts[i]:starts[i] + lengths[i]]`` for each i, end to end into ``out``; adjacent segments in one copy."""
    n = int(starts.shape[0])
    if n == 0:
        return out
    ends = starts + lengths
    breaks = (torch.nonzero(starts[1:] != ends[:-1]).flatten() + 1).tolist()
    run_first = [0, *breaks]
    run_last = [*(b - 1 for b in breaks), n - 1]
    s_list, e_list = starts.tolist(), ends.tolist()
    o = 0
    for a, b in zip(run_first, run_last, strict=True):
        lo, hi = s_list[a], e_list[b]
        out[o:o + hi - lo].copy_(pool[lo:hi])
        o += hi - lo
    return out


#: live items the first step of an eviction walk reads beyond the batch size (each further step reads twice as many)
_WALK_FIRST = 16


def _ring_rows(starts: np.ndarray, lengths: np.ndarray, first: int, end: int,
               capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The ragged starts and lengths of the items with handles ``first .. end - 1`` (slots ``handle % capacity``)."""
    slots = np.arange(first, end, dtype=np.int64) % capacity
    return starts[slots], lengths[slots]


def _ring_walk(starts: np.ndarray, lengths: np.ndarray, first: int, end: int, capacity: int, *, head: int,
               span: int, pool: int, step: int) -> tuple[int, int]:
    """Walk the live items of one ragged field from handle ``first`` (no item before it holds elements) towards
    ``end``, over what a block taking ``span`` pool elements from ``head`` on (wrapping past the pool's end) sweeps.

    The live items' elements lie in the pool in handle order, read circularly from ``head`` (the ring invariant:
    :func:`conduit.storage.base.ring_ordered`), so the swept items are the oldest ones: the walk stops at the first
    item that holds elements outside the span, and reads about twice the items it passes, however many are live.

    Returns:
        (the first handle from ``first`` on whose item holds elements, or ``end``;
        the handle after the newest item with elements in the span, or 0 when none has).
    """
    found = end
    upto = 0
    h = first
    while h < end:
        stop = min(h + step, end)
        st, ln = _ring_rows(starts, lengths, h, stop, capacity)
        full = np.flatnonzero(ln > 0)
        if full.size:
            found = min(found, h + int(full[0]))
            outside = np.flatnonzero((st[full] - head) % pool >= span)
            if outside.size:  # every item with elements before the first one outside the span is inside it
                j = int(outside[0])
                return found, (h + int(full[j - 1]) + 1 if j else upto)
            upto = h + int(full[-1]) + 1
        h, step = stop, step * 2
    return found, upto


@functools.cache
def index_copy_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """None when ``index_copy_`` copies rows of ``dtype``; else the same-width integer dtype to view both
    sides as (the float8 dtypes: torch stores and gathers them, but has no ``index_copy_`` for them)."""
    try:
        torch.zeros(2, dtype=dtype).index_copy_(0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=dtype))
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
        return same_width_integer(dtype)
    return None


#: elements per item of capacity in each ragged pool when nothing sizes it (see :func:`pool_elements`)
DEFAULT_POOL_PER_ITEM = 64


def pool_elements(ragged_capacity: int | None, capacity: int) -> int:
    """The elements of each ragged pool: ``ragged_capacity``, or ``capacity * DEFAULT_POOL_PER_ITEM`` (64) when it is
    None.

    Raises:
        ConfigurationError: ``ragged_capacity`` is not an int (a float, a string, a bool).
    """
    if ragged_capacity is None:
        return capacity * DEFAULT_POOL_PER_ITEM
    try:
        if isinstance(ragged_capacity, bool):
            raise TypeError
        return operator.index(ragged_capacity)
    except TypeError:
        raise ConfigurationError(f"ragged_capacity must be an int (elements in each ragged field's pool), got "
                                 f"{ragged_capacity!r}.") from None


def empty_column(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu", *,
                 pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised tensor for a storage column or a delivery buffer.

    Pageable host tensors live in memory NumPy allocates where the dtype allows: NumPy asks
    Linux for transparent huge pages on allocations of 4 MiB and more (``madvise``), meant to
    cut TLB misses under random row gathers; whether they help depends on the machine (on the
    Intel VM of ``benchmarks/results/host_memory_2026-12-06*.md`` the kernel granted them and
    gathers took the same time as from ``torch.empty`` memory). Page-locked and GPU tensors,
    and dtypes NumPy lacks (bfloat16), come from ``torch.empty``.

    The tensor is a normal one also when made under ``torch.inference_mode()``: a column or buffer outlives that
    block, and torch refuses every in-place write to an inference tensor outside inference mode.
    """
    with torch.inference_mode(False):
        if torch.device(device).type == "cpu" and not pin_memory:
            try:
                np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            except TypeError:
                pass
            else:
                return torch.from_numpy(np.empty(shape, dtype=np_dtype))
        return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def _numpy_view(column: torch.Tensor) -> Any:
    """A NumPy array sharing ``column``'s memory (host columns of NumPy-representable dtypes), or None."""
    if column.device.type != "cpu":
        return None
    try:
        return column.numpy()
    except (TypeError, RuntimeError):  # e.g. bfloat16 has no NumPy dtype
        return None


def _raw_rows(column: torch.Tensor) -> tuple[int, int, torch.dtype] | None:
    """(address, bytes per row, dtype) of a contiguous host column, or None (then rows are copied by tensor ops)."""
    if column.device.type != "cpu" or not column.is_contiguous() or column.is_complex():
        return None
    return column.data_ptr(), column[:1].nbytes, column.dtype


def last_level_cache(cpu: str = "/sys/devices/system/cpu/cpu0") -> int | None:
    """The size in bytes of CPU 0's last-level cache, as Linux reports it (``cache/index*/``: the data or unified
    cache of the highest level), or None where nothing readable reports one."""
    best: tuple[int, int] | None = None  # (level, bytes)
    try:
        for index in os.scandir(os.path.join(cpu, "cache")):
            if not index.name.startswith("index"):
                continue
            info = {}
            for name in ("type", "level", "size"):
                with open(os.path.join(index.path, name)) as f:
                    info[name] = f.read().strip()
            size = info["size"]
            value = int(size.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            level = int(info["level"])
            if info["type"] != "Instruction" and value > 0 and (best is None or level > best[0]):
                best = (level, value)
    except (OSError, ValueError):
        return None
    return None if best is None else best[1]


def stream_thresholds(llc: int | None) -> tuple[int, int]:
    """The sizes in bytes from which the compiled row copies write around the caches (non-temporal stores): (a
    gather, a run of rows into the ring), for a last-level cache of ``llc`` bytes (None: unknown).

    A plain store first reads each line it writes, and a copy larger than the cache evicts what it wrote before
    anyone reads it; a copy the cache holds is read back from it. Measured (``benchmarks/scripts/stream_ab.py``):
    with a 16 MiB L3 streaming won from 4 MiB gathers and 5 MB runs; with a 300 MiB L3 it lost for gathers of
    10 MB and runs of 5-82 MB, and won for gathers from 41 MB. So: from 4 MiB or an eighth of the cache for a
    gather, from 1 MiB or a quarter of the cache for a run, whichever is larger."""
    gather, run = 4 << 20, 1 << 20
    if llc:
        gather, run = max(gather, llc // 8), max(run, llc // 4)
    return gather, run


#: the compiled row copies (see gather_into and ColumnarStorage.append_rows), or None
_rows: Any = load_kernels("conduit.storage._rows", ("put", "gather", "streaming"))
if _rows is not None:
    _rows.streaming(*stream_thresholds(last_level_cache()))


def gather_into(column: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                raw: tuple[int, int, torch.dtype] | None = None) -> torch.Tensor:
    """``torch.index_select(column, 0, slots, out=out)``: by the compiled row copy (``conduit.storage._rows``)
    where it applies (a contiguous host column of items with a shape, an output of its dtype, int64 host slots),
    which gathers the same rows faster (large gathers write around the caches); else by torch (which gathers
    scalar columns as fast). ``raw``: ``column``'s :func:`_raw_rows`, when known."""
    raw = _raw_rows(column) if raw is None else raw
    k = slots.shape[0]
    if (_rows is not None and raw is not None and column.dim() > 1 and slots.dtype is torch.int64 and slots.is_cpu
            and slots.dim() == 1 and slots.is_contiguous() and type(out) is torch.Tensor and out.dtype is raw[2]
            and out.is_cpu and out.is_contiguous() and out.shape[0] == k and out.nbytes == k * raw[1]
            and not out.is_neg()):
        _rows.gather(out.data_ptr(), raw[0], raw[1], slots.data_ptr(), k, column.shape[0])
        return out
    return torch.index_select(column, 0, slots, out=out)


_memmove = ctypes.memmove


class ColumnarStorage(Storage):
    """One contiguous preallocated tensor per field; ragged fields in a packed element pool.

    Ingestion writes each field with at most two copies (one if the ring does not wrap)
    straight from the caller's tensors: no copy beyond the one into storage. A contiguous
    host tensor is written with one ``memmove`` per run of rows (about 0.5 us less per field
    than through NumPy for one item, 2% for 256); other host tensors through a NumPy view of
    the column (a few microseconds less per call than ``copy_`` for small batches).

    A storage built under ``torch.inference_mode()`` holds normal tensors (not inference tensors), so that it is
    written and read outside that mode as inside it.

    Args:
        schema: the fields.
        capacity: number of item slots.
        device: where the columns live.

    Keyword Args:
        ragged_capacity: elements in each ragged field's pool (default ``capacity * 64``).
        pin_memory: allocate host columns in page-locked memory (needs CUDA).
        allocator: custom column allocation (e.g. memory-mapped files for the disk tier).
        tier: the tier name reported by placement.
        prefault: commit pageable host columns at construction (zero every page), so that no
            ingestion call takes first-touch page faults while the ring fills. Measured
            (``benchmarks/results/host_memory_2026-12-06*.md``, two runs): a first-pass append without it
            took 1.44-1.57x the time of one into committed pages; building a 200 MB storage took
            36-44 ms more with it. Pass False to let the OS commit memory as
            it is written (a capacity far above what a run will fill). Page-locked, device
            and custom-allocated columns are unaffected.
    """

    def __init__(self, schema: ExperienceSchema, capacity: int, device: torch.device | str = "cpu", *,
                 ragged_capacity: int | None = None, pin_memory: bool = False,
                 allocator: Allocator | None = None, tier: str | None = None, prefault: bool = True) -> None:
        if not is_int(capacity) or capacity <= 0:  # (NumPy's 8 is a count, as everywhere in core; True is none)
            raise ConfigurationError(f"capacity must be a positive int, got {capacity!r}.")
        capacity = int(capacity)
        self.schema = schema
        self.capacity = capacity
        self.device = torch.device(device)
        self.tier = tier or ("host" if self.device.type == "cpu" else "gpu")
        self.ragged_capacity = pool_elements(ragged_capacity, capacity)
        if schema.ragged and self.ragged_capacity <= 0:
            raise ConfigurationError("ragged_capacity must be positive for a schema with ragged fields.")

        def default_alloc(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
            column = empty_column(shape, dtype, self.device, pin_memory=pin_memory)
            if prefault and column.device.type == "cpu" and not pin_memory:
                column.zero_()
            return column

        alloc = allocator or default_alloc
        # normal tensors also when built under torch.inference_mode(): the buffer is written in place outside it
        try:
            with torch.inference_mode(False):
                self._cols = {n: alloc((capacity, *schema[n].shape), schema[n].dtype, n) for n in schema.fixed}
                self._pools = {n: alloc((self.ragged_capacity, *schema[n].shape), schema[n].dtype, n)
                               for n in schema.ragged}
                # Per-slot bookkeeping on the host: ragged start/length.
                self._rstart = {n: torch.zeros(capacity, dtype=torch.int64) for n in schema.ragged}
                self._rlen = {n: torch.zeros(capacity, dtype=torch.int64) for n in schema.ragged}
        except (MemoryError, ValueError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            pools = f" and ragged pools of {self.ragged_capacity} elements" if schema.ragged else ""
            raise AllocationError(f"A storage of {capacity} items ({schema.fixed_item_bytes} bytes each in fixed fields"
                                  f"{pools}) cannot be allocated on {self.tier} ({first_line(e)}); "
                                  f"lower capacity (or ragged_capacity), or place the buffer where there is room "
                                  f"(e.g. DiskPlacement).") from e
        self._rhead = {n: 0 for n in schema.ragged}
        #: per ragged field, handles (a, b) whose items a .. b - 1 hold no elements: an eviction walk from an oldest
        #: item in [a, b] starts at b (a bound from below, so that an oldest moved back is walked from again)
        self._rempty = {n: (0, 0) for n in schema.ragged}
        self._oldest = 0
        self._next = 0
        self._np_cols = {n: _numpy_view(c) for n, c in self._cols.items()}
        #: host columns written by one memmove per contiguous run of rows (the columns are never reallocated)
        self._raw_cols = {n: _raw_rows(c) for n, c in self._cols.items()}
        self._plan = self._rows_plan()

    def __getstate__(self) -> dict[str, Any]:
        """The storage for a copy or pickle, without the columns' NumPy views and raw addresses: those name this
        object's memory (a copy writing through them would write into this storage, or into freed memory)."""
        state = self.__dict__.copy()
        del state["_np_cols"], state["_raw_cols"], state["_plan"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_rempty", {n: (0, 0) for n in self._pools})  # (pickled before it existed)
        self._np_cols = {n: _numpy_view(c) for n, c in self._cols.items()}
        self._raw_cols = {n: _raw_rows(c) for n, c in self._cols.items()}
        self._plan = self._rows_plan()

    def _rows_plan(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...], int, int, torch.Tensor], ...] | None:
        """What :meth:`append_rows` hands the compiled row store: per fixed field (name, dtype, item shape, column
        address, bytes per row, the column: held by the plan, so that a store running without the GIL never
        writes into a column :meth:`close` let go of); None where it cannot serve (no compiled kernels, ragged
        fields, a column off the host or not contiguous)."""
        if _rows is None or self._pools or not self._cols or any(r is None for r in self._raw_cols.values()):
            return None
        return tuple((n, raw[2], tuple(self.schema[n].shape), raw[0], raw[1], self._cols[n])
                     for n, raw in self._raw_cols.items() if raw is not None)

    def append_rows(self, columns: dict[str, Any]) -> AppendResult | None:
        """:meth:`append`, evicting as needed, for the common batch in one compiled call: a dict holding exactly the
        schema's fields as host tensors of their dtypes and item shapes, contiguous, 1 to ``capacity`` rows. The
        call checks every field, then copies each with one ``memmove`` per run of rows.

        Returns None, with nothing changed, for anything else (NumPy arrays, other shapes or dtypes, ragged
        fields, columns off the host, an install without the compiled row store): then validate the batch
        (:meth:`ExperienceBatch.checked`) and :meth:`append` it, which converts it or refuses it typed.
        """
        plan = self._plan
        if plan is None:
            return None
        first = self._next
        try:
            n = _rows.put(columns, plan, first % self.capacity, self.capacity)
        except RuntimeError:  # torch refused to read a field (e.g. the shape of a nested tensor): put wrote nothing
            return None
        if n < 0:
            return None
        evicted_from = self._oldest
        self._oldest = max(evicted_from, first + n - self.capacity)
        self._next = first + n
        return AppendResult(first, n, evicted_from, self._oldest)

    # -- ring ------------------------------------------------------------------------------
    @property
    def oldest(self) -> int:
        return self._oldest

    @property
    def next_handle(self) -> int:
        return self._next

    def nbytes(self) -> int:
        cols = list(self._cols.values()) + list(self._pools.values())
        return sum(c.numel() * c.element_size() for c in cols)

    def _slot_evictions(self, batch: ExperienceBatch) -> int:
        """How many oldest items must go for ``batch``'s item slots, once it is checked to fit at all.

        Raises:
            CapacityError: ``batch`` is larger than the capacity, or brings more elements than a pool.
        """
        n = batch.batch_size
        if n > self.capacity:
            raise CapacityError(f"A batch of {n} items is larger than the capacity ({self.capacity}); "
                                f"split it or raise capacity.")
        self.check_ragged_fits(batch)
        return max(0, self._next - self._oldest + n - self.capacity)

    def _evictions_for(self, batch: ExperienceBatch) -> tuple[int, dict[str, int]]:
        """How many oldest items must go for ``batch`` to fit, and where each ragged block starts.

        Each ragged pool is a ring: a batch's elements go at the field's head, or at the pool's start when they do
        not fit before its end (the rest of the pool is then skipped). The items whose elements lie in what the
        block sweeps (from the head to the block's end, a skipped rest included) go, with every older item. The
        cost grows with the items evicted, not with the items live (:func:`_ring_walk`).
        """
        n = batch.batch_size
        size = self._next - self._oldest
        k = self._slot_evictions(batch)
        starts: dict[str, int] = {}
        pool = self.ragged_capacity
        for name in self.schema.ragged:
            col = batch[name]
            assert isinstance(col, Ragged)
            total = int(col.values.shape[0])
            head = self._rhead[name]
            wraps = head + total > pool
            starts[name] = 0 if wraps else head
            if size and total:
                a, b = self._rempty[name]
                found, upto = _ring_walk(self._rstart[name].numpy(), self._rlen[name].numpy(),
                                         b if a <= self._oldest <= b else self._oldest, self._next, self.capacity,
                                         head=head, span=pool - head + total if wraps else total, pool=pool,
                                         step=2 * n + _WALK_FIRST)
                self._rempty[name] = (self._oldest, found)  # (true whether or not this append goes ahead)
                k = max(k, upto - self._oldest)
        return k, starts

    def append(self, batch: ExperienceBatch, *, evict: bool = True) -> AppendResult:
        n = batch.batch_size
        starts: dict[str, int]
        if not self._pools and n <= self.capacity:  # fixed fields only: evictions are a subtraction
            k, starts = max(0, self._next - self._oldest + n - self.capacity), {}
        else:
            k, starts = self._evictions_for(batch)
        if k and not evict:
            if k <= max(0, self._next - self._oldest + n - self.capacity):
                short = "capacity."
            else:
                default = (f", the default: {DEFAULT_POOL_PER_ITEM} per item of capacity"
                           if self.ragged_capacity == pool_elements(None, self.capacity) else "")
                short = (f"ragged_capacity: the slots have room, but each ragged field's pool holds "
                         f"{self.ragged_capacity} elements{default}, and the live items' sequences fill it. Build the "
                         f"buffer with ExperienceDataPlane(..., ragged_capacity=N), N about capacity x the mean "
                         f"sequence length.")
            raise CapacityError(f"Storing {n} more items needs {k} live items evicted, and this buffer may "
                                f"not evict (on-policy data not yet consumed). Consume first or raise {short}")
        ev_from = self._oldest
        self._oldest += k
        first = self._next
        s = first % self.capacity
        if n:
            a = min(n, self.capacity - s)
            cols = cast("dict[str, torch.Tensor]", batch._columns)  # this loop reads the fixed fields only
            for name, dst in self._cols.items():
                src = cols[name]
                raw = self._raw_cols[name]
                if (raw is not None and type(src) is torch.Tensor and src.dtype is raw[2] and src.is_cpu
                        and src.is_contiguous() and not src.is_neg() and src.nbytes == n * raw[1]
                        and (p := src.data_ptr())):
                    # the rows are one contiguous block on both sides, of the same dtype: the fastest copy there is
                    # (it cannot write past the ring or read past ``src``: the sizes were just checked)
                    row = raw[1]
                    _memmove(raw[0] + s * row, p, a * row)
                    if a < n:
                        _memmove(raw[0], p + a * row, (n - a) * row)
                    continue
                dnp = self._np_cols[name]
                if src.requires_grad:  # stored by value: a copy_ would put the column in src's autograd graph
                    src = src.detach()
                if dnp is not None and src.is_cpu and not (src.is_neg() or src.is_conj()):
                    snp = src.numpy()
                    dnp[s:s + a] = snp[:a]
                    if a < n:
                        dnp[:n - a] = snp[a:]
                    continue
                if a == n:
                    dst.narrow(0, s, n).copy_(src)
                else:
                    dst.narrow(0, s, a).copy_(src.narrow(0, 0, a))
                    dst.narrow(0, 0, n - a).copy_(src.narrow(0, a, n - a))
            for name in self.schema.ragged:
                col = batch[name]
                assert isinstance(col, Ragged)
                total = int(col.values.shape[0])
                head = starts[name]
                # by value, without autograd history (a pool in a graph could no longer be gathered into buffers)
                self._pools[name][head:head + total].copy_(col.values.detach() if col.values.requires_grad
                                                           else col.values)
                st = head + col.offsets
                self._rstart[name][s:s + a] = st[:a]
                self._rlen[name][s:s + a] = col.lengths[:a]
                if a < n:
                    self._rstart[name][:n - a] = st[a:]
                    self._rlen[name][:n - a] = col.lengths[a:]
                self._rhead[name] = head + total
        self._next = first + n
        return AppendResult(first, n, ev_from, self._oldest)

    def evictions_if_compacted(self, batch: ExperienceBatch) -> int:
        """How many oldest items must go for ``batch`` to fit once the pools are compacted (:meth:`compact`): the
        slots, and each ragged field's free elements taken as one block. At most what :meth:`append` evicts without
        compacting (its swept span holds no live item, so the live items leave room for the batch in total).

        Raises:
            CapacityError: ``batch`` is larger than the capacity, or brings more elements than a pool.
        """
        k = self._slot_evictions(batch)
        if not self._pools or self._next == self._oldest:
            return k
        slots = np.arange(self._oldest, self._next, dtype=np.int64) % self.capacity
        for name in self.schema.ragged:
            col = batch[name]
            assert isinstance(col, Ragged)
            held = np.cumsum(self._rlen[name].numpy()[slots])  # elements of the oldest 1, 2, ... items
            excess = int(held[-1]) + int(col.values.shape[0]) - self.ragged_capacity
            if excess > 0:
                k = max(k, int(np.searchsorted(held, excess, side="left")) + 1)
        return k

    def compact(self) -> None:
        """Move the live items' ragged elements to the start of each pool, end to end in handle order, and put each
        pool's head after them: the free elements then form one block (an append refused only because the free
        elements were split, e.g. a free tail too short and the pool's start taken, fits after it).

        Items keep their handles and contents; only where their elements lie changes, so a caller must not hold
        views into the pools (a :meth:`gather` copies) nor call it while another thread reads them. Released items'
        elements may be overwritten: :meth:`unrelease` cannot restore them afterwards.
        """
        slots = torch.remainder(torch.arange(self._oldest, self._next, dtype=torch.int64), self.capacity)
        for name, pool in self._pools.items():
            st, ln = self._rstart[name][slots], self._rlen[name][slots]
            total = int(ln.sum())
            if total:
                # a copy first (index_select never aliases the pool): the new places may overlap the old ones
                pool[:total].copy_(torch.index_select(pool, 0, ranges(st, ln).to(pool.device)))
            self._rstart[name][slots] = torch.cumsum(ln, 0) - ln
            self._rhead[name] = total

    def release(self, upto: int) -> None:
        self._oldest = max(self._oldest, min(int(upto), self._next))

    def unrelease(self, oldest: int) -> None:
        """Undo :meth:`release` calls made since the oldest live handle was ``oldest``: the released items are live
        again, with the rows they held.

        Only for a release whose items no write has touched since, i.e. undoing the release an append made just
        before it was refused (a refused :meth:`append` checks before it writes, so it overwrote nothing). After a
        successful append, a :meth:`truncate` or a restore, the released slots may hold other rows: do not call it
        then.

        Raises:
            ConfigurationError: ``oldest`` is above the oldest live handle, or so far below the next handle that
                the items would not fit in the capacity (nothing changed).
        """
        oldest = int(oldest)
        if oldest > self._oldest or self._next - oldest > self.capacity:
            raise ConfigurationError(
                f"unrelease({oldest}) can only restore a release of live items (oldest live handle {self._oldest}, "
                f"next {self._next}, capacity {self.capacity}); pass the oldest handle read before that release.")
        self._oldest = oldest

    def truncate(self, upto: int) -> None:
        """Forget the newest items, from handle ``upto`` on, as if they had never been appended.

        Undoes appends whose items the caller could not keep (a sharded write that failed on
        another shard). Older items are untouched; the forgotten items' slots and ragged pool
        space are free again: each pool's head goes back to the end of the newest live item's
        elements (live items lie in the pool in handle order, so what follows them is free).
        """
        self._next = max(self._oldest, min(int(upto), self._next))
        for name, (a, b) in self._rempty.items():
            self._rempty[name] = (min(a, self._next), min(b, self._next))
        if self._next > self._oldest:
            slot = (self._next - 1) % self.capacity
            for name in self._pools:
                self._rhead[name] = int(self._rstart[name][slot]) + int(self._rlen[name][slot])

    # -- read ------------------------------------------------------------------------------
    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> ExperienceBatch:
        cols: dict[str, torch.Tensor | Ragged] = {}
        dev_slots = slots if slots.device == self.device else slots.to(self.device)
        for name, col in self._cols.items():
            if out is not None:
                cols[name] = gather_into(col, dev_slots, out[name], self._raw_cols[name])
            else:
                cols[name] = torch.index_select(col, 0, dev_slots)
        for name, pool in self._pools.items():
            st, ln = self._rstart[name][slots], self._rlen[name][slots]
            total = int(ln.sum())
            buf = torch.empty((total, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
            if total >= _SEGMENT_COPY_MIN_MEAN * max(int(ln.shape[0]), 1):
                vals = _copy_segments(pool, st, ln, buf)  # long sequences: memcpy whole runs
            else:
                flat = ranges(st, ln)
                vals = torch.index_select(pool, 0, flat.to(pool.device), out=buf)
            cols[name] = Ragged(vals, ln)
        return ExperienceBatch(cols, int(slots.shape[0]))

    # -- checkpoint ------------------------------------------------------------------------
    def ragged_layout(self) -> dict[str, Any] | None:
        if not self._pools:
            return None
        slots = torch.remainder(torch.arange(self._oldest, self._next, dtype=torch.int64), self.capacity)
        return {"pool": self.ragged_capacity, "starts": {n: self._rstart[n][slots].clone() for n in self._pools},
                "heads": {n: int(self._rhead[n]) for n in self._pools}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        oldest, batch, layout = self.checkpoint_contents(state)
        self.rewrites += 1
        self._oldest = self._next = oldest
        for name in self.schema.ragged:
            self._rhead[name] = 0
            self._rempty[name] = (0, 0)
        if batch.batch_size:
            self.append(batch, evict=False)
        if layout is not None:
            self.place_ragged(batch, layout)

    def place_ragged(self, batch: ExperienceBatch, layout: dict[str, Any]) -> None:
        """Move the live items' ragged elements (``batch``, the live items in handle order, just loaded packed) to
        where ``layout`` (checked by :meth:`checkpoint_layout`) says the saved buffer held them."""
        slots = torch.remainder(torch.arange(self._oldest, self._next, dtype=torch.int64), self.capacity)
        for name, pool in self._pools.items():
            col = batch[name]
            assert isinstance(col, Ragged)
            starts = layout["starts"][name]
            if int(col.values.shape[0]):
                where = ranges(starts, col.lengths.cpu()).to(pool.device)
                values = col.values.detach().to(pool.device, pool.dtype)
                bits = index_copy_dtype(pool.dtype)
                if bits is None:
                    pool.index_copy_(0, where, values)
                else:
                    pool.view(bits).index_copy_(0, where, values.view(bits))
            self._rstart[name][slots] = starts
            self._rhead[name] = layout["heads"][name]
