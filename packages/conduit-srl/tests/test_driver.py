"""SRL's call pattern end to end: actor threads post and flush over ZMQ on 127.0.0.1, the trainer's main
thread runs consume_to, a training thread runs empty()/get(); plus the buffer-worker loop."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
from conduit.testing.lifecycle import eventually
from conduit_srl import ConduitBuffer, StreamPolicy
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import SrlDriver, run_buffer_worker
from conduit_srl.testing.fifo import FifoBuffer


def test_many_producers_nothing_lost_or_duplicated_and_reuses_honoured(closing) -> None:
    actors, per_actor, reuses, batch = 6, 40, 2, 8
    b = closing(batch_size=batch, capacity=actors * per_actor, reuses=reuses)
    r = SrlDriver(b, actors=actors, samples_per_actor=per_actor, per_poll=3, time_steps=5).run(timeout_s=60)
    total = actors * per_actor
    assert r.received == r.sent == total and r.dropped == 0
    counts = Counter(r.delivered_ids.tolist())
    assert set(counts) == set(range(total)) and set(counts.values()) == {reuses}, "lost or duplicated samples"
    # each batch comes `reuses` times in a row, with reuses 0..R-1 as the trainer reads them
    for k in range(0, len(r.deliveries), reuses):
        group = r.deliveries[k:k + reuses]
        assert [d.reuses for d in group] == list(range(reuses))
        assert all(np.array_equal(d.ids, group[0].ids) for d in group)
    assert all(d.samples == 5 * batch and d.time_steps == 5 for d in r.deliveries)
    assert all(d.staleness >= 0 for d in r.deliveries)
    assert max(d.staleness for d in r.deliveries) > 0, "the learner advanced while actors were acting"
    assert b.stats()["queue_dropped"] == 0


def test_queue_buffer_delivers_what_a_plain_fifo_delivers() -> None:
    """With one actor (a fixed arrival order), the Conduit queue and the FIFO baseline give the same entries."""
    runs = []
    for make in (lambda: ConduitBuffer(batch_size=4, capacity=64, reuses=3), lambda: FifoBuffer(batch_size=4,
                                                                                                   reuses=3)):
        buf = make()
        r = SrlDriver(buf, actors=1, samples_per_actor=32, per_poll=5).run(timeout_s=60)
        runs.append([(d.ids.tolist(), d.reuses, d.samples) for d in r.deliveries])
        if isinstance(buf, ConduitBuffer):
            buf.close()
    assert runs[0] == runs[1] and len(runs[0]) == 32 // 4 * 3


def test_replay_through_the_driver(closing) -> None:
    b = closing(semantics="replay", batch_size=16, capacity=64, warmup=16, seed=3)
    r = SrlDriver(b, actors=2, samples_per_actor=48, max_steps=40).run(timeout_s=60)
    assert r.received == 96 and len(r.deliveries) == 40
    ids = r.delivered_ids
    assert set(ids.tolist()) <= set(range(96)) and len(set(ids.tolist())) > 16
    assert r.deliveries[-1].reuses > 0


@pytest.mark.parametrize("late_actors", [False, True])
def test_prioritized_through_the_driver_with_priority_updates(closing, late_actors: bool) -> None:
    """The last 20 of 60 steps draw mostly the samples the training thread prioritised. That holds once every sample
    arrived and was drawn (and so re-prioritised) a while before them: a sample arriving late comes with the largest
    priority, so a burst of arrivals near the end (actors descheduled on a loaded machine) was drawn instead. The
    training thread therefore waits, at step 20, until all 64 samples are stored (``late_actors``: the actors send
    everything after their first poll only then, the latest arrival this test allows)."""
    total, wait_at = 64, 20
    b = closing(semantics="prioritized", batch_size=8, capacity=total, alpha=1.0, seed=4)
    steps = [0]
    waiting = threading.Event()  # the training thread reached its wait for every sample

    def priorities(entry: object) -> np.ndarray:
        steps[0] += 1
        if steps[0] == wait_at:  # (the training thread: every sample arrives before the remaining 40 steps)
            waiting.set()
            assert eventually(lambda: b.stats()["samples_put"] == total, timeout=60.0), b.stats()
            b.flush()  # (stored, so drawn from here on)
        ids = np.asarray(entry.sample.id)[0]  # type: ignore[attr-defined]
        return np.where(ids % 2 == 0, 10.0, 0.01)  # even ids matter

    def sample(i: int, version: int) -> object:
        if late_actors and i % 32 >= 4:  # (after each actor's first poll of 4)
            assert waiting.wait(timeout=60.0), "the training thread never reached its wait"
        return make_sample([i], time_steps=4, dim=3, version=version)

    r = SrlDriver(b, actors=2, samples_per_actor=32, max_steps=60, priorities=priorities, step_seconds=0.001,
                  make_sample_fn=sample).run(timeout_s=120)
    assert len(r.deliveries) == 60 and r.received == total
    late = np.concatenate([d.ids for d in r.deliveries[-20:]])
    assert (late % 2 == 0).mean() > 0.8, "priority updates sent by the training thread had no effect"


def test_on_policy_through_the_driver_accounts_for_every_sample(closing) -> None:
    b = closing(semantics="on_policy", capacity=256, num_minibatches=2, num_epochs=2, rollout_size=8)
    r = SrlDriver(b, actors=3, samples_per_actor=24, per_poll=2).run(timeout_s=60)
    counts = Counter(r.delivered_ids.tolist())
    assert set(counts.values()) <= {2}, "every delivered sample comes once per epoch"
    stats = b.stats()
    assert len(counts) + stats["late_dropped"] + b.qsize() == 72, (len(counts), stats, b.qsize())
    for d in r.deliveries:
        assert d.samples == 4 * len(d.ids)


def test_buffer_worker_reposts_along_the_batch_axis(closing) -> None:
    worker_buffer = closing(batch_size=4, capacity=64)
    trainer_buffer = FifoBuffer(batch_size=1)
    upstream = [make_sample([i]) for i in range(20)]
    reposted, reached = run_buffer_worker(upstream, worker_buffer, trainer_buffer, timeout_s=30)
    assert reposted == reached == 20
    got = []
    while not trainer_buffer.empty():
        got.extend(trainer_buffer.get().sample.id[0].tolist())
    assert got == list(range(20)), "the buffer worker re-posted out of order, lost or repeated samples"


@pytest.mark.parametrize("kind", ["conduit", "fifo"])
def test_coalesced_stream_through_the_driver(closing, kind: str) -> None:
    """Conduit's producer sends 5 samples per message; every sample still arrives once, batches in order."""
    buffer = closing(batch_size=5, capacity=128) if kind == "conduit" else FifoBuffer(batch_size=5)
    r = SrlDriver(buffer, actors=2, samples_per_actor=30, per_poll=3,
                  stream_policy=StreamPolicy(coalesce=5, max_delay_s=0.05)).run(timeout_s=60)
    assert r.received == 60 and r.sent < 60 and r.dropped == 0
    counts = Counter(r.delivered_ids.tolist())
    assert set(counts) == set(range(60)) and set(counts.values()) == {1}
