"""Faults of the multi-node plane: room a failed write's undo frees, the
``recovered`` count of a loss an evicting ingestion finds, and copies that get no answer when there is no monitor.

Every test runs on the real local Ray cluster of ``conftest.py`` (a third node for replication 2 with a shard left
to copy to); faults are real: killed actors, and a shard's calls held up behind a call waiting for its argument.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit.batch import ExperienceBatch
from conduit.distributed import stage
from conduit.distributed.errors import TransferError
from conduit.distributed.testing import kill_server
from conduit.distributed.wire import to_wire
from conduit.testing.lifecycle import eventually
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

sys.path.insert(0, str(Path(__file__).parent))
import test_distributed_loss_handling_and_float8 as _base  # noqa: E402, I001
from test_distributed_loss_handling_and_float8 import _gated, _ids, _plane, _shards_of  # noqa: E402, I001

owned, third = _base.owned, _base.third  # the sibling module's fixtures, used here by name

ray = pytest.importorskip("ray")
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

pytestmark = pytest.mark.timeout(600)


# -- 1. room a failed write's undo frees ---------------------------------------------------------------------------
def test_real_cluster_an_undo_truncate_that_answers_late_gives_the_room_back(cluster, owned, tmp_path):
    """A write stored items on shard 0, then failed; its undo's truncate there waited behind another data call and
    did not answer in time, though the shard answered the probe. The truncate ran later, but the plane kept
    counting the forgotten rows as used: a batch that fits was refused ("No live shard can take the items")."""
    p = _plane(owned, [cluster.head], capacity=8, timeout=10.0)
    p.ingest(id_batch(np.arange(4)))
    actor = p.servers[0].actor
    # the part of a write that reached shard 0: it stored four rows there (the index never names them)
    before = list(p._local_next)
    rows = ray.put(to_wire(ExperienceBatch.checked(id_batch(np.arange(90, 94)), ID_SCHEMA), ID_SCHEMA))
    first, _, nxt = ray.get(actor.append.remote(p.buffer_id, rows, 0, 4, 0), timeout=60)
    assert (first, nxt) == (4, 8)
    with p._lock:
        p._local_next[0] = nxt
    gate = tmp_path / "open"
    blocker = actor.sink.remote(_gated.remote(str(gate)))  # the undo's truncate queues behind this call
    try:
        with p._lock:
            evicted = p._undo_store(before, p.index.oldest, TransferError("another shard failed"))
        assert evicted and p.alive_shards == [0] and p.losses == []
    finally:
        gate.touch()
    assert ray.get(blocker, timeout=120) == 1
    oldest, nxt = ray.get(actor.span.remote(p.buffer_id), timeout=60)
    assert (oldest, nxt) == (0, 4), "the late truncate forgot the write's rows"
    # the buffer holds 4 of 8: four more fit (the plane counted the forgotten rows as used: no room), and every
    # item reads back
    assert p.ingest(id_batch(np.arange(4, 8))).tolist() == [4, 5, 6, 7]
    assert _ids(p) == list(range(8)) and len(p) == 8
    assert p._local_next[0] == ray.get(actor.span.remote(p.buffer_id), timeout=60)[1] == 8


# -- 2. evicted items are neither lost nor recovered ---------------------------------------------------------------
def test_real_cluster_items_an_ingestion_evicts_are_not_counted_recovered_with_the_shard_it_finds_dead(
        cluster, third, owned):
    """Items 0-3 have replicas on two shards, 4-7 on two others (capacity 8, full); a shard holding only 0-3 dies,
    and the ingestion of 8-11, which evicts 0-3, finds it. Its report counted 0-3 recovered (their other replica
    was still there), although the ingestion evicts them: they are neither lost nor recovered."""
    nodes = [cluster.head, cluster.workers[0], third]
    p = _plane(owned, nodes, replication=2)
    p.ingest(id_batch(np.arange(4)), node=third)
    p.ingest(id_batch(np.arange(4, 8)), node=cluster.head)
    only_old = sorted(set(_shards_of(p, 0)) - set(_shards_of(p, 4)))
    assert only_old, f"placement {_shards_of(p, 0)} / {_shards_of(p, 4)} leaves no shard with only 0-3"
    dead = only_old[0]
    kill_server(p.servers[dead].actor)
    h = p.ingest(id_batch(np.arange(8, 12)), node=nodes[dead])  # placed on the dead shard first: finds it
    assert h.tolist() == [8, 9, 10, 11]
    assert [r.shard for r in p.losses] == [dead]
    report = p.losses[0]
    assert report.lost.tolist() == [] and p.lost_items == 0
    assert report.recovered == 0, f"evicted items counted recovered: {report}"
    assert _ids(p) == list(range(4, 12)) and len(p) == 8


def _wait_dead(actor: Any) -> None:
    """Return once Ray reports ``actor`` dead (a killed actor's objects are lost from then on)."""

    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError as e:
            return not isinstance(e, ray.exceptions.ActorUnavailableError)  # (unavailable proves no death yet)
        except ray.exceptions.GetTimeoutError:
            pass
        return False

    assert eventually(dead, timeout=60), "the killed producer still answers"


@ray.remote(num_cpus=0)
class _Producer:
    def produce(self, ids: np.ndarray) -> Any:
        return stage(id_batch(ids), ID_SCHEMA)


def test_real_cluster_a_failed_evicting_ingestion_counts_the_items_it_left_in_place_recovered(cluster, third, owned):
    """The same, but the batch was staged by a producer that died: the ingestion fails and evicts nothing, so 0-3
    stay in the window, deliverable from their other replica: the report counts them recovered after all."""
    nodes = [cluster.head, cluster.workers[0], third]
    for _ in range(3):  # (the premise is Ray's: a dead producer's object can still be served for a while)
        p = _plane(owned, nodes, replication=2)
        p.ingest(id_batch(np.arange(4)), node=third)
        p.ingest(id_batch(np.arange(4, 8)), node=cluster.head)
        assert _shards_of(p, 0)[-1] == 2 and 2 not in _shards_of(p, 4)
        producer = _Producer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(third, soft=False)).remote()
        staged = ray.get(producer.produce.remote(np.arange(8, 12)), timeout=120)
        ray.kill(producer, no_restart=True)  # its staged batch goes with it
        _wait_dead(producer)  # (ray.kill only asks: a fetch right after it could still be answered)
        kill_server(p.servers[2].actor)
        try:
            p.ingest(staged)  # placed on shard 2 first (the producer's node): finds it dead
        except TransferError:
            break
        p.close()  # Ray still served the dead producer's batch (stored after shard 2's loss): not this test's case
    else:
        pytest.fail("Ray served a killed producer's staged batch three times: the failed ingestion never happened")
    assert [r.shard for r in p.losses] == [2]
    report = p.losses[0]
    assert report.lost.tolist() == [] and p.lost_items == 0
    assert report.recovered == 4, f"items left in place not counted: {report}"
    assert p.index.oldest == 0 and _ids(p) == list(range(8)) and len(p) == 8


# -- 3. no monitor: a copy that gets no answer is probed in the call ----------------------------------------------
def test_real_cluster_without_a_monitor_a_copy_target_that_stopped_answering_is_found_lost(
        cluster, third, owned, tmp_path):
    """health_period=None. Shard 0 of items 0-3 (copies on shards 0 and 1) dies; the copy to shard 2 gets no
    answer: shard 2 stopped answering data calls and health checks alike. The copy's outcome was left to a health
    monitor that does not exist: shard 2 stayed live in the plane, and nothing would ever look at it again. The
    copy's shards are now probed in the call: shard 2 is found lost at once (its loss loses nothing: the copy
    never landed)."""
    p = _plane(owned, [cluster.head, cluster.workers[0], third], replication=2, timeout=10.0)
    p.ingest(id_batch(np.arange(4)), node=cluster.head)
    assert _shards_of(p, 0) == [0, 1]
    target = p.servers[2].actor
    gate = tmp_path / "open"
    hold = _gated.remote(str(gate))
    target.sink.remote(hold)  # its data calls queue behind this one
    target.sink.options(concurrency_group="health").remote(hold)  # and so do its health checks
    try:
        kill_server(p.servers[0].actor)
        # a read finds shard 0 dead (it reads the learner's node's replica first; shard 2 is not pinged before)
        assert check_payload(p.read(np.arange(4))).tolist() == [0, 1, 2, 3]
    finally:
        gate.touch()
    # (shard 2's report comes first: it was found while shard 0's loss was being accounted, see LossReport)
    assert [r.shard for r in p.losses] == [2, 0], \
        "the shard that does not answer is found lost by the call that copied to it"
    assert p.losses[1].recovered == 4 and p.losses[1].re_replicated == 0 and p.losses[0].lost.tolist() == []
    assert p.alive_shards == [1]
    assert _ids(p) == [0, 1, 2, 3] and len(p) == 4
