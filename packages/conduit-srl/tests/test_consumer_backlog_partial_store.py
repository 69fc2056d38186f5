"""A left-over sample that the buffer stored in part before it refused the rest for another reason than a full buffer.

``consume()`` returns a coalesced message one sample at a time; ``consume_to`` puts the rest first. A batched
(``batched_puts=True``) on-policy put that completes a rollout stores through its end and waits for room for
the rest; a ``close()`` of the buffer meanwhile makes it raise, saying how many columns it stored. The
:class:`UnstoredSamplesError` must carry only the columns not stored: putting its samples again must not store a
column twice.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conduit_srl import ConduitBuffer, ConduitSampleConsumer, UnstoredSamplesError
from conduit_srl.streams import pack
from conduit_srl.testing.driver import NothingToConsume, ZmqSampleConsumer, ZmqSampleProducer
from conduit_srl.testing.records import make_sample

BOUND_S = 60.0  # generous bounds on waits that end well under a second


def columns(sample: object) -> list[int]:
    return np.asarray(sample.id)[0].tolist()  # type: ignore[attr-defined]


def test_a_left_over_batched_sample_stored_in_part_is_carried_without_its_stored_columns() -> None:
    socket = ZmqSampleConsumer()
    consumer = ConduitSampleConsumer(socket)
    producer = ZmqSampleProducer(socket.address)
    buffer = ConduitBuffer(semantics="on_policy", capacity=8, rollout_size=4, num_minibatches=1,
                           batched_puts=True, pin_memory=False)
    try:
        buffer.put(make_sample([0, 1, 2, 3], batched=True))  # a sealed rollout, not delivered
        buffer.put(make_sample([4, 5, 6], batched=True))  # the open rollout: room for 1 more sample
        producer.post(pack([make_sample([10, 11, 13, 14], batched=True), make_sample([7, 8, 9, 12], batched=True)]))
        producer.flush()
        deadline = time.monotonic() + BOUND_S
        while True:  # (the message is on its way over the socket)
            try:
                first = consumer.consume()
                break
            except NothingToConsume:
                assert time.monotonic() < deadline, "the coalesced message never arrived"
                time.sleep(0.001)
        assert columns(first) == [10, 11, 13, 14]  # the second sample is left over: consume_to puts it first

        caught: list[BaseException] = []

        def trainer_main_thread() -> None:
            try:
                consumer.consume_to(buffer)
            except BaseException as e:  # noqa: BLE001 - checked below
                caught.append(e)

        t = threading.Thread(target=trainer_main_thread, daemon=True)
        t.start()
        deadline = time.monotonic() + BOUND_S
        while buffer.stats()["samples_put"] < 8:  # sample 7 completed the open rollout; 8, 9, 12 wait for room
            assert time.monotonic() < deadline and t.is_alive(), f"the put did not store its first column: {caught}"
            time.sleep(0.001)
        buffer.close()  # (shutdown while the put waits for room)
        t.join(BOUND_S)
        assert not t.is_alive()
        assert len(caught) == 1 and isinstance(caught[0], UnstoredSamplesError), caught
        err = caught[0]
        assert err.__cause__ is not None and err.__cause__.samples_stored == 1  # type: ignore[attr-defined]
        assert [columns(s) for s in err.samples] == [[8, 9, 12]], "column 7 is stored, yet carried as not stored"
        assert consumer.close() == []
    finally:
        producer.close()
        consumer.close()
        buffer.close()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
