"""Core's Overlapped scheduler on the multi-node buffer: background ingestion into the shards and
prefetch from them, with the prefetch conformance checks and the suites run over it.

One 2-node ``ray.cluster_utils.Cluster`` serves the module (head = learner, one worker).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import OnPolicy, Overlapped, PrioritizedSampler, Replay  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.distributed.testing import (  # noqa: E402
    DistributedOnPolicyEndpoint,
    DistributedReplayEndpoint,
)
from conduit.testing import FreshnessSuite, ReplaySuite  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _shard_of(plane, handles) -> np.ndarray:
    h = np.asarray(handles)
    shard, _ = plane.index.replicas(plane.index.segments_of(h), h)
    return shard[:, 0]


def test_ingest_returns_at_once_and_keeps_the_producers_node(cluster, servers):
    """Hand-overs are queued (None returned), stored in order by the worker, each on its producer's node."""
    sched = Overlapped(g_ing=1, g_del=2, queue_depth=2)
    with DistributedDataPlane(ID_SCHEMA, capacity=400, servers=servers, health_period=None, scheduler=sched) as p:
        for i in range(6):
            node = cluster.workers[0] if i % 2 else cluster.head
            assert p.ingest(id_batch(np.arange(20 * i, 20 * i + 20)), node=node) is None
        p.flush()
        assert len(p) == 120
        h = p.live_handles()
        assert check_payload(p.read(h)).tolist() == list(range(120)), "queued batches were reordered"
        on = _shard_of(p, h).reshape(6, 20)
        assert (on[1::2] == 1).all() and (on[0::2] == 0).all()


@pytest.mark.parametrize(("overlap", "g_ing", "copy"), [(True, 3, False), (False, 3, False), (True, 1, True)],
                         ids=["coalesced-background", "coalesced-in-caller", "copied-on-ingest"])
def test_coalesced_ingestion_keeps_each_batchs_producer_node(cluster, servers, overlap, g_ing, copy):
    """Hand-overs coalesced into one write (``g_ing > 1``) or copied on ingest are still stored each on its
    producer's shard, in order, once, and the coalescing itself is kept (one write per group)."""
    producers = [1, 1, 0, 1, 0, 0]  # shard = node: servers are [head, worker]
    nodes = [cluster.head, cluster.workers[0]]
    sched = Overlapped(g_ing=g_ing, g_del=1, overlap=overlap, queue_depth=8, copy_on_ingest=copy)
    with DistributedDataPlane(ID_SCHEMA, capacity=400, servers=servers, health_period=None, scheduler=sched) as p:
        t0 = time.perf_counter()
        for i, s in enumerate(producers):
            p.ingest(id_batch(np.arange(20 * i, 20 * i + 20)), node=nodes[s])
        p.flush()
        writes = [r for r in p.telemetry.since(t0) if r.kind == "ingest"]
        assert len(writes) == len(producers) // g_ing, "the hand-overs were not coalesced as g_ing asks"
        assert len(p) == 120
        h = p.live_handles()
        assert check_payload(p.read(h)).tolist() == list(range(120)), "coalesced batches were reordered"
        on = _shard_of(p, h).reshape(len(producers), 20)
        assert (on == np.array(producers)[:, None]).all(), f"rows left their producer's node: {on[:, 0].tolist()}"


class _CountingActor:
    """A shard server's actor handle whose ``gather`` requests are counted (everything else passes through)."""

    def __init__(self, actor):
        self._actor, self.gathers = actor, 0

    def __getattr__(self, name):
        return getattr(self._actor, name)

    @property
    def gather(self):
        outer = self

        class _Method:
            def remote(self, *args, **kwargs):
                outer.gathers += 1
                return outer._actor.gather.remote(*args, **kwargs)

        return _Method()


def test_replay_selections_read_together_take_one_request_per_shard(cluster, servers):
    """``gather_now`` of several replay selections (a prefetch chunk, or several learners' batches) sends each
    shard one request for all of their rows, and returns every selection's rows back to back, in draw order."""
    with DistributedDataPlane(ID_SCHEMA, capacity=400, servers=servers, health_period=None, measure=False,
                              semantics=Replay(seed=3)) as p:
        for i, node in enumerate([cluster.head, cluster.workers[0]] * 2):
            p.ingest(id_batch(np.arange(50 * i, 50 * i + 50)), node=node)
        sels = p.select_now([32, 32, 32, 32])
        spies = [_CountingActor(servers[s].actor) for s in range(2)]
        try:
            for s in range(2):
                servers[s].actor = spies[s]
            batch = p.gather_now(sels)
        finally:
            for s in range(2):
                servers[s].actor = spies[s]._actor
        assert [s.gathers for s in spies] == [1, 1], "a shard got one request per selection, not one in all"
        drawn = torch.cat([s.info.handles for s in sels])
        assert check_payload(batch).tolist() == drawn.tolist()  # handle == id here
        assert set(_shard_of(p, drawn).tolist()) == {0, 1}


class _Primitives:
    """Deliveries made the way a prefetching scheduler makes them, with the buffer's primitives: a real selection,
    then a gather into buffers allocated at exactly the size asked (what a fresh prefetch buffer does)."""

    def __init__(self, plane):
        self.plane, self.asked = plane, []

    def _out(self, rows):
        self.asked.append(rows)
        return {n: torch.empty((rows, *ID_SCHEMA[n].shape), dtype=ID_SCHEMA[n].dtype) for n in ID_SCHEMA.fixed}

    def deliver(self):
        (sel,) = self.plane.select_now([None])
        batch = self.plane.gather_now([sel], self._out)
        self.plane.release_now(sel)
        return batch, sel.info


def _on_policy_run_with_a_crashed_shard(cluster, scheduler, primitives=False):
    """Minibatches of 20, 20, 20 and 10 items per epoch (no shuffle), the 2nd and 4th held by a shard whose server
    crashes before delivery; returns each delivery's (epoch, minibatch, last, ids) and the buffer's loss reports."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    victim_pid = servers[1].pid
    try:
        with DistributedDataPlane(ID_SCHEMA, capacity=200, servers=servers, health_period=None, measure=False,
                                  reuse=1.0, timeout=20.0, scheduler=scheduler,
                                  semantics=OnPolicy(minibatch_size=20, num_epochs=2, shuffle=False)) as p:
            for i, node in enumerate([cluster.head, cluster.workers[0]] * 2):
                p.ingest(id_batch(np.arange(20 * i, min(20 * i + 20, 70))), version=0, node=node)
            p.seal()
            assert _shard_of(p, p.live_handles()).tolist() == [0] * 20 + [1] * 20 + [0] * 20 + [1] * 10
            os.kill(victim_pid, signal.SIGKILL)  # the worker's shard server crashes: items 20-39 and 60-69 are gone
            driver = _Primitives(p) if primitives else p
            out = []
            while True:
                batch, info = driver.deliver()
                ids = check_payload(batch)
                assert info.handles.tolist() == ids.tolist()  # handle == id here
                out.append((info.epoch, info.minibatch, info.last, ids.tolist()))
                if info.last or len(out) > 8:
                    break
            if primitives:  # buffers asked per delivery; epoch 0's lost 10-item minibatch was replaced by a
                # 20-item one, so the buffers were grown to 20 (the 20-item skips reuse theirs)
                assert driver.asked == [20, 20, 10, 20, 20, 10], driver.asked
            return out, list(p.losses)
    finally:
        servers.shutdown()


@pytest.mark.parametrize("driver", ["synchronous", "overlapped", "primitives"])
def test_on_policy_minibatch_whose_items_were_all_lost_is_skipped_as_the_synchronous_buffer_does(cluster, driver):
    """A minibatch whose items all died with their shard is skipped and reported (a LossReport names them), with
    or without prefetch (and through the primitives a prefetching scheduler uses, where epoch 0's lost 10-item
    minibatch is replaced by a 20-item one: the buffers grow); only the rollout's last minibatch, when it is all
    lost, comes back empty, with ``info.last`` set, to end the rollout."""
    out, losses = _on_policy_run_with_a_crashed_shard(cluster, Overlapped() if driver == "overlapped" else None,
                                                      primitives=driver == "primitives")
    assert [(e, m, last) for e, m, last, _ in out] == [(0, 0, False), (0, 2, False), (1, 0, False), (1, 2, False),
                                                       (1, 3, True)]
    assert [ids for *_, ids in out] == [list(range(20)), list(range(40, 60)), list(range(20)),
                                        list(range(40, 60)), []]
    assert len(losses) == 1 and losses[0].shard == 1
    assert sorted(losses[0].lost.tolist()) == list(range(20, 40)) + list(range(60, 70))


def test_prefetch_reads_the_next_batch_from_the_shards_while_the_learner_updates(cluster, servers):
    sched = Overlapped(g_ing=1, g_del=2)
    with DistributedDataPlane(ID_SCHEMA, capacity=400, servers=servers, health_period=None, scheduler=sched) as p:
        p.ingest(id_batch(np.arange(100)), node=cluster.head)
        p.ingest(id_batch(np.arange(100, 200)), node=cluster.workers[0])
        seen = set()
        for _ in range(8):
            b, info = p.deliver(32)
            ids = check_payload(b)
            assert (info.handles.numpy() == ids).all()  # id == handle in this buffer
            seen |= set(ids.tolist())
            time.sleep(0.05)  # the learner's update: the next chunk is read meanwhile
        assert sched.prefetch_hits >= 4, (sched.prefetch_hits, sched.prefetch_misses)
        assert any(i < 100 for i in seen) and any(i >= 100 for i in seen)


@pytest.mark.parametrize("transport", ["object_store", "torch"])
def test_on_policy_prefetch_delivers_the_synchronous_sequence(cluster, servers, transport):
    """On-policy prefetch only predicts: the minibatches are exactly the synchronous buffer's, epoch by epoch."""
    runs = {}
    for name, sched in (("sync", None), ("overlapped", Overlapped(g_ing=0.5))):
        with DistributedDataPlane(ID_SCHEMA, capacity=400, servers=servers, health_period=None, transport=transport,
                                  semantics=OnPolicy(num_minibatches=4, num_epochs=2, seed=9), scheduler=sched) as p:
            out = []
            for v in range(2):
                p.set_policy_version(v)
                p.ingest(id_batch(np.arange(100 * v, 100 * v + 60)), version=v, node=cluster.head)
                p.ingest(id_batch(np.arange(100 * v + 60, 100 * v + 100)), version=v, node=cluster.workers[0])
                p.seal()
                while True:
                    b, info = p.deliver()
                    out.append((info.version, info.epoch, check_payload(b).tolist()))
                    if info.last:
                        break
            runs[name] = out
            if sched is not None:
                assert sched.prefetch_hits > 0
    assert runs["overlapped"] == runs["sync"]
    assert len(runs["sync"]) == 16


def test_prioritized_prefetch_sees_updates_within_the_declared_staleness(cluster, servers):
    sched = Overlapped(g_del=2)
    with DistributedDataPlane(ID_SCHEMA, capacity=50, servers=servers, health_period=None, scheduler=sched,
                              semantics=Replay(PrioritizedSampler(alpha=1.0), seed=1)) as p:
        p.ingest(id_batch(np.arange(25)), node=cluster.head)
        p.ingest(id_batch(np.arange(25, 50)), node=cluster.workers[0])
        assert sched.priority_staleness == 2
        prio = torch.full((50,), 1e-6)
        prio[49] = 1e6
        b, info = p.deliver(64)
        p.update_priorities(info.handles, prio[info.handles])
        shares = []
        for _ in range(5):
            b, info = p.deliver(64)
            shares.append(float((check_payload(b) == 49).mean()))
            p.update_priorities(info.handles, prio[info.handles])
        assert min(shares[2:]) > 0.99, shares


# -- the suites (prefetch checks included) over an overlapped multi-node buffer -------------------------------------
class TestOverlappedDistributedReplay(ReplaySuite):
    @pytest.fixture(autouse=True)
    def _servers(self, servers):
        self.servers = servers

    def make_replay(self, **kwargs):
        return DistributedReplayEndpoint(self.servers, scheduler=Overlapped(g_ing=2, g_del=2), **kwargs)


class TestOverlappedDistributedFreshness(FreshnessSuite):
    @pytest.fixture(autouse=True)
    def _servers(self, servers):
        self.servers = servers

    def make_on_policy(self, **kwargs):
        return DistributedOnPolicyEndpoint(self.servers, scheduler=Overlapped(g_ing=0.5), **kwargs)
