"""On-policy: selections made ahead of delivery and discarded as stale give their permutation draws back.

``OnPolicy.draw_mark()`` before a selection made ahead (an adapter's prefetch) and ``take_back_draws(mark, k)``
after its ``k`` selections were thrown away because their rollout went stale put the permutation generator back,
so the rollouts ordered afterwards are shuffled as if those selections had never been made. Nothing else moves:
exactly-once per epoch and the drop counts are those of the selections as made. ``defer_stale`` makes a selection
ahead leave a stale rollout to the learner's own delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conduit import (
    ConfigurationError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Synchronous,
)

SCHEMA = ExperienceSchema(x=Field((), torch.int64))
SCHEDULERS: dict[str, Callable[[], Any]] = {
    "sync": Synchronous,
    "overlapped": lambda: Overlapped(g_del=1),
}


def _buffer(sched: str) -> tuple[ExperienceDataPlane, OnPolicy]:
    sem = OnPolicy(num_minibatches=2, num_epochs=2, seed=3)
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=sem, scheduler=SCHEDULERS[sched]())
    edp.ingest({"x": torch.arange(0, 4)}, version=0)  # rollout A
    edp.ingest({"x": torch.arange(4, 12)}, version=1)  # rollout B (seals A)
    edp.ingest({"x": torch.arange(12, 20)}, version=2)  # rollout C (seals B)
    edp.seal()
    edp.flush()
    return edp, sem


def _ids(edp: ExperienceDataPlane) -> tuple[int | None, int | None, list[int]]:
    batch, info = edp.deliver()
    return info.version, info.epoch, batch.tensor("x").tolist()


def _rest(edp: ExperienceDataPlane, k: int) -> list[tuple[int | None, int | None, list[int]]]:
    return [_ids(edp) for _ in range(k)]


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_discarded_selections_give_their_draws_back(sched: str) -> None:
    ref, _ = _buffer(sched)
    spec, sem = _buffer(sched)
    try:
        _ids(ref)  # A epoch 0 minibatch 0
        ref.set_policy_version(1)  # A is stale: dropped at the next delivery
        expected = _rest(ref, 8)  # B and C, both epochs

        _ids(spec)
        mark = spec.read_locked(sem.draw_mark)
        _ids(spec), _ids(spec)  # made ahead: A's last minibatch of epoch 0 (draws epoch 1's order), and one more
        spec.set_policy_version(1)
        assert spec.read_locked(lambda: sem.take_back_draws(mark, 2)) is True
        assert _rest(spec, 8) == expected, "the rollouts after the discarded selections were ordered differently"
        assert sem.dropped_items == 4, "A (being delivered, stale) is dropped whole, as without the selections"
    finally:
        ref.close()
        spec.close()


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_nothing_is_given_back_unless_all_selections_since_the_mark_were_discarded_and_the_rollout_is_stale(
        sched: str) -> None:
    edp, sem = _buffer(sched)
    try:
        _ids(edp)
        mark = edp.read_locked(sem.draw_mark)
        _ids(edp), _ids(edp)
        before = sem.state_dict()
        assert edp.read_locked(lambda: sem.take_back_draws(mark, 2)) is False, "A is fresh: it goes on"
        edp.set_policy_version(1)
        assert edp.read_locked(lambda: sem.take_back_draws(mark, 1)) is False, "one selection since was kept"
        assert edp.read_locked(lambda: sem.take_back_draws(mark, 0)) is False
        after = sem.state_dict()
        assert torch.equal(after["rng"], before["rng"]) and after["selections"] == before["selections"] == 3
    finally:
        edp.close()


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_defer_stale_selects_nothing_and_drops_nothing(sched: str) -> None:
    edp, sem = _buffer(sched)
    try:
        _ids(edp)
        edp.set_policy_version(1)
        edp.read_locked(lambda: setattr(sem, "defer_stale", True))
        before = sem.state_dict()
        with pytest.raises(EmptyBufferError, match="stale"):
            edp.deliver()
        after = sem.state_dict()
        assert after["dropped_items"] == 0 and after["cur"] == before["cur"] and after["k"] == before["k"]
        assert torch.equal(after["rng"], before["rng"]) and after["selections"] == before["selections"]
        edp.read_locked(lambda: setattr(sem, "defer_stale", False))
        assert _ids(edp)[0] == 1, "the learner's own delivery drops the stale rollout"
        assert sem.dropped_items == 4
    finally:
        edp.close()


def test_selection_count_is_checkpointed_and_a_damaged_one_refused() -> None:
    edp, sem = _buffer("sync")
    try:
        _ids(edp)
        state = edp.state_dict()
        assert state["semantics"]["selections"] == 1
        other, osem = _buffer("sync")
        try:
            other.load_state_dict(state)
            assert osem.draw_mark()[0] == 1
            old = dict(state, semantics={k: v for k, v in state["semantics"].items() if k != "selections"})
            other.load_state_dict(old)  # written before the count existed: it starts at 0
            assert osem.draw_mark()[0] == 0
            for bad in (-1, "1", 1.5):
                damaged = dict(state, semantics=dict(state["semantics"], selections=bad))
                with pytest.raises(ConfigurationError, match="selection count"):
                    other.load_state_dict(damaged)
                assert osem.draw_mark()[0] == 0, "a refused load changed the count"
        finally:
            other.close()
    finally:
        edp.close()
