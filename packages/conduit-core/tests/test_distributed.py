"""The multi-node tier on a real local Ray cluster: pinning, routing, union semantics, conformance.

One 2-node ``ray.cluster_utils.Cluster`` (head + one worker, separate raylets and object
stores on this machine) serves the whole module; shard servers on both nodes are shared
by the buffers the tests build. The learner is this process, on the head node.
"""

from __future__ import annotations

import subprocess
import sys

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
    SchemaError,
)
from conduit.distributed import DistributedDataPlane, stage  # noqa: E402
from conduit.distributed.errors import ClusterError  # noqa: E402
from conduit.distributed.testing import (  # noqa: E402
    DistributedOnPolicyEndpoint,
    DistributedReplayEndpoint,
)
from conduit.testing import ConcurrencySuite, FreshnessSuite, ReplaySuite  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402
from conduit.testing.suites.base import chi_square_p  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _plane(servers, **kwargs):
    kwargs.setdefault("capacity", 1000)
    kwargs.setdefault("health_period", None)
    return DistributedDataPlane(ID_SCHEMA, servers=servers, **kwargs)


def _on_shard(plane, handles) -> np.ndarray:
    """The shard holding each handle's first replica (from the index)."""
    h = np.asarray(handles)
    shard, _ = plane.index.replicas(plane.index.segments_of(h), h)
    return shard[:, 0]


def _span(plane, shard: int) -> tuple[int, int]:
    import ray

    return tuple(ray.get(plane.servers[shard].actor.span.remote(plane.buffer_id), timeout=30))


# -- no cluster needed -----------------------------------------------------------------------------
def test_import_conduit_needs_no_ray_and_without_ray_init_a_typed_error_says_what_to_do():
    """``import conduit`` (and even ``conduit.distributed``) does not import Ray; a plane built without ``ray.init``
    raises ClusterError naming it. (One fresh interpreter checks both, in that order: the build imports Ray.)"""
    code = ("import sys, conduit, conduit.distributed\n"
            "print('ray' in sys.modules)\n"
            "from conduit.distributed import DistributedDataPlane, ClusterError\n"
            "from conduit.testing.reference import ID_SCHEMA\n"
            "try:\n    DistributedDataPlane(ID_SCHEMA, capacity=8)\n"
            "except ClusterError as e:\n    print('ClusterError', 'ray.init' in str(e))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines() == ["False", "ClusterError True"], out.stdout + out.stderr


# -- pinning and routing ---------------------------------------------------------------------------
def test_servers_are_pinned_to_their_nodes(cluster, servers):
    import ray

    assert servers.nodes == [cluster.head, cluster.workers[0]]
    for info in servers.servers:
        node, pid = ray.get(info.actor.ready.remote(), timeout=30)
        assert node == info.node_id and pid == info.pid


def test_links_are_measured_between_every_pair(cluster, servers):
    prof = servers.links()
    nodes = set(servers.nodes) | {prof.learner_node}
    assert prof.learner_node == cluster.head
    assert {(a, b) for a in nodes for b in nodes} <= set(prof.links)
    for ln in prof.links.values():
        assert ln.overhead_s > 0 and ln.peak_bandwidth > 0
        assert ln.seconds(4 << 20) > ln.seconds(4 << 10) > 0


def test_ingestion_goes_to_the_producers_node(cluster, servers):
    """With reuse 1 the plan keeps items on the node that produced them, and the shard there holds them."""
    with _plane(servers) as p:
        ha = p.ingest(id_batch(np.arange(40)), node=cluster.workers[0])
        hb = p.ingest(id_batch(np.arange(40, 70)), node=cluster.head)
        assert (_on_shard(p, ha) == 1).all() and (_on_shard(p, hb) == 0).all()
        assert _span(p, 1) == (0, 40) and _span(p, 0) == (0, 30)
        got = p.read(torch.cat([ha, hb]))
        assert check_payload(got).tolist() == list(range(70))


def test_staged_experience_goes_from_the_producer_actor_to_its_nodes_shard(cluster, servers):
    """A producer actor on the worker node stages a batch in its object store; the worker's shard stores it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def produce(ids):
        return stage(id_batch(ids), ID_SCHEMA)

    ref = ray.get(produce.options(scheduling_strategy=NodeAffinitySchedulingStrategy(cluster.workers[0], False))
                  .remote(np.arange(100, 164)), timeout=120)
    assert ref.node_id == cluster.workers[0] and ref.batch_size == 64
    with _plane(servers) as p:
        h = p.ingest(ref)
        assert (_on_shard(p, h) == 1).all()
        batch, info = p.deliver(256)
        ids = check_payload(batch)
        assert set(ids.tolist()) <= set(range(100, 164)) and len(set(ids.tolist())) > 32


def test_high_reuse_pulls_large_batches_to_the_learners_node(cluster, servers):
    """With reuse 8, an item crosses the network once at ingestion instead of 8 times at delivery; with reuse 1
    it crosses once wherever it goes, and stays on the producer's node.

    The plan is given declared links (10 GB/s within a node, 1 GB/s across): on one machine the measured
    same-node and cross-node paths are close, and load can swap their order (the outcome would follow the noise).
    """
    from conduit.distributed import LinkProfile
    from conduit.placement.profile import LinkCost

    nodes = [cluster.head, cluster.workers[0]]
    declared = LinkProfile({(a, b): LinkCost.constant(10.0 if a == b else 1.0, overhead_us=100.0)
                            for a in nodes for b in nodes}, learner_node=cluster.head)
    schema = ExperienceSchema(id=Field((), torch.int64), obs=Field((1024,), torch.float32))
    n = 512  # 2 MiB: transfer time, not call latency, decides
    batch = {"id": torch.arange(n), "obs": torch.zeros(n, 1024)}
    for reuse, shard in ((8.0, 0), (1.0, 1)):
        with DistributedDataPlane(schema, capacity=4 * n, servers=servers, reuse=reuse, links=declared,
                                  health_period=None) as p:
            assert p.links is declared
            order = p.plan.order(cluster.workers[0], n * (8 + 4096))
            assert order[0] == shard, f"reuse {reuse}: the plan should prefer shard {shard}, ranked {order}"
            h = p.ingest(batch, node=cluster.workers[0])
            assert (_on_shard(p, h) == shard).all()
            assert p.read(h).tensor("id").tolist() == list(range(n))


def test_bad_input_leaves_the_buffer_unchanged(servers):
    with _plane(servers) as p:
        p.ingest(id_batch(np.arange(10)))
        with pytest.raises(SchemaError):
            p.ingest({"id": torch.arange(3)})
        with pytest.raises(ConfigurationError):
            p.ingest(id_batch(np.arange(3)), priorities=torch.ones(3))
        assert len(p) == 10 and p.index.next_handle == 10


def test_a_checkpoint_of_other_semantics_is_refused_and_changes_nothing(servers):
    with _plane(servers, semantics=OnPolicy(num_minibatches=2)) as donor, _plane(servers) as p:
        donor.ingest(id_batch(np.arange(4)), version=0)
        p.ingest(id_batch(np.arange(100, 110)))
        rng = p.semantics.state_dict()["sampler"]["rng"].clone()
        with pytest.raises(ConfigurationError, match="semantics"):
            p.load_state_dict(donor.state_dict())
        assert len(p) == 10 and sorted(p.read(p.live_handles()).tensor("id").tolist()) == list(range(100, 110))
        assert torch.equal(p.semantics.state_dict()["sampler"]["rng"], rng)


def test_replication_needs_distinct_nodes(servers):
    """More copies than the servers' distinct nodes is refused, naming both (the module's servers span two nodes:
    no group of its own is started for this refusal), and the servers are left running for other buffers."""
    with pytest.raises(ConfigurationError, match="replication=3 needs servers on at least 3 distinct nodes; "
                                                 "these servers span 2"):
        DistributedDataPlane(ID_SCHEMA, capacity=10, servers=servers, replication=3, health_period=None)
    servers.check_running()


# -- semantics across shards -----------------------------------------------------------------------
def test_uniform_sampling_is_over_the_union_not_per_shard(cluster, servers):
    """90 items on one shard, 10 on the other: each item is drawn 1% of the time, not 5% for the few."""
    with _plane(servers, capacity=100, semantics=Replay(seed=3)) as p:
        p.ingest(id_batch(np.arange(90)), node=cluster.head)
        p.ingest(id_batch(np.arange(90, 100)), node=cluster.workers[0])
        assert (_on_shard(p, np.arange(90, 100)) == 1).all()
        counts = np.zeros(100, dtype=np.int64)
        for _ in range(20):
            np.add.at(counts, check_payload(p.deliver(1000)[0]), 1)
        assert chi_square_p(counts, np.ones(100)) > 1e-3
        share = counts[90:].sum() / counts.sum()
        assert 0.07 < share < 0.13, f"the small shard got {share:.1%} of draws; per-shard uniform would give 50%"


def test_prioritized_sampling_uses_one_global_total(cluster, servers):
    """Priorities 1 on one shard and 9 on the other: draws follow p / sum over both shards."""
    with _plane(servers, capacity=100, semantics=Replay(PrioritizedSampler(alpha=1.0, beta=0.5), seed=4)) as p:
        p.ingest(id_batch(np.arange(90)), node=cluster.head, priorities=torch.ones(90))
        p.ingest(id_batch(np.arange(90, 100)), node=cluster.workers[0], priorities=torch.full((10,), 9.0))
        prio = np.r_[np.ones(90), np.full(10, 9.0)]
        counts = np.zeros(100, dtype=np.int64)
        for _ in range(20):
            batch, info = p.deliver(1000)
            ids = check_payload(batch)
            np.add.at(counts, ids, 1)
            np.testing.assert_allclose(info.probabilities.numpy(), prio[ids] / prio.sum(), rtol=1e-9)
        assert chi_square_p(counts, prio) > 1e-3
        assert abs(counts[90:].sum() / counts.sum() - 0.5) < 0.03


def test_on_policy_minibatches_cut_across_shards_exactly_once(cluster, servers):
    sem = OnPolicy(num_minibatches=4, num_epochs=3, seed=5)
    with _plane(servers, semantics=sem) as p:
        p.ingest(id_batch(np.arange(50)), version=0, node=cluster.head)
        p.ingest(id_batch(np.arange(50, 100)), version=0, node=cluster.workers[0])
        p.seal()
        epochs: dict[int, list[int]] = {}
        mixed = 0
        while True:
            batch, info = p.deliver()
            ids = check_payload(batch)
            epochs.setdefault(info.epoch, []).extend(ids.tolist())
            mixed += int((ids < 50).any() and (ids >= 50).any())
            if info.last:
                break
        assert sorted(epochs) == [0, 1, 2]
        for e, ids in epochs.items():
            assert sorted(ids) == list(range(100)), f"epoch {e} is not exactly once over both shards"
        assert mixed == 12, "every minibatch should draw from both shards"
        assert len(p) == 0


def test_ragged_fields_cross_shards_in_draw_order(cluster, servers):
    schema = ExperienceSchema(id=Field((), torch.int64), tokens=Field((), torch.int64, ragged=True))

    def batch(ids):
        return {"id": torch.as_tensor(ids), "tokens": [torch.full((int(i) % 7 + 1,), int(i)) for i in ids]}

    with DistributedDataPlane(schema, capacity=64, servers=servers, health_period=None) as p:
        p.ingest(batch(np.arange(20)), node=cluster.head)
        p.ingest(batch(np.arange(20, 40)), node=cluster.workers[0])
        b, _ = p.deliver(200)
        ids = b.tensor("id")
        for i, tok in zip(ids.tolist(), [b["tokens"][j] for j in range(len(ids))], strict=True):
            assert tok.tolist() == [i] * (i % 7 + 1)


RAGGED_IDS = ExperienceSchema(id=Field((), torch.int64), tokens=Field((), torch.int64, ragged=True))


def _ragged_ids(ids, length):
    return {"id": torch.as_tensor(ids, dtype=torch.int64), "tokens": [torch.full((length,), int(i)) for i in ids]}


def test_an_ingestion_every_shard_refuses_leaves_the_stored_items_readable(servers):
    """A full buffer, then a batch whose ragged field fits no shard's pool: the typed error leaves every
    stored item readable (a refusing shard used to keep the eviction it had made room with)."""
    with DistributedDataPlane(RAGGED_IDS, capacity=4, ragged_capacity=8, servers=servers, health_period=None) as p:
        p.ingest(_ragged_ids([0, 1, 2, 3], 1))
        with pytest.raises(ClusterError):
            p.ingest(_ragged_ids([4], 20))
        assert len(p) == 4
        got = p.read(p.live_handles())
        assert sorted(got.tensor("id").tolist()) == [0, 1, 2, 3]


def test_a_checkpoint_loads_into_shards_with_the_buffers_ragged_capacity(servers):
    """800 ragged elements in a 4-item buffer: more than the default pool (64 per item slot)."""
    with DistributedDataPlane(RAGGED_IDS, capacity=4, ragged_capacity=1000, servers=servers,
                              health_period=None) as p:
        p.ingest(_ragged_ids([0, 1, 2, 3], 200))
        p.load_state_dict(p.state_dict())
        got = p.read(p.live_handles())
        assert sorted(got.tensor("id").tolist()) == [0, 1, 2, 3]
        assert got["tokens"].lengths.tolist() == [200] * 4


def test_delivery_reads_object_store_arrays_without_copying(servers):
    """Rows arrive as read-only object-store NumPy arrays; the torch view shares their memory."""
    import ray
    from conduit.distributed.wire import from_wire

    with _plane(servers, capacity=30000) as p:
        h = p.ingest(id_batch(np.arange(30000)), node=p.shard_node(1))
        # where the rows went is the plan's call (measured links; local and remote are alike on one machine)
        shards, counts = np.unique(_on_shard(p, h), return_counts=True)
        s, k = int(shards[counts.argmax()]), int(counts.max())
        assert k >= 15000
        cols = ray.get(p.servers[s].actor.gather.remote(p.buffer_id, np.arange(k)), timeout=60)
        assert not cols["obs"].flags.writeable  # backed by the object store
        t = from_wire(cols, ID_SCHEMA).tensor("obs")
        assert t.data_ptr() == cols["obs"].ctypes.data


# -- the conformance suites on a multi-node buffer -------------------------------------------------
class TestDistributedReplay(ReplaySuite):
    @pytest.fixture(autouse=True)
    def _servers(self, servers):
        self.servers = servers

    def make_replay(self, **kwargs):
        return DistributedReplayEndpoint(self.servers, **kwargs)


class TestDistributedFreshness(FreshnessSuite):
    @pytest.fixture(autouse=True)
    def _servers(self, servers):
        self.servers = servers

    def make_on_policy(self, **kwargs):
        return DistributedOnPolicyEndpoint(self.servers, **kwargs)


class TestDistributedConcurrency(ConcurrencySuite):
    @pytest.fixture(autouse=True)
    def _servers(self, servers):
        self.servers = servers

    def make_replay(self, **kwargs):
        return DistributedReplayEndpoint(self.servers, **kwargs)
