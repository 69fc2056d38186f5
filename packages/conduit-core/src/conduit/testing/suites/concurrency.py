"""Concurrency: many producer threads, nothing lost or duplicated."""

from __future__ import annotations

import threading
from abc import abstractmethod

import numpy as np

from conduit.testing.endpoints import CAP_CONCURRENT_INGEST, ReplayEndpoint
from conduit.testing.suites.base import SuiteBase, needs

__all__ = ["ConcurrencySuite"]


class ConcurrencySuite(SuiteBase):
    """Concurrent ingestion. Subclass and implement :meth:`make_replay`."""

    threads: int = 8
    items_per_thread: int = 100_000
    chunk: int = 500

    @abstractmethod
    def make_replay(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                    seed: int = 0) -> ReplayEndpoint:
        """An EMPTY replay endpoint wired through the adapter."""

    def test_concurrent_producers_lose_and_duplicate_nothing(self) -> None:
        """8 producer threads x 1e5 items: every id is stored exactly once.

        Troubleshooting: guard the ring's write pointer; reserve slots and write under one lock.
        """
        total = self.threads * self.items_per_thread
        ep = self.make_replay(capacity=total)
        try:
            needs(ep, CAP_CONCURRENT_INGEST)
            errors: list[BaseException] = []
            barrier = threading.Barrier(self.threads)

            def produce(t: int) -> None:
                try:
                    barrier.wait()
                    base = t * self.items_per_thread
                    for s in range(0, self.items_per_thread, self.chunk):
                        ep.insert(np.arange(base + s, base + min(s + self.chunk, self.items_per_thread)))
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            ts = [threading.Thread(target=produce, args=(t,)) for t in range(self.threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errors, f"producer threads raised: {errors[:3]}"
            assert len(ep) == total, f"{len(ep)} items stored, {total} produced"
            ids = np.sort(ep.contents())
            dup = int((np.diff(ids) == 0).sum())
            assert dup == 0 and len(ids) == total and ids[0] == 0 and ids[-1] == total - 1, (
                f"{dup} duplicates, {total - len(np.unique(ids))} lost")
        finally:
            ep.close()
