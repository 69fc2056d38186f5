"""How a claimed stream's consumer hands received messages to buffers, over real sockets."""

from __future__ import annotations

import time
from typing import Any

from conduit_srl import ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy
from conduit_srl.testing import Record, make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer


def receive(consumer: ConduitSampleConsumer, buffer: Any, expected: int, timeout_s: float = 30.0) -> int:
    got, deadline = 0, time.monotonic() + timeout_s
    while got < expected and time.monotonic() < deadline:
        got += consumer.consume_to(buffer, 16)
    return got


class ListBuffer:
    """Another library's buffer: ``put`` takes one sample, ``put_batch`` a list of samples."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, x: Any) -> None:
        self.items.append(x)

    def put_batch(self, xs: list[Any]) -> None:
        self.items.extend(xs)

    def empty(self) -> bool:
        return not self.items

    def qsize(self) -> int:
        return len(self.items)


def test_a_coalesced_message_goes_to_another_buffer_as_k_puts_even_if_it_has_a_put_batch() -> None:
    # README: "the consumer hands a message to a Conduit buffer as one put_batch, to any other buffer ... as k put
    # calls in order". A buffer of another kind with a put_batch method of its own (here: a list of samples) was
    # handed the whole [T, k, ...] record, which it read as a list of that record's field values.
    inner = ZmqSampleConsumer()
    producer = ConduitSampleProducer([ZmqSampleProducer(inner.address)], policy=StreamPolicy(coalesce=3))
    consumer = ConduitSampleConsumer(inner)
    try:
        for i in range(3):
            producer.post(make_sample([i], time_steps=2))
        producer.flush()
        buf = ListBuffer()
        assert receive(consumer, buf, 3) == 3
        assert [type(x) for x in buf.items] == [Record] * 3
        assert [int(x.obs[0, 0]) for x in buf.items] == [0, 1, 2]
        assert all(x.obs.shape == make_sample([0], time_steps=2).obs.shape for x in buf.items)
    finally:
        producer.close()
        assert consumer.close() == []


class FlushFailsOnce:
    """A real IP producer whose first flush meets a socket error (the samples stay in its cache, as SRL's would)."""

    def __init__(self, inner: ZmqSampleProducer) -> None:
        self.inner = inner
        self.failures = 1

    def post(self, sample: Any) -> None:
        self.inner.post(sample)

    def flush(self) -> None:
        if self.failures:
            self.failures -= 1
            raise OSError("transient socket error")
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def test_a_target_whose_flush_raised_is_flushed_by_the_next_flush_and_others_are_not_skipped() -> None:
    # Round robin over two trainers: target 0's flush raised, and target 1 (given a message in the same call) was
    # never flushed; later flush() calls with nothing new to send flushed neither, so both messages sat in the
    # targets' caches (past max_delay_s) until new samples happened to go there, or close().
    consumers = [ZmqSampleConsumer(), ZmqSampleConsumer()]
    targets = [FlushFailsOnce(ZmqSampleProducer(c.address)) for c in consumers]
    producer = ConduitSampleProducer(targets, policy=StreamPolicy(route="round_robin"))
    try:
        producer.post(make_sample([0]))
        producer.post(make_sample([1]))
        targets[1].failures = 0
        try:
            producer.flush()
        except OSError:
            pass
        else:
            raise AssertionError("the first flush should raise target 0's error")
        assert targets[1].inner.sent == 1  # flushed although target 0's flush raised first
        producer.flush()  # nothing new: target 0, whose flush raised, is flushed again
        assert targets[0].inner.sent == 1
        for c, want in zip(consumers, ([0], [1]), strict=True):
            buf = ListBuffer()
            assert receive(ConduitSampleConsumer(c), buf, 1) == 1
            assert [int(x.id[0]) for x in buf.items] == want
    finally:
        producer.close()
        for c in consumers:
            c.close()
