"""The overlapped scheduler: hand-over, backpressure, draining, failures, prefetch semantics, buffer validity."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    ColumnarStorage,
    ConfigurationError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    PrioritizedSampler,
    Replay,
    StaleExperienceError,
    Synchronous,
)
from conduit.placement import HostPlacement
from conduit.testing.lifecycle import eventually
from conduit.testing.reference import ID_SCHEMA, id_batch


class _GatedStorage(ColumnarStorage):
    """Host storage whose appends wait for a gate: stands in for a slow tier."""

    def __init__(self, *args: Any, gate: threading.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = gate

    def append(self, batch: Any, *, evict: bool = True) -> Any:
        assert self.gate.wait(10), "gate never opened"
        return super().append(batch, evict=evict)


class _GatedPlacement(HostPlacement):
    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        return _GatedStorage(schema, capacity, "cpu", gate=self.gate)


def ids_of(edp: ExperienceDataPlane) -> list[int]:
    return edp.state_dict()["storage"]["data"]["id"].tolist()


def replay(scheduler: Any, capacity: int = 1000, **kw: Any) -> ExperienceDataPlane:
    return ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=Replay(seed=3, **kw), scheduler=scheduler)


def on_policy(scheduler: Any, capacity: int = 1000, **kw: Any) -> ExperienceDataPlane:
    kw.setdefault("num_minibatches", 4)
    return ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=OnPolicy(seed=5, **kw), scheduler=scheduler)


# -- ingestion ----------------------------------------------------------------------------------------------------
def test_ingest_returns_once_handed_over_and_flush_stores() -> None:
    gate = threading.Event()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, placement=_GatedPlacement(gate), scheduler=Overlapped())
    t0 = time.perf_counter()
    assert edp.ingest(id_batch(np.arange(10))) is None
    assert time.perf_counter() - t0 < 5
    assert len(edp) == 0, "the batch was stored before the (closed) storage gate opened"
    gate.set()
    edp.flush()
    assert ids_of(edp) == list(range(10))
    edp.close()


def test_full_queue_blocks_the_producer_until_the_worker_catches_up() -> None:
    gate = threading.Event()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, placement=_GatedPlacement(gate),
                              scheduler=Overlapped(queue_depth=2))
    done = threading.Event()

    def produce() -> None:
        for k in range(5):
            edp.ingest(id_batch(np.arange(10 * k, 10 * k + 10)))
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    time.sleep(0.3)
    assert not done.is_set(), "5 hand-overs went through a queue of depth 2 while storage was blocked"
    assert len(edp.scheduler.pending()) <= 3  # 2 queued + the one the worker holds
    gate.set()
    t.join(10)
    assert done.is_set()
    edp.flush()
    assert ids_of(edp) == list(range(50)), "backpressure lost or reordered hand-overs"
    edp.close()


def test_coalescing_g_ing_rollouts_per_write_keeps_order() -> None:
    edp = replay(Overlapped(g_ing=3, g_del=1), capacity=10_000)
    for k in range(10):
        edp.ingest(id_batch(np.arange(7 * k, 7 * k + 7)))
    edp.flush()
    assert ids_of(edp) == list(range(70))
    tot = edp.telemetry.totals
    assert tot["ingest"].calls == 4, f"10 rollouts at g_ing=3 should take 4 writes, took {tot['ingest'].calls}"
    assert tot["stage"].calls == 3 and tot["ingest_wait"].calls == 10
    edp.close()


def test_sequential_g_ing_stores_complete_groups_in_the_call() -> None:
    edp = replay(Overlapped(g_ing=2, overlap=False))
    edp.ingest(id_batch(np.arange(5)))
    assert len(edp) == 0, "a group of 2 rollouts was written after 1"
    edp.ingest(id_batch(np.arange(5, 10)))
    assert len(edp) == 10
    edp.ingest(id_batch(np.arange(10, 15)))
    batch, _ = edp.deliver(8)  # the buffer is not empty, so the pending rollout may wait
    assert batch["id"].max() < 10
    edp.flush()
    assert ids_of(edp) == list(range(15))
    edp.close()


def test_delivery_flushes_when_nothing_is_stored_yet() -> None:
    edp = replay(Overlapped(g_ing=4, overlap=False))
    edp.ingest(id_batch(np.arange(6)))
    batch, _ = edp.deliver(4)
    assert set(batch["id"].tolist()) <= set(range(6))
    edp.close()


def test_close_drains_everything_handed_over() -> None:
    gate = threading.Event()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1000, placement=_GatedPlacement(gate),
                              scheduler=Overlapped(g_ing=4))
    for k in range(6):
        edp.ingest(id_batch(np.arange(10 * k, 10 * k + 10)))
    threading.Timer(0.2, gate.set).start()
    edp.close()
    st = edp.storage
    got = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)["id"].tolist()
    assert got == list(range(60)), "close() returned before everything handed over was stored"


def test_background_failure_is_raised_later_and_the_batch_retried() -> None:
    sched = Overlapped()
    edp = on_policy(sched, capacity=16, num_minibatches=2)
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    edp.ingest(id_batch(np.arange(100, 110)), version=1)  # does not fit until the first rollout is consumed
    # the worker's write has failed and paused storing (waited for, not slept on: a loaded machine runs it late)
    assert eventually(lambda: sched._ingestion._paused, timeout=60), "the background write never failed"
    with pytest.raises(CapacityError, match="still queued|stay queued"):
        edp.ingest(id_batch(np.arange(200, 202)), version=1)
    assert [h.batch.batch_size for h in edp.scheduler.pending()] == [10], "the failed batch is not kept in order"
    while not edp.deliver()[1].last:  # consume the first rollout: room for the second
        pass
    edp.seal()  # flushes: the retry now succeeds
    ids = []
    while True:
        b, info = edp.deliver()
        ids += b["id"].tolist()
        assert info.version == 1
        if info.last:
            break
    assert sorted(ids) == list(range(100, 110)), "the retried batch was lost or changed"
    edp.close()


def test_close_raises_when_a_batch_cannot_be_stored_and_keeps_it() -> None:
    edp = on_policy(Overlapped(), capacity=16, num_minibatches=2)
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    edp.ingest(id_batch(np.arange(100, 110)), version=1)
    with pytest.raises(CapacityError):
        edp.close()
    left = edp.scheduler.pending()
    assert len(left) == 1 and left[0].batch["id"].tolist() == list(range(100, 110))


def test_on_policy_versions_may_not_go_backwards_across_the_queue() -> None:
    gate = threading.Event()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=OnPolicy(num_minibatches=2),
                              placement=_GatedPlacement(gate), scheduler=Overlapped())
    edp.ingest(id_batch(np.arange(4)), version=3)
    with pytest.raises(ConfigurationError, match="backwards"):
        edp.ingest(id_batch(np.arange(4, 8)), version=2)
    gate.set()
    edp.flush()
    assert ids_of(edp) == [0, 1, 2, 3], "the rejected batch changed the buffer"
    edp.close()


def test_copy_on_ingest_lets_the_producer_reuse_its_arrays() -> None:
    gate = threading.Event()
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, placement=_GatedPlacement(gate),
                              scheduler=Overlapped(copy_on_ingest=True))
    data = id_batch(np.arange(8))
    edp.ingest(data)
    data["id"].fill_(-1)
    data["obs"].fill_(-1)
    gate.set()
    edp.flush()
    assert ids_of(edp) == list(range(8))
    edp.close()


# -- delivery -----------------------------------------------------------------------------------------------------
def _filled(scheduler: Any, n: int = 500, **kw: Any) -> ExperienceDataPlane:
    edp = replay(scheduler, **kw)
    edp.ingest(id_batch(np.arange(n)))
    edp.flush()
    return edp


def test_prefetched_batches_are_the_drawn_items() -> None:
    edp = _filled(Overlapped(g_del=2))
    for _ in range(30):
        b, info = edp.deliver(32)
        assert torch.equal(b["id"], info.handles), "a prefetched batch does not hold the items its handles name"
        assert torch.equal(b["obs"][:, 0], b["id"].float())
    s = edp.scheduler
    assert s.prefetch_hits >= 20, f"prefetch served {s.prefetch_hits} deliveries, missed {s.prefetch_misses}"
    edp.close()


def test_prefetch_with_ingestion_in_the_caller() -> None:
    """background_ingest=False: each ingest is stored before it returns, and delivery still prefetches."""
    edp = replay(Overlapped(g_del=2, background_ingest=False))
    assert "background_ingest=False" in repr(edp.scheduler)
    assert edp.scheduler._ingestion._thread is None, "an ingestion worker thread was started"
    for k in range(10):
        edp.ingest(id_batch(np.arange(50 * k, 50 * (k + 1))))
        assert len(edp) == 50 * (k + 1), "an ingest returned before its batch was stored"
    for i in range(20):
        b, info = edp.deliver(32)
        assert torch.equal(b["id"], info.handles), "a prefetched batch does not hold the items its handles name"
        edp.ingest(id_batch(np.arange(500 + 10 * i, 510 + 10 * i)))
        assert len(edp) == 510 + 10 * i
    s = edp.scheduler
    assert s.prefetch_hits >= 10, f"prefetch served {s.prefetch_hits} deliveries, missed {s.prefetch_misses}"
    assert ids_of(edp) == list(range(700))
    edp.close()


def test_delivered_batches_stay_valid_for_output_depth_deliveries() -> None:
    for sched in (Overlapped(g_del=1), Overlapped(g_del=3), Overlapped(g_del=2, overlap=False),
                  Overlapped(g_del=1, output_depth=3)):
        edp = _filled(sched)
        depth = sched.output_depth
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(25):
            b, info = edp.deliver(16)
            kept.append((b["id"], info.handles.clone()))
            for view, handles in kept[-depth:]:  # the current batch and output_depth - 1 before it
                assert torch.equal(view, handles), f"{sched!r}: a batch was overwritten within its validity"
        edp.close()


def test_a_different_request_discards_prepared_batches() -> None:
    edp = _filled(Overlapped(g_del=2))
    edp.deliver(32)
    edp.deliver(32)
    b, info = edp.deliver(8)
    assert b.batch_size == 8 and torch.equal(b["id"], info.handles)
    assert edp.scheduler.discarded >= 1
    edp.close()


def test_sequential_g1_draws_exactly_what_synchronous_draws() -> None:
    def run(sched: Any) -> list[list[int]]:
        edp = replay(sched, capacity=300)
        out = []
        for k in range(12):
            edp.ingest(id_batch(np.arange(40 * k, 40 * k + 40)))
            out.append(edp.deliver(16)[0]["id"].tolist())
            out.append(edp.deliver(16, replace=False)[0]["id"].tolist())
        edp.close()
        return out

    assert run(Overlapped(overlap=False)) == run(Synchronous())


def test_sequential_granularity_is_deterministic_under_a_seed() -> None:
    def run() -> list[int]:
        edp = replay(Overlapped(g_ing=2, g_del=4, overlap=False), capacity=300)
        out: list[int] = []
        for k in range(10):
            edp.ingest(id_batch(np.arange(30 * k, 30 * k + 30)))
            for _ in range(3):
                out += edp.deliver(8)[0]["id"].tolist()
        edp.close()
        return out

    assert run() == run()


def test_prioritized_weights_follow_the_delivery_beta() -> None:
    def run(sched: Any) -> list[np.ndarray]:
        edp = replay(sched, capacity=64, sampler=PrioritizedSampler(alpha=0.8, beta=0.4))
        edp.ingest(id_batch(np.arange(64)))
        edp.flush()
        out = []
        for k in range(6):
            b, info = edp.deliver(32, beta=0.3 + 0.1 * k)
            edp.update_priorities(info.handles, (b["id"] % 5 + 1).double())
            out.append(info.weights.numpy().copy())
        edp.close()
        return out

    for a, b in zip(run(Overlapped(overlap=False)), run(Synchronous()), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_prioritized_prefetch_respects_max_priority_staleness() -> None:
    edp = _filled(Overlapped(g_del=2, max_priority_staleness=0), sampler=PrioritizedSampler())
    assert edp.scheduler.priority_staleness == 0
    for _ in range(10):
        b, info = edp.deliver(16)
        edp.update_priorities(info.handles, torch.ones(16, dtype=torch.float64))
    edp.close()
    edp = _filled(Overlapped(g_del=2), sampler=PrioritizedSampler())
    assert edp.scheduler.priority_staleness == 2
    edp.close()


def test_checkpoint_with_prepared_batches_continues_the_same_draws() -> None:
    edp = _filled(Overlapped(g_del=2))
    for _ in range(3):
        edp.deliver(16)
    state = edp.state_dict()
    after = [edp.deliver(16)[0]["id"].tolist() for _ in range(4)]
    other = replay(Synchronous())
    other.load_state_dict(state)
    again = [other.deliver(16)[0]["id"].tolist() for _ in range(4)]
    assert after[0] == again[0], "the first draw after a checkpoint came from a batch prepared before it"
    edp.close()


def test_ragged_fields_survive_prefetch() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), tokens=Field((), torch.int64, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=200, semantics=Replay(seed=1), scheduler=Overlapped(g_del=2))
    ids = np.arange(100)
    edp.ingest({"id": torch.as_tensor(ids), "tokens": [torch.full((int(i % 7) + 1,), int(i)) for i in ids]})
    edp.flush()
    for _ in range(20):
        b, _ = edp.deliver(8)
        toks = b["tokens"]
        for i, item in enumerate(b["id"].tolist()):
            seq = toks[i]
            assert seq.tolist() == [item] * (item % 7 + 1), f"item {item} came back with tokens {seq.tolist()}"
    edp.close()


# -- on-policy ----------------------------------------------------------------------------------------------------
def _on_policy_run(sched: Any, on_stale: str) -> list[tuple[Any, ...]]:
    edp = on_policy(sched, num_minibatches=3, num_epochs=2, max_staleness=1, on_stale=on_stale)
    out: list[tuple[Any, ...]] = []
    for v in range(4):
        for part in range(3):
            edp.ingest(id_batch(np.arange(100 * v + 10 * part, 100 * v + 10 * part + 10)), version=v)
        edp.seal()
    for step in range(40):
        if step in (3, 14):
            edp.set_policy_version(edp.semantics.policy_version + 2)  # mid-rollout: the rollout turns stale
        try:
            b, info = edp.deliver()
        except (EmptyBufferError, StaleExperienceError) as e:
            out.append((type(e).__name__,))
            if isinstance(e, StaleExperienceError):
                edp.set_policy_version(edp.semantics.policy_version - 2)
            continue
        out.append((info.version, info.epoch, info.minibatch, info.staleness, b["id"].tolist()))
        assert info.staleness is not None and info.staleness <= 1
    edp.close()
    return out


@pytest.mark.parametrize("on_stale", ["drop", "raise"])
def test_on_policy_overlapped_delivers_exactly_the_synchronous_sequence(on_stale: str) -> None:
    ref = _on_policy_run(Synchronous(), on_stale)
    assert any(r[0] in ("EmptyBufferError", "StaleExperienceError") for r in ref), "the scenario tests nothing"
    for sched in (Overlapped(), Overlapped(g_ing=1 / 3), Overlapped(overlap=False)):
        assert _on_policy_run(sched, on_stale) == ref, f"{sched!r} changed what on-policy delivery returns"


def test_on_policy_prefetch_is_used_within_a_rollout() -> None:
    sched = Overlapped()
    edp = on_policy(sched, num_minibatches=4, num_epochs=2)
    edp.ingest(id_batch(np.arange(64)), version=0)
    edp.seal()
    while not edp.deliver()[1].last:
        time.sleep(0.005)  # the learner's update
    assert sched.prefetch_hits >= 5, f"{sched.prefetch_hits} of 8 minibatches came from prefetch"
    assert sched.discarded == 0
    edp.close()


# -- configuration ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, on_policy_buffer", [
    ({"g_del": 1.5}, False), ({"g_ing": 2.5}, False), ({"g_del": 2}, True), ({"g_ing": 2}, True)])
def test_granularity_outside_the_safe_range_is_refused(kwargs: dict[str, float], on_policy_buffer: bool) -> None:
    with pytest.raises(ConfigurationError):
        if on_policy_buffer:
            on_policy(Overlapped(**kwargs))
        else:
            replay(Overlapped(**kwargs))


@pytest.mark.parametrize("kwargs", [{"g_ing": 0}, {"g_del": -1}, {"output_depth": 0}, {"queue_depth": 0},
                                    {"max_priority_staleness": -1}])
def test_bad_constructor_arguments_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        Overlapped(**kwargs)


def test_retune_changes_the_next_chunk() -> None:
    edp = _filled(Overlapped(g_del=1, overlap=False))
    edp.deliver(10)
    edp.scheduler.retune(g_del=4, g_ing=2)
    edp.deliver(10)
    assert edp.telemetry.records[-2].items == 40, "the chunk after retune(g_del=4) is not 4 batches"
    with pytest.raises(ConfigurationError):
        edp.scheduler.retune(g_del=0.5)
    edp.close()


# -- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_prefetch_stages_pinned_and_copies_on_a_side_stream() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=2000, semantics=Replay(seed=0), device="cuda",
                              scheduler=Overlapped(g_del=2))
    edp.ingest(id_batch(np.arange(2000)))
    edp.flush()
    ring = edp.scheduler._ring
    assert ring.pin and ring.stream is not None
    w = torch.randn(512, 512, device="cuda")
    for _ in range(20):
        b, info = edp.deliver(256)
        assert b["id"].is_cuda
        for _ in range(5):
            w = torch.tanh(w @ w)  # the learner's work on its stream while the next copy runs
        assert torch.equal(b["id"].cpu(), info.handles)
        assert torch.equal(b["obs"][:, 0].cpu(), info.handles.float())
    assert any(s.host and s.host["obs"].is_pinned() for s in ring.slots)
    edp.close()


def test_prefetch_follows_an_online_migration_to_a_grown_schema() -> None:
    from conduit.placement import DiskPlacement

    edp = _filled(Overlapped(g_del=2, g_ing=2))
    for _ in range(5):
        edp.deliver(16)
    grown = ExperienceSchema(id=Field((), torch.int64), obs=Field((5,), torch.float32))

    def pad(b: Any) -> dict[str, torch.Tensor]:
        return {"id": b["id"], "obs": torch.nn.functional.pad(b["obs"], (0, 2))}

    edp.migrate(DiskPlacement(), schema=grown, transform=pad)
    edp.ingest({"id": torch.arange(500, 520), "obs": torch.arange(500, 520).float()[:, None].expand(-1, 5)})
    edp.ingest({"id": torch.arange(520, 540), "obs": torch.arange(520, 540).float()[:, None].expand(-1, 5)})
    edp.flush()
    for _ in range(10):
        b, info = edp.deliver(16)
        assert b["obs"].shape == (16, 5), "a batch prepared for the old schema was delivered after the migration"
        assert torch.equal(b["id"], info.handles) and torch.equal(b["obs"][:, 0], b["id"].float())
    edp.close()
