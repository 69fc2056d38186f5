"""Queue checkpoints and drop counts when eviction meets batches selected ahead."""

from __future__ import annotations

import pickle
import time

from conduit_srl import ConduitBuffer
from conduit_srl.testing import entry_ids, make_sample


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30  # (a wait for background threads, only reached when they never get there)
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _drain(b: ConduitBuffer) -> list[tuple[list[int], list[int], float]]:
    out = []
    while not b.empty():
        e = b.get()
        out.append((entry_ids(e).tolist(), e.sampling_indices.tolist(), e.reuses))
    return out


def test_a_restored_queue_does_not_redeliver_a_reused_batch_that_eviction_took() -> None:
    b = ConduitBuffer(batch_size=2, capacity=6, reuses=2, prefetch=0, overlap=True)  # (Conduit selects ahead)
    for i in range(6):
        b.put(make_sample([i], time_steps=2))
    assert entry_ids(b.get()).tolist() == [0, 1]  # first of its two uses
    fifo = b._a._fifo()
    _wait(lambda: fifo._sel[1] is None, "Conduit did not select the second use ahead")
    for i in range(6, 8):  # evicts samples 0 and 1
        b.put(make_sample([i], time_steps=2))
    b.flush()
    restored = pickle.loads(pickle.dumps(b))
    try:
        live, again = _drain(b), _drain(restored)
    finally:
        b.close()
        restored.close()
    expected = [([i, i + 1], [i, i + 1], float(u)) for i in (2, 4, 6) for u in (0, 1)]
    assert live == expected
    # before the fix: the restored buffer first delivered samples [6, 7] as "handles [0, 1], reuse 1"
    assert again == expected, again
    assert restored.stats()["queue_abandoned"] == b.stats()["queue_abandoned"] == 1


def test_queue_dropped_counts_each_evicted_undelivered_sample_once_across_a_checkpoint() -> None:
    b = ConduitBuffer(batch_size=2, capacity=6, overlap=True)  # (Conduit selects ahead)
    for i in range(6):
        b.put(make_sample([i], time_steps=2))
    b.flush()  # (else Conduit's prefetch after the assembler's delivery may look before 4 and 5 are stored)
    got = [entry_ids(b.get()).tolist()]
    fifo = b._a._fifo()
    # the assembler holds [2, 3] (confirmed); Conduit has selected [4, 5] ahead (not confirmed)
    _wait(lambda: b._a._ready and fifo._sel[0] == 6, "the next batches were not prepared ahead")
    for i in range(6, 14):  # evicts 0..7: 4..7 were never delivered
        b.put(make_sample([i], time_steps=2))
    b.flush()
    restored = pickle.loads(pickle.dumps(b))  # the checkpoint discards the prepared [4, 5]
    try:
        got += [ids for ids, _, _ in _drain(b)]
        again = [ids for ids, _, _ in _drain(restored)]
    finally:
        b.close()
        restored.close()
    assert got == [[0, 1], [2, 3], [8, 9], [10, 11], [12, 13]]
    assert again == [[2, 3], [8, 9], [10, 11], [12, 13]]
    assert b.stats()["queue_dropped"] == 4, b.stats()  # was 6 (6 and 7 counted twice)
    assert restored.stats()["queue_dropped"] == 4, restored.stats()  # was 2 (4 and 5 never counted)
