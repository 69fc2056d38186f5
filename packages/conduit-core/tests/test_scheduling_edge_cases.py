"""The overlapped and automatic schedulers: failure paths, close races, invalidation, argument checks, attach."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    CapacityError,
    ColumnarStorage,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Replay,
    Synchronous,
)
from conduit.placement import HostPlacement
from conduit.testing.lifecycle import eventually
from conduit.testing.reference import ID_SCHEMA, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_scheduling import _GatedPlacement  # noqa: E402  (a slow tier whose appends wait for a gate)


class _FlakyStorage(ColumnarStorage):
    """Host storage whose gather fails ``fail`` times when the prefetch worker calls it (a transient tier error)."""

    fail = 0

    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> Any:
        if self.fail and threading.current_thread().name == "conduit-prefetch":
            self.fail -= 1
            raise RuntimeError("injected gather failure in the prefetch worker")
        return super().gather(slots, out)


class _FlakyPlacement(HostPlacement):
    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        return _FlakyStorage(schema, capacity, "cpu")




def _flaky_replay(scheduler: Overlapped) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1000, semantics=Replay(seed=1), placement=_FlakyPlacement(),
                              scheduler=scheduler)
    edp.ingest(id_batch(np.arange(100)))
    edp.flush()
    return edp


def _fail_next_prefetch(edp: ExperienceDataPlane) -> None:
    """Make the prefetch job that the next delivery starts fail, and let it finish."""
    assert isinstance(edp.storage, _FlakyStorage)
    edp.storage.fail = 1
    edp.deliver(8)
    job = edp.scheduler._job
    assert job is not None, "the delivery started no prefetch job"
    job.wait()
    assert edp.storage.fail == 0, "the prefetch job did not run into the injected failure"


# -- failures of the prefetch worker ---------------------------------------------------------------------------------
def test_a_failed_prefetch_job_does_not_fail_a_later_delivery_that_had_its_batch() -> None:
    edp = _flaky_replay(Overlapped(g_del=2))
    _fail_next_prefetch(edp)  # the first delivery prepared a chunk of 2 in the caller: one batch stays ready
    for i in range(6):
        try:
            b, info = edp.deliver(8)
        except RuntimeError as e:
            pytest.fail(f"delivery {i} raised the earlier prefetch job's failure: {e}")
        assert torch.equal(b["id"], info.handles), "a delivered batch does not hold the items its handles name"
    edp.close()


def test_close_after_a_failed_prefetch_job_still_drains_ingestion_and_stops() -> None:
    edp = _flaky_replay(Overlapped(g_del=2))
    _fail_next_prefetch(edp)
    edp.ingest(id_batch(np.arange(100, 110)))
    try:
        edp.close()
    except RuntimeError as e:
        pytest.fail(f"close() raised the failure of a prefetch job whose batches it discards anyway: {e}")
    assert len(edp) == 110 and not edp.scheduler.pending(), "close() did not store everything handed over"
    with pytest.raises(ConfigurationError, match="closed"):
        edp.ingest(id_batch(np.arange(110, 112)))


def test_checkpoint_after_a_failed_prefetch_job_is_not_refused() -> None:
    edp = _flaky_replay(Overlapped(g_del=2))
    _fail_next_prefetch(edp)
    try:
        state = edp.state_dict()
    except RuntimeError as e:
        pytest.fail(f"state_dict() raised the failure of a discarded prefetch job: {e}")
    assert state["storage"]["data"]["id"].tolist() == list(range(100))
    edp.close()


# -- close while a producer waits for room ---------------------------------------------------------------------------
def test_a_producer_blocked_by_backpressure_during_close_is_refused_or_stored_never_dropped() -> None:
    for trial in range(8):
        gate = threading.Event()
        edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, placement=_GatedPlacement(gate),
                                  scheduler=Overlapped(queue_depth=1))
        edp.ingest(id_batch(np.arange(0, 4)))  # taken by the worker, which waits at the gate
        time.sleep(0.01)
        edp.ingest(id_batch(np.arange(4, 8)))  # fills the queue
        outcome: dict[str, Any] = {}

        def produce(edp: ExperienceDataPlane = edp, outcome: dict[str, Any] = outcome) -> None:
            try:
                edp.ingest(id_batch(np.arange(8, 12)))  # blocks: the queue is full
                outcome["accepted"] = True
            except ConfigurationError as e:
                outcome["refused"] = e

        producer = threading.Thread(target=produce)
        producer.start()
        time.sleep(0.02)
        closer = threading.Thread(target=edp.close)
        closer.start()
        time.sleep(0.02)
        gate.set()
        closer.join(10)
        producer.join(10)
        assert not closer.is_alive() and not producer.is_alive(), "close or the blocked producer hung"
        stored = len(edp) + len(edp.scheduler.pending())
        if outcome.get("accepted"):
            assert len(edp) == 12, f"trial {trial}: ingest accepted a batch during close() that was never stored"
        else:
            assert "closed" in str(outcome.get("refused")), f"trial {trial}: {outcome}"
            assert len(edp) == 8 and stored == 8, f"trial {trial}: a refused batch changed the buffer"


# -- on-policy delivery -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [True, False])
def test_on_policy_delivery_with_a_size_is_refused_as_synchronous_delivery_refuses_it(overlap: bool) -> None:
    def run(sched: Any) -> list[Any]:
        edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=OnPolicy(num_minibatches=4, seed=2),
                                  scheduler=sched)
        edp.ingest(id_batch(np.arange(16)), version=0)
        edp.seal()
        out: list[Any] = [edp.deliver()[0]["id"].tolist()]
        time.sleep(0.01)  # let a prefetch run
        with pytest.raises(ConfigurationError, match="without n"):
            edp.deliver(3)
        while True:
            b, info = edp.deliver()
            out.append(b["id"].tolist())
            if info.last:
                break
        edp.close()
        return out

    ref = run(Synchronous())
    assert run(Overlapped(overlap=overlap)) == ref, "the refused call changed what on-policy delivery returns"


# -- the automatic scheduler's candidates ---------------------------------------------------------------------------
def test_automatic_switching_windows_never_drops_a_delivered_on_policy_minibatch() -> None:
    """A window switch needs the current scheduler's queue stored; when it cannot be yet (the next rollout
    fits only once the learner consumed this one), the switch waits instead of failing the delivery."""
    s = Automatic(confirm_deliveries=3, confirm_windows=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=20, semantics=OnPolicy(num_minibatches=4, seed=1), scheduler=s)

    def rollout(v: int) -> Any:
        return id_batch(np.arange(100 * v, 100 * v + 16))

    v = 0
    edp.ingest(rollout(0), version=0)
    edp.seal()
    got: list[int] = []  # rollout v's items delivered so far
    for _ in range(400):  # whole rollouts until a window of the overlapped candidate ends inside one
        b, info = edp.deliver()
        got += b["id"].tolist()
        if info.last:
            v += 1
            got = []
            edp.set_policy_version(v)
            edp.ingest(rollout(v), version=v)
            edp.seal()
        elif (s._phase == "confirm" and s._confirm_name == "overlapped" and s.inner.background_ingest
              and 1 <= s._confirm_left <= 3 - info.minibatch):
            break
    else:
        pytest.fail("never reached a window of the overlapped candidate that ends inside a rollout")
    edp.ingest(rollout(v + 1), version=v + 1)  # stored in the background: fails until rollout v is consumed
    # the background write has failed (waited for, not slept on: a loaded machine runs the worker late, and a
    # write tried only after rollout v was consumed would succeed and test nothing)
    assert eventually(lambda: s.inner._ingestion._paused, timeout=60), "the background write never failed"
    while True:
        try:
            b, info = edp.deliver()
        except Exception as e:  # noqa: BLE001 - the failure names it
            pytest.fail(f"a delivery of rollout {v} raised {type(e).__name__}: {e}")
        got += b["id"].tolist()
        if info.last:
            break
    assert sorted(got) == list(range(100 * v, 100 * v + 16)), f"rollout {v} was not delivered whole: {sorted(got)}"
    edp.set_policy_version(v + 1)
    with pytest.raises(CapacityError):
        edp.seal()  # the producer hears of the earlier background failure once ...
    edp.seal()  # ... and the retry stores the rollout
    rest: list[int] = []
    while True:
        b, info = edp.deliver()
        rest += b["id"].tolist()
        if info.last:
            break
    assert sorted(rest) == list(range(100 * (v + 1), 100 * (v + 1) + 16)), "the next rollout was lost or changed"
    edp.close()


def test_automatic_idle_candidate_follows_a_migration_during_the_confirm_phase() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1000, semantics=Replay(seed=1), scheduler=Automatic())
    edp.ingest(id_batch(np.arange(500)))
    edp.flush()
    s = edp.scheduler
    assert isinstance(s, Automatic)
    for _ in range(500):
        if s._phase != "probe":
            break
        edp.deliver(16)
    assert s._phase == "confirm", "calibration did not reach the confirm phase"
    grown = ExperienceSchema(id=Field((), torch.int64), obs=Field((5,), torch.float32),
                             extra=Field((2,), torch.float32))

    def grow(b: Any) -> dict[str, torch.Tensor]:
        return {"id": b["id"], "obs": torch.nn.functional.pad(b["obs"], (0, 2)), "extra": torch.zeros(b.batch_size, 2)}

    edp.migrate(HostPlacement(), schema=grown, transform=grow)
    for i in range(300):  # through every confirm window (both candidates) into the run phase
        if s._phase == "run" and i > 20:
            break
        b, info = edp.deliver(16)
        assert b["obs"].shape == (16, 5) and b["extra"].shape == (16, 2), f"delivery {i}: an old-schema batch"
        assert torch.equal(b["id"], info.handles) and torch.equal(b["obs"][:, 0], b["id"].float())
    assert s._phase == "run", "calibration did not finish"
    edp.close()


# -- bad arguments are refused typed -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(queue_depth=float("nan")), dict(queue_depth="8"), dict(queue_depth=2.5),
                                    dict(queue_depth=None), dict(max_priority_staleness="2"),
                                    dict(max_priority_staleness=float("nan")), dict(max_priority_staleness=1.5),
                                    dict(output_depth=True), dict(rollout_size="x"), dict(rollout_size=0),
                                    dict(rollout_size=-4)])
def test_overlapped_refuses_non_integer_counts_typed(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="must be"):
        Overlapped(**kwargs)


def test_overlapped_accepts_numpy_integer_counts() -> None:
    s = Overlapped(queue_depth=np.int64(4), max_priority_staleness=np.int64(1), output_depth=np.int64(3))
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, scheduler=s)
    edp.ingest(id_batch(np.arange(10)))
    edp.flush()
    assert edp.deliver(4)[0].batch_size == 4 and s.output_depth == 3
    edp.close()


@pytest.mark.parametrize("kwargs", [dict(probe_rounds=float("nan")), dict(confirm_deliveries="x"),
                                    dict(confirm_windows=2.5)])
def test_automatic_refuses_non_integer_counts_typed(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="must be an int"):
        Automatic(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(on_policy=True, num_minibatches=True), dict(on_policy=False, g_ing_max=True),
                                    dict(on_policy=False, memory_budget=-1, batch_bytes=10),
                                    dict(on_policy=False, batch_bytes=-5, memory_budget=100)])
def test_safe_ranges_refuses_bools_and_negative_bytes_typed(kwargs: dict[str, Any]) -> None:
    from conduit.scheduling import safe_ranges

    with pytest.raises(ConfigurationError, match="must be"):
        safe_ranges(**kwargs)


@pytest.mark.parametrize("version", ["abc", float("nan"), 1.7, None, True])
def test_set_policy_version_refuses_a_non_integer_typed_and_unchanged(version: Any) -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=OnPolicy(num_minibatches=2))
    edp.set_policy_version(3)
    with pytest.raises(ConfigurationError, match="policy version"):
        edp.set_policy_version(version)
    assert edp.semantics.policy_version == 3, "a refused set_policy_version changed the version"


def test_set_policy_version_takes_numpy_and_tensor_integers() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=OnPolicy(num_minibatches=2))
    edp.set_policy_version(np.int64(2))
    assert edp.semantics.policy_version == 2 and type(edp.semantics.policy_version) is int
    edp.set_policy_version(torch.tensor(5))
    assert edp.semantics.policy_version == 5 and type(edp.semantics.policy_version) is int


def _checkpoint_ok() -> dict[str, Any]:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1))
    edp.ingest(id_batch(np.arange(10)))
    return edp.state_dict()


@pytest.mark.parametrize("bad", ["none", "list", "format_only", "no_semantics", "no_storage", "storage_none"])
def test_load_state_dict_refuses_a_malformed_checkpoint_typed_and_unchanged(bad: str) -> None:
    good = _checkpoint_ok()
    state: Any = {"none": None, "list": [], "format_only": {"format": 1},
                  "no_semantics": {"format": 1, "storage": good["storage"]},
                  "no_storage": {"format": 1, "semantics": good["semantics"]},
                  "storage_none": {"format": 1, "storage": None, "semantics": good["semantics"]}}[bad]
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1), scheduler=Overlapped(g_del=2))
    edp.ingest(id_batch(np.arange(20, 25)))
    edp.flush()
    with pytest.raises(ConfigurationError, match="checkpoint"):
        edp.load_state_dict(state)
    assert edp.state_dict()["storage"]["data"]["id"].tolist() == list(range(20, 25)), "a refused load changed it"
    edp.close()


# -- telemetry --------------------------------------------------------------------------------------------------------
def test_a_trace_written_after_close_still_names_the_scheduler_workers() -> None:
    with ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1),
                             scheduler=Overlapped(g_del=2)) as edp:
        for i in range(5):
            edp.ingest(id_batch(np.arange(10 * i, 10 * i + 10)))
            edp.deliver(4)
    events = edp.telemetry.chrome_trace()["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"conduit-ingest", "conduit-prefetch"} <= names, f"the workers' spans are not named after close: {names}"
    tids = {e["tid"] for e in events if e["ph"] == "X"}
    assert tids == {e["tid"] for e in events if e["ph"] == "M"}, "a thread's spans have no name event"


# -- one scheduler per buffer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [Synchronous, lambda: Overlapped(overlap=False), lambda: Overlapped(g_del=2),
                                  Automatic])
def test_a_scheduler_serving_one_buffer_is_refused_by_another(make: Any) -> None:
    sched = make()
    a = ExperienceDataPlane(ID_SCHEMA, capacity=100, scheduler=sched)
    with pytest.raises(ConfigurationError, match="one scheduler per buffer"):
        ExperienceDataPlane(ID_SCHEMA, capacity=100, scheduler=sched)
    a.ingest(id_batch(np.arange(5)))
    a.flush()
    assert len(a) == 5, "the first buffer's batches went to the buffer that was refused"
    a.close()


@pytest.mark.parametrize("make", [Synchronous, lambda: Overlapped(g_ing=2, overlap=True)])
def test_a_scheduler_whose_buffer_was_closed_serves_a_new_one_fully(make: Any) -> None:
    """Adapters rebuild their buffer with the scheduler they were given (e.g. RLlib's replay buffer after a
    refused first add): once the first buffer is closed, the scheduler serves the new one, and the new
    one's close stores everything handed over."""
    sched = make()
    ExperienceDataPlane(ID_SCHEMA, capacity=100, scheduler=sched).close()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, scheduler=sched)
    edp.ingest(id_batch(np.arange(3)))
    edp.close()
    assert len(edp) == 3, "the rebuilt buffer's close did not store what was handed over"


def test_a_scheduler_refused_by_one_buffer_may_serve_another() -> None:
    sched = Overlapped(g_ing=2)
    with pytest.raises(ConfigurationError, match="On-policy g_ing"):
        ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, scheduler=sched)
    edp.ingest(id_batch(np.arange(4)))
    edp.flush()
    assert len(edp) == 4
    edp.close()
