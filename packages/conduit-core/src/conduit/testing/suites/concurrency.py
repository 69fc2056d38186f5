"""Concurrency: many producer threads, nothing lost or duplicated."""

from __future__ import annotations

import threading
from abc import abstractmethod

import numpy as np

from conduit.testing.endpoints import CAP_CONCURRENT_INGEST, CAP_PRIORITIZED, ReplayEndpoint
from conduit.testing.suites.base import SuiteBase, draw, needs

__all__ = ["ConcurrencySuite"]


class ConcurrencySuite(SuiteBase):
    """Concurrent ingestion. Subclass and implement :meth:`make_replay`."""

    threads: int = 8
    items_per_thread: int = 100_000
    chunk: int = 500
    #: draws of the sampled payload check (endpoints without ``verified_contents``), per stored item
    payload_draws_per_item: float = 2.0
    #: items per ``sample`` call of the sampled payload check
    payload_draw_chunk: int = 10_000
    #: items per ``insert`` call of the order check (which inserts about half the buffer again)
    reorder_chunk: int = 20_000
    #: items per producer thread while a learner samples (into a buffer a quarter of their total: every insert evicts)
    sampling_items_per_thread: int = 10_000

    @abstractmethod
    def make_replay(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                    seed: int = 0) -> ReplayEndpoint:
        """An EMPTY replay endpoint wired through the adapter."""

    def test_concurrent_producers_lose_and_duplicate_nothing(self) -> None:
        """8 producer threads x 1e5 items: every id is stored exactly once, with its own payload, and each
        producer's items in the order it inserted them (inserting half the buffer again evicts the oldest half).

        The payload check reads every item back through ``verified_contents``; an endpoint that
        cannot (it returns ``None``) is sampled instead, ``payload_draws_per_item`` draws per item.

        Troubleshooting: guard the ring's write pointer; reserve slots and write under one lock
        (an item whose payload belongs to another id is a torn write: two inserts wrote one slot).
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
            foreign = np.unique(ids[(ids < 0) | (ids >= total)])
            lost = total - int(np.isin(np.arange(total), ids).sum())
            assert dup == 0 and len(foreign) == 0 and lost == 0 and len(ids) == total, (
                f"of {total} ids produced: {dup} duplicates, {len(foreign)} ids that no producer made "
                f"(e.g. {foreign[:5].tolist()}), {lost} lost")
            self._check_payloads(ep, ids)
            self._check_producer_order(ep, total)
        finally:
            ep.close()

    def test_sampling_while_producers_insert_draws_whole_items(self) -> None:
        """A learner that samples (and, prioritized, updates the drawn items' priorities) while producer threads insert
        into a full buffer, every insert evicting, draws whole items: each with its own payload (checked by the
        endpoint's ``sample``), none that no producer made; neither side raises; afterwards the buffer holds its
        capacity of distinct items.

        Troubleshooting: hold the lock every insert takes for its write over the whole read of a draw (selecting and
        gathering the rows): an item evicted and overwritten while it was read is a torn read.
        """
        for prioritized in (False, True):
            self._sample_while_producing(prioritized)

    def _sample_while_producing(self, prioritized: bool) -> None:
        """One half of :meth:`test_sampling_while_producers_insert_draws_whole_items` (uniform or prioritized)."""
        total = self.threads * self.sampling_items_per_thread
        cap = total // 4
        ep = self.make_replay(capacity=cap, prioritized=prioritized, seed=18)
        try:
            needs(ep, CAP_CONCURRENT_INGEST)
            if prioritized and CAP_PRIORITIZED not in ep.capabilities:
                return
            for s in range(total, total + cap, self.chunk):  # full before the producers start
                ep.insert(np.arange(s, min(s + self.chunk, total + cap)))
            errors: list[tuple[str, BaseException]] = []
            foreign: list[int] = []
            draws = [0]
            drawing, produced = threading.Event(), threading.Event()

            def produce(t: int) -> None:
                try:
                    drawing.wait()  # the learner has drawn once: the inserts overlap its draws
                    base = t * self.sampling_items_per_thread
                    for s in range(0, self.sampling_items_per_thread, self.chunk):
                        ep.insert(np.arange(base + s, base + min(s + self.chunk, self.sampling_items_per_thread)))
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append((f"producer {t}", e))

            def learn() -> None:
                try:
                    while True:
                        last = produced.is_set()
                        d = draw(ep, 256)
                        foreign.extend(d.ids[(d.ids < 0) | (d.ids >= total + cap)][:5].tolist())
                        if prioritized:
                            ep.update_priorities(d.handles, (d.ids % 3 + 1).astype(np.float64))
                        draws[0] += 1
                        drawing.set()
                        if last:
                            return
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(("the learner", e))
                finally:
                    drawing.set()

            learner = threading.Thread(target=learn)
            ts = [threading.Thread(target=produce, args=(t,)) for t in range(self.threads)]
            learner.start()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            produced.set()
            learner.join()
            kind = f"prioritized={prioritized}"
            assert not errors, (
                f"{kind}: while {self.threads} threads inserted into a full buffer and a learner sampled it "
                f"({draws[0]} draws), {errors[0][0]} raised {type(errors[0][1]).__name__}: {errors[0][1]} "
                f"(a payload that does not match its id is a torn read: an item overwritten while it was read)")
            assert not foreign, f"{kind}: draws made while producers inserted hold ids no producer made: {foreign}"
            ids = ep.contents()
            assert len(ep) == cap and len(np.unique(ids)) == len(ids) == cap, (
                f"{kind}: after the concurrent inserts and draws the buffer holds {len(ep)} items, "
                f"{len(np.unique(ids))} distinct ids, expected its capacity {cap}")
        finally:
            ep.close()

    def _check_producer_order(self, ep: ReplayEndpoint, total: int) -> None:
        """Each producer's items were stored in the order it inserted them (FIFO eviction follows it).

        Inserting ``k`` more items evicts the ``k`` oldest; of each producer's items, those evicted must be its
        first ones. ``k`` is not a multiple of ``chunk``, so the cut falls inside one insert call's items.
        """
        k = total // 2 + self.chunk // 2 + 1
        for s in range(total, total + k, self.reorder_chunk):
            ep.insert(np.arange(s, min(s + self.reorder_chunk, total + k)))
        assert len(ep) == total, f"{len(ep)} items stored after {k} more were inserted into a full buffer of {total}"
        live = np.sort(ep.contents())
        new_live = int((live >= total).sum())
        assert new_live == k, f"of {k} items inserted into the full buffer afterwards, {new_live} are live"
        evicted = np.setdiff1d(np.arange(total), live, assume_unique=True)
        for t in range(self.threads):
            base = t * self.items_per_thread
            mine = evicted[(evicted >= base) & (evicted < base + self.items_per_thread)] - base
            if not np.array_equal(mine, np.arange(len(mine))):
                first_kept = int(np.setdiff1d(np.arange(len(mine)), mine)[0])
                raise AssertionError(
                    f"producer {t}'s items were not stored in the order it inserted them: inserting {k} more items "
                    f"evicted {len(mine)} of its items, but not its first {len(mine)} (its item {base + first_kept} "
                    f"is still live, its later item {base + int(mine[mine > first_kept][0])} was evicted); keep "
                    f"each producer's items in insertion order, within and across its insert calls")

    def _check_payloads(self, ep: ReplayEndpoint, ids: np.ndarray) -> None:
        """Every stored item's payload matches its id (``ids``: the sorted stored ids)."""
        torn = (f"after {self.threads} threads inserted concurrently, a stored item's payload does not match "
                f"its id (a torn write: one insert's id with another's payload)")
        try:
            verified = ep.verified_contents()
        except AssertionError as e:
            raise AssertionError(f"{torn}: {e}") from e
        if verified is not None:
            assert np.array_equal(np.sort(verified), ids), "verified_contents() and contents() disagree on the ids"
            return
        remaining = int(np.ceil(self.payload_draws_per_item * len(ids)))
        while remaining > 0:
            n = min(self.payload_draw_chunk, remaining)
            try:
                drawn = ep.sample(n).ids
            except AssertionError as e:
                raise AssertionError(f"{torn} (seen by sample()): {e}") from e
            assert np.isin(drawn, ids).all(), "sample() drew ids that contents() does not hold"
            remaining -= n
