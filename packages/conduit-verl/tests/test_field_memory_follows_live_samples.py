"""A field's memory follows the samples it holds, not everything put since its oldest live sample.

TransferQueue clears samples in any order; a field frees its ring only up to its oldest live sample. One sample
kept long (a group still generating, a key nobody clears) therefore pinned the ring, and every later put grew the
field: the re-slot always took the next larger rung, and the pool grew to hold the whole handle range, cleared
samples included. One live sample under a steady put/clear stream took a 1024-slot field to 131,199 slots and a
16,384-element pool to 4,194,559 elements after 160,000 puts (a leak that grows with the run). Now the live samples
are compacted within the same rungs when that leaves room (and when at least half the pool is dead).
"""

from __future__ import annotations

import pytest
import torch
from conduit_verl.columns import FieldStore, PoolLadder
from conduit_verl.packing import pack_column, unpack_column


def _rows(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.int64) for r in rows], layout=torch.jagged)


@pytest.mark.parametrize(("items", "elements"), [(8, 4096), (4096, 64)], ids=["slots-bound", "pool-bound"])
def test_one_pinned_sample_does_not_grow_the_field_with_every_put(items: int, elements: int) -> None:
    s = FieldStore("responses", torch.int64, 2, PoolLadder(items, elements))
    s.put([0], pack_column(_rows([[7, 7, 7]]), 1))  # kept for the whole run
    g = 1
    for _ in range(300):  # 600 samples put and cleared: 75x the slots, about 37x the pool
        s.put([g, g + 1], pack_column(_rows([[g] * 4, [g + 1] * 4]), 2))
        s.clear([g])
        s.clear([g + 1])
        g += 2
    s.put([g, g + 1], pack_column(_rows([[1, 2], [3]]), 2))
    assert (s.storage.capacity, s.storage.ragged_capacity) == (items, elements), s.migrations
    assert s.migrations == []  # compactions within the same rungs are no moves to a larger placement
    assert len(s) == 3
    assert [r.tolist() for r in unpack_column(s.get([g + 1, 0, g])).unbind()] == [[3], [7, 7, 7], [1, 2]]


def test_a_compaction_the_put_rolls_back_leaves_the_field_as_it_was() -> None:
    """An append that compacted the field and is rolled back leaves the old store, every sample readable."""
    s = FieldStore("responses", torch.int64, 2, PoolLadder(8, 64))
    s.put(list(range(8)), pack_column(_rows([[g] * (1 + g % 3) for g in range(8)]), 8))
    s.clear(list(range(1, 7)))  # out of order: sample 0 pins the ring, every slot is taken
    before = s.storage
    appended = s.append([8, 9], pack_column(_rows([[8], [9, 9]]), 2))
    assert s.storage is not before and s.storage.capacity == 8  # compacted within the same rung
    s.rollback(appended)
    assert s.storage is before and len(s) == 2
    assert [r.tolist() for r in unpack_column(s.get([7, 0])).unbind()] == [[7, 7], [0]]
    s.put([8, 9], pack_column(_rows([[8], [9, 9]]), 2))
    assert [r.tolist() for r in unpack_column(s.get([9, 0, 8, 7])).unbind()] == [[9, 9], [0], [8], [7, 7]]
