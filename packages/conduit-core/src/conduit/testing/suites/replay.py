"""Replay semantics: uniform and prioritized sampling, FIFO eviction, capacity, handles, checkpoints."""

from __future__ import annotations

import io
from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from conduit.errors import ConduitError
from conduit.testing.crossprocess import (
    REPLAY_CALLS,
    REPLAY_SEED,
    fill_replay,
    replay_call,
    replay_draws,
)
from conduit.testing.endpoints import CAP_CHECKPOINT, CAP_PRIORITIZED, Draw, ReplayEndpoint
from conduit.testing.suites.base import SuiteBase, chi_square_p, draw, needs, staleness
from conduit.testing.suites.prefetch import PrefetchReplayChecks

__all__ = ["ReplaySuite"]

#: chi-square tests reject below this p-value: a correct buffer fails each with probability P_MIN over seeds
#: (Pearson's statistic with k-1 degrees of freedom; every expected count is > 200, so the chi-square
#: approximation holds). ReplaySuite makes eleven such tests, so a correct adapter whose draws differ from
#: core's fails with probability <= 1.1e-2; the draws are seeded, so whatever the result, it is reproducible.
P_MIN = 1e-3


class ReplaySuite(PrefetchReplayChecks, SuiteBase):
    """Replay semantics every adapter keeps. Subclass and implement :meth:`make_replay`."""

    #: total draws for the distribution tests
    draws: int = 100_000
    #: draws per sample call in the distribution tests
    chunk: int = 1_000

    @abstractmethod
    def make_replay(self, *, capacity: int, prioritized: bool = False, alpha: float = 0.6, beta: float = 0.4,
                    seed: int = 0) -> ReplayEndpoint:
        """An EMPTY replay endpoint wired through the adapter."""

    @contextmanager
    def replay(self, **kwargs: Any) -> Iterator[ReplayEndpoint]:
        ep = self.make_replay(**kwargs)
        try:
            yield ep
        finally:
            ep.close()

    def _counts(self, ep: ReplayEndpoint, n_items: int) -> np.ndarray:
        """How often each id of ``0 .. n_items - 1`` came up in ``draws`` draws (in calls of ``chunk``)."""
        counts = np.zeros(n_items, dtype=np.int64)
        for start in range(0, self.draws, self.chunk):
            np.add.at(counts, draw(ep, min(self.chunk, self.draws - start)).ids, 1)
        return counts

    def _set_priorities(self, ep: ReplayEndpoint, prio_of_id: np.ndarray) -> None:
        """Give every item the priority ``prio_of_id[id]``, through sampled handles.

        Then draw (and drop) the ``priority_staleness`` draws the endpoint declares may
        still precede the last update, so later draws see every priority set here.
        """
        seen: set[int] = set()
        for _ in range(200):
            d = draw(ep, self.chunk)
            ep.update_priorities(d.handles, prio_of_id[d.ids])
            seen.update(d.ids.tolist())
            if len(seen) == len(prio_of_id):
                for _ in range(staleness(ep)):
                    draw(ep, self.chunk)
                return
        pytest.fail(f"could not reach every item through sampling to set its priority ({len(seen)} seen)")

    # -- tests ----------------------------------------------------------------------------
    def test_endpoint_is_fresh(self) -> None:
        """``make_replay`` returns an empty buffer.

        Troubleshooting: build a new framework buffer per call; do not share state between endpoints.
        """
        with self.replay(capacity=16) as ep:
            assert len(ep) == 0, f"a new endpoint holds {len(ep)} items"
            held = ep.contents()
            assert len(held) == 0, f"a new endpoint's contents() holds {len(held)} items, e.g. ids {held[:5].tolist()}"

    def test_uniform_draws_are_uniform(self) -> None:
        """Uniform sampling draws every live item with equal probability (chi-square over 1e5 draws), each
        of a sample's n items independently (with replacement).

        Troubleshooting: sample over all live slots, including after the ring wrapped.
        """
        n = 100
        with self.replay(capacity=n, seed=1) as ep:  # partly filled: only the 60 live items are drawn, evenly
            ep.insert(np.arange(60))
            counts = np.bincount(np.concatenate([draw(ep, self.chunk).ids for _ in range(20)]), minlength=n)
            assert counts[60:].sum() == 0, f"ids that are not live were drawn: {np.nonzero(counts[60:])[0] + 60}"
            p = chi_square_p(counts[:60], np.ones(60))
            assert p > P_MIN, f"uniform draws from a partly filled buffer fail chi-square (p={p:.2e})"
            # draws are with replacement: 60 independent draws from 60 items repeat one with probability
            # 1 - 60!/60^60 (a correct buffer fails this with probability ~1e-25 per draw)
            for _ in range(5):
                d = draw(ep, 60).ids
                assert len(np.unique(d)) < 60, (
                    "a draw of 60 items from a buffer of 60 holds no item twice: draws are not with replacement "
                    "(or not independent); sample each of the n items independently over all live items")
        with self.replay(capacity=n, seed=1) as ep:
            ep.insert(np.arange(n))
            ep.insert(np.arange(n, n + 37))  # wrap the ring: live ids are 37..136
            counts = self._counts(ep, n + 37)
            assert counts[:37].sum() == 0, f"evicted (not live) ids were drawn: {np.nonzero(counts[:37])[0].tolist()}"
            p = chi_square_p(counts[37:], np.ones(n))
            assert p > P_MIN, f"uniform draws fail chi-square (p={p:.2e}); counts min={counts[37:].min()} " \
                              f"max={counts[37:].max()}"

    def test_uniform_draws_follow_inserts(self) -> None:
        """Items inserted after the buffer was sampled are drawn as often as the others, and the items that insert
        evicted are drawn no more: each draw is over the items live when it is made (past the draws the endpoint
        may have prepared before the insert), not over a set fixed at an earlier draw (chi-square).

        Troubleshooting: read the live range at every draw, or refresh a cached index on every insert (a
        prefetcher may deliver only the batches it prepared before the insert).
        """
        with self.replay(capacity=100, seed=16) as ep:
            ep.insert(np.arange(50))
            steps = (("that filled the buffer (ids 50..99 after 0..49)", np.arange(50, 100), np.arange(100)),
                     ("that wrapped the ring (ids 100..139, evicting 0..39)", np.arange(100, 140), np.arange(40, 140)))
            for what, new, live in steps:
                draw(ep, self.chunk)  # the buffer is sampled before the insert
                ep.insert(new)
                for _ in range(2 * (staleness(ep) + 2)):  # draws prepared before the insert
                    draw(ep, self.chunk)
                counts = np.bincount(np.concatenate([draw(ep, self.chunk).ids for _ in range(30)]), minlength=140)
                gone = np.setdiff1d(np.arange(140), live)
                assert counts[gone].sum() == 0, (
                    f"after an insert {what}, draws hold ids that are not live: "
                    f"{np.nonzero(counts[gone])[0][:5].tolist()} (evicted, or never inserted)")
                p = chi_square_p(counts[live], np.ones(len(live)))
                assert p > P_MIN, (
                    f"after an insert {what}, made once the buffer had been sampled, uniform draws fail chi-square "
                    f"(p={p:.2e}): the {len(new)} new items were drawn {int(counts[new].sum())} times of "
                    f"{int(counts.sum())}, expected {len(new) / len(live):.0%}; draw over the items live now, not "
                    f"over those live at an earlier draw")

    def test_prioritized_frequency_proportional_to_priority_alpha(self) -> None:
        """Prioritized sampling draws item i with probability p_i^alpha / sum_j p_j^alpha (chi-square);
        items inserted later get the largest priority seen so far.

        Troubleshooting: store p^alpha in the tree; sample proportionally to the stored value; give new
        items the running maximum of the priorities set.
        """
        n, alpha = 50, 0.7
        with self.replay(capacity=n, prioritized=True, alpha=alpha, seed=2) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(n))
            prio = np.linspace(0.1, 5.0, n)
            self._set_priorities(ep, prio)
            counts = self._counts(ep, n)
            p = chi_square_p(counts, prio ** alpha)
            assert p > P_MIN, f"prioritized draws are not proportional to p^alpha (p={p:.2e})"
            assert counts[-1] > counts[0] * 3, f"highest priority drawn {counts[-1]}x vs lowest {counts[0]}x"
            # new items get the largest priority seen so far (5.0); they evict ids 0..4
            ep.insert(np.arange(n, n + 5))
            for _ in range(2 * (staleness(ep) + 2)):  # draws prepared before the insert
                draw(ep, self.chunk)
            ids = np.concatenate([draw(ep, self.chunk).ids for _ in range(20)])
            new = 5 * prio.max() ** alpha
            expected = new / (new + (prio[5:] ** alpha).sum())
            share = float((ids >= n).mean())
            assert abs(share - expected) < 0.03, (
                f"items inserted after priority updates are {share:.1%} of the draws, expected {expected:.1%}: "
                f"new items must get the largest priority seen so far")

    def test_draws_are_over_the_union_of_insert_calls(self) -> None:
        """Items inserted in calls of unequal sizes (which a sharded adapter spreads over its shards or nodes, one
        call each) are drawn from one distribution over all live items: uniformly, and prioritized with one global
        total ``sum_j p_j^alpha``, never per call or per shard (picking a shard first, evenly or by its item count,
        then an item within it). Chi-square over a partly filled buffer.

        Troubleshooting: sample over a global index of the live items (one sum tree over every shard's priorities);
        do not split a draw between shards.
        """
        sizes, cap, alpha = (36, 12, 4, 8), 80, 1.0
        n = sum(sizes)
        for prioritized in (False, True):
            with self.replay(capacity=cap, prioritized=prioritized, alpha=alpha, seed=19) as ep:
                if prioritized and CAP_PRIORITIZED not in ep.capabilities:
                    continue
                for lo, hi in zip(np.cumsum((0,) + sizes[:-1]), np.cumsum(sizes), strict=True):
                    ep.insert(np.arange(lo, hi))
                weight = np.ones(n)
                if prioritized:  # per call: 1, 4, 1, 4 (each id's priority by the call that inserted it)
                    weight = np.repeat([1.0, 4.0, 1.0, 4.0], sizes)
                    self._set_priorities(ep, weight)
                counts = self._counts(ep, cap)
                assert counts[n:].sum() == 0, f"ids that were never inserted were drawn: {np.nonzero(counts[n:])[0]}"
                p = chi_square_p(counts[:n], weight ** alpha)
                calls = [int(c.sum()) for c in np.split(counts[:n], np.cumsum(sizes)[:-1])]
                share = (np.add.reduceat(weight ** alpha, np.cumsum((0,) + sizes[:-1])) / (weight ** alpha).sum())
                assert p > P_MIN, (
                    f"prioritized={prioritized}: draws over items inserted in calls of {list(sizes)} items "
                    f"(priorities {'1, 4, 1, 4 by call' if prioritized else 'uniform'}) fail chi-square (p={p:.2e}): "
                    f"the calls' items were drawn {calls} times of {int(counts.sum())}, expected shares "
                    f"{np.round(share, 3).tolist()}; draw over the union of the live items with one global total")

    def test_new_items_get_the_largest_priority_ever_set(self) -> None:
        """Items inserted without a priority get the largest priority ever set, a running maximum that neither
        the eviction nor the lowering of the item that held it brings down (chi-square over the live items).

        Troubleshooting: keep the largest priority set so far in its own variable, raised by every update;
        do not read it from the priorities held now (a max over the live items).
        """
        n, alpha, top = 20, 1.0, 100.0
        with self.replay(capacity=n, prioritized=True, alpha=alpha, seed=12) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(n))
            prio = np.ones(n)
            prio[0] = top  # the oldest item holds the largest priority; the next insert evicts it
            self._set_priorities(ep, prio)
            phases = (("after the item holding the largest priority was evicted", n),
                      ("after the item holding the largest priority was lowered to 1", n + 1))
            for k, (what, new_id) in enumerate(phases):
                if k:  # lower the previous new item (priority `top`) to 1: every live item is at 1 now
                    d = draw(ep, 200)
                    rows = np.nonzero(d.ids == new_id - 1)[0]
                    assert len(rows), f"item {new_id - 1} (priority {top:g}) was not drawn in 200 draws"
                    ep.update_priorities(d.handles[rows], np.ones(len(rows)))
                    for _ in range(staleness(ep) + 2):  # draws prepared before the update
                        draw(ep, self.chunk)
                ep.insert(np.array([new_id]))  # evicts the oldest item
                for _ in range(2 * (staleness(ep) + 2)):  # draws prepared before the insert
                    draw(ep, self.chunk)
                live = np.arange(new_id - n + 1, new_id + 1)
                ids = np.concatenate([draw(ep, 1000).ids for _ in range(30)])  # >= 252 expected per item
                counts = np.array([(ids == i).sum() for i in live])
                expected = np.append(np.ones(n - 1), top ** alpha)
                p = chi_square_p(counts, expected)
                share = counts[-1] / counts.sum()
                assert counts.sum() == len(ids) and p > P_MIN, (
                    f"{what}, a new item is {share:.1%} of the draws (p={p:.2e}), expected "
                    f"{expected[-1] / expected.sum():.1%}: new items get the largest priority ever set ({top:g}), "
                    f"not the largest one live now; draw counts of the live ids {live[0]}..{live[-1]}: "
                    f"{counts.tolist()}, {len(ids) - counts.sum()} draws of other ids")

    def test_new_items_crossing_the_ring_end_get_the_largest_priority(self) -> None:
        """An insert whose items run past the ring's end (the first ones into the last slots, the rest into the
        first slots, over evicted items) gives every one of them the largest priority seen so far, the items
        written into the evicted items' slots too (chi-square over the live items).

        Troubleshooting: set the new items' priorities over the slots they take modulo the capacity, both parts
        of the wrapped range; do not leave the slots past the end with the evicted items' priorities.
        """
        n, alpha, top = 10, 1.0, 8.0
        with self.replay(capacity=n, prioritized=True, alpha=alpha, seed=17) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(7))
            prio = np.ones(7)
            prio[6] = top  # the largest priority seen; ids 0..5 keep priority 1
            self._set_priorities(ep, prio)
            ep.insert(np.arange(7, 13))  # into slots 7, 8, 9, 0, 1, 2: evicts ids 0..2 (priority 1)
            for _ in range(2 * (staleness(ep) + 2)):  # draws prepared before the insert
                draw(ep, self.chunk)
            live = np.arange(3, 13)
            ids = np.concatenate([draw(ep, 1000).ids for _ in range(30)])  # >= 508 expected per item
            counts = np.array([(ids == i).sum() for i in live])
            expected = np.array([1.0, 1.0, 1.0] + [top] * 7) ** alpha
            p = chi_square_p(counts, expected)
            assert counts.sum() == len(ids) and p > P_MIN, (
                f"after one insert of ids 7..12 that ran past the ring's end (capacity {n}, evicting ids 0..2 of "
                f"priority 1), the draws do not give every new item the largest priority seen ({top:g}) (p={p:.2e}): "
                f"draw counts of the live ids 3..12 {counts.tolist()}, expected in proportion to "
                f"{expected.tolist()}, {len(ids) - counts.sum()} draws of other ids")

    def test_importance_weights(self) -> None:
        """Weights are (N P(i))^-beta normalised by the largest possible weight, over the items live now
        (also after the least likely one was evicted).

        Troubleshooting: normalise by (N min_j P(j))^-beta over all live items, not over the batch.
        """
        n, alpha, beta = 20, 0.6, 0.5
        with self.replay(capacity=n, prioritized=True, alpha=alpha, beta=beta, seed=3) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(n))
            prio = np.arange(1, n + 1, dtype=np.float64)
            prio[0] = 1e-6  # P(0) ~ 3e-6: a batch almost never holds the least likely item
            self._set_priorities(ep, prio)
            d = draw(ep, 256)
            assert d.weights is not None, "a prioritized endpoint returned no importance weights"
            probs = prio ** alpha / (prio ** alpha).sum()
            if 0 not in d.ids:
                assert d.weights.max() < 0.5, (
                    f"the largest importance weight in a batch without the least likely item is "
                    f"{d.weights.max():.3g}, expected {((probs.min() / probs[d.ids].min()) ** beta):.3g}: "
                    f"weights are normalised over the batch, not by the largest possible weight")
            expected = (n * probs[d.ids]) ** (-beta) / (n * probs.min()) ** (-beta)
            np.testing.assert_allclose(d.weights, expected, rtol=1e-4,
                                       err_msg="importance weights differ from (N P(i))^-beta / max_w")
            # evict the least likely item (FIFO): the largest possible weight now follows item 1's priority
            ep.insert(np.array([n]))
            for _ in range(2 * (staleness(ep) + 2)):  # draws prepared before the insert
                draw(ep, self.chunk)
            d = draw(ep, 256)
            assert d.weights is not None, "a prioritized endpoint returned no importance weights"
            assert d.ids.min() >= 1, "the evicted item 0 was drawn after an insert evicted it"
            live_prio = np.append(prio[1:], prio.max())  # ids 1..n-1, and id n with the largest priority seen
            probs = live_prio ** alpha / (live_prio ** alpha).sum()
            p_of = probs[d.ids - 1]
            expected = (p_of / probs.min()) ** (-beta)
            np.testing.assert_allclose(d.weights, expected, rtol=1e-4, err_msg=(
                "importance weights after the least likely item was evicted differ from (N P(i))^-beta / max_w: "
                "normalise by the smallest probability among the live items, not the smallest ever stored"))

    def test_importance_weights_of_a_partly_filled_buffer(self) -> None:
        """Before the buffer is full, prioritized draws come from the live items only, and their importance weights
        are (N P(i))^-beta normalised over the live items: the empty slots are neither drawn nor the least likely
        item (the other weight checks fill the buffer first, where every slot is live).

        Troubleshooting: take min_j P(j) over the live items only (an empty leaf of a min-tree holds +inf, not 0);
        give slots that hold no item priority 0 so they are never drawn.
        """
        n, cap, alpha, beta = 12, 32, 0.6, 0.5
        with self.replay(capacity=cap, prioritized=True, alpha=alpha, beta=beta, seed=15) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(n))
            prio = np.arange(1, n + 1, dtype=np.float64)
            self._set_priorities(ep, prio)
            d = draw(ep, 512)
            foreign = sorted(set(d.ids.tolist()) - set(range(n)))
            assert not foreign, (f"a prioritized draw from a partly filled buffer ({n} of {cap} slots filled, ids "
                                 f"0..{n - 1}) holds ids {foreign[:5]}: draw the live items only")
            assert d.weights is not None, "a prioritized endpoint returned no importance weights"
            probs = prio ** alpha / (prio ** alpha).sum()
            expected = (probs[d.ids] / probs.min()) ** (-beta)
            np.testing.assert_allclose(d.weights, expected, rtol=1e-4, err_msg=(
                f"importance weights in a partly filled buffer ({n} of {cap} slots filled) differ from "
                f"(N P(i))^-beta / max_w over the {n} live items (weights from {np.min(d.weights):.3g} to "
                f"{np.max(d.weights):.3g}, expected {expected.min():.3g} to {expected.max():.3g}): are empty slots "
                f"counted as the least likely item, or as items?"))

    def test_fifo_eviction_and_capacity(self) -> None:
        """The buffer never holds more than its capacity and evicts the oldest items first.

        Troubleshooting: evict in insertion order; count capacity in items (transitions).
        """
        cap = 10
        with self.replay(capacity=cap, seed=4) as ep:
            for start in range(0, 25, 5):
                ep.insert(np.arange(start, start + 5))
                assert len(ep) == min(start + 5, cap), f"len {len(ep)} after {start + 5} inserts (capacity {cap})"
            assert sorted(ep.contents().tolist()) == list(range(15, 25)), \
                f"live ids {sorted(ep.contents().tolist())}, expected the newest 10 (15..24)"
            ids = draw(ep, 2000).ids
            assert ids.min() >= 15, f"evicted id {ids.min()} was sampled"
            # batches that do not divide the capacity: the second one wraps around the ring's end
            ep.insert(np.arange(25, 28))
            ep.insert(np.arange(28, 31))
            live = sorted(ep.contents().tolist())
            assert len(ep) == cap and live == list(range(21, 31)), (
                f"after a batch that wrapped around the ring's end: len {len(ep)}, live ids {live}, expected the "
                f"newest 10 (21..30)")

    def test_update_for_evicted_handle_is_ignored(self) -> None:
        """A priority update naming an evicted item is ignored, never applied to the slot's new occupant;
        one naming a live item after the ring wrapped is applied.

        Troubleshooting: stamp handles with a generation and check it before applying an update.
        """
        cap = 10
        with self.replay(capacity=cap, prioritized=True, alpha=1.0, seed=5) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(cap))
            old = draw(ep, 200)
            ep.insert(np.arange(100, 100 + cap))  # every old item is evicted
            # the first and the most recently evicted item (slots now holding 100 and 109), and live item 105
            stale = [np.nonzero(old.ids == i)[0][:1] for i in (0, cap - 1)]
            assert all(len(s) for s in stale), "items 0 and 9 were not both drawn in 200 draws from 10 items"
            for _ in range(10):  # a prefetching endpoint may first deliver draws made before the insert
                new = draw(ep, 200)
                live = np.nonzero(new.ids == 105)[0][:1]
                if len(live):
                    break
            assert len(live), "item 105 was never drawn in 10 x 200 draws after it was inserted"
            ep.update_priorities(old.handles[np.concatenate(stale)], np.full(2, 1e6))
            ep.update_priorities(new.handles[live], np.full(1, 1e6))
            for _ in range(staleness(ep)):
                draw(ep, self.chunk)
            counts = np.bincount(draw(ep, 5000).ids - 100, minlength=cap)
            assert counts[5] > 0.2 * counts.sum(), (
                f"the update naming live item 105 (drawn after the ring wrapped) was not applied: draw counts of "
                f"100..109 {counts.tolist()} (do handles of a wrapped ring still name live items?)")
            assert counts[[0, cap - 1]].max() < 0.01 * counts.sum(), (
                f"a stale update changed a new occupant's priority: draw counts of 100..109 {counts.tolist()}")
            ep.update_priorities(np.concatenate([old.handles[stale[1]], new.handles[live]]), np.array([1e6, 1.0]))
            for _ in range(staleness(ep)):
                draw(ep, self.chunk)
            counts = np.bincount(draw(ep, 5000).ids - 100, minlength=cap)
            assert counts.max() < 0.3 * counts.sum(), (
                f"an update naming an evicted and a live handle was not applied to the live handle only: "
                f"draw counts of 100..109 {counts.tolist()} (item 105 set back to 1, evicted 9's handle to 1e6)")

    def test_update_for_live_handle_drawn_before_an_eviction_is_applied(self) -> None:
        """An insert that evicts some items leaves the handles of the others valid: an update naming an item
        drawn before that insert, and still live, is applied (the one naming an evicted item in the same call
        is ignored). Actors insert while the learner updates, so a full buffer evicts between nearly every
        draw and its update.

        Troubleshooting: decide per handle whether its item is still live (its generation is the slot's
        current one); do not void every handle drawn before the latest eviction.
        """
        cap = 10
        with self.replay(capacity=cap, prioritized=True, alpha=1.0, seed=6) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(cap))
            d = draw(ep, 200)
            rows = [np.nonzero(d.ids == i)[0][:1] for i in (7, 0)]
            assert all(len(r) for r in rows), "items 7 and 0 were not both drawn in 200 draws from 10 items"
            ep.insert(np.array([cap, cap + 1]))  # evicts items 0 and 1; item 7 stays
            assert len(ep) == cap, f"len {len(ep)} after inserting 12 items (capacity {cap})"  # the insert landed
            ep.update_priorities(d.handles[np.concatenate(rows)], np.full(2, 1e6))
            for _ in range(staleness(ep) + 2):  # draws prepared before the insert or the update
                draw(ep, self.chunk)
            ids = draw(ep, 5000).ids
            counts = {i: int((ids == i).sum()) for i in range(2, cap + 2)}
            assert counts[7] > 0.9 * len(ids), (
                f"the update naming item 7 (drawn before an insert evicted items 0 and 1, still live) was not "
                f"applied: draw counts of the live items 2..11 {counts} (are handles drawn before an eviction "
                f"voided wholesale? only the evicted items' handles are stale)")
            assert counts[cap] < 0.01 * len(ids), (
                f"the update naming evicted item 0 changed its slot's new occupant 10: draw counts {counts}")

    def test_refused_priority_update_changes_nothing(self) -> None:
        """A priority update the buffer refuses (a NaN or infinite priority, or one priority too few) raises a
        Conduit error and changes no priority, not even those named before the bad one. (Negative priorities
        are left to the framework: RLlib floors them.)

        Troubleshooting: check every priority (and that there is one per handle) before applying any;
        do not set them one by one and raise at the first bad one.
        """
        cap = 10
        with self.replay(capacity=cap, prioritized=True, alpha=1.0, seed=14) as ep:
            needs(ep, CAP_PRIORITIZED)
            ep.insert(np.arange(cap))
            d = draw(ep, 200)
            rows = np.concatenate([np.nonzero(d.ids == i)[0][:1] for i in (3, 5)])
            assert len(rows) == 2, "items 3 and 5 were not both drawn in 200 draws from 10 items"
            refused = ((np.array([1e6, np.nan]), "a NaN priority"), (np.array([1e6, np.inf]), "an infinite priority"),
                       (np.array([1e6]), "one priority for two handles"))
            for bad, what in refused:
                try:
                    ep.update_priorities(d.handles[rows], bad)
                except ConduitError:
                    pass
                except Exception as e:  # noqa: BLE001 - reported as the failure
                    raise AssertionError(f"update_priorities with {what} raised {type(e).__name__} ({e}), expected "
                                         f"a conduit.ConduitError (PriorityError)") from e
                else:
                    pytest.fail(f"update_priorities with {what} (item 3 -> 1e6, item 5 -> {bad[1:].tolist()}) was "
                                f"accepted; refuse it with conduit.PriorityError")
            for _ in range(staleness(ep) + 2):  # draws prepared before the updates
                draw(ep, self.chunk)
            counts = self._counts(ep, cap)
            p = chi_square_p(counts, np.ones(cap))
            assert p > P_MIN, (
                f"after three refused update_priorities calls (each naming item 3 with priority 1e6 before a bad "
                f"entry) the draws are no longer uniform (p={p:.2e}): draw counts of 0..9 {counts.tolist()}; a "
                f"refused call must change no priority")

    def test_deterministic_under_seed(self) -> None:
        """The same seed and the same calls give the same draws, uniform and prioritized (with a priority update
        after each draw where the endpoint declares ``priority_staleness`` 0: every draw sees every update, so
        nothing is left to timing); another seed draws differently; two endpoints with one seed, used in turn,
        draw as one alone does.

        Troubleshooting: draw from an RNG seeded from the endpoint's seed, not a global one (for the
        prioritized sampler too, also after priority updates).
        """
        for prioritized in (False, True):
            with self.replay(capacity=64, prioritized=prioritized, seed=REPLAY_SEED) as probe:
                if prioritized and CAP_PRIORITIZED not in probe.capabilities:
                    continue
            kind = f"prioritized={prioritized}"

            def run(seed: int = REPLAY_SEED, prioritized: bool = prioritized) -> list[int]:
                return replay_draws(self.make_replay, prioritized=prioritized, seed=seed)

            a, b = run(), run()
            assert a == b, f"{kind}: two endpoints with the same seed drew different items"
            assert run(seed=REPLAY_SEED + 1) != a, (
                f"{kind}: endpoints with different seeds drew the same items: the seed is ignored")
            with self.replay(capacity=64, prioritized=prioritized, seed=REPLAY_SEED) as e1, \
                    self.replay(capacity=64, prioritized=prioritized, seed=REPLAY_SEED) as e2:
                fill_replay(e1)
                fill_replay(e2)
                d1: list[int] = []
                d2: list[int] = []
                for _ in range(REPLAY_CALLS):
                    d1 += replay_call(e1, prioritized=prioritized)
                    d2 += replay_call(e2, prioritized=prioritized)
                assert d1 == a == d2, (
                    f"{kind}: two interleaved endpoints with the same seed drew differently from one alone: "
                    f"they share an RNG (a global one?)")

    def test_checkpoint_round_trip(self) -> None:
        """A restored buffer holds the same items and continues the same draws (RNG included), gives
        items inserted after the restore the same priority as the saved buffer does, and takes priority
        updates through handles drawn before the save, for the same items.

        Troubleshooting: save the sampler's RNG state, the priorities, the largest priority seen and the
        handle counter (or whatever the adapter's handles refer to) with the contents.
        """
        for prioritized in (False, True):
            with self.replay(capacity=32, prioritized=prioritized, seed=8) as ep:
                needs(ep, CAP_CHECKPOINT)
                if prioritized and CAP_PRIORITIZED not in ep.capabilities:
                    continue
                d, state, after, live, after_insert = _save_and_go_on(ep, prioritized, (25, 50), 7, 60)
                with self.replay(capacity=32, prioritized=prioritized, seed=99) as other:
                    other.load_state_dict(state)
                    assert len(other) == len(live), f"restored buffer holds {len(other)} items, saved {len(live)}"
                    got = sorted(other.contents().tolist())
                    assert got == live, (f"restored buffer (prioritized={prioritized}) holds ids {got}, the saved one "
                                         f"{live}")
                    again = [draw(other, 16).ids.tolist() for _ in range(4)]
                    assert again == after, f"restored buffer (prioritized={prioritized}) draws differently"
                    other.insert(np.arange(50, 60))
                    got = sorted(other.contents().tolist())
                    assert got == after_insert == list(range(28, 60)), (
                        f"restored buffer (prioritized={prioritized}) evicts differently after an insert: live ids "
                        f"{got}, expected 28..59 (the write position was not restored?)")
                    if prioritized:  # new items get the largest priority seen so far: the restore must keep it
                        shares = []
                        for e in (ep, other):
                            for _ in range(2 * (staleness(e) + 2)):  # draws prepared before the insert
                                draw(e, 16)
                            ids = np.concatenate([draw(e, 256).ids for _ in range(8)])
                            shares.append(float(np.isin(ids, np.arange(50, 60)).mean()))
                        assert abs(shares[0] - shares[1]) < 0.08, (
                            f"items inserted after a restore are drawn {shares[1]:.0%} of the time, "
                            f"{shares[0]:.0%} in the saved buffer: the restored buffer gives new items another "
                            f"priority (the largest priority seen was not restored?)")
                        # a handle drawn before the save names the same item in the restored buffer
                        row = np.nonzero(d.ids >= 28)[0][:1]  # an item still live after the insert of 50..59
                        assert len(row), f"no item of 28..49 among 64 draws from 18..49: {sorted(set(d.ids.tolist()))}"
                        target = int(d.ids[row[0]])
                        shares = []
                        for e in (ep, other):
                            e.update_priorities(d.handles[row], np.full(1, 1e9))
                            for _ in range(staleness(e) + 2):  # draws prepared before the update
                                draw(e, 16)
                            shares.append(float((draw(e, 1000).ids == target).mean()))
                        assert min(shares) > 0.9, (
                            f"a priority update through a handle drawn before state_dict() (item {target}, priority "
                            f"1e9) left item {target} at {shares[1]:.0%} of the restored buffer's draws, "
                            f"{shares[0]:.0%} of the saved buffer's: handles drawn before a checkpoint must name the "
                            f"same items after load_state_dict() (save what the handles refer to with the items)")

    def test_checkpoint_round_trip_of_a_partly_filled_buffer(self) -> None:
        """A checkpoint of a buffer that is not yet full, written to bytes with ``torch.save`` and read back
        with ``torch.load``, restores only the items it held (not the empty slots), continues the same draws,
        and fills and evicts from there exactly as the saved buffer does.

        Troubleshooting: save and restore the number of live items (or the handle range), not the ring's
        capacity; keep the state picklable (tensors and plain Python values).
        """
        cap = 32
        for prioritized in (False, True):
            with self.replay(capacity=cap, prioritized=prioritized, seed=13) as ep:
                needs(ep, CAP_CHECKPOINT)
                if prioritized and CAP_PRIORITIZED not in ep.capabilities:
                    continue
                kind = f"prioritized={prioritized}"
                _, state, after, live, after_insert = _save_and_go_on(ep, prioritized, (12, 20), 5, 40)
                buf = io.BytesIO()
                try:
                    torch.save(state, buf)
                    buf.seek(0)
                    loaded = torch.load(buf, weights_only=False)
                except Exception as e:  # noqa: BLE001 - reported as the failure
                    raise AssertionError(f"{kind}: state_dict() does not survive torch.save/torch.load "
                                         f"({type(e).__name__}: {e}); keep the state picklable") from e
                with self.replay(capacity=cap, prioritized=prioritized, seed=99) as other:
                    other.load_state_dict(loaded)
                    got = sorted(other.contents().tolist())
                    assert len(other) == len(live) == 20 and got == live, (
                        f"{kind}: the restored buffer (saved with 20 of its {cap} slots filled) holds {len(other)} "
                        f"items, the saved one {len(live)}: ids {got}, expected {live}; restore the number of "
                        f"live items, not the capacity")
                    again = [draw(other, 16).ids.tolist() for _ in range(4)]
                    assert again == after, f"{kind}: the restored partly filled buffer draws differently"
                    other.insert(np.arange(20, 40))
                    got = sorted(other.contents().tolist())
                    assert got == after_insert == list(range(8, 40)), (
                        f"{kind}: after inserting 20 more items into the restored buffer (20 of {cap} filled) its live "
                        f"ids are {got}, the saved buffer's {after_insert}, expected 8..39")

    def test_sampling_empty_buffer_raises(self) -> None:
        """Sampling an empty buffer raises a Conduit error, never returns garbage, uniform and prioritized.

        Troubleshooting: raise conduit.EmptyBufferError (or let it propagate through the adapter), on the
        prioritized path too (a draw proportional to an all-zero priority sum is NaN, not empty).
        """
        for prioritized in (False, True):
            with self.replay(capacity=8, prioritized=prioritized) as ep:
                if prioritized and CAP_PRIORITIZED not in ep.capabilities:
                    continue
                try:
                    d = ep.sample(4)
                except ConduitError:
                    continue
                except Exception as e:  # noqa: BLE001 - reported as the failure
                    raise AssertionError(f"sampling an empty buffer (prioritized={prioritized}) raised "
                                         f"{type(e).__name__} ({e}), expected a conduit.ConduitError "
                                         f"(EmptyBufferError)") from e
                pytest.fail(f"sampling an empty buffer (prioritized={prioritized}) returned ids "
                            f"{np.asarray(d.ids).tolist()} instead of raising conduit.EmptyBufferError")

def _save_and_go_on(ep: ReplayEndpoint, prioritized: bool, fills: tuple[int, int], mod: int, upto: int
                    ) -> tuple[Draw, Any, list[list[int]], list[int], list[int]]:
    """The checkpoint tests' saved buffer: ids ``0..fills[0]`` and ``fills[0]..fills[1]`` inserted, 64 draws (the
    RNG past its seed; prioritized: their priorities set to ``id % mod + 1``, then the draws the endpoint may
    prepare before an update), then saved. Returns those 64 draws, the state, the 4 x 16 draws and the live ids
    that follow the save, and the live ids after inserting ``fills[1]..upto``."""
    ep.insert(np.arange(fills[0]))
    ep.insert(np.arange(fills[0], fills[1]))
    d = draw(ep, 64)
    if prioritized:
        ep.update_priorities(d.handles, (d.ids % mod + 1).astype(np.float64))
        for _ in range(staleness(ep)):
            draw(ep, 16)
    state = ep.state_dict()
    after = [draw(ep, 16).ids.tolist() for _ in range(4)]
    live = sorted(ep.contents().tolist())
    ep.insert(np.arange(fills[1], upto))
    return d, state, after, live, sorted(ep.contents().tolist())
