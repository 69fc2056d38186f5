"""The multi-node tier's parts that need no cluster: the global index, the shard plan, the wire format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import CapacityError, ExperienceBatch, ExperienceSchema, Field, OnPolicy, Ragged, Replay
from conduit.distributed.errors import ClusterError
from conduit.distributed.index import ShardIndex
from conduit.distributed.links import LinkProfile
from conduit.distributed.plan import ShardPlan
from conduit.distributed.wire import from_wire, to_wire, wire_rows
from conduit.placement import LinkCost
from conduit.testing.reference import ID_SCHEMA

A, B, L = "node-a", "node-b", "learner"


def _profile(same_gbps: float = 5.0, cross_gbps: float = 0.1) -> LinkProfile:
    prof = LinkProfile(learner_node=L)
    for s in (A, B, L):
        for d in (A, B, L):
            prof.links[(s, d)] = LinkCost.constant(same_gbps if s == d else cross_gbps, overhead_us=1000)
    return prof


# -- the index ---------------------------------------------------------------------------------------
def _index(capacity: int = 100, replication: int = 1) -> ShardIndex:
    return ShardIndex(ID_SCHEMA, capacity, replication)


def test_index_maps_handles_to_shards_and_local_handles():
    ix = _index()
    r = ix.reserve(30, evict=True)
    ix.add_segment(r.first, 20, [(0, 0)])
    ix.add_segment(r.first + 20, 10, [(1, 0)])
    r = ix.reserve(5, evict=True)
    ix.add_segment(r.first, 5, [(0, 20)])
    h = np.array([0, 19, 20, 29, 30, 34])
    shard, local = ix.replicas(ix.segments_of(h), h)
    assert shard[:, 0].tolist() == [0, 0, 1, 1, 0, 0]
    assert local[:, 0].tolist() == [0, 19, 0, 9, 20, 24]
    assert len(ix) == 35 and ix.live_handles().tolist() == list(range(35))


def test_index_fifo_eviction_trims_segments_and_moves_release_points():
    ix = _index(capacity=10)
    for shard in (0, 1, 0):
        r = ix.reserve(5, evict=True)
        ix.add_segment(r.first, 5, [(shard, 0 if r.first < 10 else 5)])
    assert (ix.oldest, ix.next_handle) == (5, 15)
    assert ix.needed_from(1) == 0 and ix.needed_from(0) == 5  # shard 0's first segment is evicted
    assert ix.needed_from(1, oldest=8) == 3
    assert ix.needed_from(2) is None
    with pytest.raises(CapacityError):
        ix.reserve(11, evict=True)
    with pytest.raises(CapacityError):
        ix.reserve(1, evict=False)
    assert (ix.oldest, ix.next_handle) == (5, 15)


def test_index_holes_from_a_lost_shard_are_exact_and_age_out():
    ix = _index(capacity=20, replication=2)
    r = ix.reserve(10, evict=True)
    ix.add_segment(r.first, 6, [(0, 0), (1, 0)])
    ix.add_segment(r.first + 6, 4, [(1, 6)])
    lost, recovered, under = ix.drop_shard(1)
    assert lost.tolist() == [6, 7, 8, 9] and recovered == 6 and len(under) == 1
    assert len(ix) == 6 and ix.live_handles().tolist() == list(range(6))
    assert ix.lost_mask(np.arange(10)).tolist() == [False] * 6 + [True] * 4
    assert ix.add_replica(under[0], 2, 100) and ix.segment(under[0])[2] == [(0, 0), (2, 100)]
    r = ix.reserve(20, evict=True)  # evicts everything, the hole included
    ix.add_segment(r.first, 20, [(0, 6)])
    assert len(ix) == 20 and ix.lost_in_window() == 0


def test_core_semantics_run_unchanged_on_the_index():
    """Replay and on-policy semantics bind to the index like to any storage (global handles)."""
    ix = _index(capacity=50)
    sem = Replay(seed=0)
    sem.bind(ix)
    sem.on_append(ix.reserve(30, evict=True), version=None, priorities=None)
    sel = sem.select(1000)
    assert set(sel.info.handles.tolist()) == set(range(30))
    ix2 = _index(capacity=50)
    on = OnPolicy(num_minibatches=3, num_epochs=1, seed=0)
    on.bind(ix2)
    on.on_append(ix2.reserve(12, evict=False), version=0, priorities=None)
    on.seal()
    got = []
    for _ in range(3):
        s = on.select()
        got += s.info.handles.tolist()
        on.after_gather(s)
    assert sorted(got) == list(range(12)) and len(ix2) == 0


# -- the plan ----------------------------------------------------------------------------------------
def test_plan_keeps_small_batches_on_the_producers_node():
    plan = ShardPlan([L, A, B], L, links=_profile(), reuse=8.0)
    assert plan.order(A, 1000)[0] == 1 and plan.order(B, 1000)[0] == 2 and plan.order(L, 1000)[0] == 0


def test_plan_moves_large_batches_by_measured_bandwidth_and_reuse():
    big = 64 << 20
    assert ShardPlan([L, A], L, links=_profile(), reuse=8.0).order(A, big)[0] == 0  # pull to the learner
    assert ShardPlan([L, A], L, links=_profile(), reuse=1.0).order(A, big)[0] == 1  # a tie: stay local
    assert ShardPlan([L, A], L, links=_profile(), reuse=0.5).order(A, big)[0] == 1  # cheaper to stay
    # no measurement: node crossings, weighted by reuse
    assert ShardPlan([L, A], L, reuse=8.0).order(A, big) == [0, 1]
    assert ShardPlan([L, A], L, reuse=1.0).order(A, big) == [1, 0]


def test_plan_split_fills_by_room_and_puts_replicas_on_distinct_nodes():
    plan = ShardPlan([A, A, B], L, reuse=1.0)
    chunks, missing = plan.split(10, A, 100, {0: 6, 1: 4, 2: 10}, 2)
    assert missing == 0
    assert sum(c.count for c in chunks) == 10
    for c in chunks:
        nodes = [plan.shard_nodes[s] for s in c.shards]
        assert len(nodes) == 2 and len(set(nodes)) == 2
    rows = sorted((c.start, c.count) for c in chunks)
    assert rows[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    chunks, missing = plan.split(5, A, 100, {0: 5, 1: 5}, 2)  # only node A has room: one copy each
    assert missing == 5 and all(len(c.shards) == 1 for c in chunks)
    chunks, missing = plan.split(10, A, 100, {0: 4, 1: 3, 2: 10}, 2)  # 17 slots for 20 copies
    assert missing == 3 and sum(c.count for c in chunks) == 10
    with pytest.raises(ClusterError):
        plan.split(20, A, 100, {0: 4, 1: 3, 2: 10}, 1)


# -- the wire format ---------------------------------------------------------------------------------
def test_wire_round_trip_shares_memory_and_carries_dtypes_numpy_lacks():
    schema = ExperienceSchema(x=Field((3,), torch.bfloat16), tok=Field((), torch.int64, ragged=True),
                              done=Field((), torch.bool))
    b = ExperienceBatch({"x": torch.randn(4, 3).to(torch.bfloat16),
                         "tok": Ragged(torch.arange(10), torch.tensor([1, 2, 3, 4])),
                         "done": torch.tensor([True, False, True, False])}, 4)
    cols = to_wire(b, schema)
    back = from_wire(cols, schema)
    back.validate(schema)
    assert torch.equal(back.tensor("x"), b.tensor("x")) and torch.equal(back.tensor("done"), b.tensor("done"))
    assert torch.equal(back["tok"].values, b["tok"].values)
    assert back.tensor("done").data_ptr() == b.tensor("done").data_ptr()  # no copy on either side
    part = wire_rows(cols, 1, 2, schema)
    assert part["tok"].lengths.tolist() == [2, 3] and part["tok"].values.tolist() == [1, 2, 3, 4, 5]


# -- outcomes of remote calls ------------------------------------------------------------------------------
def test_an_outcome_whose_argument_was_lost_blames_no_callee():
    """A call that failed because an object it took was lost (Ray's ObjectLostError and its kinds, as a copy's append
    gets when the source's node died after the read) is neither a lost callee nor an unconfirmed one; other failures
    are not argument losses."""
    exc = pytest.importorskip("ray.exceptions")
    from conduit.distributed._ray import Outcome, _classify

    ray = pytest.importorskip("ray")
    for err in (exc.ObjectLostError("ab" * 14, None, ""), exc.ObjectReconstructionFailedError("ab" * 14, None, "")):
        o = _classify(ray, err)
        assert o.argument_lost and not o.lost and not o.unconfirmed and not o.ok
    assert not Outcome(error=TimeoutError("no answer"), lost=True).argument_lost
    assert not Outcome(error=CapacityError("full")).argument_lost
    assert not Outcome(value=1).argument_lost
