"""On-policy buffers refuse what they cannot honour, changing nothing: a delivery option under every scheduler
(prefetching ones too), and a checkpoint whose state leaves live items in no rollout or names a selection of none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conduit import (
    Automatic,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Synchronous,
)

SCHEMA = ExperienceSchema(obs=Field((3,)), act=Field((), torch.int64))


def rows(ids: range) -> dict[str, torch.Tensor]:
    act = torch.as_tensor(list(ids), dtype=torch.int64)
    return {"obs": act.float()[:, None].repeat(1, 3), "act": act}


@pytest.mark.parametrize("scheduler", [Synchronous, lambda: Overlapped(overlap=False), Overlapped, Automatic],
                         ids=["synchronous", "overlapped-sequential", "overlapped", "automatic"])
def test_an_on_policy_delivery_with_an_option_is_refused_under_every_scheduler(scheduler: Callable[[], Any]) -> None:
    """``deliver(beta=...)`` on an on-policy buffer: a ``ConfigurationError`` naming the option and nothing drawn
    (prefetching schedulers delivered the next minibatch, ignoring it)."""
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=2, seed=1), scheduler=scheduler())
    try:
        edp.ingest(rows(range(4)), version=0)
        edp.seal()
        first = edp.deliver()[0]["act"].clone()
        with pytest.raises(ConfigurationError, match="takes no options"):
            edp.deliver(beta=0.4)
        second = edp.deliver()[0]["act"]
        assert sorted(first.tolist() + second.tolist()) == [0, 1, 2, 3], "the refused call drew a minibatch"
    finally:
        edp.close()


@pytest.mark.parametrize(("damage", "value"), [("outstanding", [[0, 1]]), ("open", None)],
                         ids=["a selection of no rollout", "live items in no rollout"])
def test_a_checkpoint_that_does_not_account_for_its_live_items_is_refused_unchanged(damage: str, value: Any) -> None:
    """A selection outstanding in the open rollout (never selected), or the open rollout dropped while its 4 items
    are live: loaded, their storage would never be released (the buffer would keep 4 of its 8 slots for good).
    Refused, the buffer as it was; the undamaged state loads."""
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=2, num_epochs=2, seed=1))
    try:
        edp.ingest(rows(range(4)), version=0)
        state = edp.state_dict()
        damaged = {**state, "semantics": {**state["semantics"], damage: value}}
        with pytest.raises(ConfigurationError, match="do not account for its live handles"):
            edp.load_state_dict(damaged)
        edp.load_state_dict(state)
        edp.seal()
        got = [edp.deliver()[0]["act"].tolist() for _ in range(4)]
        assert sorted(sum(got[:2], [])) == sorted(sum(got[2:], [])) == [0, 1, 2, 3] and len(edp) == 0
    finally:
        edp.close()


@pytest.mark.parametrize(("damage", "value"), [
    ("dropped_items", -1),
    ("rng", torch.zeros(5, dtype=torch.float32)),
    ("rng", torch.zeros(3, dtype=torch.uint8)),
], ids=["negative dropped count", "float rng", "short rng"])
def test_a_damaged_drop_count_or_rng_state_is_refused_typed_and_unchanged(damage: str, value: Any) -> None:
    """A drop count below 0 (it would be reported back as rows dropped), or an RNG tensor that is no
    ``torch.Generator`` state (torch's own TypeError/RuntimeError escaped the load, untyped): a
    ``ConfigurationError`` naming the state damaged, and the buffer delivers as the undamaged twin does."""
    def built() -> ExperienceDataPlane:
        edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=2, seed=1))
        edp.ingest(rows(range(4)), version=0)
        return edp

    edp, twin = built(), built()
    try:
        state = edp.state_dict()
        damaged = {**state, "semantics": {**state["semantics"], damage: value}}
        with pytest.raises(ConfigurationError, match="damaged"):
            edp.load_state_dict(damaged)
        assert edp.state_dict()["semantics"]["dropped_items"] == 0
        for p in (edp, twin):
            p.seal()
        assert [edp.deliver()[0]["act"].tolist() for _ in range(2)] == [twin.deliver()[0]["act"].tolist()
                                                                         for _ in range(2)]
    finally:
        edp.close()
        twin.close()
