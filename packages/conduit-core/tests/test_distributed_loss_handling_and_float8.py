"""Faults of the multi-node plane: confirmation of a shard's death, loss callbacks outside the
lock, float8 through the shards, late copies, and the loss accounting of an evicting ingestion.

Every test runs on the real local Ray cluster of ``conftest.py`` (a third node is added for the tests that need
three shards); faults are real: killed actors, and a shard's data thread held up by a call waiting for its argument.
Ray's ``ActorUnavailableError`` cannot be produced on demand on a local cluster, so that test hands a real instance
of it to the plane's decision step (``_settle``), on a live shard.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceSchema, Field
from conduit.distributed import DistributedDataPlane, ShardServers
from conduit.distributed._ray import Outcome
from conduit.distributed.errors import ClusterError
from conduit.distributed.faults import LossReport
from conduit.distributed.testing import kill_server
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def third(cluster: Any) -> str:
    """A third node in this module's cluster (for replication 2 with a shard left to copy to)."""
    return str(cluster.add_node())


@pytest.fixture
def owned() -> Iterator[list[Any]]:
    """Planes and server groups a test builds, closed and stopped after it (the tests kill servers)."""
    things: list[Any] = []
    yield things
    for t in reversed(things):
        t.close() if isinstance(t, DistributedDataPlane) else t.shutdown()


def _plane(owned: list[Any], nodes: list[str] | ShardServers, schema: ExperienceSchema = ID_SCHEMA,
           **kw: Any) -> DistributedDataPlane:
    """A plane on servers started on ``nodes`` (owned here), or on the given server group (owned by the caller)."""
    servers = nodes if isinstance(nodes, ShardServers) else ShardServers(nodes)
    if servers is not nodes:
        owned.append(servers)
    kw.setdefault("capacity", 8)
    kw.setdefault("timeout", 20.0)
    plane = DistributedDataPlane(schema, servers=servers, measure=False, health_period=None,
                                 transport="object_store", **kw)
    owned.append(plane)
    return plane


def _shards_of(plane: DistributedDataPlane, handle: int) -> list[int]:
    row = int(plane.index.segments_of(np.array([handle]))[0])
    return sorted(s for s, _ in plane.index.segment(row)[2])


def _ids(plane: DistributedDataPlane) -> list[int]:
    return sorted(check_payload(plane.read(plane.live_handles())).tolist())


# -- 1. a transient unavailability is not a loss -------------------------------------------------------------------
def test_real_cluster_a_shard_ray_reports_unavailable_but_that_answers_a_probe_is_not_lost(cluster, owned):
    """A read of shard 1 that Ray answers with ActorUnavailableError ("the actor is unavailable ... may or may not
    have been executed": a broken connection, not a death) fenced the shard at once and reported its items lost
    for good, although the server was alive and answered the next ping. Death now needs a probe's confirmation."""
    p = _plane(owned, [cluster.head, cluster.workers[0]])
    p.ingest(id_batch(np.arange(4)), node=cluster.workers[0])
    assert _shards_of(p, 0) == [1]
    blip = ray.exceptions.ActorUnavailableError("connection reset by peer", None)
    stuck = p._settle({1: Outcome(error=blip, lost=True)})
    assert stuck == {1}, "the live shard's failed call is stuck (or failed in passing), not a loss"
    assert p.alive_shards == [0, 1] and p.losses == [] and len(p) == 4
    assert _ids(p) == [0, 1, 2, 3]
    # a proven death is still a loss, found by the next health check
    kill_server(p.servers[1].actor)
    found = p.check_health()
    assert [r.shard for r in found] == [1] and found[0].lost.tolist() == [0, 1, 2, 3]
    assert p.alive_shards == [0]


# -- 2. loss callbacks run outside the lock, in order, once each ---------------------------------------------------
def test_real_cluster_loss_callbacks_run_outside_the_lock_in_order_once_each_with_plain_reasons(cluster, third, owned):
    """Items 0-3 live on shards 0 and 1 (replication 2), which both die. The health check finds one; copying its
    items from the other finds that one lost too, and its on_loss ran inside the first loss's hold of the buffer's
    lock: a callback that calls the buffer from another thread (or waits for a scheduler's worker) deadlocked.

    The same two deaths, for the reasons: that second loss's reason was the copy's RayTaskError header: ANSI colour
    codes and the target's process and actor ("RayTaskError(ActorDiedError): \\x1b[36mray::ShardServer.append()
    ...(pid=..., actor_id=<the target's>...)"), naming the shard that took the copy, not what happened. Both
    reasons now say what failed; the items are lost once."""
    calls: list[tuple[LossReport, bool, int]] = []
    p: DistributedDataPlane | None = None

    def on_loss(report: LossReport) -> None:
        assert p is not None
        if p.holds_lock():  # (the reader below would wait for this thread for ever)
            calls.append((report, True, -1))
            return
        got: list[int] = []
        plane = p
        reader = threading.Thread(target=lambda: got.append(len(plane)))  # it needs the buffer's lock
        reader.start()
        reader.join()
        calls.append((report, False, got[0]))

    p = _plane(owned, [cluster.head, cluster.workers[0], third], replication=2, on_loss=on_loss)
    p.ingest(id_batch(np.arange(4)), node=cluster.head)
    assert _shards_of(p, 0) == [0, 1]
    kill_server(p.servers[0].actor)
    kill_server(p.servers[1].actor)
    found = p.check_health()
    assert sorted(r.shard for r in found) == [0, 1]
    assert [id(r) for r, _, _ in calls] == [id(r) for r in p.losses] == [id(r) for r in found], \
        "each report is handed to on_loss exactly once, in the order of .losses"
    assert [held for _, held, _ in calls] == [False, False], "on_loss ran under the buffer's lock"
    assert [n for _, _, n in calls] == [0, 0]
    assert sorted(np.concatenate([r.lost for r in p.losses]).tolist()) == [0, 1, 2, 3] and p.lost_items == 4
    for r in found:
        assert r.reason.startswith("ActorDiedError: "), r.reason
        assert "\x1b" not in r.reason and "ray::" not in r.reason, r.reason


# -- 3. float8 through the shards ----------------------------------------------------------------------------------
def test_real_cluster_float8_rows_are_stored_and_delivered_bit_exactly(cluster, owned):
    """float8 has no index_copy_ in torch: the assembly of a delivered batch copies rows as their bits."""
    schema = ExperienceSchema(id=Field((), torch.int64), f8=Field((3,), torch.float8_e4m3fn),
                              e5=Field((), torch.float8_e5m2))
    p = _plane(owned, [cluster.head, cluster.workers[0]], schema=schema)
    vals = torch.linspace(-4, 4, 24).reshape(8, 3)
    batch = {"id": torch.arange(8), "f8": vals.to(torch.float8_e4m3fn), "e5": vals[:, 0].to(torch.float8_e5m2)}
    p.ingest({k: v[:4] for k, v in batch.items()}, node=cluster.head)
    p.ingest({k: v[4:] for k, v in batch.items()}, node=cluster.workers[0])
    assert _shards_of(p, 0) == [0] and _shards_of(p, 4) == [1]
    got, info = p.deliver(16)
    ids = got.tensor("id")
    assert got.tensor("f8").dtype == torch.float8_e4m3fn and got.tensor("e5").dtype == torch.float8_e5m2
    assert torch.equal(got.tensor("f8").view(torch.uint8), batch["f8"][ids].view(torch.uint8))
    assert torch.equal(got.tensor("e5").view(torch.uint8), batch["e5"][ids].view(torch.uint8))
    assert info.handles.tolist() == ids.tolist()


# -- 4. a copy that timed out and lands later ----------------------------------------------------------------------
@ray.remote(num_cpus=0)
def _gated(gate: str) -> np.ndarray:
    """Returns once the file ``gate`` exists (the test opens it; at most 300 s): a call that takes this as its
    argument waits, and the shard's calls behind it queue, until the test lets them go (not a fixed time that a
    slow machine could outlast before the call under test is even sent)."""
    deadline = time.monotonic() + 300
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return np.ones(1, dtype=np.uint8)


def test_real_cluster_a_re_replication_copy_that_lands_after_its_timeout_leaves_no_unknown_rows(
        cluster, third, owned, tmp_path):
    """Shard 0 of items 0-3 (copies on shards 0 and 1) dies; the copy to shard 2 waits behind a data call there
    and times out, so the index records no copy on shard 2. The copy then ran anyway: shard 2 held four rows the
    index did not know, taking room the buffer thought free. It is now discarded when it lands."""
    p = _plane(owned, [cluster.head, cluster.workers[0], third], replication=2, timeout=10.0)
    p.ingest(id_batch(np.arange(4)), node=cluster.head)
    assert _shards_of(p, 0) == [0, 1]
    target = p.servers[2].actor
    gate = tmp_path / "open"
    blocker = target.sink.remote(_gated.remote(str(gate)))  # shard 2's data calls queue behind this one
    try:
        kill_server(p.servers[0].actor)
        found = p.check_health()
        assert [r.shard for r in found] == [0] and found[0].recovered == 4 and found[0].re_replicated == 0
        assert p.alive_shards == [1, 2] and p.under_replicated == 4
    finally:
        gate.touch()
    assert ray.get(blocker, timeout=120) == 1  # the copy ran after it (or was discarded)
    oldest, nxt = ray.get(target.span.remote(p.buffer_id), timeout=60)
    assert nxt - oldest == 0 == p.index.held_end(2), f"shard 2 holds rows [{oldest}, {nxt}) no segment names"
    # the buffer goes on: new items are stored on shard 2 where the index says, and every item reads back
    p.ingest(id_batch(np.arange(4, 8)), node=third)
    assert 2 in _shards_of(p, 4)
    assert _ids(p) == list(range(8))


# -- 5. a loss found by an evicting ingestion ----------------------------------------------------------------------
def _evicting_plane(owned: list[Any], servers: ShardServers, shard_capacity: int) -> DistributedDataPlane:
    """Items 0-3 on shard 1, 4-7 on shard 0 (capacity 8, full), on ``servers`` (the head node's, the worker's)."""
    plane = _plane(owned, servers, shard_capacity=shard_capacity)
    plane.ingest(id_batch(np.arange(4)), node=servers.nodes[1])
    plane.ingest(id_batch(np.arange(4, 8)), node=servers.nodes[0])
    assert _shards_of(plane, 0) == [1] and _shards_of(plane, 4) == [0] and len(plane) == 8
    return plane


def test_real_cluster_an_evicting_ingestion_that_finds_a_shard_dead_reports_exactly_what_it_left_in_place(
        cluster, owned):
    """Two buffers on the same two servers (one server group and one death for both), then shard 1 dies.

    Ingesting 8-11 evicts 0-3, which lived on shard 1; the write finds shard 1 dead. Its report named 0-3
    lost (lost_items 4), although the ingestion evicts them: nothing deliverable was lost.

    The same, but shard 0 has no room: the ingestion fails and evicts nothing, so 0-3 stay in the window,
    lost with shard 1: the report names them (and only them)."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    owned.append(servers)
    evicts = _evicting_plane(owned, servers, shard_capacity=8)
    fails = _evicting_plane(owned, servers, shard_capacity=4)
    kill_server(servers[1].actor)

    h = evicts.ingest(id_batch(np.arange(8, 12)), node=cluster.workers[0])
    assert h.tolist() == [8, 9, 10, 11]
    assert [r.shard for r in evicts.losses] == [1]
    assert evicts.losses[0].lost.tolist() == [] and evicts.lost_items == 0
    assert _ids(evicts) == list(range(4, 12)) and len(evicts) == 8

    with pytest.raises(ClusterError):
        fails.ingest(id_batch(np.arange(8, 12)), node=cluster.workers[0])
    assert [r.shard for r in fails.losses] == [1]
    assert fails.losses[0].lost.tolist() == [0, 1, 2, 3] and fails.lost_items == 4
    assert fails.index.oldest == 0 and len(fails) == 4
    assert _ids(fails) == [4, 5, 6, 7]


def test_real_cluster_after_a_loss_a_replay_ingestion_evicts_further_to_fit_the_surviving_shards(cluster, owned):
    """Capacity 8 over two shards of 4; shard 1 (items 0-3) is lost. Shard 0 is full with 4-7, and FIFO eviction
    of the lost 0-1 frees nothing there: every later ingestion was refused with ClusterError "do not fit in the
    live shards (room for 0)", for ever (the training loop could not go on). Now the oldest live items go too
    (FIFO), and the priority total holds exactly the items kept."""
    from conduit import PrioritizedSampler, Replay

    p = _plane(owned, [cluster.head, cluster.workers[0]], shard_capacity=4,
               semantics=Replay(PrioritizedSampler(alpha=1.0), seed=2))
    p.ingest(id_batch(np.arange(4)), node=cluster.workers[0], priorities=torch.full((4,), 100.0))
    p.ingest(id_batch(np.arange(4, 8)), node=cluster.head, priorities=torch.arange(1.0, 5.0))
    assert _shards_of(p, 0) == [1] and _shards_of(p, 4) == [0]
    kill_server(p.servers[1].actor)
    assert [r.lost.tolist() for r in p.check_health()] == [[0, 1, 2, 3]]
    h = p.ingest(id_batch(np.arange(8, 10)), node=cluster.head, priorities=torch.tensor([5.0, 6.0]))
    assert h.tolist() == [8, 9]
    assert _ids(p) == [6, 7, 8, 9] and len(p) == 4 and p.lost_items == 4
    assert p.semantics.sampler._tree.total == pytest.approx(3.0 + 4.0 + 5.0 + 6.0)
    assert set(check_payload(p.deliver(200)[0]).tolist()) == {6, 7, 8, 9}
    p.ingest(id_batch(np.arange(10, 14)), node=cluster.workers[0])  # (routed to the surviving shard)
    assert _ids(p) == [10, 11, 12, 13]
