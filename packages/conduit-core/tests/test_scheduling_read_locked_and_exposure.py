"""Scheduling issues (exposure accounting with real workers, deliveries inside read_locked that
need a prefetch job, the on-policy release step's lock mark), each made deterministic."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, OnPolicy, Overlapped
from conduit.demo import transition_schema
from conduit.exposure import ExposureLog
from conduit.semantics import Replay
from conduit.telemetry import CallRecord, thread_id
from conduit.testing.reference import ID_SCHEMA, id_batch

D = 8
JOIN_S = 20.0

sys.path.insert(0, str(Path(__file__).parent))
from test_read_locked_deliveries_and_lock_access import _pair as _plane_pair  # noqa: E402, I001
from test_core_regressions_checkpoints_and_locks import _in_thread  # noqa: E402, I001


def _rollout(n: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.randn(n, D), "next_obs": torch.randn(n, D), "action": torch.zeros(n, dtype=torch.int64),
            "reward": torch.randn(n), "done": torch.zeros(n, dtype=torch.bool)}


def test_a_background_store_beside_the_update_is_hidden_exactly_outside_the_loops_spans() -> None:
    """The ingestion worker's write is forced to run beside the loop's update (not while the loop waits), with
    no timing luck: the loop holds the buffer's lock (which the write needs) across its hand-over and lets go of
    it only inside the update span. The write is then counted hidden exactly for its part outside the loop's
    experience-path spans (the hand-over, and the loop's wait for the write in ``flush()``, which counted as hidden
    before ``flush`` recorded it), and the identity total = hidden + exposed holds."""
    edp = ExperienceDataPlane(transition_schema(D), capacity=256, semantics=Replay(seed=0),
                              scheduler=Overlapped(g_ing=1, g_del=1))
    tel = edp.telemetry
    log = ExposureLog(tel)
    lock = edp.lock
    try:
        with log.iteration():
            with tel.span("rollout", 16):
                data = _rollout(16)
            lock.__enter__()  # the worker's write (ingest_now) waits for this lock
            held = True
            try:
                edp.ingest(data)  # handed over: stored by the worker, not here
                with tel.span("update", 16):
                    lock.__exit__(None, None, None)  # from here on the worker stores beside the loop
                    held = False
                    edp.flush()  # (the loop's wait in it is exposed: a flush_wait span)
            finally:
                if held:
                    lock.__exit__(None, None, None)
        it = log.iterations[-1]
        recs = [r for r in tel.records if r.end > it.start and r.start < it.end]
        loop = thread_id()
        (work,) = [r for r in recs if r.kind == "ingest"]
        (wait,) = [r for r in recs if r.kind == "ingest_wait"]
        (update,) = [r for r in recs if r.kind == "update"]
        (flushed,) = [r for r in recs if r.kind == "flush_wait"]
        assert work.thread != loop and wait.thread == loop == update.thread == flushed.thread
        assert work.start < update.end and work.end > update.start  # the write ran into the update span
        assert wait.end <= flushed.start

        def overlap(a: CallRecord, b: CallRecord) -> float:
            return max(0.0, min(a.end, b.end) - max(a.start, b.start))

        # the write's part outside the hand-over and the loop's wait for it in flush()
        assert it.hidden_s == pytest.approx(work.seconds - overlap(work, wait) - overlap(work, flushed), rel=1e-9,
                                            abs=1e-12)
        assert it.exposed_s == pytest.approx(wait.seconds + flushed.seconds, rel=1e-9, abs=1e-12)
        assert it.total_s == pytest.approx(it.hidden_s + it.exposed_s, rel=1e-12)
        assert len(edp) == 16
    finally:
        edp.close()


# -- 2. a delivery inside read_locked() that needs a prefetch job that has not taken the buffer's lock -----------------
def _pair(on_policy: bool) -> tuple[ExperienceDataPlane, Overlapped, ExperienceDataPlane]:
    """An overlapped buffer (g_del=2 off-policy) and a synchronous twin, same contents and seed."""
    return _plane_pair(1 if on_policy else 2, on_policy=on_policy)


def _ids(edp: ExperienceDataPlane, n: int | None) -> list[int]:
    return [int(i) for i in edp.deliver(n)[1].handles.tolist()]


@pytest.mark.parametrize("job_entered_first", [False, True], ids=["job-blocked", "job-done"])
@pytest.mark.parametrize("on_policy", [False, True], ids=["replay", "on-policy"])
def test_a_delivery_inside_read_locked_is_served_whether_or_not_the_prefetch_job_took_the_lock_first(
        on_policy: bool, job_entered_first: bool) -> None:
    """A prefetch job started before ``read_locked`` began either took the buffer's lock first (it prepared the
    next batch) or waits for it (it has drawn nothing). The delivery inside that needs the job was refused in the
    second case only: worker timing decided. Forced here both ways (the job is started while this thread holds the
    lock, or waited for before), the delivery is served the synchronous draws in both, and nothing is skipped."""
    edp, sched, ref = _pair(on_policy)
    n = None if on_policy else 4
    first = 1 if on_policy else 2  # (replay: the chunk's second batch was prepared in the call; the job: the next)

    def run() -> tuple[list[list[int]], list[list[int]]]:
        if job_entered_first:
            before = []
            for _ in range(first):
                before.append(_ids(edp, n))
                job: Any = sched._job
                if job is not None:
                    job.wait()  # it took the lock, prepared, and let go of it
            return before, edp.read_locked(lambda: [_ids(edp, n) for _ in range(2)])
        with edp.lock:  # the job waits for this lock: it has drawn nothing when read_locked begins
            before = [_ids(edp, n) for _ in range(first)]
            return before, edp.read_locked(lambda: [_ids(edp, n) for _ in range(2)])

    got = _in_thread(run)
    assert not isinstance(got, BaseException), f"refused: {got!r}"
    assert isinstance(got, tuple)
    before, inside = got
    assert before == [_ids(ref, n) for _ in range(first)]
    assert inside == [_ids(ref, n), _ids(ref, n)], "not the synchronous draws, in order"
    for _ in range(3):  # nothing skipped or drawn twice after it (a cancelled job drew nothing)
        assert _ids(edp, n) == _ids(ref, n)
    edp.close()
    ref.close()


def test_a_checkpoint_inside_read_locked_still_refuses_a_job_it_cannot_wait_for() -> None:
    """Only deliveries prepare a job's batch in the call instead (what a synchronous delivery does); ``state_dict``
    inside ``read_locked`` with a prefetch job waiting for the lock is still refused, changing nothing."""
    edp, _sched, ref = _pair(on_policy=False)

    def run() -> object:
        with edp.lock:
            assert _ids(edp, 4) == _ids(ref, 4)
            assert _ids(edp, 4) == _ids(ref, 4)  # the job for the next chunk waits for the lock held here
            try:
                edp.state_dict()
            except ConfigurationError as e:
                return e
        return None

    err = _in_thread(run)
    assert isinstance(err, ConfigurationError) and "prefetch worker" in str(err), err
    for _ in range(3):
        assert _ids(edp, 4) == _ids(ref, 4)
    edp.close()
    ref.close()


def test_close_inside_read_locked_is_refused_while_a_cancelled_job_waits_for_the_lock() -> None:
    """The last on-policy delivery of a rollout inside ``read_locked`` cancels the job that waits for the lock and
    starts none: ``close`` there would wait for the worker to end that job, which needs the lock. Refused; once the
    lock is let go, close works."""
    edp, _sched, ref = _pair(on_policy=True)

    def run() -> tuple[list[list[int]], object]:
        with edp.lock:
            got = [_ids(edp, None) for _ in range(8)]  # the whole rollout, 4 minibatches x 2 epochs
            try:
                edp.close()
            except ConfigurationError as e:
                return got, e
        return got, None

    res = _in_thread(run)
    assert isinstance(res, tuple), res
    got, err = res
    assert got == [_ids(ref, None) for _ in range(8)]
    assert isinstance(err, ConfigurationError) and "prefetch worker" in str(err), err
    assert not edp.closed and not _sched._closed, "a refused close changed the buffer or its scheduler"
    pool = _sched._pool
    edp.close()
    assert edp.closed
    assert pool is None or not pool._thread.is_alive(), "the close after the refused one left the prefetch worker"
    ref.close()


# -- 3. on-policy Overlapped: the release step leaves no stale "waits for the buffer's lock" mark ----------------------
class _Watched(Overlapped):
    """Reports when another thread starts to wait for the delivery lock (``entering``) and when it has checked,
    while waiting, whether the delivery holding it waits for the buffer's lock (``checked``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entering = threading.Event()
        self.checked = threading.Event()

    def _enter(self, call: str) -> None:
        self.entering.set()
        super()._enter(call)

    def _holder_wants_buffer_lock(self) -> bool:
        wants = super()._holder_wants_buffer_lock()
        self.checked.set()
        return wants


def _release_window(plane: Any, sched: _Watched) -> tuple[list[object], list[list[int]]]:
    """Deliver on this thread; right after the release step lets go of the plane's lock (this delivery still holds
    the delivery lock and the scheduler's marks), another thread delivers inside ``read_locked`` and is held until
    it has checked the mark once. Its outcome, and this thread's deliveries."""
    real = plane.release_now
    other: list[object] = []  # the other delivery's outcome (appended by its thread)
    threads: list[threading.Thread] = []
    armed = [True]

    def release_now(selection: Any, *, when: Any = None) -> None:
        real(selection, when=when)
        if not armed[0]:
            return
        armed[0] = False
        t = threading.Thread(target=lambda: other.append(_guarded(lambda: plane.read_locked(
            lambda: [int(i) for i in plane.deliver()[1].handles.tolist()]))), daemon=True)
        t.start()
        assert sched.entering.wait(JOIN_S) and sched.checked.wait(JOIN_S), "the other delivery did not wait"
        threads.append(t)

    plane.release_now = release_now
    mine = [[int(i) for i in plane.deliver()[1].handles.tolist()]]
    (t,) = threads
    t.join(JOIN_S)
    assert not t.is_alive(), "the delivery inside read_locked hung"
    del plane.release_now
    return other, mine


def _guarded(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        return e


def _check_release_window(plane: Any, ref: Any, sched: _Watched) -> None:
    other, mine = _release_window(plane, sched)
    assert len(other) == 1 and not isinstance(other[0], BaseException), f"refused spuriously: {other!r}"
    expect = [[int(i) for i in ref.deliver()[1].handles.tolist()] for _ in range(2)]
    assert mine + other == expect, "not the synchronous minibatches, in order"


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_the_on_policy_release_step_leaves_no_stale_mark_core_plane(overlap: bool) -> None:
    """Item 3 on the core plane: the mark that the delivery waits for the buffer's lock is cleared under that lock
    (``release_now(when=...)``), so a delivery inside ``read_locked`` that meets it just after the release waits for
    it (it needs the lock no more) instead of being refused."""
    sched = _Watched(g_del=1, overlap=overlap, background_ingest=False)

    def build(s: Overlapped | None) -> ExperienceDataPlane:
        e = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=4, num_epochs=2),
                                scheduler=s)
        e.ingest(id_batch(np.arange(32)), version=0)
        e.seal()
        return e
    plane, ref = build(sched), build(None)
    _check_release_window(plane, ref, sched)
    plane.close()
    ref.close()


def test_the_on_policy_release_step_leaves_no_stale_mark_distributed_plane(servers: Any) -> None:
    """Item 3 on the distributed plane (a real 2-node Ray cluster): the same, through its ``release_now``."""
    from conduit.distributed import DistributedDataPlane

    sched = _Watched(g_del=1, overlap=False, background_ingest=False)
    sem = OnPolicy(minibatch_size=8, num_epochs=2, shuffle=False)
    with DistributedDataPlane(ID_SCHEMA, capacity=64, servers=servers, health_period=None, measure=False,
                              semantics=sem, scheduler=sched) as plane:
        plane.ingest(id_batch(np.arange(32)), version=0)
        plane.seal()
        ref = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(minibatch_size=8, num_epochs=2,
                                                                             shuffle=False))
        ref.ingest(id_batch(np.arange(32)), version=0)
        ref.seal()
        _check_release_window(plane, ref, sched)
        ref.close()
