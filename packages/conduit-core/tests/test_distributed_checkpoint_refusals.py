"""Checkpoints a :class:`~conduit.distributed.DistributedDataPlane` must refuse before it empties its shards.

A load reopens every live shard's partition before it stores the checkpoint's items, so anything that would stop
it part way must be found first: what got through before emptied the buffer and then raised a ``ClusterError``
("Loading stopped after 0 of the checkpoint's N items"), or loaded a window later calls overflowed on.

Most tests use the in-process harness of ``test_distributed_bookkeeping`` (real shard server bodies called
without Ray); the last two run the ragged refusals on the module's real local Ray cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import CapacityError, ConfigurationError, ExperienceBatch, ExperienceDataPlane, Ragged
from conduit.distributed.plane import DistributedDataPlane
from conduit.testing.reference import ID_SCHEMA, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import RAGGED, _ids, _plane, _ragged_batch, fake_ray  # noqa: E402, F401, I001

pytestmark = pytest.mark.timeout(300)


def _ragged_ids(plane: DistributedDataPlane) -> list[int]:
    return sorted(plane.read(plane.live_handles())["id"].tolist())


@pytest.mark.usefixtures("fake_ray")
def test_a_checkpoint_whose_columns_are_numpy_arrays_is_refused_typed_and_changes_nothing():
    """Columns converted to NumPy (e.g. to pickle them without torch) passed the check, which converted a copy,
    and the raw arrays then went to the shards after they were emptied: a ClusterError "Loading stopped after 0
    of the checkpoint's 6 items (AttributeError: 'numpy.ndarray' object has no attribute 'detach')", and the
    buffer's own items were gone. ExperienceDataPlane refuses such a checkpoint as damaged; so must this one."""
    p = _plane(["a", "b"], capacity=10)
    p.ingest(id_batch(np.arange(6)))
    state = p.state_dict()
    state["data"] = {k: v.numpy() for k, v in state["data"].items()}
    core = ExperienceDataPlane(ID_SCHEMA, capacity=10)
    with pytest.raises(ConfigurationError):  # the single-node buffer's answer to the same columns
        core.load_state_dict({**core.state_dict(), "storage": {**core.state_dict()["storage"], "data": state["data"],
                                                                "next": 6}})
    q = _plane(["a", "b"], capacity=10)
    q.ingest(id_batch(np.arange(100, 103)))
    with pytest.raises(ConfigurationError, match="damaged"):
        q.load_state_dict(state)
    assert _ids(q) == [100, 101, 102] and len(q) == 3 and not q.lost_items


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("start", [2**63, 2**64 + 3])
def test_a_checkpoint_whose_handles_lie_beyond_int64_is_refused_and_changes_nothing(start):
    """An (empty) window starting beyond int64 loaded: the buffer then held nothing and every ingestion raised an
    untyped OverflowError. ExperienceDataPlane refuses such handles as damaged; so must this one."""
    p = _plane(["a", "b"], capacity=10)
    state = {**p.state_dict(), "oldest": start, "next": start}
    q = _plane(["a", "b"], capacity=10)
    q.ingest(id_batch(np.arange(3)))
    with pytest.raises(ConfigurationError, match="damaged"):
        q.load_state_dict(state)
    assert _ids(q) == [0, 1, 2] and q.index.next_handle == 3
    assert q.ingest(id_batch(np.arange(3, 5))).tolist() == [3, 4]


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("case", ["total", "one_item"])
def test_a_ragged_checkpoint_larger_than_the_live_pools_is_refused_typed_and_changes_nothing(case):
    """A checkpoint of a buffer with larger ragged pools: its elements do not fit this buffer's live shards
    (in all, or one item larger than a pool). Only the item count was checked, so the shards were emptied, no
    shard could take the items, and the load raised ClusterError "Loading stopped after 0 of the checkpoint's 4
    items", the buffer's own items gone. ExperienceDataPlane raises CapacityError and keeps its items."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=1000)
    if case == "total":
        p.ingest(_ragged_batch([0, 1, 2, 3], 200))  # 800 elements, the pools hold 2 x 300
    else:
        p.ingest(_ragged_batch([0], 400))  # 400 elements, in all less than 2 x 300, but one item
    state = p.state_dict()
    q = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=300)
    q.ingest(_ragged_batch([10, 11], 2))
    with pytest.raises(CapacityError, match="ragged_capacity"):
        q.load_state_dict(state)
    assert _ragged_ids(q) == [10, 11] and len(q) == 2 and not q.lost_items and not q.losses
    # a buffer whose pools hold it loads it exactly
    r = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=1000)
    r.load_state_dict(state)
    got, want = r.read(r.live_handles()), p.read(p.live_handles())
    assert got["id"].tolist() == want["id"].tolist()
    assert got["tok"].values.tolist() == want["tok"].values.tolist()
    assert got["tok"].lengths.tolist() == want["tok"].lengths.tolist()


def _uneven_batch(lengths: list[int]) -> ExperienceBatch:
    n = len(lengths)
    return ExperienceBatch({"id": torch.arange(n, dtype=torch.int64),
                            "tok": Ragged(torch.arange(sum(lengths), dtype=torch.int64),
                                          torch.tensor(lengths, dtype=torch.int64))}, n)


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("lengths,fits", [([300, 300, 300], False), ([200, 400, 100, 300], True),
                                          ([100, 300, 300, 200], True), ([250, 251, 251, 200], False)])
def test_a_ragged_checkpoint_whose_items_cannot_be_packed_into_the_pools_is_refused_and_changes_nothing(lengths,
                                                                                                       fits):
    """3 items of 300 elements and 2 pools of 500: 900 elements fit 1000 in all, and no item is larger than a
    pool, so the check passed; but an item's elements stay in one pool and no pool holds two of them, so the load
    emptied the shards, then stopped: ClusterError "Loading stopped after 0 of the checkpoint's 3 items", the
    buffer's own items gone. The check packs the items (in row order, else first fit decreasing) and refuses,
    typed, before anything changes; checkpoints whose items can be packed still load exactly."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=10_000)
    p.ingest(_uneven_batch(lengths))
    state = p.state_dict()
    q = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=500)
    q.ingest(_ragged_batch([10, 11], 2))
    if not fits:
        with pytest.raises(CapacityError, match="packed"):
            q.load_state_dict(state)
        assert _ragged_ids(q) == [10, 11] and len(q) == 2 and not q.lost_items and not q.losses
        return
    q.load_state_dict(state)
    got, want = q.read(q.live_handles()), p.read(p.live_handles())
    assert got["id"].tolist() == want["id"].tolist() == list(range(len(lengths))) and not q.lost_items
    assert got["tok"].values.tolist() == want["tok"].values.tolist()
    assert got["tok"].lengths.tolist() == lengths


@pytest.mark.slow
def test_real_cluster_a_ragged_checkpoint_larger_than_the_live_pools_is_refused_and_changes_nothing(servers):
    """The ragged refusal above on a real two-node cluster: the buffer keeps its items and goes on; a buffer
    whose pools hold the checkpoint only spread over both nodes loads it exactly."""
    p = DistributedDataPlane(RAGGED, capacity=4, servers=servers, measure=False, health_period=None,
                             ragged_capacity=1000)
    q = DistributedDataPlane(RAGGED, capacity=4, servers=servers, measure=False, health_period=None,
                             ragged_capacity=300)
    r = DistributedDataPlane(RAGGED, capacity=4, servers=servers, measure=False, health_period=None,
                             ragged_capacity=500)
    try:
        p.ingest(_ragged_batch([0, 1, 2, 3], 200))
        state = p.state_dict()
        q.ingest(_ragged_batch([10, 11], 2))
        with pytest.raises(CapacityError, match="ragged_capacity"):
            q.load_state_dict(state)
        assert _ragged_ids(q) == [10, 11] and len(q) == 2 and not q.lost_items
        q.ingest(_ragged_batch([12], 2))
        assert _ragged_ids(q) == [10, 11, 12]
        r.load_state_dict(state)
        got, want = r.read(r.live_handles()), p.read(p.live_handles())
        assert got["id"].tolist() == want["id"].tolist() == [0, 1, 2, 3] and not r.lost_items
        assert got["tok"].values.tolist() == want["tok"].values.tolist()
    finally:
        p.close()
        q.close()
        r.close()


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("nodes,pool,n,length", [(["a", "b"], 500, 4, 200), (["a", "b", "c"], 250, 6, 100),
                                                 (["a", "b", "c"], 300, 9, 100)])
def test_a_ragged_checkpoint_that_fits_only_spread_over_the_shards_loads_exactly(nodes, pool, n, length):
    """The checkpoint's elements fit the live pools together, not in one: the load sent all its items to the
    learner's shard as one append, which that shard's pool refused whole, and so did every other shard: the
    shards emptied, then ClusterError "Loading stopped after 0 of the checkpoint's 4 items". The items are sent
    in runs that each fit a pool, so they spread over the shards and load exactly."""
    p = _plane(nodes, schema=RAGGED, capacity=n, ragged_capacity=10_000)
    p.ingest(_ragged_batch(list(range(n)), length))
    state = p.state_dict()
    q = _plane(nodes, schema=RAGGED, capacity=n, ragged_capacity=pool)
    q.ingest(_ragged_batch([100], 2))
    q.load_state_dict(state)
    got, want = q.read(q.live_handles()), p.read(p.live_handles())
    assert q.live_handles().tolist() == p.live_handles().tolist() and len(q) == n and not q.lost_items
    assert got["id"].tolist() == want["id"].tolist()
    assert got["tok"].values.tolist() == want["tok"].values.tolist()
    assert got["tok"].lengths.tolist() == want["tok"].lengths.tolist()
    assert len({s for r in q.index.live_rows() for s, _ in q.index.segment(r)[2]}) > 1, "spread over the shards"


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("pool", [400, 500, 700])
def test_a_replicated_ragged_checkpoint_whose_copies_do_not_all_fit_loads_every_item_once(pool):
    """replication=2, three shards whose pools hold one copy of the checkpoint's 1200 elements, not two. The plan
    places copies by item slots, so the first runs took two copies each and left no pool room for the last: the
    shards emptied, then ClusterError "Loading stopped after 0 of the checkpoint's 6 items". Every item is
    stored once first, then copied where room is left; the copies missing are counted in under_replicated."""
    nodes = ["a", "b", "c"]
    p = _plane(nodes, schema=RAGGED, capacity=6, ragged_capacity=10_000, replication=2)
    p.ingest(_ragged_batch(list(range(6)), 200))
    state = p.state_dict()
    q = _plane(nodes, schema=RAGGED, capacity=6, ragged_capacity=pool, replication=2)
    q.load_state_dict(state)
    got, want = q.read(q.live_handles()), p.read(p.live_handles())
    assert got["id"].tolist() == want["id"].tolist() == list(range(6)) and not q.lost_items
    assert got["tok"].values.tolist() == want["tok"].values.tolist()
    copies = sum(c * len(reps) for c, reps in (q.index.segment(r)[1:] for r in q.index.live_rows()))
    assert q.under_replicated == 12 - copies
    if pool == 700:  # a run of three items (600 elements) is copied where another pool has room for it
        assert copies > 6


@pytest.mark.slow
def test_real_cluster_a_ragged_checkpoint_whose_items_cannot_be_packed_is_refused_and_changes_nothing(servers):
    """The packing refusal above on a real two-node cluster: 3 items of 300 elements and two pools of 500."""
    kw = {"servers": servers, "measure": False, "health_period": None}
    p = DistributedDataPlane(RAGGED, capacity=4, ragged_capacity=10_000, **kw)
    q = DistributedDataPlane(RAGGED, capacity=4, ragged_capacity=500, **kw)
    try:
        p.ingest(_uneven_batch([300, 300, 300]))
        q.ingest(_ragged_batch([10, 11], 2))
        with pytest.raises(CapacityError, match="packed"):
            q.load_state_dict(p.state_dict())
        assert _ragged_ids(q) == [10, 11] and len(q) == 2 and not q.lost_items
        q.ingest(_ragged_batch([12], 2))
        assert _ragged_ids(q) == [10, 11, 12]
    finally:
        p.close()
        q.close()
