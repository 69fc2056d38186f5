"""A queue get() observes every put that returned before it, also while Conduit still stores those puts.

SRL's buffers are sequential: a ``get`` after ``put`` calls sees their effects (new samples, and the
samples their overflow evicted). The Conduit buffer stores puts in the background; these tests keep
puts on their way deterministically (``g_ing`` larger than the puts made, so the ingestion group
never completes by itself) and compare with what a sequential buffer would deliver.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay
from conduit_srl.fifo import FifoSampler
from conduit_srl.testing import entry_ids, make_sample


def _on_their_way(b) -> int:
    """Samples handed over and not stored yet."""
    return sum(h.batch.batch_size for h in b.edp.scheduler.pending())


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30  # (a wait for the assembler thread, only reached when it never prepares)
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_queue_get_does_not_return_samples_evicted_by_puts_still_being_stored(closing, overlap: bool,
                                                                              prefetch: int) -> None:
    b = closing(batch_size=2, capacity=4, g_ing=8, queue_depth=16, overlap=overlap, prefetch=prefetch)
    for i in range(4):
        b.put(make_sample([i]))
    b.flush()
    for i in range(4, 7):  # once stored, they evict samples 0, 1 and 2 (never delivered)
        b.put(make_sample([i]))
    assert _on_their_way(b) == 3, "the test needs the puts still on their way"
    got = entry_ids(b.get()).tolist()
    assert got == [3, 4], f"get() returned {got}: samples the earlier puts evicted (a sequential queue gives [3, 4])"
    assert b.stats()["queue_dropped"] == 3, b.stats()
    assert entry_ids(b.get()).tolist() == [5, 6]
    assert b.empty()


def test_queue_reuse_of_a_batch_that_puts_on_their_way_evict_is_abandoned(closing) -> None:
    b = closing(batch_size=3, capacity=3, reuses=2, g_ing=8, queue_depth=16, overlap=False, prefetch=0)
    for i in range(3):
        b.put(make_sample([i]))
    b.flush()
    first = b.get()
    assert entry_ids(first).tolist() == [0, 1, 2] and first.reuses_left == 1
    for i in range(3, 6):  # once stored, they evict the batch being reused
        b.put(make_sample([i]))
    assert _on_their_way(b) == 3, "the test needs the puts still on their way"
    second = b.get()
    assert entry_ids(second).tolist() == [3, 4, 5], (
        f"get() delivered {entry_ids(second).tolist()} (reuse {second.reuses}) although the earlier puts evicted it")
    assert second.reuses == 0
    assert b.stats()["queue_abandoned"] == 1, b.stats()


def test_queue_entry_assembled_after_the_puts_returned_does_not_hold_samples_they_evict(closing) -> None:
    # overlap=False: Conduit selects nothing ahead, so the assembler thread makes the selection after the puts
    b = closing(batch_size=2, capacity=6, g_ing=8, queue_depth=16, overlap=False, prefetch=1)
    b.put_batch(make_sample(list(range(6)), batched=True))
    b.flush()
    assert entry_ids(b.get()).tolist() == [0, 1]
    _wait(lambda: len(b._a._ready) == 1, "the assembler did not prepare the next entry")  # [2, 3], before the puts
    b.put_batch(make_sample(list(range(6, 12)), batched=True))  # once stored, evicts 0..5: 4 and 5 never delivered
    assert _on_their_way(b) == 6, "the test needs the puts still on their way"
    assert entry_ids(b.get()).tolist() == [2, 3]  # prepared ahead before the puts: handed out as prepared
    got = entry_ids(b.get()).tolist()  # selected after the puts returned (by the assembler or by this get)
    assert got == [6, 7], f"got {got}: samples the earlier puts evicted (a sequential queue gives [6, 7])"
    assert b.stats()["queue_dropped"] == 2, b.stats()


@pytest.mark.parametrize("semantics", ["queue", "replay"])
def test_qsize_takes_off_what_puts_on_their_way_will_evict(closing, semantics: str) -> None:
    b = closing(semantics=semantics, batch_size=2, capacity=4, g_ing=8, queue_depth=16, prefetch=0)
    for i in range(4):
        b.put(make_sample([i]))
    b.flush()
    for i in range(4, 7):  # once stored, they evict 0, 1 and 2
        b.put(make_sample([i]))
    assert _on_their_way(b) == 3, "the test needs the puts still on their way"
    before = b.qsize()
    b.flush()
    after = b.qsize()
    assert after == 4
    assert before == after, f"qsize() was {before} while the puts were on their way and {after} once stored " \
                            f"(the capacity is 4)"


# -- queue_dropped when a selection made ahead skipped samples eviction had already counted -------------------
def test_queue_dropped_does_not_count_again_the_samples_a_selection_ahead_skipped() -> None:
    # Conduit's prefetch selects through select_now and the adapter confirms what it delivers; a checkpoint
    # (or any discard) forgets the unconfirmed selection: rewind() counts its evicted samples as dropped
    fifo = FifoSampler()
    edp = ExperienceDataPlane(ExperienceSchema(id=Field(())), capacity=4, semantics=Replay(fifo))
    try:
        def put(*ids: int) -> None:
            edp.ingest({"id": torch.tensor(ids, dtype=torch.float32)})

        put(0, 1)
        (first,) = edp.select_now([1])
        fifo.confirm(first.info)  # sample 0 delivered
        put(2, 3, 4, 5)  # evicts 0 and 1: sample 1 was never delivered (dropped: 1)
        assert fifo.dropped == 1
        (ahead,) = edp.select_now([1])  # selected ahead, not delivered
        assert ahead.info.handles.tolist() == [2]
        put(6, 7)  # evicts 2 (selected ahead) and 3 (dropped: 2)
        assert fifo.dropped == 2
        saved = fifo.state_dict()
        fifo.rewind()  # the selection ahead is discarded: sample 2 is lost too
        # samples 1, 2 and 3 were never delivered; sample 1 was counted twice before the fix
        assert fifo.dropped == 3, f"queue_dropped is {fifo.dropped}, but only samples 1, 2 and 3 were dropped"
        assert saved["dropped"] == 3, f"a checkpoint saves queue_dropped={saved['dropped']}, expected 3"
        (nxt,) = edp.select_now([1])
        assert nxt.info.handles.tolist() == [4]
    finally:
        edp.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_queue_abandoned_counts_a_reused_batch_that_eviction_took_once_across_a_checkpoint(closing,
                                                                                          overlap: bool) -> None:
    b = closing(batch_size=2, capacity=3, reuses=2, prefetch=0, overlap=overlap)
    b.put(make_sample([0]))
    b.put(make_sample([1]))
    first = b.get()
    assert entry_ids(first).tolist() == [0, 1] and first.reuses_left == 1
    b.put(make_sample([2]))
    b.put(make_sample([3]))  # evicts sample 0: the batch's second delivery is abandoned
    b.flush()
    restored = pickle.loads(pickle.dumps(b))
    try:
        assert b.stats()["queue_abandoned"] == 1, f"one batch was abandoned, counted {b.stats()['queue_abandoned']}"
        assert restored.stats()["queue_abandoned"] == 1, (
            f"one batch was abandoned, the checkpoint saved {restored.stats()['queue_abandoned']}")
        assert entry_ids(restored.get()).tolist() == [2, 3]
    finally:
        restored.close()
