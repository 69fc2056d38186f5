"""A user's journey through the multi-node tier on a real local Ray cluster (2 nodes, one per module).

What an engineer does following ``benchmarks/docs/distributed.md`` and the docstrings of
``conduit.distributed`` literally, beyond what the other multi-node tests cover: the documented
example as written, and wrong inputs a user can plausibly give (a host name or a shortened id
where a node id is wanted, one node id where a list is wanted, a timeout that is no number), each
refused with a typed error that says what to do, before any server starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import ConfigurationError, ExperienceSchema, Field, PrioritizedSampler, Replay  # noqa: E402
from conduit.distributed import (  # noqa: E402
    ClusterError,
    DistributedDataPlane,
    ShardServers,
    alive_nodes,
    stage,
)

pytestmark = pytest.mark.timeout(300)

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), reward=Field((), torch.float32))


@pytest.fixture(scope="module")
def head_server(cluster: Any) -> Iterator[ShardServers]:
    """One shard server on the head node for this module (the worker node holds none), shared by the tests that
    need a group but no server of their own: each buffer on it has a partition of its own (its links may be
    measured and cached: a link-probe setting is checked with or without a cached profile)."""
    group = ShardServers([cluster.head])
    yield group
    group.shutdown()


def _batch(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    r = torch.arange(start, start + n, dtype=torch.float32)
    return {"obs": r[:, None].repeat(1, 4), "reward": r}


def test_the_documented_example_runs_as_written(cluster):
    """The example at the top of distributed.md: servers on every alive node, replication 2, prioritized replay
    over the union, a batch ingested here and one staged; deliver(512) and a priority update."""
    servers = ShardServers(alive_nodes())  # one shard server pinned to each node
    try:
        assert sorted(servers.nodes) == sorted(cluster.nodes)
        buf = DistributedDataPlane(SCHEMA, capacity=1_000_000, servers=servers, replication=2,
                                   semantics=Replay(PrioritizedSampler(alpha=0.6, beta=0.4)))
        try:
            handles = buf.ingest(_batch(1000))
            ref = stage(_batch(1000, 1000), SCHEMA)
            staged = buf.ingest(ref)
            assert handles.tolist() == list(range(1000)) and staged.tolist() == list(range(1000, 2000))
            batch, info = buf.deliver(512)
            assert batch.batch_size == 512 and info.probabilities is not None and info.weights is not None
            # every item has its two copies, one on each node
            h = np.arange(2000)
            shards, _ = buf.index.replicas(buf.index.segments_of(h), h)
            assert all({buf.shard_node(s) for s in row} == set(cluster.nodes) for row in shards.tolist())
            # each delivered row is the item its handle names
            assert torch.equal(batch["reward"], info.handles.to(torch.float32))
            assert buf.update_priorities(info.handles, torch.rand(512) + 0.1) == 512
            assert buf.losses == [] and len(buf) == 2000
        finally:
            buf.close()
    finally:
        servers.shutdown()


@pytest.mark.parametrize("kind", ["made up", "an address", "a shortened id"])
def test_a_learner_node_that_is_no_alive_node_id_is_refused_typed(cluster, kind):
    """``learner_node`` took anything: a host name, an address or a shortened node id was accepted silently, the
    plan priced every shard as on another node (the learner's locality lost), and the bogus id even became a
    "known" producer node that ``ingest(node=...)`` accepted. It must be refused as ``ingest``'s ``node`` is,
    before any server starts."""
    bad = {"made up": "learner", "an address": "127.0.0.1", "a shortened id": cluster.head[:8]}[kind]
    with pytest.raises(ConfigurationError, match="learner_node=.*alive_nodes"):
        DistributedDataPlane(SCHEMA, capacity=10, servers=[cluster.head], learner_node=bad, measure=False,
                             health_period=None)


def test_a_learner_node_without_a_shard_server_is_taken(cluster, head_server):
    """An alive node that holds no server (e.g. a GPU learner's node) is a valid learner node; so is a server's."""
    head, worker = cluster.head, cluster.workers[0]
    assert head_server.nodes == [head]  # the worker's node holds no server
    for learner in (worker, head):
        buf = DistributedDataPlane(SCHEMA, capacity=10, servers=head_server, learner_node=learner, measure=False,
                                   health_period=None)
        try:
            assert buf.learner_node == learner
            buf.ingest(_batch(4))
            assert buf.deliver(4)[0].batch_size == 4
        finally:
            buf.close()


def test_one_node_id_given_where_a_list_is_wanted_is_refused_with_what_to_write(cluster):
    """``ShardServers(node_id)`` (or ``servers=node_id``) was taken as the list of its characters, and refused
    with every character named as an unknown node. The refusal must say to pass a list."""
    for build in (lambda: ShardServers(cluster.head),
                  lambda: DistributedDataPlane(SCHEMA, capacity=10, servers=cluster.head, measure=False,
                                               health_period=None)):
        with pytest.raises(ClusterError, match=r"list of node ids.*\[node_id\]") as e:
            build()
        assert "Nodes [" not in str(e.value) and cluster.head in str(e.value)


@pytest.mark.parametrize("nodes", [2, 2.0])
def test_a_count_of_servers_given_where_node_ids_are_wanted_is_refused_typed(cluster, nodes):
    """``ShardServers(2)`` (or ``servers=2``, read as "two shard servers") failed with a bare ``TypeError: 'int'
    object is not iterable``. It is refused as the one-string case is: typed, saying what to pass, before any
    server starts."""
    before = _shard_server_actors()
    for build in (lambda: ShardServers(nodes),
                  lambda: DistributedDataPlane(SCHEMA, capacity=10, servers=nodes, measure=False,
                                               health_period=None)):
        with pytest.raises(ClusterError, match=r"list of node ids.*alive_nodes\(\)"):
            build()
    assert _shard_server_actors() == before


def _shard_server_actors() -> int:
    """Shard server actors of this cluster that are not dead (started, or starting)."""
    import ray

    return sum(1 for a in ray._private.state.actors().values()
               if a["ActorClassName"].endswith("ShardServer") and a["State"] != "DEAD")


@pytest.mark.parametrize("start_timeout", [None, "30", float("nan"), 0, float("inf")])
def test_a_bad_start_timeout_is_refused_typed_and_starts_no_server(cluster, start_timeout):
    """``ShardServers(start_timeout=None)`` (or ``"30"``) started the servers, then failed in the wait with a bare
    ``TypeError``, leaving them running with nobody holding them (``nan`` and ``0`` gave up at once, naming a
    start failure). A setting that cannot work is refused typed before anything starts; so is ``inf``, as every
    other timeout of the tier (a remote call is always bounded)."""
    before = _shard_server_actors()
    with pytest.raises(ConfigurationError, match="start_timeout must be a finite number of seconds > 0"):
        ShardServers([cluster.head], start_timeout=start_timeout)
    assert _shard_server_actors() == before


@pytest.mark.parametrize("timeout", [None, "5", float("inf")])
def test_a_link_probe_timeout_that_is_no_number_is_refused_typed(head_server, timeout):
    """``ShardServers.links(timeout=None)`` failed with a bare ``TypeError`` from the settings check itself; ``inf``
    was taken, unlike every other timeout of the tier."""
    with pytest.raises(ConfigurationError, match="timeout must be a finite number of seconds > 0"):
        head_server.links(timeout=timeout)


@pytest.mark.parametrize("timeout", [None, "5", float("inf")])
def test_a_link_probe_timeout_that_is_no_number_is_refused_once_links_are_measured_too(head_server, timeout):
    """Once the group had measured its links, ``links(timeout=None)`` (or ``"5"``, or ``inf``) returned the cached
    profile and took the bad setting silently; it is refused typed as before a measurement, and the cached profile
    stays."""
    profile = head_server.links()  # measured once, then cached
    with pytest.raises(ConfigurationError, match="timeout must be a finite number of seconds > 0"):
        head_server.links(timeout=timeout)
    assert head_server.links() is profile


def test_fencing_a_server_the_group_does_not_have_is_refused_and_kills_nothing(cluster):
    """``ShardServers.kill(i)`` swallowed every error to make fencing a dead server a no-op, so an index past the
    end (``kill(2)`` of servers 0 and 1: an off-by-one) silently fenced nothing, and the caller believed the server
    gone. It is refused typed; every server still answers."""
    import ray

    servers = ShardServers([cluster.head, cluster.head])
    try:
        for bad in (2, -3, "0", 1.0):
            with pytest.raises(ClusterError, match="no shard server"):
                servers.kill(bad)
        assert ray.get([s.actor.ping.remote() for s in servers.servers], timeout=60) == [0, 0]
        servers.kill(1)  # a server of the group is fenced as before, and fencing it again does nothing
        servers.kill(1)
    finally:
        servers.shutdown()
