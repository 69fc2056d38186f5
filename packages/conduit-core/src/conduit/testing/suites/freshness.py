"""On-policy freshness: exactly once per epoch, M minibatches, version purity, staleness bound, checkpoints."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from conduit.errors import ConduitError, EmptyBufferError
from conduit.testing.crossprocess import (
    ON_POLICY_SEED,
    deliver_rollout,
    on_policy_deliveries,
)
from conduit.testing.endpoints import OnPolicyEndpoint
from conduit.testing.suites.base import SuiteBase
from conduit.testing.suites.onpolicy_checkpoint import OnPolicyCheckpointChecks, _drain
from conduit.testing.suites.prefetch import PrefetchFreshnessChecks, expect_stale

__all__ = ["FreshnessSuite"]


class FreshnessSuite(PrefetchFreshnessChecks, OnPolicyCheckpointChecks, SuiteBase):
    """On-policy semantics every adapter keeps. Subclass and implement :meth:`make_on_policy`."""

    @abstractmethod
    def make_on_policy(self, *, num_minibatches: int, num_epochs: int, max_staleness: int = 0,
                       on_stale: str = "drop", seed: int = 0) -> OnPolicyEndpoint:
        """An EMPTY on-policy endpoint wired through the adapter."""

    @contextmanager
    def on_policy(self, **kwargs: Any) -> Iterator[OnPolicyEndpoint]:
        ep = self.make_on_policy(**kwargs)
        try:
            yield ep
        finally:
            ep.close()

    def test_endpoint_is_fresh(self) -> None:
        """``make_on_policy`` returns an endpoint with nothing to deliver.

        Troubleshooting: build a new buffer per call.
        """
        with self.on_policy(num_minibatches=2, num_epochs=1) as ep:
            with pytest.raises(EmptyBufferError):
                got = ep.consume()
                pytest.fail(f"a new endpoint delivered {len(got)} minibatch(es) before anything was ingested "
                            f"(ids {[m.ids.tolist() for m in got][:3]}); it must raise conduit.EmptyBufferError")

    def test_ending_an_empty_rollout_delivers_nothing(self) -> None:
        """``end_rollout`` with nothing ingested since the last one (on a new endpoint, or called twice) ends no
        rollout: nothing is delivered for it, neither M x E empty minibatches nor a rollout of another's items.

        Troubleshooting: on ``end_rollout`` seal the open rollout only if it holds items; a learner handed empty
        minibatches computes its loss over nothing.
        """
        with self.on_policy(num_minibatches=3, num_epochs=2, seed=4) as ep:
            ep.end_rollout()
            with pytest.raises(EmptyBufferError):
                got = ep.consume()
                pytest.fail(f"end_rollout() on a new endpoint made a rollout: consume() delivered {len(got)} "
                            f"minibatch(es) of sizes {[len(m.ids) for m in got]} instead of raising EmptyBufferError")
            ep.ingest(np.arange(12), version=0)
            ep.end_rollout()
            ep.end_rollout()  # nothing ingested since the last one
            assert self._epochs(ep.consume(), 2) == [list(range(12))] * 2, "the rollout was not delivered whole"
            with pytest.raises(EmptyBufferError):
                got = ep.consume()
                pytest.fail(f"a second end_rollout() with nothing ingested since the first made a rollout: consume() "
                            f"delivered {len(got)} minibatch(es) of sizes {[len(m.ids) for m in got]} instead of "
                            f"raising EmptyBufferError")

    def test_each_item_exactly_once_per_epoch(self) -> None:
        """Each epoch delivers every item of the rollout exactly once, in M minibatches of N/M (+-1); the
        epochs come one after another.

        Troubleshooting: permute once per epoch and cut the permutation; never sample with replacement.
        """
        n, m, e = 102, 4, 3  # ceil-sized cuts would leave the last minibatch short (26, 26, 26, 24)
        with self.on_policy(num_minibatches=m, num_epochs=e, seed=1) as ep:
            ep.ingest(np.arange(n), version=0)
            ep.end_rollout()
            mbs = ep.consume()
            assert len(mbs) == m * e, f"got {len(mbs)} minibatches, expected M*E = {m * e}"
            order = [mb.epoch for mb in mbs]
            assert order == sorted(order), (
                f"minibatches are not delivered in epoch order (epochs in delivery order: {order}): deliver "
                f"every minibatch of an epoch before the next epoch's")
            for epoch in range(e):
                part = [mb for mb in mbs if mb.epoch == epoch]
                assert len(part) == m, f"epoch {epoch} has {len(part)} minibatches, expected {m}"
                sizes = sorted(len(mb.ids) for mb in part)
                assert sizes[0] >= n // m and sizes[-1] <= -(-n // m), f"minibatch sizes {sizes} for N={n}, M={m}"
                ids = np.concatenate([mb.ids for mb in part])
                assert sorted(ids.tolist()) == list(range(n)), (
                    f"epoch {epoch} is not a permutation of the rollout: "
                    f"{len(ids) - len(set(ids.tolist()))} repeats, {n - len(set(ids.tolist()))} missing")
            orders = [np.concatenate([mb.ids for mb in mbs if mb.epoch == k]).tolist() for k in range(e)]
            assert orders[0] != orders[1], "epochs were not reshuffled"
            parts = [{frozenset(mb.ids.tolist()) for mb in mbs if mb.epoch == k} for k in range(e)]
            assert parts[0] != parts[1], "every epoch cut the same minibatches: reshuffle the items each epoch"

    def test_rollout_ingested_in_several_calls_is_one_rollout(self) -> None:
        """The items of one version ingested in several calls form one rollout until ``end_rollout`` (or a new
        version): it is delivered whole, in M minibatches per epoch, each epoch shuffled over all its items,
        not call by call.

        Troubleshooting: append each ingest call to the open rollout; seal only on ``end_rollout`` or a new
        version; permute the whole rollout each epoch.
        """
        parts, m, e = (10, 7, 13), 3, 3
        bounds = np.cumsum((0,) + parts)
        n = int(bounds[-1])
        with self.on_policy(num_minibatches=m, num_epochs=e, seed=2) as ep:
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                ep.ingest(np.arange(lo, hi), version=0)
            ep.end_rollout()
            mbs = ep.consume()
            what = f"a rollout ingested in {len(parts)} calls of {list(parts)} items (version 0)"
            delivered = sorted(set(np.concatenate([mb.ids for mb in mbs]).tolist()))
            assert delivered == list(range(n)), (
                f"{what} was delivered as {len(delivered)} of its {n} items: the ingest calls of one version form "
                f"one rollout until end_rollout() or a new version")
            assert len(mbs) == m * e, f"{what} came in {len(mbs)} minibatches, expected M*E = {m * e}"
            assert all(mb.version == 0 for mb in mbs), f"{what} reports versions {[mb.version for mb in mbs]}"
            call_of = np.searchsorted(bounds, np.arange(n), side="right") - 1
            in_call_order = 0
            for epoch in range(e):
                part = [mb for mb in mbs if mb.epoch == epoch]
                sizes = sorted(len(mb.ids) for mb in part)
                assert len(part) == m and sizes == [n // m] * m, (
                    f"{what}: epoch {epoch} came in minibatches of {sizes} items, expected {m} of {n // m}")
                order = np.concatenate([mb.ids for mb in part])
                assert sorted(order.tolist()) == list(range(n)), f"{what}: epoch {epoch} is not a permutation"
                in_call_order += bool((np.diff(call_of[order]) >= 0).all())
            assert in_call_order < e, (
                f"{what}: every epoch delivers the calls' items one call after another: shuffle the whole "
                f"rollout each epoch, not each ingest call")

    def test_deterministic_under_seed(self) -> None:
        """The same seed and the same calls deliver the same minibatches in the same order; another seed
        shuffles differently; two endpoints with one seed, used in turn, deliver as one alone does.

        Troubleshooting: draw each epoch's permutation from a generator seeded from the endpoint's seed,
        not from a global one.
        """
        def run(seed: int) -> list[tuple[int, list[int]]]:
            return on_policy_deliveries(self.make_on_policy, seed=seed)

        a = run(ON_POLICY_SEED)
        assert run(ON_POLICY_SEED) == a, (
            "two endpoints with the same seed delivered different minibatches (or another order)")
        assert run(ON_POLICY_SEED + 1) != a, (
            "endpoints with different seeds delivered the same minibatches: the seed is ignored")
        with self.on_policy(num_minibatches=4, num_epochs=3, seed=ON_POLICY_SEED) as e1, \
                self.on_policy(num_minibatches=4, num_epochs=3, seed=ON_POLICY_SEED) as e2:
            got1, got2 = [], []
            for v in range(2):
                got1 += deliver_rollout(e1, v)
                got2 += deliver_rollout(e2, v)
            assert got1 == a == got2, ("two endpoints with the same seed, used in turn, delivered differently from "
                                       "one alone: they share an RNG (a global one?)")

    def test_version_purity(self) -> None:
        """A minibatch never mixes items of two policy versions; rollouts come oldest first, each whole (every
        epoch holds all its items, also those of the ingest that arrived with a new version and closed the
        previous rollout); a rollout is delivered only once it has ended (a new version arrived or
        ``end_rollout``).

        Troubleshooting: seal a rollout when a new version arrives, then add that ingest's items, all of them,
        to the new one; cut minibatches inside one rollout; raise conduit.EmptyBufferError while only an open
        rollout is waiting.
        """
        with self.on_policy(num_minibatches=3, num_epochs=2, max_staleness=5) as ep:
            ep.ingest(np.arange(0, 30), version=0)
            ep.ingest(np.arange(1000, 1030), version=1)
            ep.end_rollout()
            for version, base in ((0, 0), (1, 1000)):
                mbs = ep.consume()
                assert len(mbs) == 6, f"version {version}'s rollout came in {len(mbs)} minibatches, expected M*E = 6"
                for mb in mbs:
                    assert mb.version == version, f"expected version {version}, got {mb.version}"
                    assert ((mb.ids >= base) & (mb.ids < base + 30)).all(), (
                        f"minibatch of version {version} holds ids {mb.ids.tolist()}")
                for epoch, ids in enumerate(self._epochs(mbs, 2)):
                    lost = sorted(set(range(base, base + 30)) - set(ids))
                    assert ids == list(range(base, base + 30)), (
                        f"epoch {epoch} of version {version}'s rollout (ids {base}..{base + 29}, "
                        f"{'ended by the ingest of version 1' if version == 0 else 'opened by that ingest'}) "
                        f"delivered {len(ids)} items: {len(lost)} missing (e.g. {lost[:5]}), "
                        f"{len(ids) - len(set(ids))} repeated; every epoch delivers each of the rollout's items "
                        f"exactly once")
            ep.ingest(np.arange(2000, 2012), version=1)  # an open rollout is not deliverable until it ends
            with pytest.raises(EmptyBufferError):
                mbs = ep.consume()
                pytest.fail(f"a rollout was delivered before end_rollout(): ids "
                            f"{sorted(np.concatenate([mb.ids for mb in mbs]).tolist())}")
            ep.end_rollout()
            got = self._epochs(ep.consume(), 2)
            assert got == [list(range(2000, 2012))] * 2, f"the rollout ended after a refused delivery holds {got}"

    def test_staleness_bound_drop(self) -> None:
        """A rollout more than max_staleness versions behind the policy is dropped, the next one delivered.

        Troubleshooting: compare policy_version - rollout_version with max_staleness at delivery time.
        """
        with self.on_policy(num_minibatches=2, num_epochs=1, max_staleness=1, on_stale="drop") as ep:
            ep.ingest(np.arange(10), version=0)
            ep.end_rollout()
            ep.ingest(np.arange(10, 20), version=1)
            ep.end_rollout()
            ep.set_policy_version(2)
            try:
                mbs = ep.consume()
            except EmptyBufferError:
                pytest.fail("nothing was delivered: the rollout of version 1 (within max_staleness=1 of policy 2) "
                            "was dropped with the stale one")
            got = sorted(np.concatenate([mb.ids for mb in mbs]).tolist())
            assert got == list(range(10, 20)), f"expected only version 1's items, got {got}"
            assert all(mb.version == 1 for mb in mbs), (
                f"minibatches report versions {[mb.version for mb in mbs]}, expected the rollout's version 1")

    def test_staleness_bound_of_several_versions(self) -> None:
        """max_staleness counts versions: with max_staleness=3 and the policy at version 4, the rollouts of
        versions 1 and 2 (3 and 2 versions behind) are delivered, oldest first, and version 0's (4 behind) is
        dropped.

        Troubleshooting: pass max_staleness through as a number of versions; do not map it onto an on/off
        switch (one version of lag or none).
        """
        with self.on_policy(num_minibatches=2, num_epochs=1, max_staleness=3, on_stale="drop") as ep:
            for v in range(3):
                ep.set_policy_version(v)
                ep.ingest(np.arange(10 * v, 10 * v + 10), version=v)
                ep.end_rollout()
            ep.set_policy_version(4)
            got: list[tuple[int | None, list[int]]] = []
            for _ in range(4):  # at most the 3 rollouts waiting, then EmptyBufferError
                try:
                    mbs = ep.consume()
                except EmptyBufferError:
                    break
                got.append((mbs[0].version if mbs else None,
                            sorted(np.concatenate([mb.ids for mb in mbs] or [np.zeros(0, np.int64)]).tolist())))
            expected = [(v, list(range(10 * v, 10 * v + 10))) for v in (1, 2)]
            assert got == expected, (
                f"with max_staleness=3 and the policy at version 4, the delivered rollouts (version, first ids) are "
                f"{[(v, ids[:3]) for v, ids in got]}, expected versions 1 and 2 (3 and 2 versions behind), oldest "
                f"first; only version 0 (4 behind) is dropped")

    def test_staleness_drop_skips_every_stale_rollout(self) -> None:
        """With on_stale="drop", every stale rollout waiting is dropped before a fresh one is delivered, not just the
        first: with max_staleness=0 and the policy at version 2, the rollouts of versions 0 and 1 are dropped,
        version 2's is delivered, and nothing is left.

        Troubleshooting: after dropping a stale rollout, judge the next one the same way (a loop, not one check).
        """
        with self.on_policy(num_minibatches=2, num_epochs=1, max_staleness=0, on_stale="drop") as ep:
            for v in range(3):
                ep.set_policy_version(v)
                ep.ingest(np.arange(10 * v, 10 * v + 10), version=v)
                ep.end_rollout()
            got: list[tuple[list[int], list[int]]] = []
            for _ in range(4):  # at most the 3 rollouts waiting, then EmptyBufferError
                try:
                    mbs = ep.consume()
                except EmptyBufferError:
                    break
                got.append((sorted({mb.version for mb in mbs}),
                            sorted(np.concatenate([mb.ids for mb in mbs] or [np.zeros(0, np.int64)]).tolist())))
            assert got == [([2], list(range(20, 30)))], (
                f"with max_staleness=0 and the policy at version 2, the delivered rollouts (versions, first ids) are "
                f"{[(v, ids[:3]) for v, ids in got]}, expected only version 2's (ids 20..29): the rollouts of versions "
                f"0 and 1 are both stale and dropped, not only the first of them")

    def test_items_of_an_older_version_never_join_a_newer_rollout(self) -> None:
        """Items ingested with a version older than the open rollout's (a late producer) never join that rollout: the
        ingest is refused with a Conduit error and changes nothing, or the items are dropped as late (all of them;
        conduit-srl's ``on_stale="drop"``). Either way the open rollout is delivered whole, under its own version.
        (Delivering them apart, after it, is what :meth:`test_no_rollout_of_an_older_version_after_a_newer_one`
        refuses.)

        Troubleshooting: refuse a version lower than the open rollout's (conduit's buffers raise
        ConfigurationError), or close the open rollout first; never add the items to it under its version.
        """
        with self.on_policy(num_minibatches=2, num_epochs=1, max_staleness=5, seed=6) as ep:
            ep.ingest(np.arange(10), version=1)
            try:
                ep.ingest(np.arange(100, 110), version=0)
                refused = False
            except ConduitError:
                refused = True
            ep.end_rollout()
            mbs: list[Any] = []
            for _ in range(3):  # at most the 2 rollouts, then EmptyBufferError
                try:
                    mbs += ep.consume()
                except EmptyBufferError:
                    break
            mixed = [(mb.version, mb.ids.tolist()) for mb in mbs if (mb.version != np.where(mb.ids < 100, 1, 0)).any()]
            assert not mixed, (
                f"items of version 0 ingested while version 1's rollout was open (ids 100..109 after 0..9) were "
                f"delivered under another version: (reported version, ids) {mixed[:2]}; refuse them, or keep them "
                f"in a rollout of their own version")
            got = sorted(set(np.concatenate([mb.ids for mb in mbs] or [np.zeros(0, np.int64)]).tolist()))
            allowed = [list(range(10))] + ([] if refused else [list(range(10)) + list(range(100, 110))])
            late = "" if refused else ", and all or none of version 0's 100..109"
            assert got in allowed, (
                f"after an ingest of the older version 0 into version 1's open rollout "
                f"({'refused' if refused else 'accepted'}), the delivered ids are {got}, expected version 1's "
                f"0..9{late}")

    def test_no_rollout_of_an_older_version_after_a_newer_one(self) -> None:
        """Once items of version 1 were ingested (their rollout open, ended, or ended and delivered), items a late
        producer ingests with version 0 never reach the learner after them: the ingest is refused with a Conduit
        error and changes nothing (the endpoint then takes and delivers version 1's next rollout as before), or the
        items are dropped as late. The version-0 rollout is within ``max_staleness``, so only the order forbids it:
        the learner never gets experience of an older policy after a newer one's, with either ``on_stale``.

        Troubleshooting: keep the version of the last ended rollout and refuse (or drop) an ingest below it or below
        the open rollout's (conduit's buffers raise ConfigurationError); do not deliver it as a rollout of its own.
        """
        for on_stale in ("drop", "raise"):
            for stage in ("was open", "ended", "ended and was delivered"):
                with self.on_policy(num_minibatches=2, num_epochs=1, max_staleness=5, on_stale=on_stale,
                                    seed=7) as ep:
                    what = (f"with on_stale={on_stale!r}, items of version 0 (ids 100..109) ingested after version "
                            f"1's rollout (ids 0..9) {stage}")
                    ep.set_policy_version(1)
                    ep.ingest(np.arange(10), version=1)
                    if stage != "was open":
                        ep.end_rollout()
                    got = _drain(ep) if stage == "ended and was delivered" else []
                    try:
                        ep.ingest(np.arange(100, 110), version=0)
                    except ConduitError:
                        pass
                    ep.end_rollout()
                    ep.ingest(np.arange(20, 30), version=1)  # the endpoint goes on as before
                    ep.end_rollout()
                    got += _drain(ep)
                    mbs = [mb for rollout in got for mb in rollout]  # (version, epoch, ids), in delivery order
                    assert all(v == 1 and all(i < 100 for i in ids) for v, _, ids in mbs), (
                        f"{what} were delivered after it: (version, ids) of the minibatches in delivery order "
                        f"{[(v, sorted(ids)) for v, _, ids in mbs]}; refuse an ingest below the last ended or the "
                        f"open rollout's version, or drop its items")
                    ids = sorted(i for _, _, part in mbs for i in part)
                    assert ids == list(range(10)) + list(range(20, 30)), (
                        f"{what}: the delivered ids are {ids}, expected version 1's rollouts 0..9 and 20..29, each "
                        f"once (the refused or dropped ingest changed them)")

    def test_staleness_bound_raise(self) -> None:
        """With on_stale="raise", a too-stale rollout raises and stays in the buffer.

        Troubleshooting: raise conduit.StaleExperienceError before changing any state.
        """
        with self.on_policy(num_minibatches=2, num_epochs=1, max_staleness=0, on_stale="raise") as ep:
            ep.ingest(np.arange(8), version=0)
            ep.end_rollout()
            ep.set_policy_version(1)
            expect_stale(ep, "a rollout of version 0 to policy 1 (max_staleness=0, on_stale='raise')")
            ep.set_policy_version(0)
            try:
                mbs = ep.consume()
            except EmptyBufferError:
                mbs = []
            got = sorted(np.concatenate([mb.ids for mb in mbs] or [np.zeros(0, np.int64)]).tolist())
            assert got == list(range(8)), f"the rollout was changed by the failed delivery: {got}"
