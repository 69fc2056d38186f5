"""Per-slot weights with sums and minima, for proportional sampling (float64).

Two implementations of one interface; :func:`sum_tree` picks the faster one this install has.
:class:`CompiledSumTree` is a binary tree whose kernels are C (``conduit.semantics._sumtree``,
compiled when conduit-core is installed where a C compiler is found): a write or a draw is one
C call over ``log2 C`` levels, so a priority update or a draw of 32 costs a few microseconds
whatever the capacity. :class:`SumTree` is NumPy alone, for installs without the compiled kernels:

A two-level structure rather than a binary tree: leaves are grouped in blocks of ``B``
(64 by default), and each block keeps its sum and its smallest positive leaf. An update
rewrites the leaves and marks their blocks stale; the next read (a draw, the total, the
minimum) recomputes the stale blocks from their leaves, once however many updates came
between. So a priority update is two NumPy calls, and with prefetching the block work runs
on the worker thread that draws, off the learner's critical path. A draw finds the
block by a cumulative sum over the block sums, then the leaf by a cumulative sum inside the
block. Both are a fixed handful of vectorised NumPy calls whatever the capacity, where a
binary tree needs several calls per level (``log2 C`` levels): for the small batches RL
updates (32-512 items) the call count, not the arithmetic, is the cost. Measured against a
binary tree of the same capacity (5k-1M slots): updates of 32-256 weights 2-10x faster,
draws of 32 1.5-3x faster, draws of 256 about equal. Block sums are recomputed from the
leaves, never adjusted incrementally, so no rounding error accumulates.

Up to :data:`FLAT_MAX` slots only the leaves are kept: a write is one NumPy call, and the
total, the minimum and a draw take one pass over all leaves (a prefix sum and a binary
search), which costs less there than the dozen calls of the two-level search.

Prefix sums run in torch (``torch.cumsum`` is 3-4x faster than NumPy's on these sizes: 5 us
against 18 us for 5000 leaves), on views of the arrays made per call: a kept view would, in a
copied or unpickled tree, still show the original's memory. The rest is NumPy. The total and
the smallest positive weight are kept between writes, so a draw reads each once; so are the
prefix sums of the leaves (leaves only) or of the block sums (an array of their own), whose last
element is the total.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

from conduit._native import load_kernels

__all__ = ["SumTree", "CompiledSumTree", "COMPILED", "KERNELS", "sum_tree", "FLAT_MAX"]

#: the kernels :class:`CompiledSumTree` calls
KERNELS = ("set", "set_one", "build", "find", "draw", "update")

_kernels: Any = load_kernels("conduit.semantics._sumtree", KERNELS)

#: whether this install has the compiled kernels (:class:`CompiledSumTree`)
COMPILED = _kernels is not None

#: capacities up to this keep leaves only (see the module docstring). Measured here, a prioritized step (draw 32,
#: update 32) with leaves only against two levels: 60 / 89 us at 5000 slots, 73 / 90 us at 16384, even at 32768
FLAT_MAX = 16384


class SumTree:
    """Non-negative weights per slot, with their total, smallest positive weight, and prefix search.

    Args:
        capacity: number of slots (all weights start at 0).

    Keyword Args:
        block: leaves per block (a draw scans ``capacity / block`` block sums and ``block``
            leaves per drawn item).
        flat: keep leaves only (default: ``capacity <= FLAT_MAX``).
    """

    def __init__(self, capacity: int, *, block: int = 64, flat: bool | None = None) -> None:
        self.capacity = capacity
        self.block = block
        self.flat = capacity <= FLAT_MAX if flat is None else flat
        self.blocks = -(-capacity // self.block)
        self._leaves = np.zeros(self.blocks * self.block, dtype=np.float64)
        self._rows = self._leaves.reshape(self.blocks, self.block)
        self._bsum = np.zeros(self.blocks, dtype=np.float64)
        self._bmin = np.full(self.blocks, np.inf, dtype=np.float64)
        self._stale = np.zeros(self.blocks, dtype=bool)  # blocks whose sum and minimum are out of date
        self._any_stale = False
        self._total: float | None = None  # the total and smallest positive weight, None once a write changed them
        self._min: float | None = None
        self._cum: np.ndarray | None = None  # the prefix sums a draw searches first (see _prefix), None as above

    def __getstate__(self) -> dict[str, object]:
        """For a copy or pickle: without ``_rows``, a view of ``_leaves`` that a copy would turn into an array of
        its own (rebuilt by :meth:`__setstate__` as a view of the copy's leaves)."""
        state = self.__dict__.copy()
        del state["_rows"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._rows = self._leaves.reshape(self.blocks, self.block)

    def _changed(self) -> None:
        self._total = self._min = self._cum = None

    def _prefix(self) -> np.ndarray:
        """The prefix sums a draw searches first: of the leaves (leaves only) or of the block sums (two levels).
        Kept until the next write; the last is the total, so a draw reads the total and searches in one pass."""
        if self._cum is None:
            if self.flat:
                sums = self._leaves[:self.capacity]
            else:
                self._refresh()
                sums = self._bsum
            self._cum = torch.cumsum(torch.from_numpy(sums), 0).numpy()
        return self._cum

    @property
    def total(self) -> float:
        if self._total is None:
            self._total = float(self._prefix()[-1])
        return self._total

    @property
    def min(self) -> float:
        """Smallest positive weight (``inf`` when every weight is zero)."""
        if self._min is None:
            if self.flat:
                live = self._leaves[:self.capacity]
                low = float(live.min())  # (a full buffer with positive weights: no mask needed)
                self._min = low if low > 0 else float(np.min(live, where=live > 0, initial=np.inf))
            else:
                self._refresh()
                self._min = float(self._bmin.min())
        return self._min

    def _refresh(self) -> None:
        """Recompute the sums and minima of the blocks updated since the last read."""
        if not self._any_stale:
            return
        touched = np.flatnonzero(self._stale)
        rows = self._rows[touched]
        self._bsum[touched] = rows.sum(axis=1)
        low = rows.min(axis=1)
        zero = low <= 0  # blocks with an empty or zero-weight slot: their smallest positive weight, by a mask
        if zero.any():
            low[zero] = np.where(rows[zero] > 0, rows[zero], np.inf).min(axis=1)
        self._bmin[touched] = low
        self._stale[touched] = False
        self._any_stale = False

    def get(self, slots: np.ndarray) -> np.ndarray:
        return self._leaves[slots]

    def set(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set the weights of ``slots`` to ``values`` (for a repeated slot the last value wins)."""
        if slots.size == 0:
            return
        if slots.size == 1:
            self.set_one(int(slots.reshape(-1)[0]), float(np.asarray(values).reshape(-1)[-1]))
            return
        slots = np.asarray(slots, dtype=np.int64)
        if slots.min() < 0 or slots.max() >= self.capacity:  # (the padding past the capacity is no slot)
            raise IndexError(f"slots must lie in [0, {self.capacity}), got {slots.min()} .. {slots.max()}")
        self._leaves[slots] = values
        self._changed()
        if self.flat:
            return
        self._stale[slots // self.block] = True
        self._any_stale = True

    def set_one(self, slot: int, value: float) -> None:
        """Set one weight (one env step per call is common: scalar indexing, one block)."""
        if not 0 <= slot < self.capacity:  # (the padding past the capacity is no slot)
            raise IndexError(f"slot {slot} is outside [0, {self.capacity})")
        self._leaves[slot] = value
        self._changed()
        if not self.flat:
            self._stale[slot // self.block] = True
            self._any_stale = True

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """For each value ``u`` of ``prefix``: the slot ``i`` with ``sum(w[:i]) <= u < sum(w[:i+1])``.

        Values at or past the total (rounding) land on the last positive-weight region's
        edge (or the last slot); callers redraw a slot whose weight is zero.
        """
        u = np.asarray(prefix, dtype=np.float64)
        if self.flat:
            return np.minimum(np.searchsorted(self._prefix(), u, side="right"), self.capacity - 1)
        if u.ndim != 1:
            return self.find(u.reshape(-1)).reshape(u.shape)
        cum = self._prefix()  # (refreshes the block sums read below)
        blk = np.minimum(np.searchsorted(cum, u, side="right"), self.blocks - 1)
        rest = u - (cum[blk] - self._bsum[blk])
        inside = torch.cumsum(torch.from_numpy(self._rows[blk]), 1).numpy()
        j = np.minimum((inside <= rest[:, None]).sum(axis=1), self.block - 1)
        return np.minimum(blk * self.block + j, self.capacity - 1)  # (the last block's padding is no slot)

    def state(self) -> np.ndarray:
        return self._leaves[:self.capacity].copy()

    def load(self, leaves: np.ndarray) -> None:
        self._leaves[:] = 0.0
        self._leaves[:self.capacity] = leaves
        self._bsum[:] = self._rows.sum(axis=1)
        self._bmin[:] = np.where(self._rows > 0, self._rows, np.inf).min(axis=1)
        self._stale[:] = False
        self._any_stale = False
        self._changed()


class CompiledSumTree:
    """:class:`SumTree`'s interface and semantics on a binary tree whose kernels are compiled C.

    Two arrays of ``2P`` nodes (``P`` the smallest power of two >= ``capacity``) hold each node's sum
    and smallest positive weight, recomputed from its children on every write (never adjusted by a
    difference, so the tree depends on the leaves alone: a loaded tree equals an updated one). The
    total and the minimum are the roots; a write and a draw are one C call each. Memory: 32 bytes per
    slot of ``P`` on top of the leaves (32 MiB at a million slots). A negative, NaN or infinite weight
    is refused (``ValueError``) before anything changes; the sampler never writes one.

    A copy or pickle carries the leaves only and rebuilds the tree where it is loaded: with
    :func:`sum_tree`, so an install without the compiled kernels gets a :class:`SumTree` of the same weights.

    Raises:
        ImportError: this install has no compiled kernels (:data:`COMPILED` is False).
    """

    def __init__(self, capacity: int) -> None:
        if _kernels is None:
            raise ImportError("conduit.semantics._sumtree was not compiled in this install (no C compiler when "
                              "conduit-core was installed); use SumTree, or sum_tree() to pick.")
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._p = 1 << max(0, (capacity - 1).bit_length())
        self._leaves = np.zeros(capacity, dtype=np.float64)
        self._sums = np.zeros(2 * self._p, dtype=np.float64)
        self._mins = np.full(2 * self._p, np.inf, dtype=np.float64)

    def __reduce__(self) -> tuple[Any, tuple[int, np.ndarray]]:
        return _rebuilt, (self.capacity, self._leaves)

    @property
    def total(self) -> float:
        return float(self._sums[1])

    @property
    def min(self) -> float:
        """Smallest positive weight (``inf`` when every weight is zero)."""
        return float(self._mins[1])

    def get(self, slots: np.ndarray) -> np.ndarray:
        return self._leaves[slots]

    def set(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set the weights of ``slots`` to ``values`` (for a repeated slot the last value wins)."""
        s = np.ascontiguousarray(slots, dtype=np.int64).reshape(-1)
        if not s.size:
            return
        v = np.asarray(values, dtype=np.float64)
        if v.shape != s.shape:  # (as NumPy's ``leaves[slots] = values``: broadcast to the slots' shape)
            v = np.broadcast_to(v, np.shape(slots)).reshape(-1)
        _kernels.set(self._sums, self._mins, self._leaves, self._p, self.capacity, s, np.ascontiguousarray(v))

    def set_one(self, slot: int, value: float) -> None:
        """Set one weight (one env step per call is common)."""
        _kernels.set_one(self._sums, self._mins, self._leaves, self._p, self.capacity, operator.index(slot),
                         float(value))

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """As :meth:`SumTree.find`; a value at or past the total (rounding) lands on the last positive-weight slot."""
        u = np.ascontiguousarray(prefix, dtype=np.float64).reshape(-1)
        out = np.empty(u.shape[0], dtype=np.int64)
        _kernels.find(self._sums, self._p, self.capacity, u, out)
        return out.reshape(np.shape(prefix))

    def draw(self, u: np.ndarray, beta: float, oldest: int) -> tuple[np.ndarray, ...] | None:
        """A prioritized draw in one call, for uniforms ``u`` in [0, 1) (float64, C-contiguous): the slots
        ``find(u * total)``; their items' handles in a ring of ``capacity`` slots whose oldest live item has
        handle ``oldest``; their weights' shares of the total (float64); and ``(min / weight) ** beta``
        (float32: the importance weights). None when a draw landed on a zero weight (rounding at an interval's
        edge): the caller then draws by :meth:`find` and redraws those."""
        n = u.shape[0]
        slots, handles = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        probs, weights = np.empty(n), np.empty(n, dtype=np.float32)
        if _kernels.draw(self._sums, self._mins, self._leaves, self._p, self.capacity, u, beta, oldest, slots,
                         handles, probs, weights):
            return None
        return slots, handles, probs, weights

    def set_by_handle(self, handles: np.ndarray, priorities: np.ndarray, alpha: float, oldest: int,
                      next_handle: int, log_limit: float) -> tuple[int, float] | None:
        """A prioritized replay's priority update in one call: the weight of slot ``handle % capacity`` becomes
        ``priority ** alpha`` for each handle in ``[oldest, next_handle)``, in order; handles below ``oldest``
        (evicted) are skipped. Returns how many were applied and the largest applied priority (0.0 for none).

        None, with nothing changed, where the caller's general path must convert or refuse the input: arrays
        that are not C-contiguous int64 handles and float64 priorities of one length, a priority NaN,
        infinite or negative, a handle outside ``[0, next_handle)``, or a largest priority whose log exceeds
        ``log_limit``."""
        return _kernels.update(self._sums, self._mins, self._leaves, self._p, self.capacity, handles, priorities,
                               alpha, oldest, next_handle, log_limit)

    def state(self) -> np.ndarray:
        return self._leaves.copy()

    def load(self, leaves: np.ndarray) -> None:
        w = np.asarray(leaves, dtype=np.float64)
        if w.shape != self._leaves.shape or not (w.size == 0 or (w.min() >= 0 and w.max() < np.inf)):
            raise ValueError(f"load() takes {self.capacity} finite weights >= 0.")
        self._leaves[:] = w
        _kernels.build(self._sums, self._mins, self._leaves, self._p, self.capacity)


def sum_tree(capacity: int) -> SumTree | CompiledSumTree:
    """A tree of ``capacity`` zero weights: :class:`CompiledSumTree` where this install has its kernels, else
    :class:`SumTree`."""
    return CompiledSumTree(capacity) if COMPILED else SumTree(capacity)


def _rebuilt(capacity: int, leaves: np.ndarray) -> SumTree | CompiledSumTree:
    """A copied or unpickled :class:`CompiledSumTree`: the best tree of this install, with ``leaves`` loaded."""
    tree = sum_tree(capacity)
    tree.load(leaves)
    return tree
