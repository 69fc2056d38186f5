"""Review round 3: the sample-stream protocol under real threads and sockets on 127.0.0.1.

Coalescing samples that carry a scalar field, the producer's and consumer's life cycle (post after
close, close while another thread is mid-send, calls after close), a peer that disconnects in the
middle of a message, several trainers receiving each sample exactly once, and on-policy minibatches
taken by several training threads.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
from conduit import ConfigurationError, EmptyBufferError
from conduit_srl import ConduitBuffer, ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy
from conduit_srl.testing import Record, entry_ids, make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer


class Sink:
    """A plain buffer that keeps what a consumer puts into it."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, x: Any) -> None:
        self.items.append(x)


def receive(consumer: Any, buffer: Any, n: int, timeout_s: float = 20.0) -> int:
    """``consume_to`` until ``n`` samples arrived (fails after ``timeout_s``)."""
    got, deadline = 0, time.monotonic() + timeout_s
    while got < n:
        assert time.monotonic() < deadline, f"only {got} of {n} samples arrived in {timeout_s} s"
        k = consumer.consume_to(buffer, max_iter=64)
        got += k
        if not k:
            time.sleep(0.002)
    return got


def named(i: int) -> Record:
    """An actor's sample that also names its policy with a plain string (a field without a time axis)."""
    s = make_sample([i])
    return Record(**dict(s.items()), policy_name="default")


# -- coalescing: a field without a time axis -----------------------------------------------------------
def test_coalescing_samples_with_a_scalar_field_sends_them_alone_and_loses_none() -> None:
    """A string ``policy_name`` (which the Conduit buffer drops by default) has no axis to stack on.

    Coalescing stacked it with ``np.stack(axis=1)``: flush raised a raw numpy AxisError and every
    sample it had taken from the pending queue was lost.
    """
    consumer = ZmqSampleConsumer()
    wrapped = ConduitSampleConsumer(consumer)
    p = ConduitSampleProducer([ZmqSampleProducer(consumer.address)], policy=StreamPolicy(coalesce=2, max_delay_s=0))
    buffer = ConduitBuffer(batch_size=2, capacity=16)
    try:
        for i in range(6):
            p.post(named(i))
        p.flush()  # raised AxisError before the fix
        assert p.messages == [6], "samples with a scalar field cannot be stacked: each goes as its own message"
        assert receive(wrapped, buffer, 6) == 6
        got = []
        while not buffer.empty():
            e = buffer.get()
            assert e.sample.policy_name is None  # dropped by the buffer, as documented
            got.extend(entry_ids(e).tolist())
        assert got == list(range(6)), "samples were lost, repeated or reordered"
    finally:
        p.close()
        wrapped.close()
        buffer.close()


def test_coalescing_still_stacks_records_whose_fields_all_have_a_time_axis() -> None:
    sink = Sink()
    p = ConduitSampleProducer([sink_producer(sink)], policy=StreamPolicy(coalesce=3, max_delay_s=0))
    for i in range(6):
        p.post(make_sample([i]))
    p.post(named(6))
    p.flush()
    assert p.messages == [3] and p.sent == [7]  # two stacked messages of 3, then the scalar-field one alone
    assert [np.asarray(m.id).shape for m in sink.items] == [(4, 3), (4, 3), (4,)]


class sink_producer:  # noqa: N801 - reads as a constructor
    """An in-process sample producer: flush moves what was posted into ``sink``."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.cache: list[Any] = []

    def post(self, sample: Any) -> None:
        self.cache.append(sample)

    def flush(self) -> None:
        for s in self.cache:
            self.sink.put(s)
        self.cache.clear()


# -- the producer's life cycle -------------------------------------------------------------------------
def test_post_after_close_is_refused_instead_of_silently_dropped() -> None:
    consumer = ZmqSampleConsumer()
    sender = ZmqSampleProducer(consumer.address)
    p = ConduitSampleProducer([sender], policy=StreamPolicy(coalesce=2, max_delay_s=60))
    sink = Sink()
    try:
        p.post(make_sample([0]))
        p.close()  # sends the pending sample although its partner never came
        with pytest.raises(ConfigurationError, match="closed"):
            p.post(make_sample([1]))  # was accepted and never sent
        p.flush()  # nothing to send: a no-op
        p.close()  # idempotent
        with pytest.raises(ConfigurationError, match="closed"):
            sender.post(make_sample([2]))  # the driver's producer refuses too (was cached, then a raw ZMQError)
        assert receive(consumer, sink, 1) == 1
        time.sleep(0.05)
        assert consumer.consume_to(sink, max_iter=64) == 0
        assert [int(s.id[0]) for s in sink.items] == [0]
    finally:
        p.close()
        consumer.close()


class GatedSender(ZmqSampleProducer):
    """The driver's ZMQ producer, whose first ``post`` waits until the test releases it."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.entered = threading.Event()
        self.release = threading.Event()

    def post(self, sample: Any) -> None:
        self.entered.set()
        assert self.release.wait(20), "never released"
        super().post(sample)


def test_close_from_another_thread_waits_for_the_flush_in_flight() -> None:
    """Shutdown while the actor's flush is mid-send: close() closed the targets under the sender, which then
    lost the samples it had taken (and raised a raw error in the actor thread)."""
    consumer = ZmqSampleConsumer()
    sender = GatedSender(consumer.address)
    p = ConduitSampleProducer([sender], policy=StreamPolicy(coalesce=1))
    errors: list[BaseException] = []

    def run(fn: Any) -> threading.Thread:
        def body() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    try:
        for i in range(5):
            p.post(make_sample([i]))
        flusher = run(p.flush)
        assert sender.entered.wait(10)  # the flush took all 5 samples and is posting the first
        closer = run(p.close)
        time.sleep(0.2)
        closed_early = not closer.is_alive()
        sender.release.set()
        flusher.join(20)
        closer.join(20)
        assert not flusher.is_alive() and not closer.is_alive()
        assert not errors, f"close() cut off a flush in flight: {errors!r}"
        assert not closed_early, "close() returned while another thread was still sending"
        sink = Sink()
        assert receive(consumer, sink, 5) == 5
        assert [int(s.id[0]) for s in sink.items] == list(range(5))
    finally:
        sender.release.set()
        p.close()
        consumer.close()


def test_driver_producer_close_waits_for_a_send_blocked_by_backpressure() -> None:
    """The consumer does not read, so the flush blocks in the socket (high-water marks of 1, large samples);
    close() from another thread closed the socket under it: a raw ZMQError and unsent, uncounted samples."""
    consumer = ZmqSampleConsumer(hwm=1)
    p = ZmqSampleProducer(consumer.address, hwm=1, send_timeout_ms=20_000)
    n = 8
    for i in range(n):
        p.post(Record(x=np.full((1, 2_000_000), i, dtype=np.float32)))  # 8 MB each
    errors: list[BaseException] = []

    def flush() -> None:
        try:
            p.flush()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    flusher = threading.Thread(target=flush, daemon=True)
    flusher.start()
    sink = Sink()
    try:
        deadline = time.monotonic() + 10
        while p.sent == 0:
            assert time.monotonic() < deadline, "the first send never completed"
            time.sleep(0.01)
        time.sleep(0.2)
        assert p.sent < n, "precondition: the flush should be blocked by backpressure"
        closer = threading.Thread(target=p.close, daemon=True)
        closer.start()
        time.sleep(0.2)
        receive(consumer, sink, n, timeout_s=30)  # the consumer reads again: the blocked flush goes on
        flusher.join(30)
        closer.join(30)
        assert not errors, f"close() cut off a send in flight: {errors!r}"
        assert p.sent == n and p.dropped == 0
        assert [int(s.x[0, 0]) for s in sink.items] == list(range(n))
    finally:
        consumer.close()


def test_a_new_producer_reaches_the_same_consumer_after_the_first_closed() -> None:
    consumer = ZmqSampleConsumer()
    wrapped = ConduitSampleConsumer(consumer)
    sink = Sink()
    try:
        for start in (0, 3):  # close, then "reconnect": a fresh producer over a fresh socket
            p = ConduitSampleProducer([ZmqSampleProducer(consumer.address)],
                                      policy=StreamPolicy(coalesce=2, max_delay_s=60))
            for i in range(start, start + 3):
                p.post(make_sample([i]))
            p.flush()  # one message of 2; the third waits for a partner until close sends it
            p.close()
        assert receive(wrapped, sink, 6) == 6
        ids = [int(s.id[0]) for s in sink.items]
        assert sorted(ids) == list(range(6)), "lost or repeated samples"
        # each connection keeps its order; two connections interleave (the consumer queues them fairly)
        assert [i for i in ids if i < 3] == [0, 1, 2] and [i for i in ids if i >= 3] == [3, 4, 5]
    finally:
        wrapped.close()


# -- the consumer's life cycle ------------------------------------------------------------------------------
def test_consumer_calls_after_close_get_a_typed_error() -> None:
    wrapped = ConduitSampleConsumer(ZmqSampleConsumer())
    wrapped.close()
    wrapped.close()  # idempotent
    with pytest.raises(ConfigurationError, match="closed"):
        wrapped.consume_to(Sink(), max_iter=4)  # was a raw ZMQError "Socket operation on non-socket"
    with pytest.raises(ConfigurationError, match="closed"):
        wrapped.consume()


# -- bad producer arguments --------------------------------------------------------------------------------
def test_producer_arguments_are_checked_when_it_is_built() -> None:
    consumer = ZmqSampleConsumer()
    sender = ZmqSampleProducer(consumer.address)
    try:
        with pytest.raises(ConfigurationError, match=r"\[producer\]"):
            ConduitSampleProducer(sender)  # type: ignore[arg-type]  # (a raw TypeError: not iterable)
        with pytest.raises(ConfigurationError, match="post"):
            ConduitSampleProducer([None])  # type: ignore[list-item]  # (accepted; flush lost the samples)
        for rank in ("0", None, -1, 1.5, True):
            with pytest.raises(ConfigurationError, match="rank"):
                ConduitSampleProducer([sender], rank=rank)  # type: ignore[arg-type]
        assert ConduitSampleProducer([sender], rank=np.int64(3)).rank == 3
    finally:
        sender.close()
        consumer.close()


# -- a peer that disconnects in the middle of a message --------------------------------------------------
def test_a_peer_that_disconnects_mid_message_does_not_disturb_the_stream() -> None:
    consumer = ZmqSampleConsumer()
    wrapped = ConduitSampleConsumer(consumer)
    host, port = consumer.address.split(":")
    p = ConduitSampleProducer([ZmqSampleProducer(consumer.address)], policy=StreamPolicy(coalesce=2, max_delay_s=0))
    sink = Sink()
    try:
        for i in range(4):
            p.post(make_sample([i]))
        p.flush()
        raw = socket.create_connection((host, int(port)), timeout=5)
        raw.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03")  # the start of a greeting, then gone
        raw.close()
        for i in range(4, 8):
            p.post(make_sample([i]))
        p.flush()
        assert receive(wrapped, sink, 8) == 8
        time.sleep(0.05)
        assert wrapped.consume_to(sink, max_iter=64) == 0
        assert [int(s.id[0]) for s in sink.items] == list(range(8))
    finally:
        p.close()
        wrapped.close()


# -- several trainers: each sample reaches exactly one, in the order each actor posted ----------------------
@pytest.mark.parametrize("route", ["round_robin", "least_sent"])
def test_several_trainers_receive_each_sample_exactly_once_in_order(route: str) -> None:
    trainers = [ZmqSampleConsumer() for _ in range(2)]
    consumers = [ConduitSampleConsumer(t) for t in trainers]
    actors, per_actor = 3, 30
    errors: list[BaseException] = []

    def actor(a: int) -> None:
        try:
            p = ConduitSampleProducer([ZmqSampleProducer(t.address) for t in trainers], rank=a,
                                      policy=StreamPolicy(route=route, coalesce=2, max_delay_s=0.01))
            try:
                for i in range(a * per_actor, (a + 1) * per_actor):
                    p.post(make_sample([i]))
                    if i % 3 == 0:
                        p.flush()
            finally:
                p.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=actor, args=(a,)) for a in range(actors)]
    sinks = [Sink() for _ in trainers]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(len(s.items) for s in sinks) < actors * per_actor and not errors:
            assert time.monotonic() < deadline, "samples did not arrive"
            for c, s in zip(consumers, sinks, strict=True):
                c.consume_to(s, max_iter=64)
            time.sleep(0.002)
        for t in threads:
            t.join(20)
        assert not errors, errors
        ids = [[int(x.id[0]) for x in s.items] for s in sinks]
        counts = Counter(i for per in ids for i in per)
        assert set(counts) == set(range(actors * per_actor)) and set(counts.values()) == {1}
        assert all(ids), "both trainers should receive samples"
        for per in ids:  # per actor, a trainer sees its samples in posting order
            for a in range(actors):
                mine = [i for i in per if i // per_actor == a]
                assert mine == sorted(mine), f"actor {a}'s samples were reordered: {mine}"
    finally:
        for c in consumers:
            c.close()


# -- on-policy: several training threads take each minibatch once -----------------------------------------
@pytest.mark.parametrize("prefetch", [0, 1])
def test_on_policy_minibatches_taken_by_several_training_threads_exactly_once(prefetch: int) -> None:
    b = ConduitBuffer(semantics="on_policy", capacity=32, num_minibatches=2, num_epochs=2, rollout_size=8,
                      prefetch=prefetch)
    n = 96
    done = threading.Event()
    errors: list[BaseException] = []
    counts: Counter[int] = Counter()
    lock = threading.Lock()

    def producer() -> None:
        try:
            for i in range(n):
                b.put(make_sample([i], version=i // 8))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    def trainer() -> None:
        try:
            while True:
                if b.empty():
                    if done.is_set() and b.empty():
                        return
                    time.sleep(0.001)
                    continue
                try:
                    e = b.get()
                except EmptyBufferError:  # another thread took the last one between empty() and get()
                    continue
                assert e.sample.min_of("policy_version_steps") == e.sample.max_of("policy_version_steps")
                with lock:
                    counts.update(entry_ids(e).tolist())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=producer)] + [threading.Thread(target=trainer) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert not errors, errors
        assert set(counts) == set(range(n)) and set(counts.values()) == {2}, "each sample once per epoch"
        assert b.stats()["entries_delivered"] == n // 8 * 2 * 2
    finally:
        b.close()


# -- replay: draws while another thread puts (the ring wraps many times) ----------------------------------
def test_replay_draws_stay_consistent_while_another_thread_puts() -> None:
    b = ConduitBuffer(semantics="replay", batch_size=4, capacity=8, warmup=4, seed=1)
    n = 300
    put_so_far = [-1]
    done = threading.Event()
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            for i in range(n):
                put_so_far[0] = i  # (before the put: a draw may see the sample before put() returns)
                b.put(make_sample([i]))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=producer)
    t.start()
    draws = 0
    try:
        while not done.is_set() or draws < 20:
            if b.empty():
                time.sleep(0.001)
                continue
            e = b.get()
            ids = entry_ids(e)  # checks that every row's payload matches its id (no torn rows)
            assert ids.shape == (4,) and (ids <= put_so_far[0]).all(), "drew a sample that was never put"
            assert len(set(ids.tolist())) == len(set(np.asarray(e.sampling_indices).tolist()))
            assert e.reuses >= 0
            draws += 1
        t.join(30)
        assert not errors, errors
        assert b.stats()["entries_delivered"] == draws
    finally:
        b.close()


class RefusingOnce(sink_producer):
    """An in-process target whose ``post`` refuses the ``n``-th message once (as a full or broken socket would)."""

    def __init__(self, sink: Sink, n: int) -> None:
        super().__init__(sink)
        self.left = n

    def post(self, sample: Any) -> None:
        self.left -= 1
        if self.left == 0:
            raise OSError("the target refused the message")
        super().post(sample)


@pytest.mark.parametrize("ending", ["flush", "close"])
def test_samples_a_target_refused_stay_pending_in_order_and_go_out_on_the_next_try(ending: str) -> None:
    """The samples taken for a send after a post that raised were lost (and close() left the producer closed)."""
    sink = Sink()
    p = ConduitSampleProducer([RefusingOnce(sink, 2)], policy=StreamPolicy(coalesce=1, max_delay_s=0))
    for i in range(4):
        p.post(make_sample([i]))
    with pytest.raises(OSError, match="refused"):
        p.flush() if ending == "flush" else p.close()
    assert [int(s.id[0]) for s in sink.items] == [0], "what the target took before the refusal goes out"
    p.post(make_sample([4]))  # the producer is still open
    p.flush() if ending == "flush" else p.close()
    assert [int(s.id[0]) for s in sink.items] == [0, 1, 2, 3, 4], "a sample was lost or reordered"
    assert p.sent == [5]
