"""Liveness: calls of the scheduling roles that could wait forever under legitimate concurrent use.

Each test runs the call on a daemon thread and bounds it with a join that is reached only when the call hangs.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import torch
from conduit import ConfigurationError, ExperienceDataPlane, OnPolicy, Overlapped
from conduit.testing.lifecycle import wait_until
from conduit.testing.reference import ID_SCHEMA, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_read_locked_deliveries_and_lock_access import JOIN_S, _in_thread  # noqa: E402, I001  (a call bounded by a join: a hang fails)


# -- 1. close() stopping the prefetch worker while a job a delivery cancelled waits for the buffer's lock --------------
def test_a_call_inside_read_locked_is_refused_while_close_waits_for_a_cancelled_prefetch_job() -> None:
    """A delivery inside ``read_locked`` cancels the prefetch job that has not taken the buffer's lock (the job ends
    only once it has it). ``close()`` from another thread then holds the delivery lock while it stops the prefetch
    worker, which waits for that job: a delivery made next in the same ``read_locked`` function waited for the
    delivery lock forever (and ``close`` for the job, which waited for this thread's lock). It is refused instead
    (typed, nothing drawn), and ``close`` returns once the function does."""
    sched = Overlapped(g_ing=1, g_del=1)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=2, num_epochs=1),
                              scheduler=sched)
    edp.ingest(id_batch(np.arange(32)), version=0)
    edp.seal()
    seen: list[torch.Tensor] = []
    closed: list[object] = []

    def close() -> None:
        try:
            edp.close()
            closed.append("closed")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            closed.append(e)

    closer = threading.Thread(target=close, name="closer", daemon=True)

    def locked() -> None:
        seen.append(edp.deliver()[1].handles.clone())  # starts a prefetch job, which waits for this thread's lock
        seen.append(edp.deliver()[1].handles.clone())  # cancels it (the rollout's last minibatch: no job after it)
        assert sched._cancelled is not None and not sched._cancelled.done()
        closer.start()
        # close() holds the delivery lock from here until the prefetch worker stops
        wait_until(lambda: sched._closed, "close() marked the scheduler closed", timeout=JOIN_S)
        edp.deliver()

    err = _in_thread(lambda: edp.read_locked(locked))
    closer.join(JOIN_S)
    assert not closer.is_alive(), "close() never returned"
    assert closed == ["closed"] and edp.closed
    assert isinstance(err, ConfigurationError), err
    assert "close() running on another thread" in str(err) and "after the locked function returns" in str(err), err
    assert sorted(torch.cat(seen).tolist()) == list(range(32)), "each item once, in the two minibatches"
