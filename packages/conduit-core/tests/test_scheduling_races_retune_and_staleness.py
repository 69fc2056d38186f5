"""Scheduling, third review round: priority staleness across retune/migrate/checkpoint, concurrent producers in
sequential ingestion, Automatic's switches under a producer thread and its first delivery, close/flush/migrate
racing background work, refused retunes, and sequential prioritized delivery against a synchronous buffer."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    CapacityError,
    ColumnarStorage,
    ConduitError,
    ConfigurationError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    PrioritizedSampler,
    Replay,
    Synchronous,
)
from conduit.placement import HostPlacement
from conduit.testing.lifecycle import wait_until
from conduit.testing.reference import ID_SCHEMA, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_scheduling import _GatedPlacement  # noqa: E402  (a slow tier whose appends wait for a gate)

# -- prioritized replay: a delivered draw never misses more updates than declared ------------------------------------
_N = 8


def _dominant(item: int) -> torch.Tensor:
    """Priorities that give ``item`` (of ``_N``) all but a negligible share of the mass."""
    p = np.full(_N, 1e-9)
    p[item] = 1e9
    return torch.from_numpy(p)


def _prioritized(scheduler: Any) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=_N, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=3),
                              scheduler=scheduler)
    edp.ingest(id_batch(np.arange(_N)), priorities=_dominant(0))
    edp.flush()
    return edp


def _missed_updates(edp: ExperienceDataPlane, updates: int) -> int:
    """Deliver one batch; how many of the ``updates`` priority updates so far its draw preceded.

    Update ``u`` makes item ``u % _N`` dominant, so a draw's dominant item names the last update it saw.
    """
    b, _ = edp.deliver(64)
    seen = int(np.bincount(b["id"].numpy(), minlength=_N).argmax())
    return (updates - seen) % _N


def _staleness_run(edp: ExperienceDataPlane, steps: int, hook: Any = None) -> list[tuple[int, int, int]]:
    """Alternate delivery and a priority update; the deliveries whose draw missed more updates than declared."""
    over = []
    for step in range(steps):
        if hook is not None:
            hook(edp, step)
        bound = edp.scheduler.priority_staleness
        missed = _missed_updates(edp, step)
        if missed > bound:
            over.append((step, missed, bound))
        edp.update_priorities(torch.arange(_N), _dominant((step + 1) % _N))
    return over


def test_sequential_retune_to_a_smaller_chunk_keeps_the_declared_priority_staleness() -> None:
    sched = Overlapped(g_del=3, overlap=False)
    edp = _prioritized(sched)
    assert _missed_updates(edp, 0) == 0  # a chunk of 3 drawn in the call: 2 wait in the scheduler
    edp.update_priorities(torch.arange(_N), _dominant(1))
    sched.retune(g_del=1)
    assert sched.priority_staleness == 0, "sequential g_del=1 draws in each delivery call"
    missed = _missed_updates(edp, 1)
    assert missed == 0, (f"after retune(g_del=1) the scheduler declares priority_staleness=0, but the delivered "
                         f"draw preceded {missed} priority update(s): a batch drawn for the old chunk was kept")
    edp.close()


@pytest.mark.parametrize("make", [lambda: Overlapped(g_del=2), lambda: Overlapped(g_del=4),
                                  lambda: Overlapped(g_del=3, overlap=False),
                                  lambda: Overlapped(g_del=4, max_priority_staleness=2)],
                         ids=["overlap-g2", "overlap-g4", "sequential-g3", "overlap-g4-cap2"])
def test_priority_staleness_bound_holds_across_migrate_checkpoint_and_retune(make: Any) -> None:
    def hook(edp: ExperienceDataPlane, step: int) -> None:
        if step == 6:
            edp.migrate(HostPlacement())
        elif step == 12:
            edp.load_state_dict(edp.state_dict())
        elif step == 18:
            edp.scheduler.retune(g_del=1)
        elif step == 24:
            edp.scheduler.retune(g_del=3)

    edp = _prioritized(make())
    over = _staleness_run(edp, 32, hook)
    assert not over, f"{edp.scheduler!r}: (step, updates missed, declared bound) past the bound: {over}"
    edp.close()


# -- several producers, sequential ingestion: one storing caller at a time -------------------------------------------
def _gated(gate: threading.Event, scheduler: Any, schema: Any = ID_SCHEMA) -> ExperienceDataPlane:
    return ExperienceDataPlane(schema, capacity=1000, semantics=Replay(seed=1), placement=_GatedPlacement(gate),
                               scheduler=scheduler)



def _ingest_in_thread(edp: ExperienceDataPlane, batch: Any, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            edp.ingest(batch)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
    t = threading.Thread(target=run)
    t.start()
    return t


def test_concurrent_producers_do_not_share_the_staging_buffer_in_sequential_ingestion() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,)))

    def batch(lo: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(lo, lo + 3)
        return {"id": ids, "obs": ids[:, None].float().expand(3, 4).contiguous()}

    gate = threading.Event()
    sched = Overlapped(g_ing=2, overlap=False)
    edp = _gated(gate, sched, schema)
    errors: list[BaseException] = []
    edp.ingest(batch(0))  # half a group: waits in the queue
    first = _ingest_in_thread(edp, batch(10), errors)  # completes the group: staged, then its write waits at the gate
    wait_until(lambda: sched._ingestion._inflight, "the first group is being stored")
    second = [_ingest_in_thread(edp, batch(20), errors)]
    time.sleep(0.05)
    second.append(_ingest_in_thread(edp, batch(30), errors))  # the second group (another producer's)
    time.sleep(0.2)  # (before the fix it is staged over the first group's rows by now)
    gate.set()
    for t in [first, *second]:
        t.join(10)
        assert not t.is_alive(), "a producer hung"
    assert not errors, errors
    edp.flush()
    data = edp.state_dict()["storage"]["data"]
    ids = data["id"].tolist()
    assert sorted(ids) == [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32], (
        f"two producers' groups were staged in the same buffer at once: stored ids {ids}")
    assert torch.equal(data["obs"][:, 0], data["id"].float()), "a stored item's fields come from different batches"
    assert ids[:6] == [0, 1, 2, 10, 11, 12], f"the group taken first was not stored first: {ids}"
    edp.close()


def test_flush_waits_for_a_group_another_producer_is_storing_in_sequential_ingestion() -> None:
    gate = threading.Event()
    sched = Overlapped(g_ing=2, overlap=False)
    edp = _gated(gate, sched)
    errors: list[BaseException] = []
    edp.ingest(id_batch(np.arange(0, 4)))
    producer = _ingest_in_thread(edp, id_batch(np.arange(4, 8)), errors)  # stores both, waiting at the gate
    wait_until(lambda: sched._ingestion._inflight, "the group is being stored")
    flushed = threading.Event()
    flusher = threading.Thread(target=lambda: (edp.flush(), flushed.set()))
    flusher.start()
    time.sleep(0.1)
    returned_early = flushed.is_set()  # (len() would wait for the gated write: it holds the buffer's lock)
    gate.set()
    flusher.join(10)
    producer.join(10)
    assert not errors, errors
    assert not returned_early, ("flush() returned while a handed-over batch (its ingest had returned) was still "
                                "being written by another producer")
    assert len(edp) == 8
    edp.close()


# -- Automatic: a producer thread while the learner's deliveries switch schedulers -----------------------------------
def test_automatic_switches_never_strand_or_refuse_a_concurrent_producers_batches() -> None:
    """A switch drains the current scheduler, then routes calls to the next one; a hand-over in between
    must not land in the drained one (flush would not see it) nor be refused when that one is closed."""
    misses: list[tuple[int, int, int, str]] = []
    errors: list[BaseException] = []
    for _trial in range(5):
        sched = Automatic(g_ing_max=4, g_del_max=4, confirm_deliveries=1, confirm_windows=8, queue_depth=2)
        edp = ExperienceDataPlane(ID_SCHEMA, capacity=1 << 20, semantics=Replay(seed=1), scheduler=sched)
        edp.ingest(id_batch(np.arange(10)))
        edp.flush()
        accepted = [10]
        stop = threading.Event()

        def produce(edp: ExperienceDataPlane = edp, accepted: list[int] = accepted, stop: threading.Event = stop
                    ) -> None:
            i = 10
            try:
                while not stop.is_set():
                    edp.ingest(id_batch(np.arange(i, i + 2)))
                    i += 2
                    accepted[0] = i
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            for step in range(160):
                edp.deliver(4)
                if step % 4 == 0:
                    before = accepted[0]
                    edp.flush()
                    if len(edp) < before:
                        misses.append((step, before, len(edp), sched._phase))
        finally:
            stop.set()
            producer.join(10)
        assert not producer.is_alive(), "the producer hung"
        edp.flush()
        assert len(edp) == accepted[0], f"{accepted[0]} items accepted, {len(edp)} stored"
        edp.close()
    assert not errors, f"ingest on an open buffer was refused while Automatic switched schedulers: {errors[:1]}"
    assert not misses, (f"flush() returned before every accepted batch was stored (step, items accepted, "
                        f"items stored, phase): {misses[:3]}")


# -- close() from another thread while the learner keeps delivering --------------------------------------------------
def test_close_from_another_thread_never_breaks_a_delivery_in_progress() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), obs=Field((256,)))
    raw: list[BaseException] = []
    for trial in range(30):
        edp = ExperienceDataPlane(schema, capacity=4096, semantics=Replay(seed=1), scheduler=Overlapped(g_del=2))
        edp.ingest({"id": torch.arange(4096), "obs": torch.zeros(4096, 256)})
        edp.flush()
        stop = threading.Event()

        def learn(edp: ExperienceDataPlane = edp, stop: threading.Event = stop) -> None:
            try:
                while not stop.is_set():
                    b, info = edp.deliver(512)
                    assert torch.equal(b["id"], info.handles), "a delivered batch does not hold its items"
            except ConduitError:
                pass  # a typed refusal after close is acceptable
            except BaseException as e:  # noqa: BLE001 - reported by the test
                raw.append(e)

        learner = threading.Thread(target=learn)
        learner.start()
        time.sleep(0.005 + 0.001 * (trial % 7))
        edp.close()
        time.sleep(0.005)
        stop.set()
        learner.join(10)
        assert not learner.is_alive(), "a delivery hung after close()"
    assert not raw, f"a delivery racing close() failed with a raw exception: {raw[0]!r}"


# -- close() again after a close that could not store everything ----------------------------------------------------
def test_close_again_after_a_failed_close_retries_the_unstored_batches() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=OnPolicy(num_minibatches=2, seed=5),
                              scheduler=Overlapped())
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    edp.ingest(id_batch(np.arange(100, 110)), version=1)  # does not fit until the first rollout is consumed
    with pytest.raises(CapacityError):
        edp.close()
    with pytest.raises(CapacityError, match="pending"):  # still failing: said again, not a silent return
        edp.close()
    assert not edp.closed, "a close that could not store everything marked the buffer closed"
    assert [h.batch.batch_size for h in edp.scheduler.pending()] == [10], "the unstored batch was lost"
    while not edp.deliver()[1].last:  # consume the first rollout: room for the second
        pass
    edp.close()  # the retry now succeeds
    assert edp.scheduler.pending() == [], "close() returned with batches still unstored"
    assert edp.closed
    assert len(edp) == 10 and sorted(edp.state_dict()["storage"]["data"]["id"].tolist()) == list(range(100, 110))


# -- Automatic: the first delivery sizes the probe; a refused one must not ------------------------------------------
@pytest.mark.parametrize("bad", ["x", -5, 0, 2.5, None, True])
def test_automatic_first_delivery_with_a_bad_size_is_refused_typed_and_plans_nothing(bad: Any) -> None:
    budget = 6 * 64 * ID_SCHEMA.fixed_item_bytes  # delivery buffers for 2 batches of 64 per call, at most
    sched = Automatic(memory_budget=budget)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, semantics=Replay(seed=1), scheduler=sched)
    edp.ingest(id_batch(np.arange(200)))
    edp.flush()
    with pytest.raises(ConfigurationError, match="positive batch size"):
        edp.deliver(bad)
    b, _ = edp.deliver(64)
    assert b.batch_size == 64
    assert max(sched.range.g_del) == 2, (f"the probe range {sched.range.g_del} was sized by the refused "
                                         f"deliver({bad!r}), not by the first accepted batch of 64 items")
    edp.close()


def test_automatic_first_delivery_refused_on_an_empty_buffer_plans_nothing() -> None:
    budget = 6 * 64 * ID_SCHEMA.fixed_item_bytes
    sched = Automatic(memory_budget=budget)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, semantics=Replay(seed=1), scheduler=sched)
    with pytest.raises(EmptyBufferError):
        edp.deliver(1)
    edp.ingest(id_batch(np.arange(200)))
    edp.deliver(64)
    assert max(sched.range.g_del) == 2, f"the probe range {sched.range.g_del} was sized by a refused delivery of 1"
    edp.close()


# -- a closed buffer's scheduler serves a rebuilt buffer of another shape ---------------------------------------------
def test_a_scheduler_serves_a_rebuilt_on_policy_buffer_with_another_minibatch_count() -> None:
    sched = Overlapped()  # g_del=1: one minibatch per call, whatever M is
    first = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=4), scheduler=sched)
    first.close()
    second = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    second.ingest(id_batch(np.arange(8)), version=0)
    second.seal()
    sizes = []
    while True:
        b, info = second.deliver()
        sizes.append(b.batch_size)
        if info.last:
            break
    assert sizes == [4, 4], f"M=2 of 8 items should deliver two minibatches of 4, got {sizes}"
    second.close()
    third = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=sched)
    third.ingest(id_batch(np.arange(8)))
    assert third.deliver(4)[0].batch_size == 4
    third.close()


# -- retune: a refused call changes nothing ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"g_ing": 3, "g_del": 1.5}, {"g_ing": 3, "g_del": 0}])
def test_retune_refused_for_one_value_applies_neither(kwargs: dict[str, Any]) -> None:
    sched = Overlapped(g_ing=1, g_del=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=sched)
    with pytest.raises(ConfigurationError, match="g_del"):
        sched.retune(**kwargs)
    assert (sched.g_ing, sched._ingestion.g_ing, sched._ingestion.queue_depth, sched.g_del) == (1, 1, 8, 2), (
        "a refused retune changed the ingestion granularity")
    edp.close()


def test_on_policy_retune_refuses_a_bool_granularity() -> None:
    sched = Overlapped(g_ing=0.5)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    with pytest.raises(ConfigurationError, match="g_ing"):
        sched.retune(g_ing=True)
    assert sched.g_ing == 0.5
    edp.close()


# -- flush() from another thread while a producer waits for room and a background write fails ----------------------
class _FailOnceStorage(ColumnarStorage):
    """Host storage whose appends wait for a gate, the first ``fail`` of them then failing (a transient tier error)."""

    gate: threading.Event
    fail = 0

    def append(self, batch: Any, *, evict: bool = True) -> Any:
        assert self.gate.wait(10), "gate never opened"
        if self.fail:
            self.fail -= 1
            raise RuntimeError("injected append failure")
        return super().append(batch, evict=evict)


class _FailOncePlacement(HostPlacement):
    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        s = _FailOnceStorage(schema, capacity, "cpu")
        s.gate = self.gate
        return s


def test_flush_waiting_in_another_thread_never_hangs_when_a_blocked_producer_takes_the_failure() -> None:
    for _trial in range(20):
        gate = threading.Event()
        sched = Overlapped(queue_depth=1)
        edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=1), placement=_FailOncePlacement(gate),
                                  scheduler=sched)
        assert isinstance(edp.storage, _FailOnceStorage)
        edp.storage.fail = 1
        edp.ingest(id_batch(np.arange(0, 4)))  # the worker takes it and waits at the gate; its write will fail
        wait_until(lambda s=sched: s._ingestion._inflight, "the worker took the first batch")
        edp.ingest(id_batch(np.arange(4, 8)))  # fills the queue
        got: dict[str, str] = {}

        def call(name: str, fn: Any, got: dict[str, str] = got) -> threading.Thread:
            def run() -> None:
                try:
                    fn()
                    got[name] = "returned"
                except Exception as e:  # noqa: BLE001 - recorded for the assertions
                    got[name] = type(e).__name__
            t = threading.Thread(target=run, daemon=True)
            t.start()
            return t

        producer = call("ingest", lambda edp=edp: edp.ingest(id_batch(np.arange(8, 12))))  # waits for room
        time.sleep(0.03)  # the producer waits first: woken first, it mostly takes the failure first
        flusher = call("flush", edp.flush)
        wait_until(lambda s=sched: s._ingestion._force, "flush() waits for the worker")  # before the write fails
        gate.set()
        producer.join(5)
        flusher.join(5)
        assert not flusher.is_alive(), (f"flush() hung after a background write failed while it waited (the blocked "
                                        f"producer's call: {got.get('ingest')})")
        assert not producer.is_alive(), "the producer waiting for room hung"
        assert got["flush"] == "RuntimeError", f"flush returned with a batch unstored: {got}"
        assert got["ingest"] in ("RuntimeError", "ConfigurationError"), got
        assert [h.batch["id"].tolist() for h in sched.pending()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        edp.flush()  # the retry stores both, in order
        assert edp.state_dict()["storage"]["data"]["id"].tolist() == list(range(8))
        edp.close()


# -- migrate() from another thread while the learner keeps delivering ------------------------------------------------
def test_deliveries_racing_a_migration_to_a_grown_schema_never_gather_into_old_schema_buffers() -> None:
    """Between the storage swap and the scheduler's invalidation, a delivery (or the prefetch job) must not gather
    the new schema's rows into buffers sized for the old one (torch resizes them with a deprecation warning today,
    and will raise in a future release)."""
    grown = ExperienceSchema(id=Field((), torch.int64), obs=Field((5,), torch.float32))

    def pad(b: Any) -> dict[str, torch.Tensor]:
        return {"id": b["id"], "obs": torch.nn.functional.pad(b["obs"], (0, 2))}

    wrong: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for trial in range(10):
            edp = ExperienceDataPlane(ID_SCHEMA, capacity=20000, semantics=Replay(seed=trial),
                                      scheduler=Overlapped(g_del=1))
            edp.ingest(id_batch(np.arange(20000)))
            edp.flush()
            stop = threading.Event()

            def learn(edp: ExperienceDataPlane = edp, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    b, info = edp.deliver(64)
                    if not (torch.equal(b["id"], info.handles) and torch.equal(b["obs"][:, 0], b["id"].float())):
                        wrong.append(f"{b['id'][:4].tolist()} / {info.handles[:4].tolist()}")

            learner = threading.Thread(target=learn)
            learner.start()
            time.sleep(0.002 * (trial % 5))
            edp.migrate(HostPlacement(), schema=grown, transform=pad)
            time.sleep(0.01)
            stop.set()
            learner.join(10)
            assert not learner.is_alive()
            b, _ = edp.deliver(8)
            assert b["obs"].shape == (8, 5)
            edp.close()
    resized = [str(w.message)[:120] for w in caught if "resized" in str(w.message)]
    assert not resized, f"a gather wrote new-schema rows into an old-schema delivery buffer: {resized[0]}"
    assert not wrong, f"a delivery racing the migration does not hold its items: {wrong[:2]}"


# -- sequential delivery under a seed: what a synchronous buffer delivers, to the bit ---------------------------------
def _prioritized_run(scheduler: Any) -> list[tuple[torch.Tensor, ...]]:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(PrioritizedSampler(alpha=0.7, beta=0.4), seed=5),
                              scheduler=scheduler)
    gen = torch.Generator().manual_seed(0)
    out = []
    for k in range(8):
        edp.ingest(id_batch(np.arange(20 * k, 20 * k + 20)),
                   priorities=torch.rand(20, dtype=torch.float64, generator=gen) + 0.1)
        kw = {} if k % 3 == 0 else {"beta": 0.3 + 0.05 * k}  # the default beta, and an annealed one
        b, info = edp.deliver(16, **kw)
        assert info.weights is not None and info.probabilities is not None
        out.append((b["id"].clone(), info.handles.clone(), info.weights.clone(), info.probabilities.clone()))
        edp.update_priorities(info.handles, (b["id"] % 7 + 1).double())
    edp.close()
    return out


def test_sequential_prioritized_delivery_equals_synchronous_bit_for_bit() -> None:
    want = _prioritized_run(Synchronous())
    got = _prioritized_run(Overlapped(overlap=False))
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(("ids", "handles", "weights", "probabilities"), g, w, strict=True):
            diff = float((a.double() - b.double()).abs().max())
            assert torch.equal(a, b), (f"delivery {step}: {name} differ from a synchronous buffer's under the same "
                                       f"seed and calls (max difference {diff})")
