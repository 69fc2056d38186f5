"""Re-replication copies on a real local Ray cluster: a source whose node dies after it read the rows, and the
bound on how long re-replication holds the caller.

* a copy whose source's node dies after the source read the rows (the rows are lost with that node's object store
  before the target fetched them) blames the source, not the target: the target stays a candidate for the other
  segments' copies in the same call;
* a copy that times out because its source is dead but not yet reported dead (its data thread held, its pings
  answering) skips its target for the round's retries; once the probe after the round finds the source lost, a
  target that answered and only waited for that source is a candidate again for the next rounds' copies;
* re-replication gives up after :data:`~conduit.distributed.recovery.COPY_ROUNDS` rounds: each round sends at most
  one copy of a segment to a target not tried before for it, waits at most ``timeout`` for the round's copies, and
  probes the shards of copies whose outcome is unknown (at most ``timeout``); segments no target took stay readable
  with one copy and are counted in ``under_replicated`` and in their loss report (``recovered`` but not
  ``re_replicated``).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import ExperienceSchema, Field  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.distributed._ray import Outcome  # noqa: E402
from conduit.distributed.recovery import COPY_ROUNDS  # noqa: E402
from conduit.distributed.testing import LocalCluster, ServerStandIn, held_data_thread, kill_server  # noqa: E402
from conduit.testing.lifecycle import eventually  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(400)

#: 64 KiB an item: a segment of 4 is a 256 KiB object, kept in the source node's object store (not inlined into
#: the reply to this process, as Ray does for objects under 100 KiB), so it is lost with that node
_WIDTH = 16384
BIG = ExperienceSchema(id=Field((), torch.int64), obs=Field((_WIDTH,), torch.float32))


def _batch(ids: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    return {"id": t, "obs": t.to(torch.float32)[:, None].expand(-1, _WIDTH).contiguous()}


def _ids(batch: Any) -> list[int]:
    ids = batch["id"].numpy()
    assert (batch["obs"].numpy() == ids[:, None].astype(np.float32)).all(), "a payload does not match its id"
    return sorted(ids.tolist())


def _replicas(plane: DistributedDataPlane, handles: Any) -> set[int]:
    h = np.asarray(handles)
    shard, _ = plane.index.replicas(plane.index.segments_of(h), h)
    return set(shard[shard >= 0].tolist())


@pytest.fixture(scope="module")
def m_node(cluster: LocalCluster) -> str:
    """Node M of the two copy-source tests: it holds a shard there and is never killed, so one node serves both
    (node N, which each test kills, is each test's own)."""
    return str(cluster.add_node())


def _kill_node_reported_dead(cluster: LocalCluster, node: str) -> None:
    """Kill ``node`` for real (as a crash) and return once Ray reports it dead."""
    import ray

    cluster.kill_node(node)
    assert eventually(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node), timeout=60), \
        "Ray did not report the killed node dead"


def _check_a_lost_and_b_copied_to_shard_1(plane: DistributedDataPlane, found: list[Any], a: Any, b: Any,
                                          why: str) -> None:
    """The outcome both copy-source tests expect: shards 0 and 2 lost; segment A (replicas on both) reported lost,
    exactly, once; segment B (replica on shard 3) recovered and copied again to shard 1 (``why`` if not), nothing
    left under-replicated."""
    assert sorted(r.shard for r in found) == [0, 2]
    by = {r.shard: r for r in found}
    assert sorted(np.concatenate([r.lost for r in found]).tolist()) == sorted(a.tolist())
    assert plane.lost_items == 4
    assert by[2].recovered == 4, "B (replica on shard 3) is recovered by shard 2's loss"
    assert plane.alive_shards == [1, 3]
    assert _replicas(plane, b) == {1, 3}, why
    assert by[2].re_replicated == 4
    assert plane.under_replicated == 0


class _SourceNodeDiesAfterReading(ServerStandIn):
    """Stands in for a copy target's actor handle: before its first ``append`` is sent, the copy's source has
    read the rows (the object the append takes is created, on the source's node) and that node is killed for real
    (``Cluster.remove_node``, as a crash), and Ray reports it dead; then the append goes to the real actor."""

    def __init__(self, servers: ShardServers, shard: int, cluster: LocalCluster, node: str) -> None:
        super().__init__(servers, shard)
        self._cluster, self._node = cluster, node
        self.appends = 0
        self.killed = False

    @property
    def append(self) -> Any:
        proxy = self

        class _Append:
            @staticmethod
            def remote(buffer_id: str, data: Any, *args: Any) -> Any:
                import ray

                proxy.appends += 1
                if not proxy.killed:
                    ready, _ = ray.wait([data], timeout=60, fetch_local=False)
                    assert ready, "the source did not read the rows"
                    _kill_node_reported_dead(proxy._cluster, proxy._node)
                    proxy.killed = True
                return proxy._real.append.remote(buffer_id, data, *args)

        return _Append()


# -- 1. a copy whose source's node dies after reading --------------------------------------------------------------
def test_a_copy_whose_source_node_dies_after_reading_leaves_its_target_a_candidate(cluster, m_node):
    """Shards 0 (node N), 1 (node W), 2 (the head node) and 3 (node M). Segment A lives on shards 0 and 2, segment
    B on shards 3 and 2. Shard 2 is lost: A is copied from shard 0 to shard 1 and B from shard 3 to shard 0 (each
    the cheapest shard of another node). Node N dies after shard 0 read A's rows, before shard 1 fetched them: A's
    copy fails for want of its source (A is lost: both replicas are gone), B's fails with its target. Shard 1 did
    nothing wrong, so B's copy is sent again to shard 1, and B gets its second replica back."""
    n_node = cluster.add_node()
    servers = ShardServers([n_node, cluster.workers[0], cluster.head, m_node])
    plane = DistributedDataPlane(BIG, capacity=32, shard_capacity=16, servers=servers, replication=2, measure=False,
                                 health_period=None, timeout=20.0, transport="object_store")
    try:
        a = plane.ingest(_batch(np.arange(4)), node=n_node)
        b = plane.ingest(_batch(np.arange(4, 8)), node=m_node)
        assert _replicas(plane, a) == {0, 2} and _replicas(plane, b) == {2, 3}
        target = _SourceNodeDiesAfterReading(servers, 1, cluster, n_node)
        kill_server(servers[2].actor)
        try:
            found = plane.check_health()
        finally:
            target.restore()
        assert target.killed
        _check_a_lost_and_b_copied_to_shard_1(plane, found, a, b,
                                              "B's copy was not sent again to the healthy target of A's copy")
        assert target.appends == 2
        assert _ids(plane.read(b)) == list(range(4, 8))
    finally:
        plane.close()
        servers.shutdown()


# -- 2. the bound on re-replication ---------------------------------------------------------------------------------
class _CountsAppends(ServerStandIn):
    """Stands in for a server's actor handle: counts the ``append`` calls sent (each goes to the real actor)."""

    def __init__(self, servers: ShardServers, shard: int) -> None:
        super().__init__(servers, shard)
        self.appends = 0

    @property
    def append(self) -> Any:
        self.appends += 1
        return self._real.append


def test_re_replication_gives_up_after_copy_rounds_and_counts_the_items_left_with_one_copy(cluster):
    """Shard 1's loss leaves every item with one copy (on shard 0, the head node). The four other shards, on the
    worker node, answer health checks but their data threads are held, so no copy is ever stored. Re-replication
    sends one copy per round, each to a target not tried before, for :data:`COPY_ROUNDS` rounds and no more (the
    fourth target is never tried), probes the shards of the unanswered copies after each round (no monitor thread:
    after the last one too), and returns: the items stay readable with one copy, counted in ``under_replicated``
    and in the report (recovered, not re-replicated); no stuck target is declared lost, and the late copies are
    discarded once the targets run them. The caller was held for ``COPY_ROUNDS`` waits of at most ``timeout``
    (the copies) and ``COPY_ROUNDS`` probes of at most ``timeout``: the bound the docstrings state."""
    assert COPY_ROUNDS == 3
    w = cluster.workers[0]
    servers = ShardServers([cluster.head, w, w, w, w, w])
    plane = DistributedDataPlane(ID_SCHEMA, capacity=20, servers=servers, replication=2, measure=False,
                                 health_period=None, timeout=2.0, transport="object_store")
    probes: list[set[int]] = []
    settle = plane._settle

    def counted_settle(failed: dict[int, Outcome]) -> set[int]:
        probes.append(set(failed))
        return settle(failed)

    plane._settle = counted_settle  # type: ignore[method-assign]
    try:
        h = plane.ingest(id_batch(np.arange(10)))
        assert _replicas(plane, h) == {0, 1}
        targets = {s: _CountsAppends(servers, s) for s in (2, 3, 4, 5)}
        try:
            with ExitStack() as held:
                for s in targets:
                    held.enter_context(held_data_thread(servers[s], f"conduit-test-hold-{s}"))
                kill_server(servers[1].actor)  # (returns once Ray reports it dead)
                probes.clear()  # (the ingestion settles its failures too: none)
                t0 = time.monotonic()
                found = plane.check_health()
                took = time.monotonic() - t0
                assert {s: t.appends for s, t in targets.items()} == {2: 1, 3: 1, 4: 1, 5: 0}, \
                    "re-replication did not send exactly one copy a round, to a new target, for COPY_ROUNDS rounds"
                # one probe after each round, of the copy's source and target (only the probes of the check's
                # pings and of the copies: nothing else was unsure)
                assert probes == [{0, 2}, {0, 3}, {0, 4}]
                assert [r.shard for r in found] == [1]
                assert found[0].num_lost == 0 and found[0].recovered == 10 and found[0].re_replicated == 0
                assert plane.under_replicated == 10
                assert plane.alive_shards == [0, 2, 3, 4, 5]
                assert _replicas(plane, h) == {0}
                assert sorted(check_payload(plane.read(h)).tolist()) == list(range(10))
        finally:
            for t in targets.values():
                t.restore()
        print(f"re-replication with every target stuck held check_health {took:.2f} s "
              f"(timeout={plane.timeout:g} s, COPY_ROUNDS={COPY_ROUNDS})")
        # the late copies ran once the targets were free, and were discarded
        import ray

        for s in targets:
            assert tuple(ray.get(servers[s].actor.span.remote(plane.buffer_id), timeout=60)) == (0, 0)
    finally:
        plane.close()
        servers.shutdown()


def test_a_copy_timed_out_on_a_source_found_dead_leaves_its_target_a_candidate(cluster, m_node):
    """Shards 0 (node N), 1 (node W), 2 (the head node) and 3 (node M). Segment A lives on shards 0 and 2, segment
    B on shards 3 and 2. Shard 0's data thread is held (its pings answer): it stands for a node that died without
    Ray knowing yet. Shard 2 is lost: A is copied from shard 0 to shard 1 and B from shard 3 to shard 0; both copies
    time out (shard 0 reads and stores nothing), so shards 0 and 1 are skipped for the retries. Before the probe
    that follows, node N is killed for real: the probe finds shard 0 lost (A is lost: both replicas are gone). Shard
    1 answered the probe and only waited for shard 0's rows, so B's copy is sent again to shard 1, and B gets its
    second replica back: nothing that survived is reported lost, nothing is left under-replicated."""
    n_node = cluster.add_node()
    servers = ShardServers([n_node, cluster.workers[0], cluster.head, m_node])
    plane = DistributedDataPlane(BIG, capacity=32, shard_capacity=16, servers=servers, replication=2, measure=False,
                                 health_period=None, timeout=10.0, transport="object_store")
    probes: list[set[int]] = []
    settle = plane._settle

    def settle_after_the_source_node_died(failed: dict[int, Outcome]) -> set[int]:
        probes.append(set(failed))
        if len(probes) == 1:
            assert 0 in failed, "the first round's copies did not time out on shard 0"
            _kill_node_reported_dead(cluster, n_node)
        return settle(failed)

    try:
        a = plane.ingest(_batch(np.arange(4)), node=n_node)
        b = plane.ingest(_batch(np.arange(4, 8)), node=m_node)
        assert _replicas(plane, a) == {0, 2} and _replicas(plane, b) == {2, 3}
        plane._settle = settle_after_the_source_node_died  # type: ignore[method-assign]
        with held_data_thread(servers[0], release=False):  # (until node N is killed, in the probe's settle)
            kill_server(servers[2].actor)
            found = plane.check_health()
        # the first round's two copies timed out (shard 0 held), and their shards were probed after it
        assert probes[0] == {0, 1, 3}
        _check_a_lost_and_b_copied_to_shard_1(
            plane, found, a, b, "B's copy was not sent again to shard 1, whose only failed copy timed out on a "
                                "source found dead")
        assert _ids(plane.read(b)) == list(range(4, 8))
    finally:
        plane.close()
        servers.shutdown()
