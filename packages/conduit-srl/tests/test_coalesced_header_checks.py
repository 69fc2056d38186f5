"""The claimed sample stream on the wire: what a consumer does with a message whose coalescing header
does not match its data (a malformed frame from a buggy or foreign peer), over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conduit import SchemaError
from conduit_srl import ConduitSampleConsumer, UnstoredSamplesError
from conduit_srl.streams import COALESCED_KEY, pack
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer
from conduit_srl.testing.fifo import FifoBuffer


def _forged(k: Any) -> Any:
    """A coalesced message of samples 0 and 1 whose header claims ``k`` samples."""
    msg = pack([make_sample([0]), make_sample([1])])
    msg.pop_metadata(COALESCED_KEY)
    msg.register_metadata(**{COALESCED_KEY: k})
    return msg


def _send(msg: Any) -> ConduitSampleConsumer:
    """A Conduit consumer over a real socket whose peer has sent ``msg`` (delivered and waiting on the socket)."""
    sock = ZmqSampleConsumer()
    producer = ZmqSampleProducer(sock.address)
    producer.post(msg)
    producer.close()
    sock._socket.poll(timeout=30_000)  # (the message is on the socket: consume_to never blocks)
    return ConduitSampleConsumer(sock)


@pytest.mark.parametrize("k", [3, 1, True, 0, -1, "two", 2.5])
@pytest.mark.parametrize("kind", ["conduit", "fifo"])
def test_a_coalesced_header_that_does_not_match_the_data_is_refused_with_the_message(closing, kind: str,
                                                                                     k: Any) -> None:
    """The header is read, not trusted: a count other than the message's batch width (fewer: the others were
    silently dropped; more: an IndexError, or a Conduit buffer's count off by one; 0 or -1: the message put as one
    wrong-shaped sample, or nothing put and both samples gone) is a typed error carrying the message as received,
    and the buffer is unchanged."""
    buffer: Any = closing(batch_size=1, capacity=16) if kind == "conduit" else FifoBuffer(batch_size=1)
    consumer = _send(_forged(k))
    with pytest.raises(UnstoredSamplesError) as info:
        consumer.consume_to(buffer)
    e = info.value
    assert isinstance(e.__cause__, SchemaError) and "coalesc" in str(e.__cause__)
    assert e.stored == 0 and e.put_by_call == 0 and len(e.samples) == 1
    assert np.asarray(e.samples[0].id)[0].tolist() == [0, 1]  # the whole message, nothing of it lost
    assert e.samples[0].metadata[COALESCED_KEY] == k  # as received
    if kind == "conduit":
        buffer.flush()
        assert buffer.stats()["samples_put"] == 0 and buffer.qsize() == 0
    else:
        assert buffer.qsize() == 0
    assert consumer.close() == []


def test_a_well_formed_coalesced_message_still_arrives_whole(closing) -> None:
    buffer = closing(batch_size=2, capacity=16)
    consumer = _send(_forged(2))
    assert consumer.consume_to(buffer) == 2
    assert np.asarray(buffer.get().sample.id)[0].tolist() == [0, 1]
    consumer.close()
