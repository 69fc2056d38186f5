"""The test driver loses nothing silently and never hangs.

* ``ZmqSampleProducer.close`` after a socket error other than ``Again``: the samples it did not send stayed pending
  in a closed producer, neither sent nor counted in ``dropped``. They are now counted before the error propagates.
* ``run_buffer_worker`` joined its threads without a bound: a trainer thread inside a ``downstream_buffer.put`` that
  waits for room (a full on-policy buffer) hung the call past its ``timeout_s`` for good. Every join is now bounded
  and a thread still running then is named in a TimeoutError.
"""

from __future__ import annotations

import threading
import time

import pytest
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import STOP_GRACE_S, ZmqSampleConsumer, ZmqSampleProducer, run_buffer_worker

zmq = pytest.importorskip("zmq")


def test_close_after_a_socket_error_counts_every_sample_it_did_not_send() -> None:
    """Three posted samples; the socket fails under the producer (closed, as a terminated context leaves it), so the
    close's flush raises a ZMQError that is not ``Again``: every sample is sent or counted in ``dropped``."""
    consumer = ZmqSampleConsumer()
    producer = ZmqSampleProducer(consumer.address, send_timeout_ms=1_000)
    try:
        for i in range(3):
            producer.post(make_sample([i]))
        producer._socket.close()  # the real socket fails: its sends now raise ZMQError (ENOTSOCK), not Again
        with pytest.raises(zmq.ZMQError) as err:
            producer.close()
        assert not isinstance(err.value, zmq.Again), f"the scenario needs an error other than Again: {err.value!r}"
        assert producer.sent + producer.dropped == 3, (
            f"of 3 posted samples {producer.sent} were sent and {producer.dropped} counted as dropped after close "
            f"raised: the rest were lost silently")
        assert producer.dropped == 3 - producer.sent
        producer.close()  # idempotent: nothing counted twice
        assert producer.sent + producer.dropped == 3, "a second close counted samples again"
        with pytest.raises(Exception, match="closed"):
            producer.post(make_sample([9]))
    finally:
        consumer.close()


def test_close_after_a_failed_flush_counts_the_samples_the_flush_put_back() -> None:
    """A flush that fails with a socket error puts the unsent samples back; the close that follows (its flush fails
    too) counts them: sent + dropped equals what was posted."""
    consumer = ZmqSampleConsumer()
    producer = ZmqSampleProducer(consumer.address, send_timeout_ms=1_000)
    try:
        producer.post(make_sample([0]))
        producer.flush()
        for i in range(1, 4):
            producer.post(make_sample([i]))
        producer._socket.close()
        with pytest.raises(zmq.ZMQError):
            producer.flush()
        with pytest.raises(zmq.ZMQError):
            producer.close()
        assert (producer.sent, producer.dropped) == (1, 3), (
            f"sent {producer.sent}, dropped {producer.dropped}: the 3 samples the failed flush put back must be "
            f"counted as dropped once the producer is closed")
    finally:
        consumer.close()


def test_run_buffer_worker_with_a_stuck_downstream_put_raises_in_bounded_time(closing) -> None:
    """The downstream buffer is on-policy with room for one sealed rollout of 4 samples and nobody takes deliveries:
    its 5th put waits for room for ever. ``run_buffer_worker(timeout_s=2)`` must return within its bound with a
    TimeoutError naming the trainer thread (it used to hang until the buffer was closed)."""
    worker = closing(batch_size=2, capacity=64)
    downstream = closing(semantics="on_policy", capacity=4, num_minibatches=1, num_epochs=1, rollout_size=4)
    timeout_s = 2.0
    outcome: list[BaseException | tuple[int, int]] = []

    def call() -> None:
        try:
            outcome.append(run_buffer_worker([make_sample([i]) for i in range(8)], worker, downstream,
                                             timeout_s=timeout_s))
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome.append(e)

    t0 = time.monotonic()
    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    bound = timeout_s + 2 * STOP_GRACE_S + 10.0
    caller.join(bound)
    took = time.monotonic() - t0
    assert not caller.is_alive(), f"run_buffer_worker(timeout_s={timeout_s}) still runs after {took:.1f} s: it hangs"
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError), f"expected a TimeoutError, got {outcome}"
    message = str(outcome[0])
    assert "trainer" in message and "downstream" in message, f"the error does not say what is stuck: {message}"
    assert len(downstream) == 4, f"the downstream buffer should hold its one rollout: {len(downstream)}"


def test_driver_run_past_its_timeout_returns_within_the_bound(closing) -> None:
    """A training step (20 s) longer than ``timeout_s`` (2 s): ``SrlDriver.run`` raises its TimeoutError within the
    bound instead of joining the training thread until the step ends."""
    from conduit_srl.testing.driver import SrlDriver

    buffer = closing(batch_size=1, capacity=16)
    driver = SrlDriver(buffer, actors=1, samples_per_actor=2, per_poll=2, step_seconds=20.0)
    timeout_s = 2.0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        driver.run(timeout_s=timeout_s)
    took = time.monotonic() - t0
    assert took < timeout_s + STOP_GRACE_S + 5.0, (
        f"run(timeout_s={timeout_s}) took {took:.1f} s: it joined the training thread without a bound")
    assert "training thread" in str(err.value), f"the error does not say what did not finish: {err.value}"
