"""Review round 5 of the SRL adapter: counts and ``qsize`` that must reflect exactly what is held.

* ``qsize()`` while the assembler thread moves a queue batch to its ready queue;
* an on-policy put that stored some runs and then failed (counts, error, the coalesced consumer);
* ``stats()`` read under the data plane's lock;
* the test driver's ``consume_to`` count when a put raises;
* stream ends dropped without ``close()`` while holding samples.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_srl import (
    ConduitSampleConsumer,
    ConduitSampleProducer,
    SamplesLostWarning,
    StreamPolicy,
    UnstoredSamplesError,
)
from conduit_srl.streams import lost_without_close, pack
from conduit_srl.testing import Record, entry_ids, make_sample

sys.path.insert(0, str(Path(__file__).parent))
from test_seal_and_backlog import RefusingBuffer  # noqa: E402, I001  (a plain buffer that refuses past a limit)

JOIN_S = 60.0  # (waits for other threads, only reached when they never get there)


# -- qsize while a batch moves to the ready queue -----------------------------------------------------------
class GatedRecord(Record):
    """A record class whose construction by the assembler thread waits for ``gate``.

    The buffer builds delivered records of the put samples' class, so this pauses the real assembler
    thread inside its assembly of a batch (after the batch left Conduit, before it is ready).
    """

    gate: threading.Event | None = None
    entered = threading.Event()

    def __init__(self, **fields: Any) -> None:
        super().__init__(**fields)
        gate = GatedRecord.gate
        if gate is not None and threading.current_thread().name == "conduit-srl-assembler":
            GatedRecord.entered.set()
            gate.wait(JOIN_S)


def gated_sample(i: int) -> GatedRecord:
    return GatedRecord(**dict(make_sample([i]).items()))


def test_qsize_counts_a_batch_while_the_assembler_thread_moves_it_to_the_ready_queue(closing) -> None:
    b = closing(semantics="queue", batch_size=2, capacity=64, prefetch=1)
    for i in range(6):
        b.put(gated_sample(i))
    b.flush()
    GatedRecord.gate, GatedRecord.entered = threading.Event(), threading.Event()
    try:
        assert entry_ids(b.get()).tolist() == [0, 1]  # assembled here; the assembler thread now takes [2, 3]
        assert GatedRecord.entered.wait(JOIN_S), "the assembler thread did not start on the next batch"
        seen = b.qsize()
    finally:
        GatedRecord.gate.set()
        GatedRecord.gate = None
    assert seen == 4, (f"qsize() said {seen} while the assembler thread was moving batch [2, 3] to its ready queue; "
                       f"4 samples were undelivered (the batch vanished from the count)")
    deadline = time.monotonic() + JOIN_S
    while not b._a._ready and time.monotonic() < deadline:
        time.sleep(0.005)
    assert b.qsize() == 4, f"qsize() said {b.qsize()} once batch [2, 3] was ready"
    assert entry_ids(b.get()).tolist() == [2, 3]
    assert b.qsize() == 2


def test_on_policy_qsize_counts_a_rollout_whose_last_minibatch_waits_in_the_ready_queue(closing) -> None:
    """The plane releases a rollout's storage when it delivers the last minibatch; the assembler thread
    delivers it ahead of get(), and qsize() said 0 (with empty() False) while those samples were undelivered."""
    b = closing(semantics="on_policy", capacity=16, num_minibatches=2)
    b.put_batch(make_sample([0, 1, 2, 3], batched=True))
    b.seal()
    b.flush()
    assert b.qsize() == 4
    first = entry_ids(b.get()).tolist()
    deadline = time.monotonic() + JOIN_S
    while not b._a._ready and time.monotonic() < deadline:
        time.sleep(0.005)
    assert b._a._ready, "the assembler did not prepare the rollout's last minibatch"
    assert not b.empty()
    assert b.qsize() == 4, f"qsize() said {b.qsize()} while the rollout's last minibatch waited for get()"
    second = entry_ids(b.get()).tolist()
    assert sorted(first + second) == [0, 1, 2, 3]
    assert b.qsize() == 0 and b.empty()


# -- a put that stored some runs, then failed ----------------------------------------------------------------
def fail_nth_call(monkeypatch: pytest.MonkeyPatch, obj: object, name: str, nth: int, error: BaseException) -> None:
    """Make ``obj.name`` raise ``error`` on its ``nth`` call (1-based) from now on, and work otherwise."""
    real = getattr(obj, name)
    calls = [0]

    def wrapped(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == nth:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


def test_a_put_whose_later_run_fails_counts_exactly_the_runs_it_stored(closing, monkeypatch) -> None:
    """Versions [1, 1, 1, 1, 0], rollout_size=2: runs [0, 2) (sealed), [2, 4), and a late [4, 5). The second
    run is refused: the first is stored, the late one never reached."""
    b = closing(semantics="on_policy", capacity=16, rollout_size=2, num_minibatches=1, on_stale="drop")
    b.put(make_sample([90], version=1))
    b.put(make_sample([91], version=1))  # a whole rollout: it is sealed
    b.flush()
    sample = make_sample([0, 1, 2, 3, 4], batched=True, version=1)
    sample.policy_version_steps[:, 4] = 0
    fail_nth_call(monkeypatch, b.edp, "ingest", 2, ConfigurationError("an earlier background write failed."))
    with pytest.raises(ConfigurationError, match="background write failed") as info:
        b.put_batch(sample)
    msg = str(info.value)
    assert "The first 2 of this put's 5 samples were taken" in msg, f"the error does not say what was stored: {msg}"
    assert getattr(info.value, "samples_stored", None) == 2
    stats = b.stats()
    assert stats["samples_put"] == 4, f"samples_put counts {stats['samples_put']}; 2 + the 2 this put stored"
    assert stats["late_dropped"] == 0, "the late sample after the refused run was counted as dropped"
    assert (b._a._open_version, b._a._open_count) == (1, 0), "the open rollout counts samples never stored"
    b.put_batch(make_sample([2, 3], batched=True, version=1))  # the rest, again: a whole rollout
    b.flush()
    assert sorted(entry_ids(b.get()).tolist()) == [90, 91]
    assert sorted(entry_ids(b.get()).tolist()) == [0, 1]
    assert sorted(entry_ids(b.get()).tolist()) == [2, 3]
    assert b.stats()["samples_put"] == 6


def test_a_put_whose_rollout_seal_fails_counts_the_stored_run_and_seals_it_later(closing, monkeypatch) -> None:
    b = closing(semantics="on_policy", capacity=16, rollout_size=2, num_minibatches=1)
    b.put(make_sample([0], version=0))  # (b.edp exists from the first put)
    fail_nth_call(monkeypatch, b.edp, "seal", 1, ConfigurationError("the seal's flush failed."))
    with pytest.raises(ConfigurationError, match="seal's flush failed") as info:
        b.put_batch(make_sample([1, 2], batched=True))  # [1] completes the rollout, [2] would start the next
    msg = str(info.value)
    assert "The first 1 of this put's 2 samples were taken" in msg and "not sealed" in msg, msg
    assert b.stats()["samples_put"] == 2
    b.put_batch(make_sample([2, 3], batched=True))  # the rest, and one more: the owed seal comes first
    b.flush()
    assert sorted(entry_ids(b.get()).tolist()) == [0, 1], "the rollout whose seal failed was not sealed at its size"
    assert sorted(entry_ids(b.get()).tolist()) == [2, 3]


def test_a_put_refused_while_it_waits_for_room_says_what_it_stored_before(closing) -> None:
    """A put that stored a completed rollout and waits for room for the rest; the buffer is closed meanwhile."""
    b = closing(semantics="on_policy", capacity=4, rollout_size=2, num_minibatches=1)
    b.put_batch(make_sample([90, 91], batched=True))  # a sealed rollout: half the capacity
    errors: list[BaseException] = []

    def put() -> None:
        try:
            b.put_batch(make_sample([0, 1, 2, 3], batched=True))
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    t = threading.Thread(target=put, daemon=True)
    t.start()
    deadline = time.monotonic() + JOIN_S
    while b.stats()["samples_put"] < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    t.join(0.2)
    assert t.is_alive() and b.stats()["samples_put"] == 4, "the put did not store [0, 1] and wait for room"
    b.close()
    t.join(JOIN_S)
    assert not t.is_alive() and len(errors) == 1
    assert isinstance(errors[0], ConfigurationError) and "closed" in str(errors[0])
    assert "The first 2 of this put's 4 samples were taken" in str(errors[0]), \
        f"the error does not say that part of the put was stored: {errors[0]}"
    assert getattr(errors[0], "samples_stored", None) == 2


class LocalStream:
    """An in-process transport: ``post``/``flush`` on one side, ``consume_to`` on the other."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def post(self, sample: Any) -> None:
        self.sent.append(sample)

    def flush(self) -> None:
        pass

    def consume_to(self, buffer: Any, max_iter: int = 16) -> int:
        n = 0
        while self.sent and n < max_iter:
            buffer.put(self.sent.pop(0))
            n += 1
        return n

    def consume(self) -> Any:
        return self.sent.pop(0)


def test_a_coalesced_message_a_conduit_put_stored_in_part_is_not_put_twice(closing, monkeypatch) -> None:
    b = closing(semantics="on_policy", capacity=16, rollout_size=2, num_minibatches=1)
    b.put(make_sample([90]))
    b.put(make_sample([91]))
    stream = LocalStream()
    stream.post(pack([make_sample([i]) for i in range(4)]))
    consumer = ConduitSampleConsumer(stream)
    fail_nth_call(monkeypatch, b.edp, "ingest", 2, ConfigurationError("an earlier background write failed."))
    with pytest.raises(UnstoredSamplesError) as info:
        consumer.consume_to(b)
    err = info.value
    assert (err.stored, [int(np.asarray(s.id)[0]) for s in err.samples]) == (2, [2, 3]), \
        "the samples the buffer had stored are in the error too (putting them again repeats them)"
    for s in err.samples:
        b.put(s)
    b.flush()
    got = [sorted(entry_ids(b.get()).tolist()) for _ in range(3)]
    assert got == [[90, 91], [0, 1], [2, 3]]
    assert b.empty()


def test_an_unstored_samples_error_counts_what_its_consume_to_call_put() -> None:
    """consume_to's count (samples put) was lost with the error: earlier messages of the call were not in it."""
    stream = LocalStream()
    stream.post(make_sample([7]))
    stream.post(pack([make_sample([i]) for i in range(4)]))
    consumer = ConduitSampleConsumer(stream)
    buffer = RefusingBuffer(limit=3)
    with pytest.raises(UnstoredSamplesError) as info:
        consumer.consume_to(buffer, max_iter=8)
    err = info.value
    assert (err.stored, err.total, len(buffer.items)) == (2, 4, 3)
    assert getattr(err, "put_by_call", None) == 3, "the samples this consume_to call put are not counted"



def test_a_transport_error_in_consume_to_is_typed_and_counts_what_the_call_put(closing: Any) -> None:
    """Over a real ZMQ socket, two good messages then bytes that do not unpickle (a foreign sender): the native
    consumer's ``pickle.loads`` raised out of ``consume_to`` as a raw UnpicklingError, and the count of the
    samples that call had already put (they stay in the buffer) was lost with it."""
    import pickle

    import zmq
    from conduit_srl import ReceiveError
    from conduit_srl.testing.driver import ZmqSampleConsumer

    native = ZmqSampleConsumer()
    consumer = ConduitSampleConsumer(native)
    buffer = closing(batch_size=2, capacity=8, pin_memory=False)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"tcp://{native.address}")
    try:
        for i in range(2):  # (one socket: the three messages arrive in this order)
            push.send(pickle.dumps(make_sample([i])))
        push.send(b"not a pickle")
        returned = 0
        with pytest.raises(ReceiveError) as info:
            for _ in range(20_000):  # (until the third arrives: bounded, not timed)
                returned += consumer.consume_to(buffer, max_iter=64)
                time.sleep(0.001)
        err = info.value
        assert isinstance(err.__cause__, pickle.UnpicklingError), repr(err.__cause__)
        assert buffer.stats()["samples_put"] == 2 and native.received == 3
        assert returned + err.put_by_call == 2, f"2 samples were put, {returned} + {err.put_by_call} counted"
        assert sorted(entry_ids(buffer.get()).tolist()) == [0, 1]
    finally:
        push.close()
        consumer.close()

# -- stats() under the data plane's lock ---------------------------------------------------------------------
def test_stats_reads_rollout_dropped_under_the_data_planes_lock(closing) -> None:
    """A selection that only predicts the next delivery (peek, as Conduit's prefetch makes) drops a stale
    rollout and then restores the state; stats() read meanwhile counted a drop that never happened."""
    b = closing(semantics="on_policy", capacity=16, num_minibatches=1, max_staleness=0, on_stale="drop")
    b.put_batch(make_sample([0, 1], batched=True, version=0))
    b.seal()
    b.put_batch(make_sample([2, 3], batched=True, version=1))
    b.seal()
    b.set_policy_version(1)  # the version-0 rollout is stale now
    b.flush()
    edp = b.edp
    sem = edp.semantics
    real = sem.epoch_order
    seen: list[int] = []
    readers: list[threading.Thread] = []

    def read() -> None:
        seen.append(b.stats()["rollout_dropped"])

    def epoch_order(n: int, epoch: int) -> Any:  # (OnPolicy's hook; called while the selection holds the lock)
        if sem.peeking:
            t = threading.Thread(target=read)
            t.start()
            t.join(0.5)  # (with the lock taken it waits for the selection to finish)
            readers.append(t)
        return real(n, epoch)

    sem.epoch_order = epoch_order
    edp.select_now([None], peek=True)
    for t in readers:
        t.join(JOIN_S)
    assert readers and seen == [0], f"stats() read rollout_dropped={seen} in the middle of a prediction"
    assert sorted(entry_ids(b.get()).tolist()) == [2, 3]
    assert b.stats()["rollout_dropped"] == 2


def test_stats_of_a_closed_buffer_still_reads(closing) -> None:
    b = closing(semantics="queue", batch_size=1, capacity=8)
    b.put(make_sample([0]))
    b.flush()
    b.close()
    s = b.stats()
    assert s["samples_put"] == 1 and s["queue_dropped"] == 0


# -- the test driver's consume_to ------------------------------------------------------------------------------
class RefuseSecond:
    def __init__(self) -> None:
        self.attempts = 0
        self.items: list[Any] = []

    def put(self, x: Any) -> None:
        self.attempts += 1
        if self.attempts == 2:
            raise OverflowError("refused")
        self.items.append(x)


def test_driver_consume_to_counts_what_it_received_when_a_put_raises() -> None:
    pytest.importorskip("zmq")
    from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

    consumer = ZmqSampleConsumer()
    producer = ZmqSampleProducer(consumer.address)
    try:
        for i in range(3):
            producer.post(make_sample([i]))
        producer.flush()
        buffer = RefuseSecond()
        returned = 0
        deadline = time.monotonic() + JOIN_S
        while buffer.attempts < 3 and time.monotonic() < deadline:
            try:
                returned += consumer.consume_to(buffer, max_iter=8)
            except OverflowError:
                pass
            time.sleep(0.001)
        assert buffer.attempts == 3, "the samples did not arrive"
        assert consumer.received == 3, (f"received={consumer.received} after 3 messages left the socket (one put "
                                        f"refused)")
        assert len(buffer.items) == 2 and returned <= 2
    finally:
        producer.close()
        consumer.close()


def test_driver_producer_sends_the_rest_and_says_so_when_a_sample_cannot_be_pickled() -> None:
    pytest.importorskip("zmq")
    from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

    consumer = ZmqSampleConsumer()
    producer = ZmqSampleProducer(consumer.address)
    try:
        producer.post(make_sample([0]))
        producer.post({"fn": lambda: None})  # a lambda cannot be pickled
        producer.post(make_sample([1]))
        with pytest.raises(ConfigurationError, match="could not be pickled"):
            producer.close()  # the socket is closed all the same
        assert (producer.sent, producer.dropped) == (2, 1), (producer.sent, producer.dropped)
        assert producer._socket.closed
        got: list[Any] = []

        class Keep:
            def put(self, x: Any) -> None:
                got.append(x)

        deadline = time.monotonic() + JOIN_S
        while len(got) < 2 and time.monotonic() < deadline:
            consumer.consume_to(Keep())
            time.sleep(0.001)
        assert len(got) == 2, f"{len(got)} of the 2 picklable samples arrived"
    finally:
        producer.close()
        consumer.close()


# -- stream ends dropped without close() -----------------------------------------------------------------------
def test_a_producer_dropped_with_unsent_samples_warns_and_counts_them() -> None:
    stream = LocalStream()
    before = lost_without_close()
    p = ConduitSampleProducer([stream], policy=StreamPolicy(coalesce=4, max_delay_s=60))
    for i in range(3):
        p.post(make_sample([i]))
    p.flush()  # (fewer than coalesce, not yet due: they stay pending)
    assert stream.sent == []
    with pytest.warns(SamplesLostWarning, match="held 3 samples"):
        del p
        gc.collect()
    assert lost_without_close()["unsent"] - before["unsent"] == 3


def test_a_consumer_dropped_with_unreturned_samples_warns_and_counts_them() -> None:
    stream = LocalStream()
    stream.post(pack([make_sample([i]) for i in range(3)]))
    before = lost_without_close()
    c = ConduitSampleConsumer(stream)
    assert int(np.asarray(c.consume().id)[0]) == 0
    with pytest.warns(SamplesLostWarning, match="held 2 samples"):
        del c
        gc.collect()
    assert lost_without_close()["unreturned"] - before["unreturned"] == 2


def test_closed_or_empty_stream_ends_are_dropped_silently() -> None:
    stream = LocalStream()
    before = lost_without_close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SamplesLostWarning)
        p = ConduitSampleProducer([stream], policy=StreamPolicy(coalesce=4, max_delay_s=60))
        p.post(make_sample([0]))
        p.close()  # sends it
        c = ConduitSampleConsumer(stream)
        del p, c
        gc.collect()
    assert len(stream.sent) == 1
    assert lost_without_close() == before
