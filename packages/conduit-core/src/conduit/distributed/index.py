"""The global index of a sharded buffer: handles -> (shard, local handle), with holes for lost items.

The index *is* the :class:`~conduit.storage.Storage` that core's semantics run on: a
payload-free FIFO ring of global handles (live = ``[oldest, next_handle)``, ``slot =
handle % capacity``). So uniform sampling is over the union of the shards, the
prioritized sum tree holds one global total, and an on-policy rollout is one range of
global handles however it is spread, exactly as on one machine.

Each ingestion adds *segments*: a run of consecutive global handles stored, as a run of
consecutive local handles, on up to ``replication`` shards. A segment whose every
replica was lost is a hole: its handles are *lost* (never delivered again, not counted by
``len``) until FIFO eviction or on-policy release passes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from conduit.batch import ExperienceBatch
from conduit.checks import is_int
from conduit.errors import CapacityError, ConfigurationError
from conduit.schema import ExperienceSchema
from conduit.storage.base import AppendResult, Storage

__all__ = ["ShardIndex"]


class ShardIndex(Storage):
    """Global handles of a sharded buffer and where each one's replicas live.

    Args:
        schema: the fields (kept for reports; the payload lives in the shards).
        capacity: global item slots.
        replication: replicas per item (columns of the replica table).
    """

    tier = "remote"

    def __init__(self, schema: ExperienceSchema, capacity: int, replication: int) -> None:
        if not is_int(capacity) or capacity <= 0:  # (NumPy's 8 is a count, as everywhere in core; True is none)
            raise ConfigurationError(f"capacity must be a positive int, got {capacity!r}.")
        capacity = int(capacity)
        self.schema = schema
        self.capacity = capacity
        self.replication = replication
        self.device = torch.device("cpu")
        self._oldest = 0
        self._next = 0
        self._first = np.zeros(64, dtype=np.int64)
        self._count = np.zeros(64, dtype=np.int64)
        self._shard = np.full((64, replication), -1, dtype=np.int64)
        self._local = np.zeros((64, replication), dtype=np.int64)
        self._lo = 0
        self._hi = 0
        #: global [a, b) ranges with no replica left (clipped to the window lazily)
        self._holes: list[tuple[int, int]] = []

    # -- the ring -----------------------------------------------------------------------------
    @property
    def oldest(self) -> int:
        return self._oldest

    @property
    def next_handle(self) -> int:
        return self._next

    def lost_in_window(self) -> int:
        """Lost items among ``[oldest, next_handle)``."""
        return sum(max(0, min(b, self._next) - max(a, self._oldest)) for a, b in self._holes)

    def __len__(self) -> int:
        """Live items that can still be delivered (lost ones excluded)."""
        return self._next - self._oldest - self.lost_in_window()

    def reserve(self, n: int, *, evict: bool) -> AppendResult:
        """Assign handles to ``n`` new items, evicting the oldest (FIFO) when allowed.

        Raises:
            CapacityError: ``n`` exceeds the capacity, or room is needed and eviction is off.
        """
        k = self.evictions_for(n)
        if k and not evict:
            raise CapacityError(f"Storing {n} more items needs {k} live items evicted, and this buffer may not "
                                f"evict (on-policy data not yet consumed). Consume first or raise capacity.")
        ev_from = self._oldest
        self._oldest += k
        first = self._next
        self._next += n
        self._trim()
        return AppendResult(first, n, ev_from, self._oldest)

    def evictions_for(self, n: int) -> int:
        """How many oldest items an ingestion of ``n`` evicts."""
        if n > self.capacity:
            raise CapacityError(f"A batch of {n} items is larger than the capacity ({self.capacity}); split it or "
                                f"raise capacity.")
        return max(0, self._next - self._oldest + n - self.capacity)

    def append(self, batch: ExperienceBatch, *, evict: bool = True) -> AppendResult:
        """Reserve handles for ``batch`` (the payload itself goes to the shards, not here)."""
        return self.reserve(batch.batch_size, evict=evict)

    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> ExperienceBatch:
        raise NotImplementedError("The index holds no payload; DistributedDataPlane reads rows from the shards.")

    def handles_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The live handle at each live slot (arithmetic: handles are consecutive)."""
        return self._oldest + torch.remainder(slots.to(torch.int64) - self._oldest, self.capacity)

    def release(self, upto: int) -> None:
        self._oldest = max(self._oldest, min(int(upto), self._next))
        self._trim()

    def state_dict(self) -> dict[str, Any]:
        return {"oldest": self._oldest, "next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset(int(state["oldest"]))
        self._next = int(state["next"])

    # -- segments -----------------------------------------------------------------------------
    def reset(self, start: int = 0) -> None:
        """Empty index whose next handle is ``start``."""
        self._oldest = self._next = start
        self._lo = self._hi = 0
        self._holes = []

    def _grow(self) -> None:
        live = self._hi - self._lo
        cap = self._first.shape[0]
        if self._lo > 0 and live < cap // 2:
            sl = slice(self._lo, self._hi)
            self._first[:live], self._count[:live] = self._first[sl].copy(), self._count[sl].copy()
            self._shard[:live], self._local[:live] = self._shard[sl].copy(), self._local[sl].copy()
        else:
            new = cap * 2
            self._first = np.resize(self._first, new)
            self._count = np.resize(self._count, new)
            self._shard = np.concatenate([self._shard, np.full((new - cap, self.replication), -1, np.int64)])
            self._local = np.concatenate([self._local, np.zeros((new - cap, self.replication), np.int64)])
            return
        self._lo, self._hi = 0, live

    def add_segment(self, first: int, count: int, replicas: list[tuple[int, int]]) -> None:
        """Record that handles ``[first, first + count)`` live on ``replicas`` as (shard, first local handle)."""
        if self._hi == self._first.shape[0]:
            self._grow()
        i = self._hi
        self._first[i], self._count[i] = first, count
        self._shard[i] = -1
        for r, (s, lf) in enumerate(replicas):
            self._shard[i, r], self._local[i, r] = s, lf
        self._hi += 1
        if not replicas:
            self._holes.append((first, first + count))

    def _trim(self) -> None:
        while self._lo < self._hi and self._first[self._lo] + self._count[self._lo] <= self._oldest:
            self._lo += 1
        if self._holes and self._holes[0][1] <= self._oldest:
            self._holes = [h for h in self._holes if h[1] > self._oldest]

    def segments_of(self, handles: np.ndarray) -> np.ndarray:
        """Row of the segment holding each handle (handles must be live)."""
        rows = np.searchsorted(self._first[self._lo:self._hi], handles, side="right") - 1 + self._lo
        return rows.astype(np.int64)

    def lost_mask(self, handles: np.ndarray) -> np.ndarray:
        """True for each handle whose every replica is lost."""
        if not self._holes:
            return np.zeros(handles.shape[0], dtype=bool)
        rows = self.segments_of(handles)
        return (self._shard[rows] < 0).all(axis=1)

    def replicas(self, rows: np.ndarray, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, local handle) per replica column for each handle: arrays ``[k, replication]`` (-1: none)."""
        shard = self._shard[rows]
        local = self._local[rows] + (handles - self._first[rows])[:, None]
        return shard, local

    def live_rows(self) -> range:
        return range(self._lo, self._hi)

    def segment(self, row: int, oldest: int | None = None) -> tuple[int, int, list[tuple[int, int]]]:
        """(first handle, count, [(shard, local first)]) of a segment, clipped to the live window (or to the
        window once it starts at ``oldest``, when given)."""
        first, count = int(self._first[row]), int(self._count[row])
        cut = max(0, (self._oldest if oldest is None else oldest) - first)
        reps = [(int(s), int(lf) + cut) for s, lf in zip(self._shard[row], self._local[row], strict=True) if s >= 0]
        return first + cut, count - cut, reps

    def segment_span(self, row: int) -> tuple[int, int]:
        """(first handle, count) of a segment as it was added (not clipped)."""
        return int(self._first[row]), int(self._count[row])

    def add_replica(self, row: int, shard: int, local_first_of_segment: int) -> bool:
        """Record one more replica of segment ``row`` (its local handle of the segment's first item)."""
        free = np.nonzero(self._shard[row] < 0)[0]
        if free.size == 0:
            return False
        c = int(free[0])
        self._shard[row, c], self._local[row, c] = shard, local_first_of_segment
        return True

    def drop_shard(self, shard: int) -> tuple[np.ndarray, int, list[int]]:
        """Forget every replica on ``shard``.

        Returns:
            (lost handles in the window, items still held by another replica, rows now under-replicated)
        """
        sl = slice(self._lo, self._hi)
        hit = (self._shard[sl] == shard)
        rows = np.nonzero(hit.any(axis=1))[0] + self._lo
        self._shard[sl][hit] = -1
        lost: list[np.ndarray] = []
        recovered = 0
        under: list[int] = []
        for row in rows.tolist():
            first, count, reps = self.segment(row)
            if count <= 0:
                continue
            if reps:
                recovered += count
                under.append(row)
            else:
                self._holes.append((first, first + count))
                lost.append(np.arange(first, first + count, dtype=np.int64))
        handles = np.concatenate(lost) if lost else np.zeros(0, dtype=np.int64)
        return handles, recovered, under

    def needed_from(self, shard: int, oldest: int | None = None) -> int | None:
        """The smallest local handle on ``shard`` still needed once the window starts at ``oldest``
        (default: now); None when nothing there is needed."""
        o = self._oldest if oldest is None else oldest
        sl = slice(self._lo, self._hi)
        cut = np.clip(o - self._first[sl], 0, self._count[sl])
        # segments that ``oldest`` evicts whole need nothing (the index trims them only once they are evicted)
        hit = (self._shard[sl] == shard) & (cut < self._count[sl])[:, None]
        if not hit.any():
            return None
        local = self._local[sl] + cut[:, None]
        return int(local[hit].min())

    def held_end(self, shard: int) -> int:
        """One past the highest local handle on ``shard`` that a segment of the index names (0: none)."""
        sl = slice(self._lo, self._hi)
        hit = self._shard[sl] == shard
        if not hit.any():
            return 0
        return int((self._local[sl] + self._count[sl][:, None])[hit].max())

    def live_handles(self) -> np.ndarray:
        """Every deliverable handle, oldest first."""
        h = np.arange(self._oldest, self._next, dtype=np.int64)
        return h[~self.lost_mask(h)] if self._holes else h
