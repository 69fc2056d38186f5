"""A plain FIFO buffer with the queue semantics, the baseline the Conduit buffer is measured against.

Written from the behaviour of SRL's queue buffers, made thread-safe: ``put`` keeps ``[T, ...]``
samples and, once ``batch_size`` are waiting, stacks them along a new batch axis (``[T, B, ...]``)
in the putting thread; ``get`` returns the oldest batch, each one ``reuses`` times. No background
work, no prefetch: what it costs is paid inside ``put`` and ``get``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np

from conduit_srl.assembler import ReplayEntry
from conduit_srl.testing.records import stack

__all__ = ["FifoBuffer"]


class FifoBuffer:
    """Batches of ``batch_size`` samples in arrival order, each delivered ``reuses`` times."""

    def __init__(self, *, batch_size: int, reuses: int = 1) -> None:
        self.batch_size = batch_size
        self.reuses = reuses
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()  # puts one at a time: batches keep arrival order across putting threads
        self._waiting: list[Any] = []
        self._batches: deque[list[Any]] = deque()  # [sample, uses so far, first id]
        self._stacking = 0  # samples taken from _waiting and being stacked into a batch (counted by qsize)
        self._next = 0

    def put(self, x: Any) -> None:
        with self._put_lock:
            with self._lock:
                self._waiting.append(x)
                if len(self._waiting) < self.batch_size:
                    return
                group, self._waiting = self._waiting[:self.batch_size], self._waiting[self.batch_size:]
                self._stacking = len(group)
            try:
                batch = stack(group, axis=1)
            except BaseException:
                with self._lock:
                    self._stacking = 0
                raise
            with self._lock:
                handles = np.arange(self._next, self._next + len(group), dtype=np.int64)
                self._next += len(group)
                self._batches.append([batch, 0, handles])
                self._stacking = 0

    def get(self) -> ReplayEntry:
        with self._lock:
            if not self._batches:
                raise IndexError("the FIFO buffer is empty")
            item = self._batches[0]
            uses = item[1]
            item[1] += 1
            if item[1] >= self.reuses:
                self._batches.popleft()
        return ReplayEntry(sample=item[0], reuses=uses, sampling_indices=item[2], reuses_left=self.reuses - uses - 1,
                           receive_time=time.time())

    def empty(self) -> bool:
        with self._lock:
            return not self._batches

    def qsize(self) -> int:
        with self._lock:
            return len(self._waiting) + self._stacking + sum(len(b[2]) for b in self._batches if b[1] == 0)
