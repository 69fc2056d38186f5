"""The multi-node driver in-process (the harness of test_distributed_bookkeeping): retries, undo, loads, refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import ExperienceBatch
from conduit.distributed import plane as plane_mod
from conduit.distributed.plane import DistributedDataPlane
from conduit.testing.reference import ID_SCHEMA, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import RAGGED, _ids, _plane, _ragged_batch, _servers, _two_producer_batch, fake_ray  # noqa: E402, F401, I001

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fake_ray")]


def test_rows_stored_earlier_in_one_ingestion_are_not_released_by_its_retry_on_the_same_shard():
    """Run A lands on shard 0, run B's shard 1 dies, so B is retried on shard 0 in a second round. That
    write's release point must not pass A's rows, which the index does not list yet: it did (shard 0 held
    nothing the index named, so it released everything it held), and reading A then failed with "the
    buffer's index and this shard disagree"."""
    p = _plane(["a", "b"], capacity=100)
    p.servers[1].actor.die_after_appends = 0
    h = p.ingest_now(_two_producer_batch(p, [10, 11, 12, 13]))
    assert h.tolist() == [0, 1, 2, 3] and p.alive_shards == [0]
    assert _ids(p) == [10, 11, 12, 13] and not p.lost_items


def test_a_shard_that_refuses_for_room_sends_its_run_to_a_shard_that_keeps_the_first_rows():
    """As above, with shard 1 refusing its run for room (its ragged pool overflows: CapacityError)."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=8, ragged_capacity=16)
    p.ingest(_ragged_batch([0], 12), node="b")  # shard 1's pool: 12 of 16 elements used
    b = _ragged_batch([10, 11, 12, 13], 3)
    producer = torch.tensor([p._producer_id("a")] * 2 + [p._producer_id("b")] * 2, dtype=torch.int32)
    h = p.ingest_now(ExperienceBatch({**b, plane_mod._PRODUCER: producer}, 4))
    assert h.tolist() == [1, 2, 3, 4]
    got = p.read(p.live_handles())
    assert got.tensor("id").tolist() == [0, 10, 11, 12, 13]
    assert got["tok"].lengths.tolist() == [12, 3, 3, 3, 3]


def test_a_failed_ingestion_keeps_the_replicas_made_for_a_shard_lost_in_it():
    """Replication 2. The ingestion's write loses shard 1 (so the older items, on shards 0 and 1, get a new
    copy on shard 2) and shard 0 cannot read the batch (TransferError). Undoing the ingestion must not
    remove that new copy: the index lists it, and once shard 0 is lost too, the items are read from it
    (the undo used to truncate shard 2 back to empty, and reading failed: "the index and this shard disagree")."""
    from conduit.distributed.errors import TransferError

    p = _plane(["a", "b", "c"], capacity=100, replication=2)
    p.ingest(id_batch(np.arange(4)), node="a")  # on shards 0 and 1
    p.servers[1].actor.die_after_appends = p.servers[1].actor.appends
    p.servers[0].actor.fail_appends_after = p.servers[0].actor.appends
    with pytest.raises(TransferError):
        p.ingest(id_batch(np.arange(10, 14)), node="a")
    assert p.alive_shards == [0, 2] and p.losses[0].recovered == 4 and p.losses[0].re_replicated == 4
    p._lose(0, "test: shard 0 lost")
    assert _ids(p) == [0, 1, 2, 3] and not p.lost_items


def test_a_load_that_stops_part_way_takes_the_lost_items_out_of_the_sum_tree():
    """Prioritized: the checkpoint's items that could not be loaded are lost, so, as for a lost shard, they
    must leave the global sum tree: they stayed in its total, so every later draw reported probabilities
    (and importance weights) as if they could still be drawn."""
    from conduit.distributed.errors import ClusterError
    from conduit.semantics.replay import PrioritizedSampler, Replay

    p = _plane(["a"], capacity=8, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=0))
    p.ingest(id_batch(np.arange(6)))
    state = p.state_dict()
    p.servers[0].actor.fail_appends_after = p.servers[0].actor.appends
    with pytest.raises(ClusterError, match="Loading stopped"):
        p.load_state_dict(state)
    p.servers[0].actor.fail_appends_after = None
    p.ingest(id_batch([70, 71]))
    _, info = p.deliver(50)
    assert info.probabilities is not None
    assert torch.allclose(info.probabilities, torch.full((50,), 0.5, dtype=info.probabilities.dtype)), (
        f"two live items of equal priority must each have probability 0.5, got {info.probabilities.unique()}")


@pytest.mark.parametrize("damage", ["missing_key", "short_column", "unsorted_handles", "not_a_dict"])
def test_a_damaged_checkpoint_is_refused_typed_and_the_buffer_keeps_its_items(damage):
    """A checkpoint whose parts do not agree (a column shorter than its handles, handles out of order, a key
    missing) must be refused with a ConfigurationError before the shards are reopened: it got a raw KeyError,
    or the shards were emptied first and the load then failed part way, losing the buffer's contents."""
    from conduit.errors import ConfigurationError

    p = _plane(["a", "b"], capacity=10)
    p.ingest(id_batch(np.arange(6)))
    state = p.state_dict()
    if damage == "missing_key":
        del state["handles"]
    elif damage == "short_column":
        state["data"] = {k: v[:3] for k, v in state["data"].items()}
    elif damage == "unsorted_handles":
        state["handles"] = state["handles"].flip(0)
    else:
        state = [state]
    with pytest.raises(ConfigurationError, match="checkpoint"):
        p.load_state_dict(state)
    assert _ids(p) == list(range(6)) and len(p) == 6 and not p.lost_items


def test_a_buffer_whose_scheduler_refuses_it_leaves_no_partition_on_the_servers():
    """The constructor raises ConfigurationError when the scheduler refuses the semantics; the partitions it
    had opened on the (shared) servers must be dropped again: they stayed, holding memory for good (and
    servers the buffer started itself kept running)."""
    from conduit.errors import ConfigurationError
    from conduit.scheduling.overlapped import Overlapped
    from conduit.semantics.onpolicy import OnPolicy

    servers = _servers(["a", "b"])
    with pytest.raises(ConfigurationError, match="g_del"):
        DistributedDataPlane(ID_SCHEMA, capacity=10, servers=servers, learner_node="a", measure=False,
                             health_period=None, transport="object_store",
                             semantics=OnPolicy(num_minibatches=2), scheduler=Overlapped(g_del=2))
    assert [s.actor.server.ping() for s in servers.servers] == [0, 0], "a partition of the refused buffer stayed"


def test_a_load_that_stops_after_a_lost_range_counts_each_lost_item_once():
    """The checkpoint starts with items lost before it was written (handles 0-3), and loading stops at its
    first stored run: the buffer holds nothing and 8 lost items. The range lost before was recorded twice
    (as the gap before the run, then again in "the rest of the checkpoint"), so len() came out negative."""
    from conduit.distributed.errors import ClusterError

    p = _plane(["a", "b"], capacity=8)
    p.ingest(id_batch(np.arange(4)), node="a")
    p.ingest(id_batch(np.arange(4, 8)), node="b")
    p.servers[0].actor.dead = True
    p._lose(0, "test: shard 0 lost")
    state = p.state_dict()
    assert state["handles"].tolist() == [4, 5, 6, 7]
    p.servers[1].actor.fail_appends_after = p.servers[1].actor.appends
    with pytest.raises(ClusterError, match="Loading stopped after 0 of the checkpoint's 4 items"):
        p.load_state_dict(state)
    assert p.index.lost_in_window() == 8 and len(p) == 0, (p.index.lost_in_window(), len(p))
    p.servers[1].actor.fail_appends_after = None
    p.ingest(id_batch([70, 71]))
    assert len(p) == 2 and _ids(p) == [70, 71]
