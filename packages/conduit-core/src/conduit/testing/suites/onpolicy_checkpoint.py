"""On-policy checkpoints: a restored endpoint keeps the freshness semantics exactly where the saved one was.

Mixed into :class:`~conduit.testing.FreshnessSuite`. An endpoint declaring :data:`~conduit.testing.CAP_CHECKPOINT`
is saved with rollouts waiting (ended and not delivered, and one still open) and between rollouts; one declaring
only :data:`~conduit.testing.CAP_CHECKPOINT_BETWEEN_ROLLOUTS` between rollouts, and must refuse the save while
rollouts wait. Either way the restored endpoint (built with another seed) must deliver what the saved one does
from there on, and that is what an endpoint never checkpointed delivers.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Container
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest
import torch

from conduit.errors import ConduitError, EmptyBufferError
from conduit.testing.endpoints import CAP_CHECKPOINT, CAP_CHECKPOINT_BETWEEN_ROLLOUTS, OnPolicyEndpoint

__all__ = ["OnPolicyCheckpointChecks"]

#: one delivered rollout: its minibatches as (version, epoch, ids in delivery order)
Rollout = list[tuple[int, int, list[int]]]

_SEED, _OTHER_SEED = 5, 99


def _caps(ep: OnPolicyEndpoint) -> Container[str]:
    return getattr(ep, "capabilities", frozenset())  # type: ignore[no-any-return]


def _through_bytes(state: Any, what: str) -> Any:
    """``state`` written with ``torch.save`` and read back with ``torch.load``, as a checkpoint file carries it."""
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    except Exception as e:  # noqa: BLE001 - reported as the failure
        raise AssertionError(f"{what}: state_dict() does not survive torch.save/torch.load ({type(e).__name__}: "
                             f"{e}); keep the state picklable") from e


def _drain(ep: OnPolicyEndpoint, limit: int = 8) -> list[Rollout]:
    """Every rollout ``ep`` delivers until :class:`~conduit.EmptyBufferError`, in order."""
    out: list[Rollout] = []
    for _ in range(limit):
        try:
            mbs = ep.consume()
        except EmptyBufferError:
            return out
        out.append([(int(mb.version), int(mb.epoch), [int(i) for i in mb.ids.tolist()]) for mb in mbs])
    pytest.fail(f"consume() went on delivering after {limit} rollouts, more than were ingested: the first ids of "
                f"each: {[r[0][2][:3] if r else [] for r in out]}")


def _check_rollouts(got: list[Rollout], expected: list[tuple[int, list[int]]], m: int, epochs: int,
                    what: str) -> None:
    """``got`` is exactly the ``expected`` rollouts (version, items), oldest first: each in M x E minibatches of its
    own version, each epoch delivering each of its items exactly once."""
    seen = [(r[0][0] if r else None, sorted({i for _, _, ids in r for i in ids})) for r in got]
    if seen != expected:
        delivered, wanted = {i for _, ids in seen for i in ids}, {i for _, ids in expected for i in ids}
        lost, extra = sorted(wanted - delivered), sorted(delivered - wanted)
        raise AssertionError(
            f"{what}: the delivered rollouts (version, first ids) are {[(v, ids[:4]) for v, ids in seen]}, expected "
            f"{[(v, ids[:4]) for v, ids in expected]}: {len(lost)} items lost (e.g. {lost[:5]}), {len(extra)} "
            f"delivered that should not be (e.g. {extra[:5]}) (rollouts come oldest first, each once: nothing "
            f"delivered before the checkpoint again, nothing of an older version after a newer one, no stale "
            f"rollout, nothing lost)")
    for rollout, (version, items) in zip(got, expected, strict=True):
        versions = sorted({v for v, _, _ in rollout})
        assert versions == [version], (
            f"{what}: the rollout of version {version} came in minibatches reporting versions {versions}")
        assert len(rollout) == m * epochs, (
            f"{what}: the rollout of version {version} came in {len(rollout)} minibatches, expected M*E = "
            f"{m * epochs}")
        for epoch in range(epochs):
            ids = [i for _, ep_, part in rollout if ep_ == epoch for i in part]
            missing, repeated = sorted(set(items) - set(ids)), len(ids) - len(set(ids))
            assert sorted(ids) == items, (
                f"{what}: epoch {epoch} of the rollout of version {version} ({len(items)} items) delivered "
                f"{len(ids)}: {len(missing)} lost (e.g. {missing[:5]}), {repeated} duplicated; every epoch delivers "
                f"each of the rollout's items exactly once")


class OnPolicyCheckpointChecks:
    """Checkpoint and restore of on-policy endpoints (:data:`CAP_CHECKPOINT`,
    :data:`CAP_CHECKPOINT_BETWEEN_ROLLOUTS`)."""

    make_on_policy: Callable[..., OnPolicyEndpoint]
    on_policy: Callable[..., AbstractContextManager[OnPolicyEndpoint]]

    def _restore_and_compare(self, settings: dict[str, Any], before: Callable[[OnPolicyEndpoint], None],
                             after: Callable[[OnPolicyEndpoint], tuple[bool, list[Rollout]]],
                             rollouts: list[tuple[int, list[int]]], what: str) -> bool:
        """Run ``before``, save, and run ``after`` on the saved endpoint, on one restored from the save (built with
        another seed) and on one never saved: each delivers exactly ``rollouts`` (version, items) from there, and
        all three the same minibatches. Returns whether the save was taken: an endpoint that declares only
        CAP_CHECKPOINT_BETWEEN_ROLLOUTS may refuse it (checked: with a Conduit error, and the refused save changed
        nothing)."""
        m, epochs = settings["num_minibatches"], settings["num_epochs"]
        with self.on_policy(seed=_SEED, **settings) as ref:
            before(ref)
            expected = after(ref)
        _check_rollouts(expected[1], rollouts, m, epochs, f"{what}, never saved")
        with self.on_policy(seed=_SEED, **settings) as ep:
            caps = _caps(ep)
            if CAP_CHECKPOINT not in caps and CAP_CHECKPOINT_BETWEEN_ROLLOUTS not in caps:
                pytest.skip(f"{type(ep).__name__} declares neither {CAP_CHECKPOINT!r} nor "
                            f"{CAP_CHECKPOINT_BETWEEN_ROLLOUTS!r}")
            before(ep)
            try:
                state = ep.state_dict()
            except ConduitError as err:
                if CAP_CHECKPOINT in caps:
                    raise AssertionError(f"{what}: state_dict() raised {type(err).__name__} ({err}), and the endpoint "
                                         f"declares {CAP_CHECKPOINT!r} (a checkpoint also while rollouts wait); "
                                         f"declare {CAP_CHECKPOINT_BETWEEN_ROLLOUTS!r} instead if it checkpoints only "
                                         f"between rollouts") from err
                went_on = after(ep)
                assert went_on == expected, (
                    f"{what}: after a refused state_dict() ({type(err).__name__}) the endpoint delivers differently "
                    f"from one never asked: {went_on[1][:1]} instead of {expected[1][:1]}; a refused checkpoint "
                    f"changes nothing")
                return False
            state = _through_bytes(state, what)
            went_on = after(ep)
        assert went_on == expected, (
            f"{what}: taking a checkpoint changed what the endpoint delivers from there: (refused, rollouts) "
            f"{went_on[0], [r[:1] for r in went_on[1]]} instead of {expected[0], [r[:1] for r in expected[1]]}")
        with self.on_policy(seed=_OTHER_SEED, **settings) as other:
            other.load_state_dict(state)
            restored = after(other)
        _check_rollouts(restored[1], rollouts, m, epochs, f"{what}, restored")
        assert restored[0] == expected[0], (
            f"{what}: the restored endpoint {'refused' if restored[0] else 'took'} an ingest of a version older than "
            f"the last ended rollout, the saved one {'refused' if expected[0] else 'took'} it (save the version of "
            f"the last ended rollout: versions do not go back across a restore)")
        assert restored[1] == expected[1], (
            f"{what}: the restored endpoint (built with seed {_OTHER_SEED}) delivers differently from the saved one "
            f"(seed {_SEED}): first minibatches {[r[:1] for r in restored[1]]} instead of "
            f"{[r[:1] for r in expected[1]]}; save the waiting rollouts, the policy version and the shuffle RNG's "
            f"state")
        return True

    def test_checkpoint_between_rollouts(self) -> None:
        """Saved between rollouts (two delivered, the policy moved on to version 4, ``max_staleness=1``) and
        restored into an endpoint built with another seed, the endpoint goes on as the saved one does: the policy
        version is kept (a rollout of version 2, 2 behind, is dropped as stale, not delivered), versions do not go
        back (an ingest of version 1, older than the last ended rollout, is refused or dropped, as by the saved
        endpoint), and the next rollout comes in the same shuffled minibatches (the RNG's state is kept). Taking
        the checkpoint changes nothing the saved endpoint delivers.

        Troubleshooting: save the policy version, the version of the last ended rollout and the shuffle RNG's
        state, and restore them; ``state_dict`` reads, it does not reseed or redraw.
        """
        settings = {"num_minibatches": 3, "num_epochs": 2, "max_staleness": 1, "on_stale": "drop"}

        def before(ep: OnPolicyEndpoint) -> None:
            for v, base in ((0, 0), (2, 100)):
                ep.set_policy_version(v)
                ep.ingest(np.arange(base, base + 24), version=v)
                ep.end_rollout()
                ep.consume()
            ep.set_policy_version(4)

        def after(ep: OnPolicyEndpoint) -> tuple[bool, list[Rollout]]:
            try:
                ep.ingest(np.arange(500, 524), version=1)
                refused = False
            except ConduitError:
                refused = True
            ep.end_rollout()
            ep.ingest(np.arange(200, 224), version=2)
            ep.end_rollout()
            ep.ingest(np.arange(300, 327), version=4)
            ep.end_rollout()
            return refused, _drain(ep)

        what = "an endpoint saved between rollouts (policy at version 4, max_staleness=1)"
        saved = self._restore_and_compare(settings, before, after, [(4, list(range(300, 327)))], what)
        assert saved, (
            f"{what}: state_dict() was refused with nothing waiting for delivery (every rollout delivered); an "
            f"endpoint that declares a checkpoint capability saves between rollouts")

    def test_checkpoint_with_rollouts_waiting(self) -> None:
        """Saved while rollouts wait (one delivered; ended ones of versions 0, 1 and 2, the last ingested in two
        calls; version 3's still open, being collected) and restored into an endpoint built with another seed, the
        endpoint goes on as the saved one does: later ingests of version 3 join the open rollout, and once the
        policy is at version 3 (``max_staleness=2``) it delivers versions 1, 2 and 3 in that order, each whole
        (each item exactly once per epoch, the open rollout's items from before and after the save together),
        drops version 0's as stale, and delivers nothing delivered before the save again.

        An endpoint that declares only ``CAP_CHECKPOINT_BETWEEN_ROLLOUTS`` must refuse this save with a Conduit
        error that changes nothing (a state without the waiting rollouts would lose them).

        Troubleshooting: save the ended rollouts not delivered yet and the open one (items, version, and that it
        is still open), the policy version and the RNG's state; on restore, keep the open rollout open.
        """
        settings = {"num_minibatches": 3, "num_epochs": 2, "max_staleness": 2, "on_stale": "drop"}

        def before(ep: OnPolicyEndpoint) -> None:
            ep.ingest(np.arange(1000, 1040), version=0)  # delivered before the save
            ep.end_rollout()
            ep.consume()
            ep.ingest(np.arange(0, 12), version=0)  # waits; stale once the policy is at 3
            ep.end_rollout()
            ep.set_policy_version(1)
            ep.ingest(np.arange(100, 112), version=1)
            ep.end_rollout()
            ep.ingest(np.arange(200, 207), version=2)
            ep.ingest(np.arange(207, 215), version=2)
            ep.end_rollout()
            ep.ingest(np.arange(300, 311), version=3)  # open: the save comes while it is collected

        def after(ep: OnPolicyEndpoint) -> tuple[bool, list[Rollout]]:
            ep.ingest(np.arange(311, 321), version=3)
            ep.end_rollout()
            ep.set_policy_version(3)
            return False, _drain(ep)

        what = "an endpoint saved with rollouts waiting (ended ones of versions 0..2, version 3's open)"
        expected = [(1, list(range(100, 112))), (2, list(range(200, 215))), (3, list(range(300, 321)))]
        self._restore_and_compare(settings, before, after, expected, what)  # (an endpoint declaring
        # CAP_CHECKPOINT_BETWEEN_ROLLOUTS only refuses the save, and goes on as one never asked: checked there)
