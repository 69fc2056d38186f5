"""A shard whose ragged pool has room for a write's rows in total, but split, compacts it instead of refusing.

A shard's pool is a ring: rows go at its head, or at its start when they do not fit before its end. After
evictions and a write's earlier rows (which the write never evicts), the free elements could lie in two pieces,
e.g. a pool of 8 holding the write's 2 elements at 5..7: a row of 6 found its free tail too short and its start
taken, and the write was refused (``ClusterError``, after evicting the oldest items), though the emptied pools hold
the batch. The shard now packs its live items at the pool's start first (``ColumnarStorage.compact``) and stores
the rows; items keep their handles and contents. The first tests use the in-process harness of
``test_distributed_bookkeeping``; the last runs on the real two-node cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conduit import ExperienceBatch, Ragged
from conduit.distributed.plane import DistributedDataPlane
from conduit.storage.columnar import ColumnarStorage

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import RAGGED, _plane, fake_ray  # noqa: E402, F401, I001

pytestmark = pytest.mark.timeout(300)


def _batch(ids: list[int], lengths: list[int], first: int = 0) -> ExperienceBatch:
    total = sum(lengths)
    return ExperienceBatch({"id": torch.tensor(ids, dtype=torch.int64),
                            "tok": Ragged(torch.arange(first, first + total, dtype=torch.int64),
                                          torch.tensor(lengths, dtype=torch.int64))}, len(ids))


def test_compacting_a_split_pool_keeps_every_item_and_makes_one_free_block():
    s = ColumnarStorage(RAGGED, 8, ragged_capacity=8)
    s.append(_batch([0, 1], [3, 2]))
    s.append(_batch([2], [2], first=100))  # elements 5..6: free are 7 and 0..2 once item 0 goes
    s.release(1)
    b = _batch([3], [4], first=200)
    assert s.evictions_if_compacted(b) == 0
    with pytest.raises(Exception, match="ragged_capacity"):
        s.append(b, evict=False)  # split: the tail holds 1 element, the start 3
    s.compact()
    s.append(b, evict=False)
    got = s.gather(torch.arange(1, 4))
    assert got["id"].tolist() == [1, 2, 3] and got["tok"].lengths.tolist() == [2, 2, 4]
    assert got["tok"].values.tolist() == [3, 4, 100, 101, *range(200, 204)]
    assert s.evictions_if_compacted(_batch([4], [1])) == 1  # the pool is full: the oldest item goes


def _fragmenting_write(p: DistributedDataPlane, producer: str, holders: list[str]) -> None:
    """An item of 5 elements on each shard (pools of 8), then items of 2, 6, 2 and 6: each shard refuses a run of
    2 + 6 (it needs the old item evicted), takes the 2 in its free tail, and then the 6 only compacted."""
    for i, node in enumerate(holders):
        p.ingest(_batch([i], [5]), node=node)
    p.ingest(_batch([10, 11, 12, 13], [2, 6, 2, 6]), node=producer)
    got = p.read(p.live_handles())
    assert got["id"].tolist() == [10, 11, 12, 13] and got["tok"].values.tolist() == list(range(16))
    assert len(p) == 4 and p.index.oldest == 2 and not p.lost_items


@pytest.mark.usefixtures("fake_ray")
def test_a_write_whose_own_rows_split_a_pool_is_stored_not_refused():
    _fragmenting_write(_plane(["a", "b"], schema=RAGGED, capacity=16, ragged_capacity=8), "a", ["a", "b"])


@pytest.mark.slow
def test_real_cluster_a_write_whose_own_rows_split_a_pool_is_stored(cluster, servers):
    p = DistributedDataPlane(RAGGED, capacity=16, servers=servers, measure=False, health_period=None,
                             ragged_capacity=8)
    try:
        _fragmenting_write(p, cluster.workers[0], [cluster.head, cluster.workers[0]])
    finally:
        p.close()
