"""``Automatic`` and calls made while the calling thread holds the buffer's lock.

``Automatic`` routes every hand-over through its routing lock, and holds it while its inner scheduler stores (in the
probe phase that happens in the producer's own call, under the buffer's lock) and while a switch of scheduler drains
the one it leaves. A thread inside ``edp.read_locked()`` holds the buffer's lock; an ``ingest`` (or a delivery that
switches scheduler) there waited for the routing lock, whose holder waited for the buffer's lock: both threads hung.

Each test builds that interleaving with event gates on the real scheduler (no sleeps) and bounds the calls with a
join that is reached only when they hang. Nothing handed over may be lost: every item is delivered at the end.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from conduit import Automatic, ExperienceDataPlane
from conduit.testing.lifecycle import call_bounded, start_bounded
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

#: the bound on a call that returns at once unless it hangs
JOIN_S = 45.0


def _all_ids(edp: ExperienceDataPlane, n: int) -> list[int]:
    """The ids of everything stored (a draw of all ``n`` items without replacement), payloads checked."""
    edp.flush()
    assert len(edp) == n
    batch, _ = edp.deliver(n, replace=False)
    return sorted(check_payload(batch).tolist())


def test_ingest_inside_read_locked_while_a_probing_producer_waits_for_the_buffer_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe phase: a producer holds the routing lock and stores in its own call, so it waits for the buffer's lock
    that a thread inside ``read_locked`` holds; that thread's ``ingest`` waited for the routing lock (a deadlock).
    It now hands over at once and stores both batches in order of hand-over; the producer returns after it."""
    sched = Automatic()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, scheduler=sched)
    probe = sched.inner
    routed = threading.Event()
    real = probe.ingest

    def observed(batch: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "producer":
            routed.set()  # the producer holds the routing lock from here until its batch is stored
        return real(batch, **kwargs)
    monkeypatch.setattr(probe, "ingest", observed)
    started: list[tuple[threading.Thread, list[object]]] = []

    def locked() -> object:
        started.append(start_bounded(lambda: edp.ingest(id_batch(np.arange(0, 8))), name="producer"))
        assert routed.wait(JOIN_S), "the producer never reached its hand-over"
        return edp.ingest(id_batch(np.arange(8, 16)))

    out = call_bounded(lambda: edp.read_locked(locked), JOIN_S, name="locked",
                       hang="ingest() inside read_locked() hung: it waited for the routing lock")
    assert not isinstance(out, BaseException), out
    ((producer, produced),) = started
    producer.join(JOIN_S)
    assert not producer.is_alive(), "the producer's ingest() never returned"
    assert produced == [None], produced
    assert _all_ids(edp, 16) == list(range(16)), "each item stored once"
    edp.close()


def test_ingest_inside_read_locked_while_a_switch_of_scheduler_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    """The delivery that ends calibration switches scheduler: it holds the routing lock while the probe's scheduler
    stores what it was handed, which needs the buffer's lock. An ``ingest`` inside ``read_locked`` meanwhile waited
    for the routing lock (a deadlock). It now hands over to the scheduler being drained, which stores it; the switch
    completes after the locked function returns, and nothing is lost."""
    sched = Automatic(overlap=False, g_ing_max=1, g_del_max=1, probe_rounds=1)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, scheduler=sched)
    edp.ingest(id_batch(np.arange(0, 32)))  # (the whole ingestion probe: one hand-over at g_ing = 1)
    probe = sched.inner
    draining, locked_now = threading.Event(), threading.Event()
    real = probe.drain

    def gated() -> bool:  # called by the switch, which holds the routing lock
        draining.set()
        assert locked_now.wait(JOIN_S), "the locked function never started"
        return real()
    monkeypatch.setattr(probe, "drain", gated)
    learner, delivered = start_bounded(lambda: edp.deliver(4), name="learner")  # ends the probe: the switch starts
    assert draining.wait(JOIN_S), "the delivery never switched scheduler"

    def locked() -> object:
        locked_now.set()
        return edp.ingest(id_batch(np.arange(32, 40)))

    out = call_bounded(lambda: edp.read_locked(locked), JOIN_S, name="locked",
                       hang="ingest() inside read_locked() hung: it waited for the routing lock held by a switch")
    assert not isinstance(out, BaseException), out
    learner.join(JOIN_S)
    assert not learner.is_alive(), "the delivery that switches scheduler never returned"
    assert len(delivered) == 1 and not isinstance(delivered[0], BaseException), delivered
    assert sched.calibrated and sched.inner is not probe, "the switch completed"
    assert _all_ids(edp, 40) == list(range(40)), "each item stored once"
    edp.close()


def test_delivery_inside_read_locked_that_ends_calibration_while_a_producer_waits_for_the_buffer_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A delivery inside ``read_locked`` that ends calibration switches scheduler, which takes the routing lock; a
    producer held it, waiting for the buffer's lock (a deadlock). The delivery now returns its batch and leaves the
    switch to the next delivery, as when the scheduler's queue cannot be stored yet; nothing is lost."""
    sched = Automatic(overlap=False, g_ing_max=1, g_del_max=1, probe_rounds=1)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, scheduler=sched)
    edp.ingest(id_batch(np.arange(0, 32)))
    probe = sched.inner
    routed = threading.Event()
    real = probe.ingest

    def observed(batch: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "producer":
            routed.set()
        return real(batch, **kwargs)
    monkeypatch.setattr(probe, "ingest", observed)
    started: list[tuple[threading.Thread, list[object]]] = []

    def locked() -> object:
        started.append(start_bounded(lambda: edp.ingest(id_batch(np.arange(32, 40))), name="producer"))
        assert routed.wait(JOIN_S), "the producer never reached its hand-over"
        return edp.deliver(4)  # the probe's last delivery

    out = call_bounded(lambda: edp.read_locked(locked), JOIN_S, name="locked",
                       hang="a delivery inside read_locked() that switches scheduler hung on the routing lock")
    assert not isinstance(out, BaseException), out
    assert out[0].batch_size == 4  # type: ignore[index]
    ((producer, produced),) = started
    producer.join(JOIN_S)
    assert not producer.is_alive(), "the producer's ingest() never returned"
    assert produced == [None], produced
    assert not sched.calibrated and sched.inner is probe, "the switch waits for a later delivery"
    edp.deliver(4)
    assert sched.calibrated and sched.inner is not probe, "the next delivery switched"
    assert _all_ids(edp, 40) == list(range(40)), "each item stored once"
    edp.close()
