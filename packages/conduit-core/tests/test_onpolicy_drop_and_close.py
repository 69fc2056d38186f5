"""On-policy drops under outstanding selections, and what a closed ExperienceDataPlane still does.

1. A stale rollout dropped inside ``select`` must not free storage that a selection made by ``select_now``
   and not yet handed over (``release_now``) still reads; the held-back release is part of the checkpoint.
2. After ``close()`` the buffer takes no more work: ingest, deliver and the scheduler primitives raise a
   typed "closed" error; close is idempotent; a checkpoint taken before or after close loads into a new buffer,
   which goes on exactly as the closed one would have.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    EmptyBufferError,
    ExperienceDataPlane,
    OnPolicy,
    Overlapped,
    Replay,
    Synchronous,
)
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch


def _ids(batch: Any) -> list[int]:
    return [int(i) for i in check_payload(batch).tolist()]


# -- 1. drops held back while a selection is outstanding ---------------------------------------------------------
def _finished_a_then_drop_b(capacity: int = 12) -> tuple[ExperienceDataPlane, Any, Any]:
    """Rollouts A (v0, ids 0-3), B (v1, 4-7), C (v3, 8-11); A's only minibatch selected and not handed over;
    then the policy moves to 3 (B is stale) and the next selection drops B and selects C."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=capacity,
                              semantics=OnPolicy(num_minibatches=1, max_staleness=1, shuffle=False))
    edp.ingest(id_batch(np.arange(4)), version=0)
    edp.seal()
    edp.ingest(id_batch(np.arange(4, 8)), version=1)
    edp.seal()
    (sel_a,) = edp.select_now([None]) or []
    edp.set_policy_version(3)
    edp.ingest(id_batch(np.arange(8, 12)), version=3)
    edp.seal()
    (sel_c,) = edp.select_now([None]) or []  # drops B (stale) on the way to C
    return edp, sel_a, sel_c


def test_a_stale_drop_does_not_free_a_selected_rollout_before_it_is_handed_over() -> None:
    edp, sel_a, sel_c = _finished_a_then_drop_b()
    assert edp.semantics.dropped_items == 4, "rollout B (stale) was not dropped"  # type: ignore[attr-defined]
    assert len(edp) == 12, (f"{12 - len(edp)} items freed while A's selected minibatch waits to be handed over; "
                            f"only B's 4 may go, and only once A's selection is handed over")
    with pytest.raises(CapacityError):  # A's slots are not free: a new rollout may not overwrite them
        edp.ingest(id_batch(np.arange(100, 108)), version=3)
    assert _ids(edp.gather_now([sel_a])) == [0, 1, 2, 3], "A's selection reads rows a later ingest overwrote"
    edp.release_now(sel_a)
    assert len(edp) == 4, f"{len(edp)} items live after A was handed over; B's and A's storage should be free"
    assert _ids(edp.gather_now([sel_c])) == [8, 9, 10, 11]
    edp.release_now(sel_c)
    assert len(edp) == 0
    edp.ingest(id_batch(np.arange(100, 112)), version=3)  # the whole capacity is free again


def test_dropping_the_rollout_being_delivered_waits_for_its_selected_minibatch() -> None:
    """A rollout dropped part way (its first minibatch selected, not handed over) keeps that minibatch's rows."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=8,
                              semantics=OnPolicy(num_minibatches=2, max_staleness=0, shuffle=False))
    edp.ingest(id_batch(np.arange(4)), version=0)
    edp.seal()
    (first,) = edp.select_now([None]) or []
    edp.set_policy_version(1)
    edp.ingest(id_batch(np.arange(4, 8)), version=1)
    edp.seal()
    (nxt,) = edp.select_now([None]) or []  # drops the rest of rollout 0
    assert _ids(edp.gather_now([nxt])) == [4, 5], "the fresh rollout's first minibatch"
    assert len(edp) == 8, "rollout 0 was freed under its selected, not handed over, first minibatch"
    assert _ids(edp.gather_now([first])) == [0, 1]
    edp.release_now(nxt)  # handing over the later selection first frees nothing of rollout 0
    assert len(edp) == 8, "handing over another rollout's selection freed rollout 0 under its outstanding one"
    edp.release_now(first)
    assert len(edp) == 4, f"{len(edp)} items live; rollout 0 (dropped, its selection handed over) should be free"
    edp.release_now(first)  # handed over twice: counts for nothing
    assert len(edp) == 4


def test_built_in_delivery_still_frees_dropped_rollouts_at_once() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=12, semantics=OnPolicy(num_minibatches=1, max_staleness=0))
    edp.ingest(id_batch(np.arange(4)), version=0)
    edp.seal()
    edp.set_policy_version(1)
    edp.ingest(id_batch(np.arange(4, 8)), version=1)
    edp.seal()
    batch, _ = edp.deliver()
    assert sorted(_ids(batch)) == [4, 5, 6, 7] and len(edp) == 0


def test_stale_rollouts_a_refused_delivery_dropped_stay_dropped_so_producers_get_room() -> None:
    """The one exception to "a refused select changes nothing" (Semantics' contract): on-policy storage never
    evicts, so a buffer full of stale rollouts must be freed by the delivery that finds them stale, even when
    it then has nothing to deliver."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=1, max_staleness=0))
    edp.ingest(id_batch(np.arange(8)), version=0)
    edp.seal()
    with pytest.raises(CapacityError):
        edp.ingest(id_batch(np.arange(8, 10)), version=1)  # full, and on-policy never evicts
    edp.set_policy_version(1)
    with pytest.raises(EmptyBufferError):
        edp.deliver()
    assert len(edp) == 0 and edp.semantics.dropped_items == 8, (len(edp), edp.semantics.dropped_items)
    edp.ingest(id_batch(np.arange(8, 10)), version=1)  # room again
    edp.seal()
    batch, _ = edp.deliver()
    assert sorted(_ids(batch)) == [8, 9]


def test_a_checkpoint_with_a_held_back_drop_round_trips_exactly() -> None:
    edp, sel_a, sel_c = _finished_a_then_drop_b()
    state = edp.state_dict()
    sem_state = state["semantics"]
    assert sem_state["outstanding"] == [(0, 1), (8, 1)] and sem_state["due"] == 8, (
        f"outstanding {sem_state['outstanding']}, due {sem_state['due']}: the held-back drop is not in the checkpoint")
    twin = ExperienceDataPlane(ID_SCHEMA, capacity=12,
                               semantics=OnPolicy(num_minibatches=1, max_staleness=1, shuffle=False))
    twin.load_state_dict(state)
    again = twin.state_dict()["semantics"]
    for key in ("outstanding", "due", "finished_end", "dropped_items", "sealed", "cur"):
        assert again[key] == sem_state[key], f"{key}: {again[key]!r} after the round trip, saved {sem_state[key]!r}"
    for buf in (edp, twin):
        assert len(buf) == 12
        assert _ids(buf.gather_now([sel_a])) == [0, 1, 2, 3]
        buf.release_now(sel_a)
        assert len(buf) == 4, f"{len(buf)} items live after A was handed over"
        buf.release_now(sel_c)
        assert len(buf) == 0


@pytest.mark.parametrize("damage", [{"outstanding": [(0, 0)]}, {"outstanding": [(0, 1), (0, 2)]},
                                    {"outstanding": "x"}, {"due": -1}, {"due": 1.5}, {"due": 10**6},
                                    {"outstanding": [(10**6, 1)]}],
                         ids=["zero-count", "duplicate", "not-a-list", "negative-due", "float-due", "due-past-end",
                              "outstanding-past-end"])
def test_a_damaged_held_back_state_is_refused_typed_and_changes_nothing(damage: dict[str, Any]) -> None:
    edp, _, _ = _finished_a_then_drop_b()
    state = edp.state_dict()
    state["semantics"] = {**state["semantics"], **damage}
    before = edp.state_dict()["semantics"]
    with pytest.raises(ConfigurationError, match="damaged"):
        edp.load_state_dict(state)
    after = edp.state_dict()["semantics"]
    assert (after["outstanding"], after["due"]) == (before["outstanding"], before["due"])


# -- 2. a closed buffer ------------------------------------------------------------------------------------------
SCHEDULERS = {"sync": Synchronous, "overlapped": Overlapped}


def _closed(sched: str, on_policy: bool) -> ExperienceDataPlane:
    sem = OnPolicy(num_minibatches=2) if on_policy else None
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=sem, scheduler=SCHEDULERS[sched]())
    edp.ingest(id_batch(np.arange(8)), version=0 if on_policy else None)
    if on_policy:
        edp.seal()
    edp.close()
    return edp


@pytest.mark.parametrize("sched", SCHEDULERS)
@pytest.mark.parametrize("on_policy", [False, True], ids=["replay", "on-policy"])
def test_a_closed_buffer_refuses_ingest_delivery_and_the_primitives_typed(sched: str, on_policy: bool) -> None:
    edp = _closed(sched, on_policy)
    state = edp.state_dict()  # reading is fine after close
    assert sorted(state["storage"]["data"]["id"].tolist()) == list(range(8))
    version = 0 if on_policy else None
    n = None if on_policy else 2
    calls = {
        "ingest": lambda: edp.ingest(id_batch(np.arange(8, 10)), version=version),
        "deliver": lambda: edp.deliver(n),
        "ingest_now": lambda: edp.ingest_now(edp.storage.gather(torch.arange(2)), version=version),
        "deliver_now": lambda: edp.deliver_now(n),
        "select_now": lambda: edp.select_now([n]),
        "prepare_now": lambda: edp.prepare_now([n]),
        "load_state_dict": lambda: edp.load_state_dict(state),
    }
    if on_policy:
        calls |= {"seal": edp.seal, "set_policy_version": lambda: edp.set_policy_version(1)}
    for name, call in calls.items():
        with pytest.raises(ConfigurationError, match="closed; build a new one"):
            call()
        assert len(edp) == 8, f"{name} after close changed the contents ({len(edp)} items)"
    edp.close()  # idempotent
    edp.flush()  # nothing left to store: returns
    assert edp.closed and len(edp) == 8


def test_a_selection_made_before_close_cannot_be_read_or_released_after_it() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=OnPolicy(num_minibatches=1))
    edp.ingest(id_batch(np.arange(4)), version=0)
    edp.seal()
    (sel,) = edp.select_now([None]) or []
    edp.close()
    with pytest.raises(ConfigurationError, match="closed"):
        edp.gather_now([sel])
    with pytest.raises(ConfigurationError, match="closed"):
        edp.release_now(sel)
    assert len(edp) == 4


@pytest.mark.parametrize("sched", SCHEDULERS)
def test_a_checkpoint_taken_before_close_loads_into_a_new_buffer_and_close_twice_keeps_the_next_one(
        sched: str) -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=OnPolicy(num_minibatches=2, seed=3),
                              scheduler=SCHEDULERS[sched]())
    edp.ingest(id_batch(np.arange(8)), version=0)
    edp.seal()
    first, _ = edp.deliver()
    state = edp.state_dict()
    scheduler = edp.scheduler
    edp.close()
    new = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=OnPolicy(num_minibatches=2, seed=3),
                              scheduler=scheduler)  # the closed buffer's scheduler serves the new one
    new.load_state_dict(state)
    edp.close()  # closing the old buffer again must not close the scheduler now serving the new one
    rest, _ = new.deliver()
    assert sorted(_ids(first) + _ids(rest)) == list(range(8)), "the new buffer did not continue the rollout"
    new.ingest(id_batch(np.arange(8, 12)), version=1)  # the shared scheduler still takes work for the new buffer
    new.flush()
    assert len(new) == 4
    new.close()


def test_a_checkpoint_read_after_close_continues_the_draws_a_prefetching_buffer_had_prepared() -> None:
    """Closing drops the batches a prefetching scheduler prepared; their draws are given back first, so the
    state read after close continues exactly as a synchronous buffer's."""
    def build(scheduler: Any) -> ExperienceDataPlane:
        edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, semantics=Replay(seed=4), scheduler=scheduler)
        edp.ingest(id_batch(np.arange(200)))
        edp.flush()
        return edp

    ref, over = build(Synchronous()), build(Overlapped(g_del=2))
    for _ in range(3):
        assert _ids(ref.deliver(8)[0]) == _ids(over.deliver(8)[0])
    over.close()
    twin = build(Synchronous())
    twin.load_state_dict(over.state_dict())
    expected = [_ids(ref.deliver(8)[0]) for _ in range(3)]
    got = [_ids(twin.deliver(8)[0]) for _ in range(3)]
    assert got == expected, "the checkpoint read after close skipped the draws the closed buffer had prepared"


@pytest.mark.parametrize("sched", ["sync", "overlapped"])
def test_a_read_that_fails_still_hands_its_selection_over_so_storage_is_freed(sched: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = Synchronous() if sched == "sync" else Overlapped(g_del=1)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=2, shuffle=False),
                              scheduler=scheduler)
    edp.ingest(id_batch(np.arange(8)), version=0)
    edp.seal()
    storage = edp.storage
    real = storage.gather
    failures = [OSError("the disk went away")]

    def gather_failing_once(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(storage, "gather", gather_failing_once)
    with pytest.raises(OSError, match="disk went away"):
        edp.deliver()  # the first minibatch: selected, its read failed
    assert edp.semantics.state_dict()["outstanding"] == [], "the failed read's selection is still outstanding"
    batch, info = edp.deliver()  # the second minibatch finishes the rollout
    assert info.last and sorted(_ids(batch)) == [4, 5, 6, 7]
    assert len(edp) == 0, "the finished rollout's storage was never freed"
    edp.ingest(id_batch(np.arange(8, 16)), version=0)  # room for a whole new rollout
    edp.close()
