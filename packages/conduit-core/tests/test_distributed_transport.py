"""Delivery over torch.distributed on a real local Ray cluster: same bytes as the object store, bounded failures.

One 2-node ``ray.cluster_utils.Cluster`` serves the module. The learner is this process
(rank 0 of a gloo group with the shard servers) or, in one test, a Ray actor on the
worker node that forms its own group with the same servers.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import (  # noqa: E402
    ConfigurationError,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    Replay,
)
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((6,), torch.float32),
                          half=Field((3,), torch.bfloat16), tokens=Field((), torch.int32, ragged=True))


def _batch(ids: np.ndarray) -> dict:
    g = torch.Generator().manual_seed(int(ids[0]))
    n = len(ids)
    return {"id": torch.as_tensor(ids, dtype=torch.int64), "obs": torch.randn(n, 6, generator=g),
            "half": torch.randn(n, 3, generator=g).to(torch.bfloat16),
            "tokens": [torch.full((int(i) % 5 + 1,), int(i), dtype=torch.int32) for i in ids]}


def _same_bytes(a, b) -> bool:
    for name in SCHEMA:
        x, y = a[name], b[name]
        if SCHEMA[name].ragged:
            if not (torch.equal(x.lengths, y.lengths) and torch.equal(x.values.view(torch.uint8),
                                                                      y.values.view(torch.uint8))):
                return False
        elif not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            return False
    return a.batch_size == b.batch_size


def _run(plane, nodes, kind: str) -> list:
    """Ingest from both nodes, then deliver a few batches; returns (batch, info) pairs."""
    out = []
    if kind == "on_policy":
        for i, node in enumerate(nodes):
            plane.ingest(_batch(np.arange(40 * i, 40 * i + 40)), version=0, node=node)
        plane.seal()
        while True:
            b, info = plane.deliver()
            out.append((b, info))
            if info.last:
                return out
    for i, node in enumerate(nodes):
        plane.ingest(_batch(np.arange(50 * i, 50 * i + 50)), node=node)
    for _ in range(4):
        b, info = plane.deliver(64)
        out.append((b, info))
        if kind == "prioritized":
            plane.update_priorities(info.handles, (b.tensor("id") % 7 + 1).double())
    return out


def _semantics(kind: str):
    if kind == "uniform":
        return Replay(seed=7)
    if kind == "prioritized":
        return Replay(PrioritizedSampler(alpha=0.8, beta=0.5), seed=7)
    return OnPolicy(num_minibatches=3, num_epochs=2, seed=7)


@pytest.mark.parametrize("kind", ["uniform", "prioritized", "on_policy"])
def test_torch_transport_delivers_the_same_bytes_as_the_object_store(cluster, servers, kind):
    """Same seed, same ingestion: every delivered batch is bitwise equal through both transports."""
    nodes = [cluster.head, cluster.workers[0]]
    results = {}
    for transport in ("object_store", "torch"):
        with DistributedDataPlane(SCHEMA, capacity=200, semantics=_semantics(kind), servers=servers,
                                  health_period=None, transport=transport) as p:
            assert p.transports == [transport] * 2
            results[transport] = _run(p, nodes, kind)
            assert p.transports == [transport] * 2, "the torch group was retired during the run"
    assert len(results["torch"]) == len(results["object_store"]) >= 4
    for (a, ia), (b, ib) in zip(results["object_store"], results["torch"], strict=True):
        assert _same_bytes(a, b)
        assert torch.equal(ia.handles, ib.handles)
    seen = set(np.concatenate([b.tensor("id").numpy() for b, _ in results["torch"]]).tolist())
    assert any(i < 40 for i in seen) and any(i >= 50 for i in seen), "both shards should have delivered"


def test_torch_links_are_measured_like_the_object_store_links(cluster, servers):
    g = servers.torch_group()
    prof = g.links
    assert prof.transport == "torch" and prof.learner_node == cluster.head
    assert set(prof.links) == {(cluster.head, cluster.head), (cluster.workers[0], cluster.head)}
    for ln in prof.links.values():
        assert ln.overhead_s > 0 and ln.seconds(4 << 20) > ln.seconds(4 << 10) > 0


def test_auto_uses_a_group_only_where_one_exists(cluster):
    """``auto`` forms no group; once this process has one with the servers, ``auto`` picks per shard by measurement."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        with DistributedDataPlane(SCHEMA, capacity=64, servers=group, health_period=None) as p:
            assert p.transports == ["object_store", "object_store"]
            assert group.torch_group(create=False) is None
        g = group.torch_group()
        with DistributedDataPlane(SCHEMA, capacity=64, servers=group, health_period=None) as p:
            osl, tl = p.links, g.links
            mib = float(1 << 20)
            expect = ["torch" if tl.seconds(n, cluster.head, mib) < osl.seconds(n, cluster.head, mib)
                      else "object_store" for n in group.nodes]
            assert p.transports == expect
            p.ingest(_batch(np.arange(20)), node=cluster.workers[0])
            assert sorted(p.deliver(100)[0].tensor("id").unique().tolist()) == list(range(20))
        with DistributedDataPlane(SCHEMA, capacity=64, servers=group, health_period=None, measure=False) as p:
            assert p.transports == ["object_store", "torch"]  # unmeasured: torch for the shard off this node
        with pytest.raises(ConfigurationError):
            DistributedDataPlane(SCHEMA, capacity=64, servers=group, transport="carrier-pigeon")
    finally:
        group.shutdown()


def test_a_learner_in_a_ray_actor_joins_a_group_with_the_servers(cluster, servers):
    """The learner runs in an actor on the worker node: it forms its own group and gets the same bytes."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Learner:
        def run(self, group, nodes):
            from conduit.distributed._ray import current_node_id

            out = {"node": current_node_id()}
            got = {}
            for transport in ("object_store", "torch"):
                with DistributedDataPlane(SCHEMA, capacity=200, semantics=_semantics("uniform"), servers=group,
                                          health_period=None, transport=transport, measure=False) as p:
                    out[transport] = p.transports
                    got[transport] = _run(p, nodes, "uniform")
            out["same"] = all(_same_bytes(a, b) for (a, _), (b, _) in zip(got["object_store"], got["torch"],
                                                                          strict=True))
            out["rank_of_learner"] = 0 if group.torch_group(create=False) is not None else -1
            return out

    actor = Learner.options(scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.workers[0], False)).remote()
    try:
        out = ray.get(actor.run.remote(servers, [cluster.head, cluster.workers[0]]), timeout=240)
    finally:
        ray.kill(actor)
    assert out["node"] == cluster.workers[0]
    assert out["torch"] == ["torch", "torch"] and out["object_store"] == ["object_store"] * 2
    assert out["same"] and out["rank_of_learner"] == 0


def _pid(group, shard):
    return group.servers[shard].pid


def test_a_peer_dying_mid_transfer_is_a_reported_loss_not_a_hang(cluster):
    """The worker's server freezes while the learner waits on its rows, then dies: the delivery ends
    within the timeout, the shard's items are reported lost, and training goes on from the other shard."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        with DistributedDataPlane(SCHEMA, capacity=200, servers=group, health_period=None, transport="torch",
                                  timeout=20.0, measure=False) as p:
            h_head = p.ingest(_batch(np.arange(0, 30)), node=cluster.head)
            h_work = p.ingest(_batch(np.arange(100, 130)), node=cluster.workers[0])
            p.deliver(32)
            pid = _pid(group, 1)
            os.kill(pid, signal.SIGSTOP)
            result: dict = {}

            def learner():
                t0 = time.monotonic()
                try:
                    result["batch"] = p.deliver(256)[0]
                except Exception as e:  # noqa: BLE001 - recorded for the assertion below
                    result["error"] = e
                result["seconds"] = time.monotonic() - t0

            th = threading.Thread(target=learner)
            th.start()
            time.sleep(1.5)  # the learner now waits on the frozen peer's rows
            assert th.is_alive(), "the delivery should be waiting on the frozen peer"
            os.kill(pid, signal.SIGKILL)
            th.join(timeout=60)
            assert not th.is_alive(), "the delivery hung after its peer died"
            assert "error" not in result, result.get("error")
            assert len(p.losses) == 1 and p.losses[0].shard == 1
            assert sorted(p.losses[0].lost.tolist()) == h_work.tolist()
            ids = result["batch"].tensor("id").numpy()
            assert set(ids.tolist()) <= set(range(30))
            assert group.torch_group(create=False).broken, "a failed transfer retires the group"
            assert p.transports == ["object_store", "object_store"]
            for _ in range(3):  # training continues
                b, info = p.deliver(16)
                assert set(b.tensor("id").tolist()) <= set(range(30))
            assert len(p) == len(h_head)
    finally:
        group.shutdown()


@pytest.mark.slow
def test_a_hung_peer_times_out_with_a_loss_report(cluster):
    """A server that stops answering (frozen, not dead) is lost after the timeout; nothing waits longer."""
    group = ShardServers([cluster.head, cluster.workers[0]])
    pid = _pid(group, 1)
    try:
        with DistributedDataPlane(SCHEMA, capacity=200, servers=group, health_period=None, transport="torch",
                                  timeout=3.0, measure=False) as p:
            p.ingest(_batch(np.arange(0, 30)), node=cluster.head)
            h_work = p.ingest(_batch(np.arange(100, 130)), node=cluster.workers[0])
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            b, _ = p.deliver(64)
            took = time.monotonic() - t0
            assert took < 4 * 3.0 + 5, f"the delivery took {took:.1f} s with a 3 s timeout"
            assert set(b.tensor("id").tolist()) <= set(range(30))
            assert len(p.losses) == 1 and sorted(p.losses[0].lost.tolist()) == h_work.tolist()
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        group.shutdown()


@pytest.mark.gpu
def test_nccl_transport_delivers_the_same_bytes(cluster):
    """Where CUDA exists: the nccl backend moves the same bytes (needs a GPU per rank: 2 servers + learner)."""
    if torch.cuda.device_count() < 3:
        pytest.skip("nccl needs one CUDA device per rank (3 here); this machine has fewer")
    group = ShardServers([cluster.head, cluster.workers[0]])
    try:
        group.torch_group(backend="nccl")
        results = {}
        for transport in ("object_store", "torch"):
            with DistributedDataPlane(SCHEMA, capacity=200, semantics=_semantics("uniform"), servers=group,
                                      health_period=None, transport=transport, measure=False) as p:
                results[transport] = _run(p, [cluster.head, cluster.workers[0]], "uniform")
        for (a, _), (b, _) in zip(results["object_store"], results["torch"], strict=True):
            assert _same_bytes(a, b)
    finally:
        group.shutdown()
