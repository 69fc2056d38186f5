"""The semantics (replay and on-policy) through the real ExperienceDataPlane: ``select_now``, a prioritized model.

1. On-policy: a *prediction* (``select_now(..., peek=True)``) handed over with ``release_now`` counts for
   nothing, as ``OnPolicy.after_gather`` documents. It used to free the rollout whose last minibatch it predicted,
   under the real last minibatch not yet delivered: a later ingestion then overwrote those rows.
2. ``select_now`` of several deliveries that the semantics refuse part way (e.g. the rollout runs out) selects
   nothing, as ``deliver`` refused would. It used to consume the minibatches selected before the refusal: they
   were never delivered, and their outstanding selections held the buffer's storage for ever.
3. Prioritized replay against a brute-force model: FIFO eviction (also the extra evictions of a ragged pool),
   priority updates for evicted handles and duplicate handles, the max-priority default, the probabilities and
   importance weights reported, and a checkpoint that continues the same draws.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    PriorityError,
    Replay,
)
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch


def _ids(batch: Any) -> list[int]:
    return [int(i) for i in check_payload(batch).tolist()]


def _one_rollout(capacity: int, m: int = 2, n: int = 4) -> ExperienceDataPlane:
    """Rollout v0 of ids ``0 .. n-1``, sealed, cut in ``m`` minibatches in ingestion order."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=capacity,
                              semantics=OnPolicy(num_minibatches=m, shuffle=False))
    edp.ingest(id_batch(np.arange(n)), version=0)
    edp.seal()
    return edp


# -- 1. a prediction handed over frees nothing --------------------------------------------------------------------
def test_handing_over_a_prediction_of_the_last_minibatch_frees_nothing() -> None:
    edp = _one_rollout(capacity=8)
    assert _ids(edp.deliver()[0]) == [0, 1]
    (pred,) = edp.select_now([None], peek=True) or []
    assert pred.info.last, "the prediction is of the rollout's last minibatch"
    edp.release_now(pred)  # a prediction: counts for nothing (after_gather's docstring)
    assert len(edp) == 4, (f"handing over a prediction freed {4 - len(edp)} items of a rollout whose last minibatch "
                           f"is not delivered yet")
    with pytest.raises(CapacityError):  # its slots are not free: a new rollout may not overwrite them
        edp.ingest(id_batch(np.arange(100, 108)), version=1)
    batch, info = edp.deliver()
    assert info.last and _ids(batch) == [2, 3], "the real last minibatch reads rows a later ingestion overwrote"
    assert len(edp) == 0, "the real last minibatch, handed over, frees the rollout"


def test_handing_over_a_prediction_made_after_a_real_selection_keeps_that_selection_outstanding() -> None:
    """A real selection not handed over yet holds its rollout; a prediction handed over meanwhile changes nothing."""
    edp = _one_rollout(capacity=8, m=1)
    (real,) = edp.select_now([None]) or []
    edp.ingest(id_batch(np.arange(4, 8)), version=1)
    edp.seal()
    (pred,) = edp.select_now([None], peek=True) or []
    assert pred.info.last and pred.info.version == 1
    edp.release_now(pred)
    assert len(edp) == 8, f"{8 - len(edp)} items freed by handing over a prediction"
    assert _ids(edp.gather_now([real])) == [0, 1, 2, 3]
    edp.release_now(real)
    assert len(edp) == 4
    batch, info = edp.deliver()
    assert _ids(batch) == [4, 5, 6, 7] and info.last and len(edp) == 0


# -- 2. select_now refused part way selects nothing ---------------------------------------------------------------
def test_select_now_refused_part_way_consumes_none_of_its_selections() -> None:
    edp = _one_rollout(capacity=4)
    with pytest.raises(EmptyBufferError):  # three deliveries asked for, the rollout has two minibatches
        edp.select_now([None, None, None])
    got = [_ids(edp.deliver()[0]) for _ in range(2)]
    assert got == [[0, 1], [2, 3]], f"delivered {got} after the refused select_now; expected both minibatches"
    assert len(edp) == 0, f"{len(edp)} items still held after the whole rollout was delivered"
    edp.ingest(id_batch(np.arange(4, 8)), version=1)  # the whole capacity is free again
    edp.seal()
    assert _ids(edp.deliver()[0]) == [4, 5]


def test_prepare_now_refused_part_way_consumes_none_of_its_selections() -> None:
    edp = _one_rollout(capacity=8, m=1)
    with pytest.raises(EmptyBufferError):
        edp.prepare_now([None, None])
    batch, info = edp.deliver()
    assert _ids(batch) == [0, 1, 2, 3] and info.last and len(edp) == 0


def test_select_now_refused_at_its_first_selection_still_drops_stale_rollouts() -> None:
    """The refusal a single delivery makes: stale rollouts dropped on the way stay dropped (their storage freed)."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4, semantics=OnPolicy(num_minibatches=2, shuffle=False))
    edp.ingest(id_batch(np.arange(4)), version=0)
    edp.seal()
    edp.set_policy_version(5)
    with pytest.raises(EmptyBufferError):
        edp.select_now([None, None])
    assert edp.semantics.dropped_items == 4 and len(edp) == 0  # type: ignore[attr-defined]
    edp.ingest(id_batch(np.arange(4, 8)), version=5)


def test_select_now_that_fits_selects_exactly_what_deliveries_would() -> None:
    a, b = _one_rollout(capacity=8, m=2, n=5), _one_rollout(capacity=8, m=2, n=5)
    sels = a.select_now([None, None]) or []
    got = [_ids(a.gather_now([s])) for s in sels]
    for s in sels:
        a.release_now(s)
    assert got == [_ids(b.deliver()[0]) for _ in range(2)] == [[0, 1, 2], [3, 4]]
    assert len(a) == len(b) == 0


# -- 3. prioritized replay against a model ------------------------------------------------------------------------
RAGGED_IDS = ExperienceSchema(id=Field((), torch.int64), tokens=Field((), torch.int64, ragged=True))


def _batch(first: int, lengths: list[int]) -> dict[str, Any]:
    ids = list(range(first, first + len(lengths)))
    return {"id": torch.tensor(ids, dtype=torch.int64),
            "tokens": [torch.full((k,), i, dtype=torch.int64) for i, k in zip(ids, lengths, strict=True)]}


def _leaves(edp: ExperienceDataPlane) -> np.ndarray:
    return edp.semantics.state_dict()["sampler"]["leaves"].numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prioritized_replay_matches_a_model_through_wraps_ragged_evictions_and_updates(seed: int) -> None:
    rng = np.random.default_rng(seed)
    alpha, beta, cap = 0.7, 0.5, 16
    edp = ExperienceDataPlane(RAGGED_IDS, capacity=cap, ragged_capacity=40,
                              semantics=Replay(PrioritizedSampler(alpha=alpha, beta=beta), seed=seed))
    model: dict[int, float] = {}  # live handle -> priority
    top, nxt = 1.0, 0
    for step in range(300):
        k = int(rng.integers(1, 6))
        lengths = rng.integers(0, 8, k).tolist()  # at most 35 elements: a batch fits the pool
        given = None if rng.random() < 0.5 else rng.random(k) * 3
        edp.ingest(_batch(nxt, lengths), priorities=None if given is None else torch.from_numpy(given))
        for j in range(k):
            model[nxt + j] = top if given is None else float(given[j])
        if given is not None:
            top = max(top, float(given.max()))
        nxt += k
        st = edp.storage
        for h in [h for h in model if h < st.oldest]:  # FIFO (the ring, or the ragged pool, evicted them)
            del model[h]
        assert sorted(model) == list(range(st.oldest, st.next_handle)), "the live handles are not the model's"
        want = np.zeros(cap)
        for h, p in model.items():
            want[h % cap] = p ** alpha
        np.testing.assert_allclose(_leaves(edp), want, rtol=1e-12, atol=0,
                                   err_msg=f"step {step}: a slot's weight is not its live item's priority ** alpha")
        batch, info = edp.deliver(8)
        handles = info.handles.tolist()
        assert batch.tensor("id").tolist() == handles and all(h in model for h in handles), "drew an item not live"
        assert info.probabilities is not None and info.weights is not None
        total = math.fsum(p ** alpha for p in model.values())
        smallest = min(p ** alpha for p in model.values() if p > 0)
        for i, h in enumerate(handles):
            assert info.probabilities[i].item() == pytest.approx(model[h] ** alpha / total, rel=1e-12)
            assert info.weights[i].item() == pytest.approx((smallest / model[h] ** alpha) ** beta, rel=1e-6)
        # updates: some handles evicted (ignored, never applied to the slot's new occupant), some repeated (the
        # last value wins)
        upd = rng.integers(max(0, st.oldest - cap), st.next_handle, 6)
        upd[-1] = upd[0]
        pr = rng.random(6) * 4 + (rng.random(6) < 0.2) * 1e-9
        assert edp.update_priorities(torch.from_numpy(upd), torch.from_numpy(pr)) == int((upd >= st.oldest).sum())
        for h, p in zip(upd.tolist(), pr.tolist(), strict=True):
            if h in model:
                model[h] = p
                top = max(top, p)


def test_a_new_item_after_the_largest_priority_was_evicted_still_gets_the_largest_seen() -> None:
    """The documented default ("the largest priority seen so far"), which evicting that item does not lower."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4, semantics=Replay(PrioritizedSampler(alpha=1.0)))
    edp.ingest(id_batch(np.arange(4)))
    edp.update_priorities(torch.tensor([0, 1, 2, 3]), torch.tensor([9.0, 2.0, 2.0, 2.0]))
    edp.ingest(id_batch(np.arange(4, 5)))  # evicts handle 0 (priority 9)
    assert _leaves(edp).tolist() == [9.0, 2.0, 2.0, 2.0]  # slot 0 now holds handle 4, at the largest seen
    assert edp.update_priorities(torch.tensor([0]), torch.tensor([0.5])) == 0, "an evicted handle was updated"
    assert _leaves(edp).tolist() == [9.0, 2.0, 2.0, 2.0], "an evicted handle's update reached its slot's new item"
    with pytest.raises(PriorityError):  # a handle never issued refuses the whole update
        edp.update_priorities(torch.tensor([1, 5]), torch.tensor([3.0, 3.0]))
    assert _leaves(edp).tolist() == [9.0, 2.0, 2.0, 2.0], "a refused update changed a priority"


def test_the_total_does_not_drift_over_a_million_updates_of_tiny_and_huge_priorities() -> None:
    """Block sums are recomputed from the leaves: after 10**6 updates mixing 1e-12 and 1e12 the probabilities
    reported are those of the priorities held (an incrementally kept total would have lost the tiny ones)."""
    cap = 10_000  # above the leaves-only size: the two-level tree
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=cap, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=3))
    edp.ingest(id_batch(np.arange(cap)))
    rng = np.random.default_rng(0)
    for _ in range(100):
        h = rng.integers(0, cap, 10_000)
        edp.update_priorities(torch.from_numpy(h), torch.from_numpy(np.where(rng.random(10_000) < 0.5, 1e12, 1e-12)))
    # finally every item tiny but one: the probabilities must come from the tiny values, not a residue of the huge
    edp.update_priorities(torch.arange(cap), torch.full((cap,), 1e-12))
    edp.update_priorities(torch.tensor([7]), torch.tensor([1e-3], dtype=torch.float64))
    _, info = edp.deliver(64)
    assert info.probabilities is not None
    total = (cap - 1) * 1e-12 + 1e-3
    for h, p in zip(info.handles.tolist(), info.probabilities.tolist(), strict=True):
        assert p == pytest.approx((1e-3 if h == 7 else 1e-12) / total, rel=1e-9)


def test_a_prioritized_checkpoint_continues_the_same_draws_and_weights() -> None:
    def build() -> ExperienceDataPlane:
        return ExperienceDataPlane(ID_SCHEMA, capacity=32, semantics=Replay(PrioritizedSampler(alpha=0.6), seed=9))

    a = build()
    for i in range(5):  # wraps: 50 items into 32 slots
        a.ingest(id_batch(np.arange(10 * i, 10 * i + 10)))
        _, info = a.deliver(8)
        a.update_priorities(info.handles, torch.rand(8, generator=torch.Generator().manual_seed(i)) + 1e-3)
    b = build()
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        (ba, ia), (bb, ib) = a.deliver(16, beta=0.7), b.deliver(16, beta=0.7)
        assert _ids(ba) == _ids(bb) and torch.equal(ia.handles, ib.handles)
        assert ia.weights is not None and ib.weights is not None and torch.equal(ia.weights, ib.weights)
        a.update_priorities(ia.handles, ia.weights + 0.5)
        b.update_priorities(ib.handles, ib.weights + 0.5)
