"""A vectorised sum/min tree over slots (NumPy, float64), for proportional sampling."""

from __future__ import annotations

import numpy as np

__all__ = ["SumTree"]


class SumTree:
    """Leaves hold non-negative weights per slot; internal nodes hold sums and minima.

    Updates and queries are vectorised over a batch of slots: a batch update costs
    O(k log C) NumPy work in ``log C`` calls, a batch draw ``log C`` calls.
    The minimum ignores zero leaves (empty or never-sampled slots).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 1 << max(0, (capacity - 1).bit_length())
        self.depth = self.size.bit_length() - 1
        self._sum = np.zeros(2 * self.size, dtype=np.float64)
        self._min = np.full(2 * self.size, np.inf, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """Smallest positive leaf (``inf`` when every leaf is zero)."""
        return float(self._min[1])

    def get(self, slots: np.ndarray) -> np.ndarray:
        return self._sum[slots + self.size]

    def set(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``slots`` to ``values`` (for a repeated slot the last value wins)."""
        if slots.size == 0:
            return
        if slots.size <= 8:  # a few leaves (one env step, one small update): scalar walk, ~10x fewer NumPy calls
            self._set_few(slots, values)
            return
        idx = slots.astype(np.int64) + self.size
        self._sum[idx] = values
        self._min[idx] = np.where(values > 0, values, np.inf)
        # Recompute each ancestor from its two children, level by level. Repeated parents
        # write the same value, so no de-duplication is needed.
        for _ in range(self.depth):
            idx >>= 1
            left = idx << 1
            self._sum[idx] = self._sum[left] + self._sum[left + 1]
            self._min[idx] = np.minimum(self._min[left], self._min[left + 1])

    def _set_few(self, slots: np.ndarray, values: np.ndarray) -> None:
        """:meth:`set` one leaf after the other, walking up with scalar reads (same results, bit for bit)."""
        s, m = self._sum, self._min
        vals = np.broadcast_to(np.asarray(values, dtype=np.float64), slots.shape).tolist()
        for slot, v in zip(slots.astype(np.int64).tolist(), vals, strict=True):
            i = slot + self.size
            s[i] = v
            m[i] = v if v > 0 else np.inf
            for _ in range(self.depth):
                i >>= 1
                left = i << 1
                s[i] = s[left] + s[left + 1]
                a, b = m[left], m[left + 1]
                m[i] = a if a < b else b

    def find(self, prefix: np.ndarray) -> np.ndarray:
        """Slots whose cumulative-weight interval contains each value of ``prefix``."""
        idx = np.ones(prefix.shape[0], dtype=np.int64)
        u = prefix.astype(np.float64, copy=True)
        while idx[0] < self.size:
            left = idx << 1
            lw = self._sum[left]
            right = u >= lw
            u -= np.where(right, lw, 0.0)
            idx = left + right
        return idx - self.size

    def state(self) -> np.ndarray:
        return self._sum[self.size:self.size + self.capacity].copy()

    def load(self, leaves: np.ndarray) -> None:
        self._sum[:] = 0.0
        self._min[:] = np.inf
        self.set(np.arange(self.capacity, dtype=np.int64), leaves)
