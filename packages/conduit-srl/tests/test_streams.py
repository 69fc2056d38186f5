"""Conduit's sample producer and consumer: coalescing (ingestion granularity) and routing, over real sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_srl import ConduitBuffer, ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy
from conduit_srl.streams import COALESCED_KEY
from conduit_srl.testing import Record, make_sample
from conduit_srl.testing.driver import NothingToConsume, ZmqSampleConsumer, ZmqSampleProducer


class Inline:
    """An in-process producer (what SRL's inline testing stream is): keeps what is flushed."""

    def __init__(self) -> None:
        self.cache: list[object] = []
        self.flushed: list[object] = []

    def post(self, sample: object) -> None:
        self.cache.append(sample)

    def flush(self) -> None:
        self.flushed.extend(self.cache)
        self.cache.clear()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def sizes(target: Inline) -> list[int]:
    return [int(getattr(m, "metadata", {}).get(COALESCED_KEY, 1)) for m in target.flushed]


def test_stream_policy_checks() -> None:
    for bad in ({"route": "random"}, {"coalesce": 0}, {"max_delay_s": -1.0}):
        with pytest.raises(ConfigurationError):
            StreamPolicy(**bad)  # type: ignore[arg-type]


def test_coalescing_waits_for_partners_at_most_max_delay() -> None:
    clock, target = Clock(), Inline()
    p = ConduitSampleProducer([target], policy=StreamPolicy(coalesce=3, max_delay_s=0.5), clock=clock)
    for i in range(4):
        p.post(make_sample([i]))
    p.flush()
    assert sizes(target) == [3]  # one full group; sample 3 waits
    clock.t = 0.4
    p.flush()
    assert sizes(target) == [3]
    clock.t = 0.6
    p.flush()
    assert sizes(target) == [3, 1]
    msg = target.flushed[0]
    assert msg.id.shape == (4, 3) and msg.id[0].tolist() == [0, 1, 2]  # type: ignore[attr-defined]
    p.post(make_sample([9]))
    p.close()  # close sends what is pending, whatever the delay
    assert sizes(target) == [3, 1, 1]


def test_only_samples_of_one_structure_are_stacked() -> None:
    target = Inline()
    p = ConduitSampleProducer([target], policy=StreamPolicy(coalesce=4, max_delay_s=0))
    plain = type("Plain", (), {"items": lambda self: iter(())})()  # no metadata: cannot be marked, goes alone
    for s in (make_sample([0]), make_sample([1]), make_sample([2], time_steps=6), plain, make_sample([3])):
        p.post(s)
    p.flush()
    assert sizes(target) == [2, 1, 1, 1]
    assert target.flushed[2] is plain


def test_routes() -> None:
    def run(route: str, rank: int, posts: list[int]) -> list[int]:
        targets = [Inline() for _ in range(3)]
        p = ConduitSampleProducer(targets, policy=StreamPolicy(route=route, coalesce=4, max_delay_s=0), rank=rank)
        for n in posts:  # n samples per flush: uneven message sizes
            for i in range(n):
                p.post(make_sample([i]))
            p.flush()
        return p.sent

    assert run("rank", 4, [1, 2, 3]) == [0, 6, 0]  # SRL's rule: rank modulo trainers
    # per message, starting at rank modulo trainers: 4 -> t1, 1 -> t2, 1 -> t0, 1 -> t1
    assert run("round_robin", 1, [4, 1, 1, 1]) == [1, 5, 1] and run("round_robin", 0, [2] * 6) == [4, 4, 4]
    # each message to the trainer with the fewest samples so far (ties: from rank on)
    assert run("least_sent", 0, [4, 1, 1, 1, 1, 4]) == [4, 6, 2]


def test_consumer_unpacks_coalesced_messages_over_zmq() -> None:
    consumer = ZmqSampleConsumer()
    wrapped = ConduitSampleConsumer(consumer)
    sender = ZmqSampleProducer(consumer.address)
    p = ConduitSampleProducer([sender], policy=StreamPolicy(coalesce=3, max_delay_s=0))
    buffer = ConduitBuffer(batch_size=2, capacity=16)
    try:
        for i in range(6):
            p.post(make_sample([i]))
        p.flush()
        got, deadline = 0, time.monotonic() + 10
        while got < 3:
            assert time.monotonic() < deadline
            got += wrapped.consume_to(buffer, max_iter=1)  # one message of 3 samples per call
            time.sleep(0.001)
        assert got == 3 and buffer.qsize() == 3  # put as one batch
        assert wrapped.address == consumer.address  # native attributes stay reachable
        deadline = time.monotonic() + 10
        while True:
            try:
                first = wrapped.consume()
                break
            except NothingToConsume:
                assert time.monotonic() < deadline
                time.sleep(0.001)
        rest = [wrapped.consume(), wrapped.consume()]
        assert [int(s.id[0]) for s in [first, *rest]] == [3, 4, 5]
        assert all(isinstance(s, Record) and COALESCED_KEY not in s.metadata for s in rest)
        assert np.array_equal(buffer.get().sample.id[0], [0, 1])
    finally:
        p.close()
        wrapped.close()
        buffer.close()
