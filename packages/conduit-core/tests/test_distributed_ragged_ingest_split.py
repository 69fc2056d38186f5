"""A ragged batch that fits the shards' pools only spread over several of them is ingested, not refused.

An ingestion sent each producer's rows as one append per shard the plan chose; a shard whose ragged pool cannot
hold the whole run refuses it, and so did every other shard: ``ClusterError`` for a batch whose elements fit the
live pools together (e.g. 4 items x 200 elements into 2 shards of ``ragged_capacity=500``). The rows now go in
runs that each fit one pool, as a checkpoint load sends them. Most tests use the in-process harness of
``test_distributed_bookkeeping``; the last two run on the real two-node cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, OnPolicy, PrioritizedSampler, Replay
from conduit.distributed.errors import ClusterError
from conduit.distributed.experience import stage
from conduit.distributed.plane import DistributedDataPlane

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import RAGGED, _plane, _ragged_batch, fake_ray  # noqa: E402, F401, I001

pytestmark = pytest.mark.timeout(300)


def _shards(p: DistributedDataPlane) -> set[int]:
    return {s for r in p.index.live_rows() for s, _ in p.index.segment(r)[2]}


def _delivered_rollout(p: DistributedDataPlane, length: int) -> list[int]:
    """Seal the open rollout and deliver it to its last minibatch; the ids delivered, sorted (each item's sequence
    is checked to be ``length`` long)."""
    p.seal()
    seen: list[int] = []
    while True:
        batch, info = p.deliver()
        assert batch["tok"].lengths.tolist() == [length] * batch.batch_size
        seen += batch["id"].tolist()
        if info.last:
            return sorted(seen)


def _check_exact(p: DistributedDataPlane, ids: list[int], length: int) -> None:
    got = p.read(p.live_handles())
    want = _ragged_batch(ids, length)
    assert got["id"].tolist() == ids and len(p) == len(ids) and not p.lost_items
    assert got["tok"].values.tolist() == want["tok"].values.tolist()
    assert got["tok"].lengths.tolist() == want["tok"].lengths.tolist()


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("nodes,pool,n,length", [(["a", "b"], 500, 4, 200), (["a", "b", "c"], 250, 6, 100),
                                                 (["a", "b", "c"], 300, 9, 100)])
def test_a_replay_ingestion_that_fits_only_spread_over_the_pools_stores_every_item(nodes, pool, n, length):
    p = _plane(nodes, schema=RAGGED, capacity=n, ragged_capacity=pool)
    handles = p.ingest(_ragged_batch(list(range(n)), length))
    assert handles is not None and handles.tolist() == list(range(n))
    _check_exact(p, list(range(n)), length)
    assert len(_shards(p)) > 1, "spread over the shards"
    batch, _ = p.deliver(16)  # replay draws over every shard
    assert set(batch["id"].tolist()) <= set(range(n))


@pytest.mark.usefixtures("fake_ray")
def test_an_on_policy_ingestion_that_fits_only_spread_over_the_pools_is_delivered_exactly_once():
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=500,
               semantics=OnPolicy(num_minibatches=2, num_epochs=1, seed=0))
    p.ingest(_ragged_batch([0, 1, 2, 3], 200), version=0)
    _check_exact(p, [0, 1, 2, 3], 200)
    assert _delivered_rollout(p, 200) == [0, 1, 2, 3] and len(p) == 0


@pytest.mark.usefixtures("fake_ray")
def test_a_full_replay_buffer_evicts_fifo_for_a_batch_that_fits_only_spread():
    """The old items sit on the learner's shard; the new batch evicts them all and spreads over both pools."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=500)
    p.ingest(_ragged_batch([0, 1, 2, 3], 100))
    p.ingest(_ragged_batch([10, 11], 200))  # evicts 0, 1 (FIFO)
    assert p.read(p.live_handles())["id"].tolist() == [2, 3, 10, 11]
    p.ingest(_ragged_batch([20, 21, 22, 23], 200))
    _check_exact(p, [20, 21, 22, 23], 200)
    assert p.index.oldest == 6


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("nodes,n,least", [(["a", "b", "c"], 3, 5), (["a", "b"], 4, 4), (["a", "b", "c"], 6, 6)])
def test_replication_2_stores_every_item_once_then_copies_what_the_pools_hold(nodes, n, least):
    """Pools of 500 holding every item (200 elements) once, not always twice. The plan places copies by item
    slots, blind to the pools: the copies of the first runs would take the room later runs need, so every item is
    stored once first, then copied where room is left; the copies missing are counted in under_replicated."""
    p = _plane(nodes, schema=RAGGED, capacity=n, ragged_capacity=500, replication=2)
    p.ingest(_ragged_batch(list(range(n)), 200))
    _check_exact(p, list(range(n)), 200)
    for r in p.index.live_rows():
        reps = p.index.segment(r)[2]
        assert len({p.shard_node(s) for s, _ in reps}) == len(reps), "copies on distinct nodes"
    copies = sum(c * len(reps) for c, reps in (p.index.segment(r)[1:] for r in p.index.live_rows()))
    assert copies >= least and p.under_replicated == 2 * n - copies


@pytest.mark.usefixtures("fake_ray")
def test_replication_2_of_a_batch_that_fits_one_pool_keeps_both_copies():
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=500, replication=2)
    p.ingest(_ragged_batch([0, 1], 200))
    assert [len(p.index.segment(r)[2]) for r in p.index.live_rows()] == [2] and p.under_replicated == 0


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("replication", [1, 2])
def test_a_batch_larger_than_the_pools_together_stores_none_of_it(replication):
    """All or nothing: runs that some shards stored before the others refused are taken back (no eviction
    needed: the buffer keeps its item)."""
    nodes = ["a", "b"] if replication == 1 else ["a", "b", "c"]
    p = _plane(nodes, schema=RAGGED, capacity=16, ragged_capacity=500, replication=replication)
    p.ingest(_ragged_batch([100], 2))
    with pytest.raises(ClusterError, match="ragged_capacity"):
        p.ingest(_ragged_batch(list(range(8)), 200))  # 1600 elements, the pools hold 500 each
    _check_exact(p, [100], 2)
    assert p.index.next_handle == 1
    p.ingest(_ragged_batch([101, 102], 200))  # the room the failed ingestion used is free again
    assert p.read(p.live_handles())["id"].tolist() == [100, 101, 102]


def _partly_filled(p: DistributedDataPlane, length: int, **kw: Any) -> None:
    """Put one item of ``length`` elements (ids 100, 101, ...) in each shard's pool, from that shard's node."""
    for i, s in enumerate(p.alive_shards):
        p.ingest(_ragged_batch([100 + i], length), node=p.shard_node(s), **kw)
    assert len(_shards(p)) == len(p.alive_shards), "one item on each shard"


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("replication", [1, 2])
def test_a_replay_batch_that_fits_the_partly_filled_pools_only_in_smaller_runs_is_stored_in_order(replication):
    """The runs were sized to empty pools: 5 items x 100 elements made one run of 500, which both pools of 500,
    holding 150 elements each, refused whole: ClusterError "No live shard can take the items" with 700 elements
    free. A run every shard refuses for room is halved and sent again; every item is stored once, in order."""
    nodes = ["a", "b"] if replication == 1 else ["a", "b", "c"]
    p = _plane(nodes, schema=RAGGED, capacity=16, ragged_capacity=500, replication=replication)
    _partly_filled(p, 150)
    old = p.read(p.live_handles())["id"].tolist()
    p.ingest(_ragged_batch(list(range(5)), 100))
    got = p.read(p.live_handles())
    assert got["id"].tolist() == old + [0, 1, 2, 3, 4] and len(p) == len(old) + 5 and not p.lost_items
    assert got["tok"].values[-500:].tolist() == list(range(500))
    assert got["tok"].lengths.tolist() == [150] * len(old) + [100] * 5
    copies = sum(c * len(reps) for c, reps in (p.index.segment(r)[1:] for r in p.index.live_rows()))
    assert p.under_replicated == replication * len(p) - copies


@pytest.mark.usefixtures("fake_ray")
def test_an_on_policy_batch_that_fits_the_partly_filled_pools_only_in_smaller_runs_is_delivered_exactly_once():
    p = _plane(["a", "b"], schema=RAGGED, capacity=8, ragged_capacity=500,
               semantics=OnPolicy(num_minibatches=2, num_epochs=1, seed=0))
    _partly_filled(p, 150, version=0)
    p.ingest(_ragged_batch([0, 1, 2, 3, 4], 100), version=0)
    assert p.read(p.live_handles())["id"].tolist() == [100, 101, 0, 1, 2, 3, 4]
    p.seal()
    seen: list[int] = []
    while True:
        batch, info = p.deliver()
        seen += batch["id"].tolist()
        if info.last:
            break
    assert sorted(seen) == [0, 1, 2, 3, 4, 100, 101] and len(p) == 0


@pytest.mark.usefixtures("fake_ray")
def test_a_batch_that_does_not_fit_the_partly_filled_pools_even_in_single_items_stores_none_of_it():
    """Halving stops at single items: 4 x 200 elements into two on-policy pools of 500 with 150 used each (350
    free: one item each) is refused, typed, and leaves the buffer as it was (its room free again). A replay buffer
    evicts the oldest items for the room instead (each pool then holds its two items of 200 once compacted)."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=16, ragged_capacity=500,
               semantics=OnPolicy(num_minibatches=1, seed=0))
    _partly_filled(p, 150, version=0)
    with pytest.raises(ClusterError, match="ragged_capacity"):
        p.ingest(_ragged_batch([0, 1, 2, 3], 200), version=0)
    assert p.read(p.live_handles())["id"].tolist() == [100, 101] and p.index.next_handle == 2 and len(p) == 2
    p.ingest(_ragged_batch([0, 1], 200), version=0)
    assert p.read(p.live_handles())["id"].tolist() == [100, 101, 0, 1] and not p.lost_items
    replay = _plane(["a", "b"], schema=RAGGED, capacity=16, ragged_capacity=500)
    _partly_filled(replay, 150)
    replay.ingest(_ragged_batch([0, 1, 2, 3], 200))
    assert replay.read(replay.live_handles())["id"].tolist() == [0, 1, 2, 3] and not replay.lost_items


def _single_node_ids(lengths: list[int], capacity: int, pool: int) -> list[int]:
    """The ids a single-node replay buffer holds after ingesting one item of each length (ids 0, 1, ...)."""
    single = ExperienceDataPlane(RAGGED, capacity=capacity, ragged_capacity=pool)
    for i, length in enumerate(lengths):
        single.ingest(_ragged_batch([i], length))
    handles = torch.arange(single.storage.oldest, single.storage.next_handle)
    return single.storage.gather(handles % capacity)["id"].tolist()


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("replication", [1, 2])
def test_a_replay_buffer_whose_pools_are_full_evicts_the_oldest_items_over_the_union(replication):
    """Items of 4 elements into pools of 8 (two items each) with free slots: an item no pool had room for was
    refused (ClusterError "No live shard can take the items"), and every later one, while a single-node replay
    buffer evicts the oldest items for pool room. Now the oldest items go, FIFO over the union of the shards: the
    buffer holds what a single-node one with the pools' room holds, evicted items leave the priority total, and
    with replication=2 copies go where the pools leave room (short ones counted in ``under_replicated``), as for
    any batch too large for one pool."""
    nodes = ["a", "b"] if replication == 1 else ["a", "b", "c"]
    p = _plane(nodes, schema=RAGGED, capacity=16, shard_capacity=11, ragged_capacity=8, replication=replication,
               semantics=Replay(PrioritizedSampler(alpha=1.0, beta=0.0)))
    for i in range(9):
        p.ingest(_ragged_batch([i], 4), node=nodes[i % 2], priorities=torch.tensor([float(i + 1)]))
        live = p.live_handles().tolist()
        assert live == list(range(i + 1 - len(live), i + 1)), f"after item {i}: the newest items, FIFO"
        assert len(live) >= min(i + 1, 4 if replication == 1 else 3), f"after item {i}: room left unused"
    if replication == 1:
        assert live == _single_node_ids([4] * 9, 16, 16) == [5, 6, 7, 8]
    got = p.read(p.live_handles())
    assert got["id"].tolist() == live and got["tok"].values.tolist() == [0, 1, 2, 3] * len(live)
    assert len(p) == len(live) and not p.lost_items
    reps = [p.index.segment(r)[2] for r in p.index.live_rows()]
    assert all(1 <= len(r) <= replication and len({s for s, _ in r}) == len(r) for r in reps), reps
    tree = p.semantics.sampler._tree
    gone = live[0]
    assert tree.get(np.arange(gone)).tolist() == [0.0] * gone, "evicted items leave the priority total"
    assert tree.total == pytest.approx(sum(range(gone + 1, 10)))


@pytest.mark.usefixtures("fake_ray")
def test_a_replay_batch_that_fits_no_empty_pool_is_refused_before_anything_is_evicted():
    """An item longer than a pool, or more elements than the empty pools hold together, can never be stored:
    refused typed, with the buffer unchanged (no item evicted for it)."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=16, ragged_capacity=8)
    p.ingest(_ragged_batch([0, 1, 2, 3], 4))
    for bad in (_ragged_batch([10], 9), _ragged_batch([10, 11, 12, 13, 14], 4)):
        with pytest.raises(ClusterError, match="ragged_capacity"):
            p.ingest(bad)
        _check_exact(p, [0, 1, 2, 3], 4)
        assert p.index.oldest == 0 and p.index.next_handle == 4


@pytest.mark.slow
def test_real_cluster_a_batch_that_fits_the_partly_filled_pools_only_in_smaller_runs_is_ingested(cluster, servers):
    """On the real two-node cluster: both pools of 500 hold 150 elements; 5 items x 100 from the worker node (a
    run of 500 each pool refuses) are stored in order. A staged
    ExperienceRef (whose lengths the learner does not see: one run) of 4 x 200 is halved the same way. Then 4 x 200
    more fit only once the oldest items go: replay evicts them (FIFO)."""
    kw = {"servers": servers, "measure": False, "health_period": None, "ragged_capacity": 500}
    p = DistributedDataPlane(RAGGED, capacity=16, **kw)
    staged = DistributedDataPlane(RAGGED, capacity=8, **kw)
    try:
        staged.ingest(stage(_ragged_batch([0, 1, 2, 3], 200), RAGGED))
        _check_exact(staged, [0, 1, 2, 3], 200)
        _partly_filled(p, 150)
        p.ingest(_ragged_batch(list(range(5)), 100), node=cluster.workers[0])
        got = p.read(p.live_handles())
        assert got["id"].tolist() == [100, 101, 0, 1, 2, 3, 4] and not p.lost_items
        assert got["tok"].values[-500:].tolist() == list(range(500))
        # (replay: the full pools evict the oldest items, FIFO, for 4 x 200; the batch was refused before)
        p.ingest(_ragged_batch([10, 11, 12, 13], 200))
        ids = p.read(p.live_handles())["id"].tolist()
        order = [100, 101, 0, 1, 2, 3, 4, 10, 11, 12, 13]
        assert ids == order[len(order) - len(ids):] and ids[:1] != [100] and not p.lost_items, ids
    finally:
        p.close()
        staged.close()


@pytest.mark.slow
def test_real_cluster_a_batch_that_fits_only_spread_over_both_nodes_is_ingested(cluster, servers):
    """On the real two-node cluster: replay and on-policy buffers store 4 items x 200 elements in two pools of
    500, from either node, exactly; with replication=2 (both copies do not fit) every item is stored once, and a
    batch larger than both pools together stores none of it."""
    kw = {"servers": servers, "measure": False, "health_period": None, "ragged_capacity": 500}
    replay = DistributedDataPlane(RAGGED, capacity=4, **kw)
    on_policy = DistributedDataPlane(RAGGED, capacity=4, semantics=OnPolicy(num_minibatches=2, seed=0), **kw)
    replicated = DistributedDataPlane(RAGGED, capacity=8, replication=2, **kw)
    try:
        replay.ingest(_ragged_batch([0, 1, 2, 3], 200), node=cluster.workers[0])
        _check_exact(replay, [0, 1, 2, 3], 200)
        assert len(_shards(replay)) == 2
        replay.ingest(_ragged_batch([4, 5], 200))  # evicts 0, 1 (FIFO)
        assert replay.read(replay.live_handles())["id"].tolist() == [2, 3, 4, 5] and not replay.lost_items
        on_policy.ingest(_ragged_batch([0, 1, 2, 3], 200), version=0)
        _check_exact(on_policy, [0, 1, 2, 3], 200)
        assert _delivered_rollout(on_policy, 200) == [0, 1, 2, 3]
        replicated.ingest(_ragged_batch([100], 2))
        with pytest.raises(ClusterError, match="ragged_capacity"):
            replicated.ingest(_ragged_batch(list(range(5)), 200))
        _check_exact(replicated, [100], 2)
        replicated.ingest(_ragged_batch([0, 1, 2, 3], 200))  # the room the refused batch used is free again
        assert replicated.read(replicated.live_handles())["id"].tolist() == [100, 0, 1, 2, 3]
        assert not replicated.lost_items and replicated.under_replicated == 4
    finally:
        replay.close()
        on_policy.close()
        replicated.close()


@pytest.mark.slow
def test_real_cluster_a_replay_buffer_whose_pools_are_full_evicts_the_oldest_items(cluster, servers):
    """On the real two-node cluster: items of 4 elements from either node into pools of 8 with free slots (the
    fifth was refused, and every later one), and a staged ExperienceRef (whose lengths only the shards see): the
    oldest items are evicted, FIFO over both shards, as a single-node replay buffer evicts for pool room."""
    p = DistributedDataPlane(RAGGED, capacity=16, servers=servers, measure=False, health_period=None,
                             ragged_capacity=8)
    try:
        nodes = [cluster.head, cluster.workers[0]]
        for i in range(7):
            p.ingest(_ragged_batch([i], 4), node=nodes[i % 2])
        p.ingest(stage(_ragged_batch([7], 4), RAGGED))
        got = p.read(p.live_handles())
        assert got["id"].tolist() == [4, 5, 6, 7] == _single_node_ids([4] * 8, 16, 16)
        assert got["tok"].values.tolist() == [0, 1, 2, 3] * 4 and len(p) == 4 and not p.lost_items
        assert p.index.oldest == 4 and len(_shards(p)) == 2
    finally:
        p.close()
