"""Claimed sample streams (close, uninstall, refusals), the zero-copy config check, the FIFO baseline."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import conduit_srl
import numpy as np
import pytest
from conduit import ConfigurationError, SchemaError
from conduit_srl import (
    ConduitSampleConsumer,
    ConduitSampleProducer,
    StreamPolicy,
    UnstoredSamplesError,
    ZeroCopyStreamError,
)
from conduit_srl.streams import lost_without_close
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer
from conduit_srl.testing.fifo import FifoBuffer
from conduit_srl.testing.records import Record

sys.path.insert(0, str(Path(__file__).parent))
from test_install import _drain  # noqa: E402  (sibling test helper)


class _Collect:
    def __init__(self) -> None:
        self.items: list[object] = []

    def put(self, x: object) -> None:
        self.items.append(x)


class _FirstCloseFails:
    """Mixed in first: the first close() raises (the socket stays open), later ones close."""

    close_calls = 0

    def close(self) -> None:
        self.close_calls += 1
        if self.close_calls == 1:
            raise OSError("transport busy")
        super().close()  # type: ignore[misc]


class _FirstCloseFailsConsumer(_FirstCloseFails, ZmqSampleConsumer):
    """A real ZMQ consumer whose first close() raises."""


class _FirstCloseFailsProducer(_FirstCloseFails, ZmqSampleProducer):
    """A real ZMQ producer whose first close() raises."""


def _recv_all(consumer: ZmqSampleConsumer, expected: int) -> list[object]:
    sink = _Collect()
    assert _drain(consumer, sink, expected) == expected
    return sink.items


def test_re_registered_stream_class_is_not_claimed_after_uninstall(srl_layout) -> None:
    """uninstall() puts back a registry entry that was registered again (same type) after install()."""
    layout = srl_layout("local")
    ss = layout["local.system.sample_stream"]
    cfg = layout["api.config"]
    ip = cfg.SampleStream.Type.IP
    conduit_srl.install()

    class Replacement(ZmqSampleConsumer):
        def __init__(self, spec: object) -> None:
            super().__init__()

    ss.register_consumer(ip, Replacement)
    claimed = ss.make_consumer(cfg.SampleStream(type_=ip, stream_name="conduit:r"))
    assert isinstance(claimed, ConduitSampleConsumer) and isinstance(claimed.inner, Replacement)
    claimed.close()
    conduit_srl.uninstall()
    assert ss.ALL_SAMPLE_CONSUMER_CLS[ip] is Replacement, (
        f"after uninstall the entry is {ss.ALL_SAMPLE_CONSUMER_CLS[ip]!r}, still Conduit's wrapper")
    plain = ss.make_consumer(cfg.SampleStream(type_=ip, stream_name="conduit:r"))
    try:
        assert not isinstance(plain, ConduitSampleConsumer), "a stream is still claimed after uninstall()"
    finally:
        plain.close()


def test_consumer_close_that_fails_keeps_the_unreturned_samples() -> None:
    """A close() whose native close raises leaves the consumer open with its left-over samples, so a retry
    returns them (they were neither returned nor counted as lost)."""
    inner = _FirstCloseFailsConsumer()
    consumer = ConduitSampleConsumer(inner)
    producer = ConduitSampleProducer([ZmqSampleProducer(inner.address)],
                                     policy=StreamPolicy(coalesce=3, max_delay_s=0))
    lost_before = lost_without_close()["unreturned"]
    try:
        for i in range(3):
            producer.post(make_sample([i]))
        producer.flush()
        deadline = time.monotonic() + 10
        while True:
            try:
                first = consumer.consume()
                break
            except Exception:  # noqa: BLE001 - NothingToConsume until the message arrives
                assert time.monotonic() < deadline, "the coalesced message never arrived"
                time.sleep(0.001)
        assert int(first.id[0]) == 0
        with pytest.raises(OSError, match="transport busy"):
            consumer.close()
        left = consumer.close()
        assert [int(s.id[0]) for s in left] == [1, 2], f"a retried close() returned {left}"
        assert inner.close_calls == 2
    finally:
        producer.close()
        consumer.close()
    assert lost_without_close()["unreturned"] == lost_before


def test_producer_close_closes_every_target_even_when_one_close_fails() -> None:
    """One target's close() raising must not leave the other targets open for good (close() is idempotent
    afterwards, so they would never be closed): every target is closed and the error is raised after."""
    sinks = [ZmqSampleConsumer(), ZmqSampleConsumer()]
    failing = _FirstCloseFailsProducer(sinks[0].address)
    other = ZmqSampleProducer(sinks[1].address)
    producer = ConduitSampleProducer([failing, other], policy=StreamPolicy(route="round_robin"))
    try:
        for i in range(4):
            producer.post(make_sample([i]))
        with pytest.raises(OSError, match="transport busy"):
            producer.close()
        assert other._closed, "the second target was left open after the first target's close() failed"
        got = [_recv_all(s, 2) for s in sinks]
        assert [[int(x.id[0]) for x in g] for g in got] == [[0, 2], [1, 3]]
        producer.close()  # idempotent: the producer is closed
        with pytest.raises(ConfigurationError, match="closed"):
            producer.post(make_sample([9]))
    finally:
        failing.close()
        other.close()
        for s in sinks:
            s.close()


def test_a_refused_message_of_one_sample_is_carried_and_counted_like_a_coalesced_one(closing) -> None:
    """With coalesce=3 a sample the producer sent alone (its partners were late) and that the buffer refuses
    was lost with a raw SchemaError, and so was the count of what the same consume_to call had put; a
    refused coalesced message keeps its samples in an UnstoredSamplesError with put_by_call."""
    buffer = closing(batch_size=2, capacity=16)
    inner = ZmqSampleConsumer()
    consumer = ConduitSampleConsumer(inner)
    producer = ConduitSampleProducer([ZmqSampleProducer(inner.address)],
                                     policy=StreamPolicy(coalesce=3, max_delay_s=0))
    try:
        producer.post(make_sample([0]))
        producer.post(make_sample([1]))
        producer.flush()  # one message of 2 (max_delay_s=0: nothing waits)
        odd = make_sample([2], dim=5)  # another observation width: the buffer refuses it
        producer.post(odd)
        producer.flush()  # a message of 1
        returned, deadline = 0, time.monotonic() + 10
        with pytest.raises(UnstoredSamplesError) as info:
            while time.monotonic() < deadline:  # until the refused message arrives
                returned += consumer.consume_to(buffer, max_iter=8)
                time.sleep(0.001)
        err = info.value
        assert (err.stored, err.total) == (0, 1), (err.stored, err.total)
        assert returned + err.put_by_call == 2, f"2 samples were put, {returned} + {err.put_by_call} counted"
        assert [int(s.id[0]) for s in err.samples] == [2]
        assert isinstance(err.__cause__, SchemaError)
        buffer.flush()
        assert buffer.stats()["samples_put"] == 2
        assert sorted(buffer.get().sample.id[0].tolist()) == [0, 1]
    finally:
        producer.close()
        consumer.close()


class _SlowToRead:
    """An array-like field whose reading (``np.asarray``) waits for ``release``: holds a put inside its stacking."""

    def __init__(self, value: np.ndarray, entered: threading.Event, release: threading.Event) -> None:
        self.value, self.entered, self.release = value, entered, release

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        self.entered.set()
        assert self.release.wait(10), "the test never released the stacking put"
        return self.value


def test_fifo_baseline_counts_a_batch_being_stacked_and_keeps_arrival_order_across_putting_threads() -> None:
    """The baseline FifoBuffer took a full group out of its waiting list and stacked it outside its lock: qsize()
    read 0 meanwhile, and a second thread's put that arrived later was appended (and delivered) first."""
    buffer = FifoBuffer(batch_size=1)
    entered, release = threading.Event(), threading.Event()
    slow = make_sample([0])
    slow = Record(**{k: (v if k != "obs" else _SlowToRead(v, entered, release)) for k, v in slow.items()})
    errors: list[BaseException] = []

    def put(sample: object) -> None:
        try:
            buffer.put(sample)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    first = threading.Thread(target=put, args=(slow,))
    second = threading.Thread(target=put, args=(make_sample([1]),))
    first.start()
    try:
        assert entered.wait(10), "the first put never started stacking"
        assert buffer.qsize() == 1, f"qsize() is {buffer.qsize()} while a put's sample is being stacked"
        second.start()
        second.join(0.3)  # (it waits for the first put, or -- before the fix -- overtakes it)
    finally:
        release.set()
        first.join(10)
        second.join(10)
    assert not errors, errors
    order = [int(buffer.get().sample.id[0, 0]) for _ in range(2)]
    assert order == [0, 1], f"batches delivered in the order {order}, not in the order the puts arrived"


def test_zero_copy_check_sees_the_config_as_given_when_post_init_rewrites_it(srl_layout) -> None:
    """srl-local's TrainerWorker turns a zero-copy config into buffer_name="simple_queue" in __post_init__ (and
    aligns the shared-memory stream to buffer_args): checked after that, the Conduit request was gone, no
    ZeroCopyStreamError was raised and Conduit silently owned nothing."""
    layout = srl_layout("srl-local")
    cfg = layout["rlsrl.api.config"]

    @dataclasses.dataclass
    class TrainerWorker:  # the stand-in, with the zero-copy rewrite srl-local's config does on construction
        sample_stream: object = None
        buffer_name: str = "priority_queue"
        buffer_args: dict = dataclasses.field(default_factory=dict)
        buffer_zero_copy: bool = False

        def __post_init__(self) -> None:
            if self.buffer_zero_copy:
                self.sample_stream.batch_size = self.buffer_args.get("batch_size", self.sample_stream.batch_size)
                self.buffer_name, self.buffer_args = "simple_queue", {"max_size": 100}

    cfg.TrainerWorker = TrainerWorker
    conduit_srl.install()
    shm = cfg.SampleStream(type_=cfg.SampleStream.Type.SHARED_MEMORY, stream_name="s")
    with pytest.raises(ZeroCopyStreamError, match="buffer_zero_copy=False"):
        cfg.TrainerWorker(sample_stream=shm, buffer_name="conduit", buffer_args={"batch_size": 8},
                          buffer_zero_copy=True)
    assert shm.batch_size is None, "the refused config changed the stream it was given"
    with pytest.raises(ConfigurationError, match="batched_puts=True"):  # positional arguments are checked too
        cfg.TrainerWorker(cfg.SampleStream(type_=cfg.SampleStream.Type.SHARED_MEMORY, stream_name="s",
                                           batch_size=4), "conduit")
    ok = cfg.TrainerWorker(sample_stream=shm, buffer_name="conduit", buffer_args={"batch_size": 8,
                                                                                   "copy_on_put": True})
    assert ok.buffer_name == "conduit"
    plain = cfg.TrainerWorker(sample_stream=shm, buffer_name="priority_queue", buffer_zero_copy=True)
    assert plain.buffer_name == "simple_queue"


def test_a_second_install_with_other_settings_is_refused_and_changes_nothing(srl_layout) -> None:  # noqa: ANN001
    layout = srl_layout("both")
    first = conduit_srl.install(stream_policy=conduit_srl.StreamPolicy(coalesce=2, max_delay_s=0))
    try:
        make_buffer = layout["base.buffer"].make_buffer
        assert conduit_srl.install(stream_policy=conduit_srl.StreamPolicy(coalesce=2, max_delay_s=0)) is first
        with pytest.raises(ConfigurationError, match=r"already installed.*stream_policy.*uninstall\(\) first"):
            conduit_srl.install()  # the default policy: not the one the patches in place use
        with pytest.raises(ConfigurationError, match="check_configs"):
            conduit_srl.install(stream_policy=conduit_srl.StreamPolicy(coalesce=2, max_delay_s=0),
                                check_configs=False)
        assert conduit_srl.installed() is first and layout["base.buffer"].make_buffer is make_buffer
    finally:
        conduit_srl.uninstall()
