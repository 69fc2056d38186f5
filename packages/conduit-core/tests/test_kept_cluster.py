"""``kept_cluster``: test modules connect in turn to one local Ray cluster instead of each starting one.

What a module may rely on: it gets the cluster's own nodes and nothing of an earlier module's job (no named actor,
every CPU free); nodes it added are stopped when it leaves; a cluster that lost one of its nodes is not handed on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")

from conduit.distributed.errors import ClusterError  # noqa: E402
from conduit.distributed.testing import kept_cluster, stop_kept_cluster  # noqa: E402
from conduit.testing.lifecycle import eventually  # noqa: E402


@pytest.fixture(autouse=True)
def _stopped() -> Iterator[None]:
    """Each test starts and ends with no kept cluster (another module's may be kept in this process)."""
    stop_kept_cluster()
    yield
    stop_kept_cluster()


def _alive() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_the_next_use_connects_to_the_same_cluster_with_nothing_of_the_last_job_left() -> None:
    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> int:
            return 1

    with kept_cluster(1, num_cpus=1, fast_failure_detection=False) as first:
        holder = Holder.options(name="left-behind", namespace="kept-test").remote()
        assert ray.get(holder.ping.remote()) == 1
        # (Ray's resource view trails the actor's start under load)
        assert eventually(lambda: ray.available_resources().get("CPU", 0) == 0, timeout=60)
        head = first.head
        # neither a log monitor (no one reads what it forwards) nor an autoscaler (nothing to scale)
        assert not {"log_monitor", "monitor"} & set(first.cluster.head_node.all_processes)
    assert not ray.is_initialized()
    with pytest.raises(ClusterError, match="no log monitor"), kept_cluster(1, num_cpus=1, fast_failure_detection=False,
                                                                           log_to_driver=True):
        pass  # pragma: no cover - refused: nothing would be forwarded
    assert not ray.is_initialized()
    with kept_cluster(1, num_cpus=1, fast_failure_detection=False) as second:
        assert second.head == head  # the same cluster, not a fresh one
        assert ray.util.list_named_actors(all_namespaces=True) == []
        assert eventually(lambda: ray.available_resources().get("CPU", 0) == 1, timeout=60)
        with pytest.raises(ClusterError, match="already initialised"), kept_cluster(1, num_cpus=1):
            pass  # pragma: no cover - a use while connected is refused
    # another shape stops the kept cluster first
    with kept_cluster(1, num_cpus=2, fast_failure_detection=False) as other:
        assert other.head != head
        assert ray.cluster_resources().get("CPU") == 2


def test_added_nodes_are_stopped_and_a_cluster_that_lost_a_node_is_not_kept() -> None:
    with kept_cluster(2) as first:
        own = set(first.nodes)
        extra = first.add_node()
        assert extra in _alive()
        head = first.head
    with kept_cluster(2) as second:
        assert second.head == head
        assert set(second.nodes) == own
        assert eventually(lambda: extra not in _alive(), timeout=30), "the node the last use added still runs"
        second.kill_node(second.workers[0])  # one of the cluster's own nodes
    with kept_cluster(2) as third:
        assert third.head != head, "a cluster that lost a node was handed on"
        assert len(_alive()) == 2
