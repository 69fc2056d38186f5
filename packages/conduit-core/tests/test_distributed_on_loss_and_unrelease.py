"""Multi-node ``on_loss`` in an overlapped delivery and refused shard appends, on a real local Ray cluster.

* an ``on_loss`` callback for a loss found during an ``Overlapped`` delivery ran on the delivering thread while it
  still held the scheduler's delivery lock: a callback that took the buffer's lock, while another thread inside
  ``read_locked()`` called ``deliver``, waited forever (and so did that thread);
* a refused append on a shard server leaves its storage exactly as before (through ``Storage.unrelease``).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ray")

from conduit import CapacityError, ConduitError, ConfigurationError, OnPolicy, Overlapped  # noqa: E402
from conduit.batch import ExperienceBatch  # noqa: E402
from conduit.distributed import DistributedDataPlane, ShardServers  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: how long a thread of a test may take before it counts as stuck for good (a liveness bound, not a timing claim:
#: the threads finish within well under a second when nothing waits forever)
_STUCK_S = 60.0


def _rows(ids: np.ndarray) -> ExperienceBatch:
    """Items whose payload is their id (``ID_SCHEMA``), as a checked batch."""
    return ExperienceBatch.checked(id_batch(ids), ID_SCHEMA)


# -- 1. on_loss under the scheduler's delivery lock ------------------------------------------------------------------
def test_on_loss_found_by_an_overlapped_delivery_may_take_the_lock_while_another_thread_delivers_in_read_locked(
        cluster: Any) -> None:
    """The loss is found by a delivery's read (a shard server killed before it); its callback waits until another
    thread is inside ``read_locked()`` and calls ``deliver`` there, then calls ``len(plane)``. Both must finish:
    the callback runs once the delivery let go of the scheduler's delivery lock, exactly once."""
    servers = ShardServers([cluster.head, cluster.workers[0]])
    victim = servers[1].pid
    in_callback, other_inside = threading.Event(), threading.Event()
    reports: list[Any] = []
    lengths: list[int] = []
    outcomes: dict[str, Any] = {}

    def on_loss(report: Any) -> None:
        reports.append(report)
        in_callback.set()
        other_inside.wait()
        lengths.append(len(plane))  # takes the buffer's lock

    try:
        plane = DistributedDataPlane(ID_SCHEMA, capacity=100, servers=servers, health_period=None, measure=False,
                                     timeout=20.0, scheduler=Overlapped(), on_loss=on_loss,
                                     semantics=OnPolicy(minibatch_size=40, num_epochs=1, shuffle=False))
        plane.ingest(id_batch(np.arange(20)), version=0, node=cluster.head)
        plane.ingest(id_batch(np.arange(20, 40)), version=0, node=cluster.workers[0])
        plane.seal()
        os.kill(victim, signal.SIGKILL)  # items 20-39 are gone; the delivery's read finds it

        def deliverer() -> None:
            batch, info = plane.deliver()
            outcomes["delivered"] = (check_payload(batch).tolist(), bool(info.last))

        def other() -> None:
            in_callback.wait()

            def inside() -> Any:
                other_inside.set()
                try:
                    return plane.deliver()
                except ConduitError as e:  # (nothing left to deliver, or a typed refusal: never a wait forever)
                    return e
            outcomes["other"] = plane.read_locked(inside)

        threads = [threading.Thread(target=deliverer, daemon=True), threading.Thread(target=other, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_STUCK_S)
        assert not any(t.is_alive() for t in threads), "the callback and the other thread wait for each other"
        assert outcomes["delivered"] == (list(range(20)), True)
        assert isinstance(outcomes["other"], (ConduitError, tuple)), outcomes["other"]
        assert [r.shard for r in reports] == [1] and sorted(reports[0].lost.tolist()) == list(range(20, 40))
        assert list(plane.losses) == reports and len(lengths) == 1
        plane.close()
    finally:
        servers.shutdown()


# -- 2. a refused append on a shard server, undone through Storage.unrelease -------------------------------------------
def test_a_refused_append_on_a_shard_server_leaves_its_partition_exactly_as_before(cluster: Any) -> None:
    """The append releases the handles below ``release_upto`` first; when the rows still do not fit it is refused
    (CapacityError), and the partition keeps every item it had, with the same rows."""
    import ray
    from conduit.distributed.wire import from_wire, to_wire

    servers = ShardServers([cluster.head])
    actor = servers[0].actor
    try:
        ray.get(actor.open.remote("b", ID_SCHEMA.to_dict(), 10, None), timeout=60)
        assert ray.get(actor.append.remote("b", to_wire(_rows(np.arange(8)), ID_SCHEMA), 0, 8, 0),
                       timeout=60) == (0, 8, 8)
        refused = to_wire(_rows(np.arange(100, 106)), ID_SCHEMA)  # 5 live after the release + 6 > 10
        with pytest.raises(CapacityError):
            ray.get(actor.append.remote("b", refused, 0, 6, 3), timeout=60)
        assert tuple(ray.get(actor.span.remote("b"), timeout=60)) == (0, 8)
        rows = from_wire(ray.get(actor.gather.remote("b", np.arange(8)), timeout=60), ID_SCHEMA)
        assert check_payload(rows).tolist() == list(range(8))
        # the release it undid was real: the same release with rows that fit goes ahead
        assert ray.get(actor.append.remote("b", refused, 0, 5, 3), timeout=60) == (8, 5, 13)
        assert tuple(ray.get(actor.span.remote("b"), timeout=60)) == (3, 13)
    finally:
        servers.shutdown()


def test_unrelease_restores_only_a_release_of_items_still_in_place() -> None:
    """``ColumnarStorage.unrelease`` makes released items live again with their rows; an ``oldest`` above the oldest
    live handle, or one whose items no longer fit in the capacity, is refused (typed) and changes nothing."""
    from conduit.storage.columnar import ColumnarStorage

    s = ColumnarStorage(ID_SCHEMA, 10, "cpu")
    s.append(_rows(np.arange(8)))
    s.release(5)
    assert (s.oldest, s.next_handle) == (5, 8)
    with pytest.raises(ConfigurationError):
        s.unrelease(6)
    s.append(_rows(np.arange(8, 15)))  # writes over slots 0-4: handles 0-4 are gone for good
    with pytest.raises(ConfigurationError):
        s.unrelease(4)
    assert (s.oldest, s.next_handle) == (5, 15)
    s.release(7)
    s.unrelease(5)
    assert (s.oldest, s.next_handle) == (5, 15)
    assert check_payload(s.gather(torch.remainder(torch.arange(5, 15), 10))).tolist() == list(range(5, 15))
