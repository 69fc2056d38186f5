"""The multi-node buffer, third review: exact capacity across shards, checkpoints taken or loaded while a
shard is lost, prefetched batches and losses, ``on_loss`` callbacks that close or raise, typed refusals and
loss reports.

Most tests use the in-process harness of ``test_distributed_bookkeeping`` (real shard server bodies, faults
injected at exact points); the last ones run the same behaviours on the module's real local Ray cluster.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import CapacityError, ConfigurationError, OnPolicy, PrioritizedSampler, PriorityError, Replay
from conduit.distributed.errors import ClusterError, ShardLostError
from conduit.distributed.index import ShardIndex
from conduit.distributed.plane import DistributedDataPlane
from conduit.distributed.servers import ShardServers
from conduit.scheduling import Overlapped
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import RAGGED, _ids, _plane, _ragged_batch, _servers, fake_ray  # noqa: E402, F401, I001

pytestmark = pytest.mark.timeout(300)


def _prioritized() -> Replay:
    return Replay(PrioritizedSampler(alpha=1.0))


# -- exact capacity across shards -------------------------------------------------------------------------
def test_the_index_needs_nothing_of_segments_an_ingestion_evicts_whole():
    """Two one-item segments on shard 0, both evicted by the next ingestion: nothing there is needed then
    (it said local handle 1, the end of the first evicted segment, so only one slot could be reused)."""
    ix = ShardIndex(ID_SCHEMA, 4, 1)
    ix.reserve(1, evict=True)
    ix.add_segment(0, 1, [(0, 0)])
    ix.reserve(1, evict=True)
    ix.add_segment(1, 1, [(0, 1)])
    ix.reserve(2, evict=True)
    ix.add_segment(2, 2, [(1, 0)])
    assert ix.needed_from(0, oldest=2) is None, "segments evicted whole by the window [2, ...) need no slot"
    assert ix.needed_from(0, oldest=1) == 1
    assert ix.needed_from(1, oldest=3) == 1


@pytest.mark.usefixtures("fake_ray")
def test_a_full_buffer_whose_shards_are_exactly_full_reuses_every_slot_it_evicts():
    """capacity 4 = 2 shards x 2 slots. Items 0 and 1 (two ingestions) fill shard 0, items 2 and 3 shard 1;
    ingesting two more from node a evicts 0 and 1, freeing both slots of shard 0. The ingestion failed with
    ClusterError "2 items do not fit in the live shards (room for 1)"."""
    p = _plane(["a", "b"], capacity=4, shard_capacity=2)
    p.ingest(id_batch(np.array([0])), node="a")
    p.ingest(id_batch(np.array([1])), node="a")
    p.ingest(id_batch(np.array([2, 3])), node="b")
    h = p.ingest(id_batch(np.array([4, 5])), node="a")
    assert h.tolist() == [4, 5]
    assert _ids(p) == [2, 3, 4, 5] and len(p) == 4, "FIFO: the two oldest items go, whichever shard held them"


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("replication,nodes", [(1, ["a", "b"]), (1, ["a", "b", "c"]), (2, ["a", "b"])])
def test_fifo_eviction_across_exactly_full_shards_keeps_the_newest_items(replication, nodes):
    """Random producers and batch sizes (zero included) into shards whose slots add up to exactly the
    capacity x replication: the buffer always holds the newest ``capacity`` items, oldest evicted first."""
    rng = np.random.default_rng(7)
    for capacity in (2, 3, 4, 6):
        shard_capacity = -(-capacity * replication // len(nodes))
        p = _plane(nodes, capacity=capacity, shard_capacity=shard_capacity, replication=replication)
        model: list[int] = []
        nxt = 0
        for step in range(30):
            n = int(rng.integers(0, capacity + 1))
            ids = list(range(nxt, nxt + n))
            nxt += n
            h = p.ingest(id_batch(np.array(ids, dtype=np.int64)), node=str(rng.choice(nodes)))
            assert h.shape == (n,)
            model = (model + ids)[-capacity:]
            assert _ids(p) == model, f"capacity {capacity}, step {step}: holds {_ids(p)}, expected {model}"
        p.close()


@pytest.mark.usefixtures("fake_ray")
def test_a_refusal_for_a_full_ragged_pool_says_to_raise_ragged_capacity():
    """On-policy (which never evicts unconsumed data): shard 0's slots are full; shard 1 has a free slot but its
    ragged pool is full, so it refuses the item and the retry finds no slot: the error said only "shard_capacity is
    too small. Raise shard_capacity or add shard servers", nothing about the pool."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, shard_capacity=2, ragged_capacity=8,
               semantics=OnPolicy(num_minibatches=1))
    p.ingest(_ragged_batch([0, 1], 1), node="a", version=0)
    p.ingest(_ragged_batch([2], 8), node="b", version=0)
    with pytest.raises(ClusterError, match="ragged_capacity"):
        p.ingest(_ragged_batch([3], 1), node="b", version=0)
    assert sorted(p.read(p.live_handles())["id"].tolist()) == [0, 1, 2] and len(p) == 3, "nothing changed"


@pytest.mark.usefixtures("fake_ray")
def test_a_replay_buffer_whose_pools_are_full_evicts_the_oldest_item_as_a_single_node_one_does():
    """Replay, the same buffer: the slots have room (3 of 4) but no shard can take the item, so the oldest item
    (0, on shard 0) is evicted, FIFO, and the new one stored there, as a single-node buffer evicts for pool room.
    The write was refused (ClusterError) for as long as the pools stayed full: the buffer took no new data."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, shard_capacity=2, ragged_capacity=8)
    p.ingest(_ragged_batch([0, 1], 1), node="a")
    p.ingest(_ragged_batch([2], 8), node="b")
    h = p.ingest(_ragged_batch([3], 1), node="b")
    assert h.tolist() == [3] and p.index.oldest == 1
    assert p.read(p.live_handles())["id"].tolist() == [1, 2, 3] and len(p) == 3 and not p.lost_items


# -- prioritized replay and lost shards -------------------------------------------------------------------
@pytest.mark.usefixtures("fake_ray")
def test_a_shard_lost_while_loading_keeps_the_items_it_had_loaded_out_of_the_priority_total():
    """A checkpoint taken while a shard was lost has a gap, so it loads in two writes. The learner's shard
    takes the first (items 0-3) and dies on the second: 0-3 are reported lost and the rest goes to the other
    shard. The load then restored the checkpoint's sum tree, giving 0-3 their priorities back (the total
    counted items that can never be drawn)."""
    p = _plane(["a", "b"], capacity=20, semantics=_prioritized())
    p.ingest(id_batch(np.arange(4)), node="a", priorities=torch.full((4,), 2.0))
    p.ingest(id_batch(np.arange(4, 8)), node="b", priorities=torch.full((4,), 3.0))
    p.ingest(id_batch(np.arange(8, 12)), node="a", priorities=torch.full((4,), 4.0))
    p._lose(1, "test")
    state = p.state_dict()
    assert state["handles"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]

    q = _plane(["a", "b"], capacity=20, semantics=_prioritized())
    q.servers[0].actor.die_after_appends = 1
    q.load_state_dict(state)
    assert [r.lost.tolist() for r in q.losses] == [[0, 1, 2, 3]]
    assert q.live_handles().tolist() == [8, 9, 10, 11]
    tree = q.semantics.sampler._tree
    assert tree.total == pytest.approx(16.0), f"only items 8-11 (priority 4 each) are in the total, got {tree.total}"
    assert tree.get(np.arange(4)).tolist() == [0.0] * 4
    _, info = q.deliver(64)
    assert set(info.handles.tolist()) <= {8, 9, 10, 11}


def test_a_load_whose_payload_cannot_be_put_leaves_a_consistent_buffer(fake_ray, monkeypatch):  # noqa: F811
    """ray.put of the checkpoint failing (e.g. a full object store) after the shards were reopened raised the
    raw error with the old priorities restored over an empty index: the next ingestion's draws landed on
    slots of items that no longer exist ("the buffer's index and this shard disagree")."""
    p = _plane(["a", "b"], capacity=10, semantics=_prioritized())
    p.ingest(id_batch(np.arange(6)))
    state = p.state_dict()
    q = _plane(["a", "b"], capacity=10, semantics=_prioritized())
    q.ingest(id_batch(np.arange(100, 104)))

    def full(_):
        raise RuntimeError("object store full")

    put = fake_ray.put
    monkeypatch.setattr(fake_ray, "put", full)
    with pytest.raises(ClusterError, match="Loading stopped after 0 of the checkpoint's 6 items"):
        q.load_state_dict(state)
    monkeypatch.setattr(fake_ray, "put", put)
    assert len(q) == 0 and q.semantics.sampler._tree.total == 0.0
    h = q.ingest(id_batch(np.array([200, 201])))
    assert h.tolist() == [6, 7]
    batch, info = q.deliver(16)
    assert set(info.handles.tolist()) == {6, 7} and set(check_payload(batch).tolist()) == {200, 201}


@pytest.mark.usefixtures("fake_ray")
def test_a_checkpoint_loaded_with_fewer_live_nodes_than_replicas_counts_the_items_stored_short():
    """replication=2 and one of the two shards lost: an ingestion stores one copy and counts it in
    under_replicated, a load stored its 4 items with one copy each and counted none."""
    p = _plane(["a", "b"], capacity=10, replication=2)
    p.ingest(id_batch(np.arange(4)))
    state = p.state_dict()
    q = _plane(["a", "b"], capacity=10, replication=2)
    q._lose(1, "test")
    q.ingest(id_batch(np.arange(2)))
    assert q.under_replicated == 2
    q.load_state_dict(state)
    assert _ids(q) == [0, 1, 2, 3]
    assert q.under_replicated == 2 + 4, f"the 4 items loaded with one copy are not counted: {q.under_replicated}"


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("prioritized", [False, True])
def test_a_checkpoint_taken_while_a_shard_dies_leaves_its_items_out_and_loads_exactly(prioritized):
    """Shard 1 dies when the checkpoint reads its items: state_dict raised ShardLostError ("read
    live_handles() instead", though the caller passed no handles). Now the shard is lost as anywhere else
    and the checkpoint holds the survivors, which load back exactly (priorities included)."""
    p = _plane(["a", "b"], capacity=10, semantics=_prioritized() if prioritized else Replay())
    p.ingest(id_batch(np.arange(4)), node="a")
    p.ingest(id_batch(np.arange(4, 8)), node="b")
    victim = p.servers[1].actor
    call = victim.call

    def dies_on_gather(name, args):
        if name == "gather":
            victim.dead = True
        return call(name, args)

    victim.call = dies_on_gather
    state = p.state_dict()
    assert state["handles"].tolist() == [0, 1, 2, 3]
    assert [r.lost.tolist() for r in p.losses] == [[4, 5, 6, 7]]
    q = _plane(["a", "b"], capacity=10, semantics=_prioritized() if prioritized else Replay())
    q.load_state_dict(state)
    assert _ids(q) == [0, 1, 2, 3] and len(q) == 4
    assert q.deliver(8)[1].handles.tolist() == p.deliver(8)[1].handles.tolist(), "the same draws after the load"
    if prioritized:
        assert q.semantics.sampler._tree.total == pytest.approx(p.semantics.sampler._tree.total) == 4.0


# -- selections read after a shard was lost (coverage: these hold) ----------------------------------------
@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("replace", [True, False])
def test_replay_selections_read_after_their_shard_was_lost_are_redrawn_within_each_selection(replace):
    p = _plane(["a", "b"], capacity=20)
    p.ingest(id_batch(np.arange(6)), node="a")
    p.ingest(id_batch(np.arange(6, 12)), node="b")
    sels = p.select_now([5, 5, 5], replace=replace)
    p._lose(1, "test")
    batch = p.gather_now(sels, replace=replace)
    handles = [s.info.handles.tolist() for s in sels]
    assert check_payload(batch).tolist() == sum(handles, []), "rows in draw order, as the selections now say"
    assert all(h < 6 for hs in handles for h in hs), f"a lost item was delivered: {handles}"
    assert [s.slots.tolist() for s in sels] == handles  # (no wrap yet: slot == handle)
    if not replace:
        assert all(len(set(hs)) == len(hs) for hs in handles), f"repeats within a selection: {handles}"


@pytest.mark.usefixtures("fake_ray")
def test_on_policy_selections_read_after_a_shard_was_lost_keep_exactly_once():
    """Rollout of 8: items 0-3 on shard 0, 4-7 on shard 1; two minibatches (no shuffle) selected together,
    shard 1 lost, then read: the first keeps its items, the second (all lost, the epoch's and rollout's
    last) comes back empty with info.last, and the rollout is released."""
    p = _plane(["a", "b"], capacity=8, semantics=OnPolicy(num_minibatches=2, shuffle=False), reuse=0)
    p.ingest(id_batch(np.arange(4)), node="a", version=0)
    p.ingest(id_batch(np.arange(4, 8)), node="b", version=0)
    p.seal()
    sels = p.select_now([None, None])
    p._lose(1, "test")
    batch = p.gather_now(sels)
    assert check_payload(batch).tolist() == [0, 1, 2, 3]
    assert sels[0].info.handles.tolist() == [0, 1, 2, 3] and sels[1].info.handles.tolist() == []
    assert sels[1].info.last
    for s in sels:
        p.release_now(s)
    assert len(p) == 0 and p.index.oldest == 8, "the rollout (lost items included) is released"
    p.ingest(id_batch(np.arange(10, 18)), node="a", version=1)  # the whole capacity is free again


@pytest.mark.usefixtures("fake_ray")
def test_priority_updates_for_items_of_a_lost_shard_are_ignored_and_never_revive_them():
    p = _plane(["a", "b"], capacity=8, semantics=_prioritized())
    p.ingest(id_batch(np.arange(4)), node="a")
    p.ingest(id_batch(np.arange(4, 8)), node="b")
    p._lose(1, "test")
    assert p.update_priorities(torch.arange(8), torch.full((8,), 3.0)) == 4, "only the 4 survivors count"
    tree = p.semantics.sampler._tree
    assert tree.total == pytest.approx(12.0) and tree.get(np.arange(4, 8)).tolist() == [0.0] * 4
    p.ingest(id_batch(np.arange(8, 12)), node="a")  # evicts 0-3: the window is 4-11, 4-7 still lost
    assert p.update_priorities(torch.arange(12), torch.full((12,), 5.0)) == 4
    assert tree.total == pytest.approx(20.0) and len(p) == 4
    with pytest.raises(CapacityError, match="not live"):  # evicted from shard 0 only: still refused, typed
        p.read([3])
    with pytest.raises(ShardLostError):
        p.read([5])
    _, info = p.deliver(32)
    assert set(info.handles.tolist()) <= set(range(8, 12))


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("on_policy", [False, True])
def test_an_empty_ingestion_changes_nothing_even_with_every_shard_lost(on_policy):
    sem = OnPolicy(num_minibatches=1) if on_policy else Replay()
    kw = {"version": 0} if on_policy else {}
    p = _plane(["a", "b"], capacity=4, semantics=sem)
    p.ingest(id_batch(np.arange(4)), **kw)
    assert p.ingest(id_batch(np.zeros(0, dtype=np.int64)), **kw).tolist() == []
    assert len(p) == 4 and p.index.next_handle == 4 and _ids(p) == [0, 1, 2, 3]
    p._lose(0, "test")
    p._lose(1, "test")
    assert p.ingest(id_batch(np.zeros(0, dtype=np.int64)), **kw).tolist() == []
    assert len(p) == 0 and p.index.next_handle == 4


# -- prefetched batches and losses ------------------------------------------------------------------------
@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("prioritized", [False, True])
def test_replay_batches_prefetched_before_a_loss_are_not_delivered_after_it_is_reported(prioritized):
    """Overlapped(g_del=2) prepares batches ahead. Once shard 1 is reported lost (its items in
    LossReport.lost: "can no longer be delivered"), the next deliveries still handed out prepared batches
    with those items."""
    group = _servers(["a", "b"])
    p = DistributedDataPlane(ID_SCHEMA, capacity=16, servers=group, learner_node="a", measure=False,
                             health_period=None, transport="object_store", scheduler=Overlapped(g_del=2),
                             semantics=_prioritized() if prioritized else Replay())
    try:
        for i in range(4):
            p.ingest(id_batch(np.arange(4 * i, 4 * i + 4)), node="ab"[i % 2])
        p.flush()
        p.deliver(4)  # the scheduler now holds prepared batches drawn from all 16 items
        p.scheduler._await_job()  # (its prefetch has run)
        group.servers[1].actor.dead = True
        (report,) = p.check_health()
        lost = set(report.lost.tolist())
        assert lost == {4, 5, 6, 7, 12, 13, 14, 15}
        for _ in range(4):
            batch, info = p.deliver(4)
            got = info.handles.tolist()
            assert not lost & set(got), f"items reported lost were delivered: {got}"
            assert check_payload(batch).tolist() == got
    finally:
        p.close()


@pytest.mark.usefixtures("fake_ray")
def test_an_on_policy_minibatch_prefetched_before_a_loss_leaves_out_the_lost_items():
    """Items alternate between the shards; minibatch 1 ([4..7], no shuffle) is prefetched while the learner
    has minibatch 0; then shard 1 is reported lost: minibatch 1 was delivered whole, with items 5 and 7
    that the report names lost (a synchronous buffer leaves them out)."""
    group = _servers(["a", "b"])
    p = DistributedDataPlane(ID_SCHEMA, capacity=16, servers=group, learner_node="a", measure=False,
                             health_period=None, transport="object_store", reuse=0, scheduler=Overlapped(),
                             semantics=OnPolicy(num_minibatches=2, shuffle=False))
    try:
        for i, node in enumerate("abababab"):
            p.ingest(id_batch(np.array([i])), node=node, version=0)
        p.seal()
        p.flush()
        first, _ = p.deliver()
        assert check_payload(first).tolist() == [0, 1, 2, 3]
        p.scheduler._await_job()  # (the prefetch of minibatch 1 has run)
        group.servers[1].actor.dead = True
        (report,) = p.check_health()
        assert report.lost.tolist() == [1, 3, 5, 7]
        second, info = p.deliver()
        assert check_payload(second).tolist() == [4, 6] and info.handles.tolist() == [4, 6] and info.last
    finally:
        p.close()


# -- close from on_loss -----------------------------------------------------------------------------------
@pytest.mark.usefixtures("fake_ray")
def test_closing_the_buffer_from_on_loss_on_the_monitor_thread_drops_its_partitions():
    """on_loss runs on the health monitor thread; a callback that closes the buffer made close() join that
    very thread ("cannot join current thread"): the partitions on the live shards stayed (and servers the
    buffer owned kept running)."""
    group = _servers(["a", "b"])
    done = threading.Event()
    errors: list[BaseException] = []

    def on_loss(report):
        try:
            plane.close()
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion below
            errors.append(e)
        done.set()

    plane = DistributedDataPlane(ID_SCHEMA, capacity=10, servers=group, learner_node="a", measure=False,
                                 health_period=0.05, transport="object_store", on_loss=on_loss)
    plane.ingest(id_batch(np.arange(4)), node="b")
    group.servers[1].actor.dead = True
    assert done.wait(10), "the monitor did not report the loss"
    assert not errors, f"close() from on_loss raised {errors[0]!r}"
    assert plane.closed
    assert plane.buffer_id not in group.servers[0].actor.server._parts, "the live shard kept the partition"
    plane._monitor.join(5)
    assert not plane._monitor.is_alive(), "the monitor thread did not stop"


@pytest.mark.usefixtures("fake_ray")
def test_an_on_loss_callback_that_raises_does_not_cost_a_survivor_its_delivery(caplog):
    """Items 0, 2 on shard 0 and 1, 3 on shard 1; two minibatches [0, 1], [2, 3] (no shuffle). Shard 1 dies
    and the first delivery finds it; on_loss raises. The delivery raised the callback's error after the
    minibatch had been selected, so item 0, a survivor, was never delivered in the epoch."""
    group = _servers(["a", "b"])

    def on_loss(report):
        raise RuntimeError("the alerting hook failed")

    p = DistributedDataPlane(ID_SCHEMA, capacity=16, servers=group, learner_node="a", measure=False,
                             health_period=None, transport="object_store", on_loss=on_loss, reuse=0,
                             semantics=OnPolicy(num_minibatches=2, shuffle=False))
    for i, node in enumerate("abab"):
        p.ingest(id_batch(np.array([i])), node=node, version=0)
    p.seal()
    group.servers[1].actor.dead = True
    first, info = p.deliver()
    assert check_payload(first).tolist() == [0] and info.minibatch == 0
    second, info = p.deliver()
    assert check_payload(second).tolist() == [2] and info.last
    assert [r.lost.tolist() for r in p.losses] == [[1, 3]]
    assert "on_loss raised" in caplog.text


# -- typed refusals and reports ---------------------------------------------------------------------------
@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("bad", [1.7, "3", True, None])
def test_set_policy_version_refuses_a_non_integer_typed_and_keeps_the_version(bad):
    """As ExperienceDataPlane.set_policy_version: 1.7 was truncated to 1, True taken as 1, "3" raised a raw
    ValueError and None a raw TypeError."""
    p = _plane(["a", "b"], capacity=10, semantics=OnPolicy(num_minibatches=1))
    p.set_policy_version(np.int64(2))
    with pytest.raises(ConfigurationError, match="policy version"):
        p.set_policy_version(bad)
    assert p.semantics.policy_version == 2


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("kwargs", [
    {"health_period": 0}, {"health_period": -1.0}, {"health_period": float("nan")}, {"timeout": "5"},
    {"timeout": float("inf")}, {"shard_capacity": 0}, {"shard_capacity": 2.5}, {"reuse": -1.0},
    {"ragged_capacity": 0, "schema": RAGGED}, {"ragged_capacity": "8"}, {"replication": True},
], ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items() if k != "schema"))
def test_bad_settings_are_refused_typed_before_any_server_starts(kwargs):
    """health_period=0 (or < 0, NaN) made the monitor ping every shard in a busy loop; replication=True was taken
    as 1 copy (a bool is refused for every other count); timeout="5" raised a
    raw TypeError; shard_capacity=2.5 became 2; reuse < 0 raised ClusterError, and it, shard_capacity=0 and
    a bad ragged_capacity were refused only after the servers were started (servers the buffer starts
    itself, given as node ids, were left running). Node ids are given here: with the in-process stand-in
    for Ray, starting servers would fail (AttributeError), so a ConfigurationError means nothing started."""
    kwargs = dict(kwargs)
    schema = kwargs.pop("schema", ID_SCHEMA)
    with pytest.raises(ConfigurationError):
        DistributedDataPlane(schema, capacity=10, servers=["a", "b"], measure=False, **kwargs)


@pytest.mark.usefixtures("fake_ray")
def test_a_numpy_integer_replication_is_a_count_of_copies():
    """replication=np.int64(2) (a count read from a config array) was refused as "not an int"."""
    p = _plane(["a", "b"], capacity=4, replication=np.int64(2))
    assert p.replication == 2 and type(p.replication) is int
    p.ingest(id_batch(np.arange(4)), node="a")
    assert _ids(p) == [0, 1, 2, 3] and all(len(p.index.segment(r)[2]) == 2 for r in p.index.live_rows())
    p.close()


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("bad", [["x"], "abc", None, [object()]], ids=["str-list", "str", "none", "object"])
@pytest.mark.parametrize("lost", [False, True], ids=["all-shards", "shard-lost"])
def test_priorities_that_are_not_numbers_are_refused_typed_and_change_nothing(bad, lost):
    """As ExperienceDataPlane.update_priorities (PriorityError): these raised raw ValueError, TypeError or
    RuntimeError from torch.as_tensor."""
    p = _plane(["a", "b"], capacity=10, semantics=_prioritized())
    p.ingest(id_batch(np.arange(4)), node="a")
    p.ingest(id_batch(np.arange(4, 8)), node="b")
    if lost:
        p._lose(1, "test")
    before = p.semantics.sampler._tree.state().copy()
    with pytest.raises(PriorityError):
        p.update_priorities(torch.tensor([0]), bad)
    assert np.array_equal(p.semantics.sampler._tree.state(), before)


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("bad", [[1.7], torch.tensor([2.9]), ["x"]], ids=["float-list", "float-tensor", "str"])
def test_a_read_of_handles_that_are_not_integers_is_refused_typed(bad):
    """read([1.7]) returned item 1 (the float truncated to another item's handle); read(["x"]) raised a raw
    ValueError."""
    p = _plane(["a", "b"], capacity=10)
    p.ingest(id_batch(np.arange(4)))
    with pytest.raises(ConfigurationError, match="integers"):
        p.read(bad)
    assert check_payload(p.read(torch.tensor([1, 2]))).tolist() == [1, 2] and p.read([]).batch_size == 0


@pytest.mark.usefixtures("fake_ray")
def test_a_read_of_lost_items_carries_the_report_that_lost_them():
    """Shard 1 (items 4-7) is lost, then shard 2 (items 8-11): reading item 5 raised ShardLostError with
    the report of shard 2, which does not name it."""
    p = _plane(["a", "b", "c"], capacity=20)
    for i, node in enumerate(["a", "b", "c"]):
        p.ingest(id_batch(np.arange(4 * i, 4 * i + 4)), node=node)
    p._lose(1, "first")
    p._lose(2, "second")
    with pytest.raises(ShardLostError) as e:
        p.read([5])
    assert e.value.report is not None and e.value.report.shard == 1 and 5 in e.value.report.lost.tolist()
    assert check_payload(p.read([0, 3])).tolist() == [0, 3]


# -- the same on the module's real local Ray cluster -------------------------------------------------------
@pytest.mark.slow
def test_real_cluster_exactly_full_shards_evict_fifo_across_nodes(cluster, servers):
    p = DistributedDataPlane(ID_SCHEMA, capacity=4, shard_capacity=2, servers=servers, measure=False,
                             health_period=None)
    try:
        head, worker = cluster.head, cluster.workers[0]
        p.ingest(id_batch(np.array([0])), node=head)
        p.ingest(id_batch(np.array([1])), node=head)
        p.ingest(id_batch(np.array([2, 3])), node=worker)
        p.ingest(id_batch(np.array([4, 5])), node=head)
        assert sorted(check_payload(p.read(p.live_handles())).tolist()) == [2, 3, 4, 5]
        p.ingest(id_batch(np.array([6, 7])), node=worker)
        assert sorted(check_payload(p.read(p.live_handles())).tolist()) == [4, 5, 6, 7]
    finally:
        p.close()


@pytest.mark.slow
def test_real_cluster_close_from_on_loss_stops_the_servers_the_buffer_started(cluster):
    import ray

    closed = threading.Event()
    errors: list[BaseException] = []

    def on_loss(report):
        try:
            plane.close()
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion below
            errors.append(e)
        closed.set()

    plane = DistributedDataPlane(ID_SCHEMA, capacity=10, servers=[cluster.head, cluster.workers[0]],
                                 measure=False, health_period=0.2, timeout=10.0, on_loss=on_loss)
    plane.ingest(id_batch(np.arange(4)), node=cluster.workers[0])
    survivor = plane.servers[0].actor
    ray.kill(plane.servers[1].actor, no_restart=True)
    assert closed.wait(60), "the loss was not reported"
    assert not errors, f"close() from on_loss raised {errors[0]!r}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # ray.kill is asynchronous: wait for the survivor to go
        try:
            ray.get(survivor.ping.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - any failure means the actor is gone
            break
        time.sleep(0.2)
    else:
        pytest.fail("the server the buffer started still runs after close() from on_loss")
    plane.close()  # again, after the fault and the close: nothing happens
    assert plane.closed


@pytest.mark.slow
def test_real_cluster_checkpoint_taken_while_a_shard_is_lost_loads_exactly(cluster, servers):
    """Prioritized replay on two nodes; the worker's shard is killed and found lost; the checkpoint then
    taken holds the survivors and a hole, and loads into another buffer exactly: same items, same priority
    total (the lost items out of it), the same next draws."""
    import ray

    own = ShardServers([cluster.head, cluster.workers[0]])
    p = DistributedDataPlane(ID_SCHEMA, capacity=16, servers=own, measure=False, health_period=None,
                             timeout=10.0, semantics=_prioritized())
    q = DistributedDataPlane(ID_SCHEMA, capacity=16, servers=servers, measure=False, health_period=None,
                             semantics=_prioritized())
    try:
        p.ingest(id_batch(np.arange(4)), node=cluster.head, priorities=torch.full((4,), 2.0))
        p.ingest(id_batch(np.arange(4, 8)), node=cluster.workers[0], priorities=torch.full((4,), 3.0))
        p.ingest(id_batch(np.arange(8, 12)), node=cluster.head, priorities=torch.full((4,), 4.0))
        ray.kill(own[1].actor, no_restart=True)
        deadline = time.monotonic() + 60
        while not p.losses:
            assert time.monotonic() < deadline, "the killed shard was not found lost"
            p.check_health()
        assert p.losses[0].lost.tolist() == [4, 5, 6, 7]
        state = p.state_dict()
        assert state["handles"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
        q.load_state_dict(state)
        assert q.live_handles().tolist() == p.live_handles().tolist() and len(q) == len(p) == 8
        assert q.semantics.sampler._tree.total == pytest.approx(p.semantics.sampler._tree.total) == 24.0
        assert p.update_priorities(torch.arange(12), torch.ones(12)) == q.update_priorities(torch.arange(12),
                                                                                            torch.ones(12)) == 8
        bp, ip = p.deliver(32)
        bq, iq = q.deliver(32)
        assert ip.handles.tolist() == iq.handles.tolist() and not set(ip.handles.tolist()) & {4, 5, 6, 7}
        assert check_payload(bp).tolist() == check_payload(bq).tolist()
    finally:
        p.close()
        p.close()
        q.close()
        own.shutdown()


@pytest.mark.slow
def test_real_cluster_a_failed_link_measurement_stops_the_servers_the_buffer_started(cluster, monkeypatch):
    """The buffer starts its own servers (given node ids), then measuring the links fails: the error
    reaches the caller and no server the buffer started is left running."""
    import ray
    from conduit.distributed.servers import ShardServers

    started: list[ShardServers] = []

    def failing_links(self: ShardServers, **kwargs: object) -> None:
        started.append(self)
        raise TimeoutError("link measurement timed out")  # a real failure mode of measuring over the network

    monkeypatch.setattr(ShardServers, "links", failing_links)
    with pytest.raises(TimeoutError, match="link measurement"):
        DistributedDataPlane(ID_SCHEMA, capacity=10, servers=[cluster.head, cluster.workers[0]], measure=True,
                             health_period=None, timeout=10.0)
    assert started, "the servers were never started"
    for info in started[0].servers:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ray.kill is asynchronous: wait for the actor to go
            try:
                ray.get(info.actor.ping.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - any failure means the actor is gone
                break
            time.sleep(0.2)
        else:
            pytest.fail("a server the failed buffer started still runs")
