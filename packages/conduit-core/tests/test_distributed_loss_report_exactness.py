"""Shard faults: the exactness of loss reports and of deliveries that find a loss.

The first tests use the in-process harness of ``test_distributed_bookkeeping`` (real shard server
bodies, faults injected at exact points); the last one runs the same fault on the real local Ray
cluster of ``conftest.py`` with killed nodes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conduit.distributed import DistributedDataPlane, ShardServers
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import _ids, _plane, fake_ray  # noqa: E402, F401, I001

pytestmark = pytest.mark.timeout(300)


def _accounted(plane: DistributedDataPlane) -> tuple[list[int], int]:
    """(every handle some report names lost, sorted; the sum of the reports' ``recovered``)."""
    lost = sorted(np.concatenate([r.lost for r in plane.losses]).tolist()) if plane.losses else []
    return lost, sum(r.recovered for r in plane.losses)


def test_items_whose_only_other_replica_dies_during_re_replication_are_not_reported_recovered(fake_ray):  # noqa: F811
    """Items 0-3 live on shards a and b (replication 2), which both die. The check finds a:
    its items' copy from b fails, which finds b lost and reports 0-3 lost. a's report still said the four items
    were recovered ("their other replica survived, they stay deliverable"): every item was counted twice, once
    lost and once recovered."""
    p = _plane(["a", "b", "c", "d"], capacity=8, replication=2)
    p.ingest(id_batch(np.arange(4)), node="a")
    assert sorted(s for s, _ in p.index.segment(0)[2]) == [0, 1]
    p.servers[0].actor.dead = True
    p.servers[1].actor.dead = True
    found = p.check_health()
    assert sorted(r.shard for r in found) == [0, 1]
    lost, recovered = _accounted(p)
    assert lost == [0, 1, 2, 3]
    assert recovered == 0, f"reports {[str(r) for r in p.losses]} count lost items as recovered"
    assert all(r.re_replicated == 0 for r in p.losses)
    assert len(p) == 0 and p.under_replicated == 0
    p.ingest(id_batch(np.arange(4, 8)), node="c")  # the training loop goes on with the survivors
    assert _ids(p) == [4, 5, 6, 7]


def test_a_prioritized_draw_that_finds_a_loss_reports_every_probability_and_weight_against_the_survivors(fake_ray):  # noqa: F811
    """Items 0-3 (priority 1) on shard a, items 4-7 (priority 3) on shard b; b dies and the next delivery finds
    it. Draws that landed on b are redrawn from the survivors, whose total is 4, but the draws that had landed
    on a kept the probability 1/16 and the weight 1/3 they had against the total with b's items in it: one
    batch mixed two sampling distributions, and the kept draws' importance weights were wrong."""
    from conduit import PrioritizedSampler, Replay

    p = _plane(["a", "b"], capacity=8, semantics=Replay(PrioritizedSampler(alpha=1.0, beta=1.0), seed=3))
    p.ingest(id_batch(np.arange(4)), node="a", priorities=np.ones(4))
    p.ingest(id_batch(np.arange(4, 8)), node="b", priorities=np.full(4, 3.0))
    assert [s for s, _ in p.index.segment(1)[2]] == [1]
    p.servers[1].actor.dead = True
    batch, info = p.deliver(32)
    assert len(p.losses) == 1 and p.losses[0].lost.tolist() == [4, 5, 6, 7]
    assert set(check_payload(batch).tolist()) <= {0, 1, 2, 3}
    assert info.handles.tolist() == check_payload(batch).tolist()
    assert np.allclose(info.probabilities.numpy(), 0.25), f"probabilities {sorted(set(info.probabilities.tolist()))}"
    assert np.allclose(info.weights.numpy(), 1.0), f"weights {sorted(set(info.weights.tolist()))}"


def test_uniform_draws_after_a_loss_of_nearly_everything_still_deliver_the_survivors(fake_ray):  # noqa: F811
    """996 of 1000 items on shard a, 4 on shard b; a dies. Draws with replacement that land on a lost item were
    redrawn over the whole window, up to 256 times: with 4 survivors in 1000 a draw stays on lost items with
    probability 0.996 ** 256 = 0.36, so a delivery of 64 raised DistributedError ("the buffer has lost nearly
    everything") although items survive, and the training loop stopped."""
    from conduit import Replay

    p = _plane(["a", "b"], capacity=1000, semantics=Replay(seed=5))
    p.ingest(id_batch(np.arange(996)), node="a")
    p.ingest(id_batch(np.arange(996, 1000)), node="b")
    p.servers[0].actor.dead = True
    assert len(p.check_health()) == 1 and len(p) == 4
    for _ in range(3):
        batch, info = p.deliver(64)
        ids = check_payload(batch).tolist()
        assert ids == info.handles.tolist()
        assert set(ids) == {996, 997, 998, 999}, f"delivered {sorted(set(ids))}"
    batch, _ = p.deliver(4, replace=False)
    assert sorted(check_payload(batch).tolist()) == [996, 997, 998, 999]


def test_draws_without_replacement_after_a_loss_are_uniform_over_the_survivors(fake_ray):  # noqa: F811
    """Items 0-2 on shard a, item 3 on shard b; b dies. A draw of one item without replacement that landed on
    item 3 was redrawn with a generator seeded by the handles drawn, so it always became the same survivor:
    that item came half the time, the two others a quarter each (not uniform over the survivors)."""
    from conduit import Replay

    p = _plane(["a", "b"], capacity=4, semantics=Replay(seed=1))
    p.ingest(id_batch(np.arange(3)), node="a")
    p.ingest(id_batch(np.arange(3, 4)), node="b")
    p.servers[1].actor.dead = True
    assert len(p.check_health()) == 1 and len(p) == 3
    counts = np.zeros(4, dtype=np.int64)
    for _ in range(3000):
        batch, info = p.deliver(1, replace=False)
        counts[check_payload(batch).tolist()] += 1
    assert counts[3] == 0
    # uniform: 1000 each (a standard deviation of 26); the seeded redraw gave one survivor 1500
    assert counts[:3].max() < 1200, f"draws per item {counts[:3].tolist()}: not uniform over the survivors"
    batch, _ = p.deliver(3, replace=False)
    assert sorted(check_payload(batch).tolist()) == [0, 1, 2]

def _wait_dead(nodes: set[str]) -> None:
    """Until Ray declares ``nodes`` dead (a killed node's actors fail fast from then on)."""
    import ray

    deadline = time.monotonic() + 90
    while {n["NodeID"] for n in ray.nodes() if n.get("Alive")} & nodes:
        assert time.monotonic() < deadline, "Ray did not declare the killed nodes dead"
        time.sleep(0.2)


@pytest.mark.slow
def test_real_cluster_deliveries_that_find_killed_nodes_are_exact_and_the_loop_goes_on(cluster):
    """Both fixes on the real local cluster, for two buffers with shards on the same two victim nodes, killed once
    (one pair of nodes started and killed for both: each buffer's own next delivery finds the loss):

    * prioritized, replication 2: items 0-3 (priority 3) on both victims, items 4-7 (priority 1) on the head node
      and a victim. The reports name 0-3 lost and only 4-7 recovered (each item once), every draw's probability
      and weight is the survivors' (1/4 and 1), a checkpoint taken after the loss round-trips, and ingestion and
      delivery go on;
    * uniform: 996 of 1000 items on a victim. The next delivery (with replacement) finds the loss and delivers the
      4 survivors, and so do draws without replacement, a checkpoint round-trip and the ingestions after it."""
    from conduit import PrioritizedSampler, Replay

    va, vb = cluster.add_node(), cluster.add_node()
    own = ShardServers([va, vb, cluster.head, cluster.workers[0]])
    own_u = ShardServers([va, cluster.head])  # the uniform buffer's shard 0 on a victim
    p = DistributedDataPlane(ID_SCHEMA, capacity=16, replication=2, servers=own, measure=False, health_period=None,
                             timeout=10.0, transport="object_store", learner_node=vb,
                             semantics=Replay(PrioritizedSampler(alpha=1.0, beta=1.0), seed=11))
    u = DistributedDataPlane(ID_SCHEMA, capacity=1000, servers=own_u, measure=False, health_period=None,
                             timeout=10.0, transport="object_store", learner_node=cluster.head,
                             semantics=Replay(seed=7))
    try:
        # prioritized
        p.ingest(id_batch(np.arange(4)), node=va, priorities=np.full(4, 3.0))
        p.ingest(id_batch(np.arange(4, 8)), node=cluster.head, priorities=np.ones(4))
        assert sorted(s for s, _ in p.index.segment(0)[2]) == [0, 1], "the plan put items 0-3 elsewhere"
        # uniform
        u.ingest(id_batch(np.arange(996)), node=va)
        u.ingest(id_batch(np.arange(996, 1000)), node=cluster.head)
        assert [s for s, _ in u.index.segment(0)[2]] == [0] and [s for s, _ in u.index.segment(1)[2]] == [1]

        cluster.kill_node(va)
        cluster.kill_node(vb)
        _wait_dead({va, vb})

        # prioritized
        batch, info = p.deliver(32)
        ids = check_payload(batch).tolist()
        assert set(ids) <= {4, 5, 6, 7} and ids == info.handles.tolist()
        probs, weights = sorted(set(info.probabilities.tolist())), sorted(set(info.weights.tolist()))
        assert np.allclose(probs, 0.25) and np.allclose(weights, 1.0), f"probabilities {probs}, weights {weights}"
        assert sorted(r.shard for r in p.losses) == [0, 1]
        lost, recovered = _accounted(p)
        assert lost == [0, 1, 2, 3] and p.lost_items == 4
        assert recovered == 4, f"reports {[str(r) for r in p.losses]}: each survivor is recovered once, no lost one"
        assert p.check_health() == [] and len(p.losses) == 2  # nothing reported again
        state = p.state_dict()
        assert state["handles"].tolist() == [4, 5, 6, 7]
        p.load_state_dict(state)
        assert sorted(check_payload(p.read(p.live_handles())).tolist()) == [4, 5, 6, 7]
        p.ingest(id_batch(np.arange(8, 12)), priorities=np.ones(4))  # the training loop goes on
        batch, info = p.deliver(64)
        assert set(check_payload(batch).tolist()) == set(range(4, 12))
        assert p.update_priorities(info.handles, np.ones(64)) == 64

        # uniform
        batch, info = u.deliver(64)
        assert set(check_payload(batch).tolist()) == {996, 997, 998, 999}
        assert len(u.losses) == 1 and u.losses[0].lost.tolist() == list(range(996)) and len(u) == 4
        batch, _ = u.deliver(4, replace=False)
        assert sorted(check_payload(batch).tolist()) == [996, 997, 998, 999]
        u.load_state_dict(u.state_dict())
        u.ingest(id_batch(np.arange(1000, 1004)))  # the training loop goes on (evicting lost items first)
        batch, _ = u.deliver(64)
        assert set(check_payload(batch).tolist()) <= set(range(996, 1004)) and len(u) == 8
    finally:
        p.close()
        u.close()
        own.shutdown()
        own_u.shutdown()
