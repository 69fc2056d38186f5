"""The test driver loses nothing silently and never hangs.

* ``ZmqSampleProducer.close`` after a socket error other than ``Again``: the samples it did not send stayed pending
  in a closed producer, neither sent nor counted in ``dropped``. They are now counted before the error propagates.
* ``run_buffer_worker`` joined its threads without a bound: a trainer thread inside a ``downstream_buffer.put`` that
  waits for room (a full on-policy buffer) hung the call past its ``timeout_s`` for good. Every join is now bounded
  and a thread still running then is named in a TimeoutError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import STOP_GRACE_S, ZmqSampleConsumer, ZmqSampleProducer, run_buffer_worker

zmq = pytest.importorskip("zmq")

#: the ``timeout_s`` a call whose threads get stuck is first given (it takes that long, plus STOP_GRACE_S, to return)
TIMEOUT_S = 2.0
#: the one it is given again on a machine too slow to reach the stuck state within TIMEOUT_S
SLOW_TIMEOUT_S = 30.0


def call_until_stuck(call: Callable[[float], object],
                     stuck: Callable[[object, list[str]], bool]) -> tuple[object, list[threading.Thread]]:
    """``call(timeout_s)`` (a driver run whose threads get stuck) on a thread of its own: what it returned or raised,
    and the threads it started that were still running when it returned.

    ``stuck(outcome, names of those threads)`` says whether the call reached the state the test is about before its
    deadline (e.g. a put waiting for room nobody makes). Threads, sockets and the first samples take tens of
    milliseconds to get there; on a machine too slow for that within ``TIMEOUT_S`` the call gave up before (and said
    so), so it runs once more, given ``SLOW_TIMEOUT_S``. A slow machine only makes the test slower; an outcome is
    returned only once the state was reached, so an assertion on it never passes (or fails) on a call that gave up
    early. ``call`` builds what it runs on afresh each time. It must return within ``timeout_s + 2 * STOP_GRACE_S``;
    30 s more than that is taken as a hang.
    """
    outcome: list[object] = []
    for timeout_s in (TIMEOUT_S, SLOW_TIMEOUT_S):
        outcome.clear()
        before = set(threading.enumerate())

        def run(t: float = timeout_s) -> None:
            try:
                outcome.append(call(t))
            except BaseException as e:  # noqa: BLE001 - the caller inspects it
                outcome.append(e)

        runner = threading.Thread(target=run, name="test-runner", daemon=True)
        runner.start()
        runner.join(timeout_s + 2 * STOP_GRACE_S + 30.0)
        assert not runner.is_alive(), f"the call with timeout_s={timeout_s} did not return: it hangs"
        assert len(outcome) == 1, outcome
        left = [t for t in threading.enumerate() if t not in before and t.is_alive() and t is not runner]
        if stuck(outcome[0], [t.name for t in left]):
            return outcome[0], left
    raise AssertionError(f"the call never reached the stuck state the test is about, also with timeout_s="
                         f"{SLOW_TIMEOUT_S}: it returned {outcome}")


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
    downstream: list[Any] = []

    def call(timeout_s: float) -> object:
        worker = closing(batch_size=2, capacity=64)
        downstream.append(closing(semantics="on_policy", capacity=4, num_minibatches=1, num_epochs=1,
                                  rollout_size=4))
        return run_buffer_worker([make_sample([i]) for i in range(8)], worker, downstream[-1], timeout_s=timeout_s)

    # stuck: the trainer waits in the 5th put, and the worker had finished by the deadline (when it had not, the
    # error reports the worker's lateness: "buffer worker re-posted k of 8 samples in ...")
    outcome, _ = call_until_stuck(call, lambda out, names: ("trainer" in names
                                                            and "buffer worker re-posted" not in str(out)))
    assert isinstance(outcome, TimeoutError), f"expected a TimeoutError, got {outcome!r}"
    message = str(outcome)
    assert "trainer" in message and "downstream" in message, f"the error does not say what is stuck: {message}"
    assert len(downstream[-1]) == 4, f"the downstream buffer should hold its one rollout: {len(downstream[-1])}"


def test_driver_run_past_its_timeout_returns_within_the_bound(closing) -> None:
    """A training step (ten times ``timeout_s``: 20 s) longer than ``timeout_s`` (2 s): ``SrlDriver.run`` raises its
    TimeoutError while the step still runs, instead of joining the training thread until the step ends."""
    from conduit_srl.testing.driver import SrlDriver

    def call(timeout_s: float) -> object:
        driver = SrlDriver(closing(batch_size=1, capacity=16), actors=1, samples_per_actor=2, per_poll=2,
                           step_seconds=10 * timeout_s)
        return driver.run(timeout_s=timeout_s)

    # the training thread still in its step when run returned: run did not wait for the step to end (nor hang)
    outcome, _ = call_until_stuck(call, lambda _, names: "training-thread" in names)
    assert isinstance(outcome, TimeoutError), f"expected a TimeoutError, got {outcome!r}"
    assert "training-thread" in str(outcome), f"the error does not say what did not finish: {outcome}"
