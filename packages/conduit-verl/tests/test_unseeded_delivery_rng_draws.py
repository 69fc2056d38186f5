"""conduit-verl's delivery and the global RNG: deliveries with ``n`` or options, and multi-size selections.

* ``MinibatchPrefetch.deliver(n, ...)`` goes straight to the semantics, past a pending prefetch job. The on-policy
  semantics refuse every such delivery, so the job's minibatch stays the next one (nothing lost, duplicated or
  reordered). But with ``seed=None`` the refusal came after an epoch waiting for its first delivery had started: the
  refused call drew that epoch's order from torch's global RNG early (before the previous minibatch trained), so the
  order and the training's global-RNG draws differed from verl's.
* With ``seed=None`` a multi-size real ``select_now`` first predicts its selections (a peek), and the prediction drew
  each epoch's order from the global RNG too: the real selections then drew them again, from the advanced RNG.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conduit import ConfigurationError
from conduit.testing.lifecycle import call_bounded
from conduit_verl.delivery import MinibatchDelivery
from tensordict import TensorDict

N = 8


def _shard() -> TensorDict:
    return TensorDict({"x": torch.arange(N, dtype=torch.float32).unsqueeze(1)}, batch_size=N)


def _delivery(*, seed: int | None, prefetch: bool, epochs: int = 2) -> MinibatchDelivery:
    d = MinibatchDelivery(num_minibatches=2, epochs=epochs, seed=seed, dataloader_kwargs={"shuffle": True},
                          prefetch=prefetch, device="cpu")
    d.ingest(_shard(), version=0)
    d.seal()
    return d


def _rows(td: TensorDict) -> list[int]:
    return [int(v) for v in td["x"].flatten().tolist()]


def _train() -> float:
    """What a training step draws from the global RNG (as dropout would)."""
    return float(torch.rand(()).item())


def _refused(d: MinibatchDelivery) -> None:
    """Deliveries with ``n`` or an option: refused, typed (on-policy minibatches are set by num_minibatches)."""
    assert d.edp is not None
    with pytest.raises(ConfigurationError, match="without"):
        d.edp.deliver(3)
    with pytest.raises(ConfigurationError, match="options"):
        d.edp.deliver(replace=True)


def _run(*, seed: int | None, prefetch: bool, refuse_at: int | None,
         settle_job: bool = False) -> tuple[list[list[int]], list[float], float]:
    """Every minibatch of a 2-epoch rollout (2 per epoch) with a training draw after each; ``refuse_at``: refused
    deliveries with ``n``/options just before the training draw that follows that minibatch."""
    d = _delivery(seed=seed, prefetch=prefetch)
    torch.manual_seed(11)
    got, draws = [], []
    try:
        for i in range(4):
            td, _info = d.next_minibatch()
            got.append(_rows(td))
            if i == refuse_at:
                job = d.scheduler._pending
                if settle_job:  # the job has selected the next minibatch (the last of the epoch) before the refusal
                    assert job is not None, "prefetch staged no job after the first minibatch"
                    job.wait()
                _refused(d)
                assert d.scheduler._pending is job, "a refused delivery touched the pending prefetch job"
            draws.append(_train())
    finally:
        d.close()
    return got, draws, _train()


def _each_row_once_per_epoch(got: list[list[int]]) -> None:
    for epoch in (got[:2], got[2:]):
        assert sorted(r for mb in epoch for r in mb) == list(range(N)), f"an epoch lost or repeated rows: {got}"


# -- 1. deliveries with n or options ------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
def test_unseeded_refused_delivery_at_an_epoch_boundary_draws_no_epoch_order(prefetch: bool) -> None:
    """seed=None, epoch 0 delivered and the next epoch waiting for its first delivery: deliveries with ``n`` or an
    option are refused and draw nothing; the next epoch's order is drawn when its first minibatch is asked for, after
    the training's draw, exactly as without the refused calls (failed before: the refusal drew the order first)."""
    ref = _run(seed=None, prefetch=prefetch, refuse_at=None)
    got = _run(seed=None, prefetch=prefetch, refuse_at=1)
    _each_row_once_per_epoch(got[0])
    assert got[0] == ref[0], f"a refused delivery changed the epoch order:\nwith {got[0]}\nwithout {ref[0]}"
    assert got[1] == ref[1], "a refused delivery moved the training's global-RNG draws"
    assert got[2] == ref[2], "a refused delivery left the global RNG elsewhere"


@pytest.mark.parametrize("seed", [None, 7], ids=["unseeded", "seeded"])
def test_refused_delivery_while_a_prefetch_job_is_pending_skips_nothing(seed: int | None) -> None:
    """A delivery with ``n``/options while the prefetch job has selected the next minibatch (the epoch's last): it is
    refused, the job stays pending and its minibatch is the next one delivered; every row once per epoch, the same
    minibatches and global-RNG draws as a synchronous delivery without the refused calls (failed before with
    seed=None: the job's selection left the next epoch waiting, and the refused call started it early)."""
    ref = _run(seed=seed, prefetch=False, refuse_at=None)
    got = _run(seed=seed, prefetch=True, refuse_at=0, settle_job=True)
    _each_row_once_per_epoch(got[0])
    assert got == ref, f"prefetch with a refused delivery differs from sync delivery:\n{got}\n{ref}"


def test_refused_delivery_inside_read_locked_while_the_job_waits_for_the_lock() -> None:
    """Inside ``read_locked`` the pending job waits for the lock the caller holds: a delivery with ``n`` neither waits
    for it nor skips it; the job then stages its minibatch, delivered next, in order."""
    ref = _run(seed=7, prefetch=False, refuse_at=None)[0]
    d = _delivery(seed=7, prefetch=True)
    try:
        assert d.edp is not None
        edp = d.edp

        def fn() -> list[int]:
            first = _rows(d.next_minibatch()[0])  # submits the job, which waits for this lock
            _refused(d)
            return first

        got = call_bounded(lambda: edp.read_locked(fn),
                           hang="a refused delivery inside read_locked waited for the prefetch job")
        assert not isinstance(got, BaseException), got
        rest = [_rows(td) for td, _ in d.minibatches()]
    finally:
        d.close()
    assert [got, *rest] == ref, f"minibatches lost, repeated or reordered: {[got, *rest]} vs {ref}"


# -- 2. a multi-size select_now draws each epoch order once -------------------------------------------------------
def _select(d: MinibatchDelivery, groups: list[int]) -> tuple[list[list[int]], float]:
    """Selections in calls of ``groups`` sizes (each handed over), and the global RNG's next draw after them."""
    assert d.edp is not None
    out = []
    for k in groups:
        sels = d.edp.select_now([None] * k)
        assert sels is not None
        for s in sels:
            out.append(s.info.handles.tolist())
            d.edp.release_now(s)
    return out, _train()


def _reference(global_seed: int) -> list[list[int]]:
    """Every minibatch of an untouched unseeded delivery (no prefetch) from ``torch.manual_seed(global_seed)``."""
    torch.manual_seed(global_seed)
    d = _delivery(seed=None, prefetch=False)
    try:
        return [_rows(td) for td, _ in d.minibatches()]
    finally:
        d.close()


@pytest.mark.parametrize("groups", [[2, 2], [4], [1, 2, 1], [1, 3]],
                         ids=["crosses-rollout-start", "whole-rollout", "crosses-epoch-1-start", "from-epoch-0-end"])
def test_unseeded_multi_size_select_now_draws_each_epoch_order_once(groups: list[int]) -> None:
    """seed=None: selections made in multi-size ``select_now`` calls are those of one-by-one calls (one draw per
    epoch) from the same global RNG state, and leave the global RNG where one draw per epoch leaves it (failed
    before: the call's prediction drew each order, and the real selections drew again)."""
    torch.manual_seed(3)
    d = _delivery(seed=None, prefetch=False)
    try:
        ref = _select(d, [1, 1, 1, 1])
    finally:
        d.close()
    torch.manual_seed(3)
    d = _delivery(seed=None, prefetch=False)
    try:
        got = _select(d, groups)
    finally:
        d.close()
    _each_row_once_per_epoch(got[0])
    assert got[0] == ref[0], f"multi-size select_now {groups} drew other orders:\n{got[0]}\n{ref[0]}"
    assert got[1] == ref[1], "multi-size select_now advanced the global RNG more than one draw per epoch"


def test_unseeded_peek_predicts_the_deliveries_and_gives_the_global_rng_back() -> None:
    """seed=None: ``select_now(..., peek=True)`` across both epochs predicts exactly what the deliveries then are, and
    leaves the global RNG as it found it (before: the prediction drew, and the deliveries drew other orders)."""
    ref = _reference(9)
    torch.manual_seed(9)
    d = _delivery(seed=None, prefetch=True)
    try:
        assert d.edp is not None
        before = torch.get_rng_state()
        sels = d.edp.select_now([None] * 4, peek=True)
        assert sels is not None
        assert torch.equal(torch.get_rng_state(), before), "a prediction left the global RNG advanced"
        predicted = [s.info.handles.tolist() for s in sels]
        got = [_rows(td) for td, _ in d.minibatches()]
    finally:
        d.close()
    assert got == ref, f"a prediction changed the deliveries: {got} vs {ref}"
    assert predicted == ref, f"the prediction {predicted} is not what was delivered {ref}"


def test_seeded_multi_size_select_now_is_unchanged() -> None:
    """With a seed the loader's own generator orders the epochs: multi-size and one-by-one selections agree, and the
    global RNG is not drawn at all."""
    orders: list[Any] = []
    for groups in ([1, 1, 1, 1], [4], [1, 3]):
        torch.manual_seed(5)
        d = _delivery(seed=7, prefetch=False)
        try:
            orders.append(_select(d, groups))
        finally:
            d.close()
    torch.manual_seed(5)
    untouched = _train()
    assert orders[0] == orders[1] == orders[2], orders
    assert orders[0][1] == untouched, "a seeded delivery drew from the global RNG"


def test_unseeded_refused_multi_size_select_now_draws_nothing() -> None:
    """seed=None: a multi-size ``select_now`` asking for more minibatches than the rollout has is refused, selects
    nothing and leaves the global RNG as it found it; the deliveries then are those of an untouched buffer."""
    from conduit import EmptyBufferError

    ref = _reference(4)
    torch.manual_seed(4)
    d = _delivery(seed=None, prefetch=False)
    try:
        assert d.edp is not None
        before = torch.get_rng_state()
        with pytest.raises(EmptyBufferError):
            d.edp.select_now([None] * 5)
        assert torch.equal(torch.get_rng_state(), before), "a refused select_now drew from the global RNG"
        got = [_rows(td) for td, _ in d.minibatches()]
    finally:
        d.close()
    assert got == ref, f"a refused select_now changed the deliveries: {got} vs {ref}"
