"""``ColumnarStorage.truncate`` forgets the newest items "as if they had never been appended": their ragged pool
space must be free for the next append, not only once the pool wraps.

The pool's head stayed past the forgotten elements, so the next append that did not fit before the pool's end had to
wrap to its start, over the oldest live item: refused where eviction is not allowed (a distributed shard, an
on-policy buffer), or evicting an item the pool had room for. A failed multi-shard ingestion truncates the shards
that stored their part, so one refused batch left the shards unable to take a batch that fit.
"""

from __future__ import annotations

import torch
from conduit import ExperienceBatch, ExperienceSchema, Field, Ragged
from conduit.storage.columnar import ColumnarStorage

TOK = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))


def _batch(ids: list[int], length: int) -> ExperienceBatch:
    n = len(ids)
    return ExperienceBatch({"id": torch.tensor(ids, dtype=torch.int64),
                            "tok": Ragged(torch.arange(n * length, dtype=torch.int64) + 1000 * ids[0],
                                          torch.full((n,), length, dtype=torch.int64))}, n)


def test_truncated_elements_are_free_for_the_next_append_without_evicting():
    st = ColumnarStorage(TOK, 8, ragged_capacity=500)
    st.append(_batch([0], 2))
    st.append(_batch([1, 2], 200))
    st.truncate(1)  # forget items 1 and 2
    res = st.append(_batch([3], 200), evict=False)  # 202 of 500 elements: fits without evicting item 0
    assert (res.first, res.evicted_from, res.evicted_to) == (1, 0, 0)
    got = st.gather(torch.tensor([0, 1]))
    assert got["id"].tolist() == [0, 3]
    assert got["tok"].values.tolist() == list(range(2)) + list(range(3000, 3200))


def test_truncating_part_of_a_batch_keeps_the_rest_and_frees_the_rest_of_its_elements():
    st = ColumnarStorage(TOK, 8, ragged_capacity=500)
    st.append(_batch([0, 1, 2], 100))
    st.truncate(2)  # item 2's 100 elements are free again
    st.append(_batch([5], 300), evict=False)
    got = st.gather(torch.tensor([0, 1, 2]))
    assert got["id"].tolist() == [0, 1, 5]
    assert got["tok"].values.tolist() == list(range(200)) + list(range(5000, 5300))
