"""``on_full="keep"``: a full on-policy buffer over SRL's own (unclaimed) sample stream lost a sample.

SRL's native consumer takes a message off its socket and only then calls ``buffer.put``. With
``on_full="raise"`` a full buffer raised :class:`BufferFullError` out of that ``consume_to``: the sample had
left the transport and nobody kept it (and SRL's worker loop re-raises what its poll raises, so the worker
stops too). Over a claimed stream Conduit's consumer keeps such samples; over a native one only the buffer can.
``on_full="keep"`` does: a put that does not fit returns, the buffer keeps its samples in put order and stores
them first (before any later put's) as deliveries free room: at the next ``put``, ``get()``, ``empty()`` or
``flush()``. They count in ``qsize()`` and ``stats()["samples_held"]``, and in ``samples_put`` once stored.
"""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit import CapacityError, ConfigurationError, SchemaError, StaleExperienceError
from conduit_srl import BufferFullError, ConduitBuffer
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer, run_buffer_worker
from conduit_srl.testing.records import make_sample

sys.path.insert(0, str(Path(__file__).parent))
from test_on_full_raise_single_thread_worker import BOUND_S, bounded, ids_of  # noqa: E402, I001


def on_policy(**kw: Any) -> ConduitBuffer:
    args: dict[str, Any] = dict(semantics="on_policy", capacity=8, rollout_size=4, num_minibatches=1,
                                pin_memory=False, on_full="keep")
    args.update(kw)
    return ConduitBuffer(**args)


def srl_buffer_worker_polls(socket: ZmqSampleConsumer, buffer: ConduitBuffer, expected: int,
                            *, polls: int = 20_000) -> list[list[int]]:
    """SRL's buffer-worker poll on one thread: ``consume_to(buffer, max_iter=64)``, then one ``get()`` if not
    ``empty()`` (a 1 ms sleep when nothing moved), until ``expected`` samples were delivered or ``polls`` ran."""
    delivered: list[list[int]] = []
    for _ in range(polls):
        moved = socket.consume_to(buffer, max_iter=64) > 0
        if not buffer.empty():
            delivered.append(ids_of(buffer.get()))
            moved = True
        if sum(map(len, delivered)) >= expected:
            break
        if not moved:
            time.sleep(0.001)
    return delivered


def send(address: str, samples: list[Any]) -> None:
    producer = ZmqSampleProducer(address)
    try:
        for s in samples:
            producer.post(s)
        producer.flush()
    finally:
        producer.close()


def test_over_a_native_stream_on_full_raise_loses_the_sample_it_refused() -> None:
    """The reported loss, on the protocol-level driver: the refused sample left the socket, and is nowhere."""
    socket = ZmqSampleConsumer()
    buffer = on_policy(on_full="raise")
    try:
        send(socket.address, [make_sample([i]) for i in range(9)])
        put = 0
        with pytest.raises(BufferFullError):
            for _ in range(20_000):  # (until the 9th arrives: bounded, not timed)
                put += bounded(lambda: socket.consume_to(buffer, max_iter=64))
                time.sleep(0.001)
        assert socket.received == 9 and buffer.qsize() == 8 and buffer.stats()["samples_put"] == 8
    finally:
        socket.close()
        buffer.close()


def test_on_full_keep_over_a_native_stream_stores_every_sample_once_and_in_order() -> None:
    """SRL's buffer worker over its native IP stream (one thread, one get() per poll, 64 messages per consume_to)
    with a buffer of two rollouts and 40 samples waiting: no put raises, every sample is delivered exactly once,
    rollout after rollout in arrival order, and the accounting adds up at every step."""
    socket = ZmqSampleConsumer()
    buffer = on_policy()
    try:
        send(socket.address, [make_sample([i]) for i in range(40)])
        got = 0
        for _ in range(20_000):  # until all 40 left the socket (bounded, not timed)
            got += bounded(lambda: socket.consume_to(buffer, max_iter=64))
            if got == 40:
                break
            time.sleep(0.001)
        assert got == socket.received == 40, "consume_to raised or lost count"
        stats = buffer.stats()
        assert stats["samples_put"] == 8 and stats["samples_held"] == 32 and len(buffer) == 8
        assert buffer.qsize() == 40, "kept samples are not delivered yet: qsize counts them"
        delivered = bounded(lambda: srl_buffer_worker_polls(socket, buffer, 40))
        assert delivered == [list(range(r, r + 4)) for r in range(0, 40, 4)], "lost, repeated or reordered"
        stats = buffer.stats()
        assert stats["samples_put"] == 40 and stats["samples_held"] == 0 and stats["late_dropped"] == 0
        assert buffer.qsize() == 0 and buffer.empty()
    finally:
        socket.close()
        buffer.close()


def test_the_drivers_buffer_worker_reposts_every_sample_once_with_on_full_keep() -> None:
    """The driver's buffer-worker pattern between two real streams: with on_full='raise' it could stop with
    BufferFullError (and lose the sample); with 'keep' every sample is re-posted once, rollout by rollout."""
    upstream = [make_sample([i]) for i in range(24)]
    buffer = on_policy()
    downstream = ConduitBuffer(semantics="queue", batch_size=1, capacity=64, pin_memory=False)
    try:
        reposted, reached = bounded(lambda: run_buffer_worker(upstream, buffer, downstream, timeout_s=30.0))
        assert reposted == reached == 24
        got = [ids_of(downstream.get())[0] for _ in range(24)]
        assert [sorted(got[r:r + 4]) for r in range(0, 24, 4)] == [list(range(r, r + 4)) for r in range(0, 24, 4)]
        assert downstream.empty()
        assert buffer.stats()["samples_held"] == 0 and buffer.qsize() == 0
    finally:
        buffer.close()
        downstream.close()


def test_a_put_behind_kept_samples_is_kept_behind_them_even_when_it_would_fit() -> None:
    buffer = on_policy()
    try:
        buffer.put_batch(make_sample([0, 1, 2, 3], batched=True))
        buffer.put_batch(make_sample([4, 5, 6], batched=True))
        buffer.put_batch(make_sample([7, 8, 9], batched=True))  # 7 completes a rollout; 8, 9 are kept
        s = buffer.stats()
        assert (s["samples_put"], s["samples_held"], buffer.qsize()) == (8, 2, 10)
        assert ids_of(buffer.get()) == [0, 1, 2, 3]  # frees a rollout: 8, 9 are stored first
        buffer.put(make_sample([10]))
        buffer.put(make_sample([11]))
        assert ids_of(buffer.get()) == [4, 5, 6, 7]
        assert ids_of(buffer.get()) == [8, 9, 10, 11]
        assert buffer.stats()["samples_held"] == 0 and buffer.empty()
    finally:
        buffer.close()


def test_later_puts_wait_in_line_behind_a_kept_one() -> None:
    """A single put kept, then one that on its own would fit after a delivery: it is stored after the kept one."""
    buffer = on_policy(rollout_size=2, capacity=4)
    try:
        for i in range(4):
            buffer.put(make_sample([i]))
        buffer.put(make_sample([4]))  # kept
        buffer.put(make_sample([5]))  # kept behind it
        assert buffer.stats()["samples_held"] == 2
        assert ids_of(buffer.get()) == [0, 1]
        assert ids_of(buffer.get()) == [2, 3]
        assert ids_of(buffer.get()) == [4, 5]
        assert buffer.empty() and buffer.qsize() == 0 and buffer.stats()["samples_put"] == 6
    finally:
        buffer.close()


def test_a_bad_sample_behind_kept_ones_is_refused_and_changes_nothing() -> None:
    buffer = on_policy()
    try:
        for i in range(9):
            buffer.put(make_sample([i]))
        before = (buffer.qsize(), buffer.stats())
        with pytest.raises(SchemaError):
            buffer.put(make_sample([9], dim=5))
        with pytest.raises(SchemaError):
            buffer.put(make_sample([9], version=-1))  # carries no policy version
        assert (buffer.qsize(), buffer.stats()) == before
    finally:
        buffer.close()


def test_a_late_sample_behind_kept_ones_raises_at_its_own_put_with_on_stale_raise() -> None:
    """on_stale='raise' refuses a sample older than a rollout before it: also one that is only kept so far."""
    buffer = on_policy(on_stale="raise")
    try:
        for i in range(8):
            buffer.put(make_sample([i], version=0))
        buffer.put(make_sample([8], version=2))  # kept
        before = (buffer.qsize(), buffer.stats())
        with pytest.raises(StaleExperienceError):
            buffer.put(make_sample([9], version=1))
        with pytest.raises(StaleExperienceError):  # older than the newest before it within one put, too
            buffer.put_batch(_two_versions(3, 2))
        assert (buffer.qsize(), buffer.stats()) == before
        buffer.put(make_sample([9], version=2))
        assert ids_of(buffer.get()) == [0, 1, 2, 3]
        assert buffer.stats()["samples_held"] == 0  # 8 and 9 (version 2) stored once room was freed
    finally:
        buffer.close()


def _two_versions(first: int, second: int) -> Any:
    """A batched sample of two columns whose versions are ``first`` then ``second``."""
    s = make_sample([20, 21], batched=True, version=first)
    s["policy_version_steps"][:, 1] = second
    return s


def test_late_samples_behind_kept_ones_are_dropped_and_counted_with_on_stale_drop() -> None:
    buffer = on_policy()
    try:
        for i in range(8):
            buffer.put(make_sample([i], version=0))
        buffer.put(make_sample([8], version=2))  # kept
        buffer.put(make_sample([9], version=1))  # kept: late once stored after version 2
        assert buffer.qsize() == 10
        buffer.set_policy_version(2)  # max_staleness=0: the stored version-0 rollouts are stale now
        assert buffer.empty()  # drops them (rollout_dropped), stores 8 and drops 9 (late_dropped)
        s = buffer.stats()
        assert (s["rollout_dropped"], s["late_dropped"], s["samples_held"], s["samples_put"]) == (8, 1, 0, 10)
        assert buffer.qsize() == 1
    finally:
        buffer.close()


def test_kept_samples_survive_a_checkpoint() -> None:
    buffer = on_policy()
    try:
        for i in range(10):
            buffer.put(make_sample([i]))
        copy = pickle.loads(pickle.dumps(buffer))
        try:
            assert copy.stats()["samples_held"] == 2 and copy.qsize() == 10
            got = [ids_of(copy.get()) for _ in range(2)]
            copy.put(make_sample([10]))
            copy.put(make_sample([11]))
            got.append(ids_of(copy.get()))
            assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        finally:
            copy.close()
    finally:
        buffer.close()


def test_a_kept_sample_is_stored_as_it_was_put_whatever_the_caller_does_with_it_after() -> None:
    """The put of a kept sample returns, so the caller may reuse or change its arrays (SRL's decoder, a user's
    buffer): the sample is stored as it was when put (the kept arrays were views of the caller's before)."""
    buffer = on_policy()
    try:
        for i in range(8):
            buffer.put(make_sample([i]))
        late = [make_sample([i]) for i in range(8, 12)]
        for s in late:
            buffer.put(s)  # kept: the buffer holds two rollouts
        assert buffer.stats()["samples_held"] == 4
        for s in late:
            np.asarray(s.id)[...] = -1
            np.asarray(s.obs)[...] = -1.0
        got = [buffer.get() for _ in range(3)]
        assert [ids_of(e) for e in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        ids, obs = np.asarray(got[2].sample.id)[0], np.asarray(got[2].sample.obs)[0]
        assert (obs == ids[:, None].astype(np.float32)).all(), "a kept sample changed after its put returned"
    finally:
        buffer.close()


def test_flush_stores_the_kept_samples_that_fit() -> None:
    buffer = on_policy(rollout_size=None)
    try:
        buffer.put_batch(make_sample([0, 1, 2, 3], batched=True))
        buffer.seal()
        buffer.put_batch(make_sample([4, 5, 6, 7], batched=True))
        buffer.seal()
        buffer.put(make_sample([8]))  # kept
        assert ids_of(buffer.get()) == [0, 1, 2, 3]
        buffer.flush()
        assert buffer.stats()["samples_held"] == 0 and len(buffer) == 5
        buffer.seal()
        assert [ids_of(buffer.get()) for _ in range(2)] == [[4, 5, 6, 7], [8]]
    finally:
        buffer.close()


@pytest.mark.parametrize("args, words", [
    (dict(on_full="keep", prefetch=1), "prefetch=0"),
    (dict(on_full="drop"), "'keep'"),
])
def test_on_full_keep_arguments_are_checked(args: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        on_policy(**args)
    with pytest.raises(ConfigurationError, match="on_policy"):
        ConduitBuffer(semantics="queue", batch_size=2, on_full="keep", pin_memory=False)


def test_srl_trainer_pattern_with_on_full_keep_accounts_for_every_posted_sample() -> None:
    """SRL's trainer (actors over ZMQ, consume_to on the main thread, empty/get on a training thread that advances
    the policy version every step) into a buffer of two rollouts: whatever the timing, each posted sample is
    delivered once or counted where it went (late, stale, or still undelivered), and none is delivered twice."""
    from conduit_srl.testing.driver import SrlDriver

    buffer = on_policy(max_staleness=2)
    try:
        report = SrlDriver(buffer, actors=2, samples_per_actor=48, per_poll=8).run(timeout_s=BOUND_S)
        delivered = report.delivered_ids.tolist()
        assert len(delivered) == len(set(delivered)), "a sample was delivered twice"
        assert set(delivered) <= set(report.posted) and report.received == len(report.posted) == 96
        s = buffer.stats()
        assert s["samples_held"] == 0 and s["samples_put"] == 96
        accounted = len(delivered) + s["late_dropped"] + s["stale_dropped"] + s["rollout_dropped"] + buffer.qsize()
        assert accounted == 96, f"{96 - accounted} samples vanished: {s}"
    finally:
        buffer.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in-put"])
@pytest.mark.parametrize("seed", range(12))
def test_random_puts_gets_seals_and_checkpoints_lose_and_repeat_nothing(seed: int, overlap: bool) -> None:
    """Found while fixing: a kept sample stored by get() while earlier puts were still being stored waited for
    them through a call that takes the put lock again, and the buffer deadlocked. Random on-policy traffic
    (puts of one to three samples, some of an older version, seals, version changes, checkpoints) into a small
    buffer that keeps what does not fit, then everything delivered: each sample is delivered once or counted
    where it went."""
    import random

    rng = random.Random(seed)
    cap = rng.choice([4, 6, 8])
    rollout = rng.choice([None, 2, 4])
    buffer = on_policy(capacity=cap, rollout_size=rollout, max_staleness=rng.choice([0, 1, 5]), overlap=overlap)
    posted, refused, version, learner = 0, 0, 0, 0
    first: list[int] = []

    def take(entry: Any) -> None:
        first.extend(ids_of(entry))

    def traffic() -> ConduitBuffer:
        nonlocal buffer, posted, refused, version, learner
        for _ in range(80):
            op = rng.random()
            if op < 0.45:
                k = rng.randint(1, 3)
                v = version if rng.random() < 0.85 else max(0, version - 1)
                try:
                    buffer.put_batch(make_sample(list(range(posted, posted + k)), batched=True, version=v))
                except CapacityError as e:  # (the open rollout fills the capacity: seal sooner)
                    assert "seal" in str(e)
                    refused += k
                posted += k
            elif op < 0.75:
                if not buffer.empty():
                    take(buffer.get())
            elif op < 0.8:
                buffer.seal()
            elif op < 0.88:
                version += 1
            elif op < 0.93:
                learner += 1
                buffer.set_policy_version(learner)
            else:
                copy = pickle.loads(pickle.dumps(buffer))
                buffer.close()
                buffer = copy
        for _ in range(3):  # (a rollout without rollout_size ends at a seal; kept samples follow it)
            buffer.seal()
            while not buffer.empty():
                take(buffer.get())
        return buffer

    try:
        bounded(traffic)
        assert len(first) == len(set(first)), "a sample was delivered twice"
        s = buffer.stats()
        accounted = len(first) + s["late_dropped"] + s["stale_dropped"] + s["rollout_dropped"] + buffer.qsize()
        assert accounted + refused == posted, f"{posted - accounted - refused} samples vanished: {s}"
    finally:
        buffer.close()
