"""Coalescing works for records shaped like SRL's SampleBatch, whose every instance carries metadata.

SRL's ``SampleBatch.__init__`` (openpsi-project/srl ``api/trainer.py``) ends with
``self.register_metadata(sampling_weight=sampling_weight)``, ``None`` unless a prioritized buffer set it. The
producer sent every record that carried any metadata alone (stacking would drop it), so with SRL's own sample
class ``coalesce=k`` never coalesced: one message per sample, whatever the policy said.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from conduit_srl import ConduitBuffer, ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy
from conduit_srl.streams import COALESCED_KEY
from conduit_srl.testing import Record, make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer


class SampleBatchLike(Record):
    """A record that, like SRL's SampleBatch, registers ``sampling_weight`` metadata (None) in every instance."""

    def __init__(self, sampling_weight: Any = None, **fields: Any) -> None:
        super().__init__(**fields)
        self.register_metadata(sampling_weight=sampling_weight)


class Inline:
    def __init__(self) -> None:
        self.cache: list[Any] = []
        self.flushed: list[Any] = []

    def post(self, sample: Any) -> None:
        self.cache.append(sample)

    def flush(self) -> None:
        self.flushed.extend(self.cache)
        self.cache.clear()


def batch_like(i: int) -> SampleBatchLike:
    return SampleBatchLike(**dict(make_sample([i]).items()))


def test_records_with_valueless_metadata_are_coalesced_and_keep_it() -> None:
    target = Inline()
    p = ConduitSampleProducer([target], policy=StreamPolicy(coalesce=4, max_delay_s=0))
    for i in range(8):
        p.post(batch_like(i))
    p.flush()
    assert [m.metadata.get(COALESCED_KEY, 1) for m in target.flushed] == [4, 4]
    msg = target.flushed[0]
    assert type(msg) is SampleBatchLike and msg.metadata["sampling_weight"] is None
    assert msg.id[0].tolist() == [0, 1, 2, 3]


def test_metadata_with_a_value_still_goes_alone() -> None:
    target = Inline()
    p = ConduitSampleProducer([target], policy=StreamPolicy(coalesce=4, max_delay_s=0))
    weighted = batch_like(1)
    weighted.register_metadata(sampling_weight=np.ones(1))
    other = batch_like(3)
    other.register_metadata(note=None)  # (other metadata keys: not stacked with the rest)
    for s in (batch_like(0), weighted, batch_like(2), other, batch_like(4)):
        p.post(s)
    p.flush()
    assert [m.metadata.get(COALESCED_KEY, 1) for m in target.flushed] == [1, 1, 1, 1, 1]
    assert target.flushed[1] is weighted


def test_sample_batches_coalesced_over_zmq_reach_a_conduit_buffer_in_order() -> None:
    socket = ZmqSampleConsumer()
    consumer = ConduitSampleConsumer(socket)
    sender = ZmqSampleProducer(socket.address)
    producer = ConduitSampleProducer([sender], policy=StreamPolicy(coalesce=3, max_delay_s=0))
    buffer = ConduitBuffer(batch_size=1, capacity=16)
    try:
        for i in range(6):
            producer.post(batch_like(i))
        producer.close()
        assert sender.sent == 2  # two messages of three samples
        got = 0
        while got < 6:
            got += consumer.consume_to(buffer, max_iter=16)
        assert [int(buffer.get().sample.id[0, 0]) for _ in range(6)] == list(range(6))
    finally:
        consumer.close()
        buffer.close()
