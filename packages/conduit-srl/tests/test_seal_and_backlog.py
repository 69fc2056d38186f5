"""Review round 4: ``seal()`` while an on-policy put waits for room, and received samples a consumer lost.

* ``seal()`` (and a checkpoint) waited on a put that was itself waiting for room, so a training
  thread that sealed before its next ``get()`` hung for good.
* ``ConduitSampleConsumer.close()`` dropped the rest of a coalesced message ``consume()`` had
  returned in part; ``consume_to`` dropped the rest of a message when the buffer refused a sample
  part way, and a Conduit buffer refused a message larger than its capacity whole.
"""

from __future__ import annotations

import pickle
import threading
from collections import deque
from typing import Any

import numpy as np
import pytest
from conduit import CapacityError
from conduit_srl import ConduitBuffer, ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy, UnstoredSamplesError
from conduit_srl.testing import entry_ids, make_sample
from conduit_srl.testing.driver import NothingToConsume

JOIN_S = 10.0


def ids_of(samples: list[Any]) -> list[int]:
    """The ids of ``[T, ...]`` samples, in order."""
    return [int(np.asarray(s.id)[0]) for s in samples]


def start(fn: Any, *args: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, errors


def wait_until_blocked(t: threading.Thread) -> None:
    t.join(0.3)
    assert t.is_alive(), "the put did not wait for room (the scenario needs a full buffer)"


# -- seal and checkpoint while a put waits for room --------------------------------------------------------
def full_on_policy_buffer() -> ConduitBuffer:
    """Capacity 8: a sealed rollout [0..3] and an open one [4, 5, 6]; a put of 2 more has to wait for room."""
    b = ConduitBuffer(semantics="on_policy", capacity=8, num_minibatches=1)
    for i in range(4):
        b.put(make_sample([i]))
    b.seal()
    for i in range(4, 7):
        b.put(make_sample([i]))
    b.flush()
    return b


def test_seal_returns_while_an_on_policy_put_waits_for_room() -> None:
    b = full_on_policy_buffer()
    putter, put_errors = start(b.put_batch, make_sample([7, 8], batched=True))
    try:
        wait_until_blocked(putter)
        sealer, seal_errors = start(b.seal)
        sealer.join(JOIN_S)
        assert not sealer.is_alive(), "seal() hung behind a put that waits for room (no get() ever came)"
        assert not seal_errors, seal_errors
        assert sorted(entry_ids(b.get()).tolist()) == [0, 1, 2, 3]
        putter.join(JOIN_S)
        assert not putter.is_alive() and not put_errors, f"the waiting put did not finish: {put_errors!r}"
        assert sorted(entry_ids(b.get()).tolist()) == [4, 5, 6], \
            "the sealed rollout must be exactly what was stored before seal()"
        assert b.empty(), "the waiting put's samples belong to the next (still open) rollout"
        b.seal()
        assert sorted(entry_ids(b.get()).tolist()) == [7, 8], "the waiting put's samples were lost or repeated"
        assert b.empty()
        assert b.stats()["samples_put"] == 9
    finally:
        b.close()
        putter.join(JOIN_S)


def test_checkpoint_returns_while_an_on_policy_put_waits_for_room() -> None:
    b = full_on_policy_buffer()
    putter, put_errors = start(b.put_batch, make_sample([7, 8], batched=True))
    out: list[bytes] = []
    try:
        wait_until_blocked(putter)
        saver, save_errors = start(lambda: out.append(pickle.dumps(b)))
        saver.join(JOIN_S)
        assert not saver.is_alive(), "pickling the buffer hung behind a put that waits for room"
        assert not save_errors, save_errors
        restored = pickle.loads(out[0])
        try:
            assert sorted(entry_ids(restored.get()).tolist()) == [0, 1, 2, 3]
            assert restored.empty()
            restored.seal()
            assert sorted(entry_ids(restored.get()).tolist()) == [4, 5, 6], \
                "the checkpoint is not the state between puts (the waiting put had not stored anything)"
        finally:
            restored.close()
        assert sorted(entry_ids(b.get()).tolist()) == [0, 1, 2, 3]
        putter.join(JOIN_S)
        assert not putter.is_alive() and not put_errors, put_errors
        b.seal()
        assert sorted(entry_ids(b.get()).tolist()) == [4, 5, 6, 7, 8]
    finally:
        b.close()
        putter.join(JOIN_S)


def test_close_ends_a_put_waiting_for_room_with_a_typed_error() -> None:
    b = full_on_policy_buffer()
    putter, put_errors = start(b.put_batch, make_sample([7, 8], batched=True))
    wait_until_blocked(putter)
    b.close()
    putter.join(JOIN_S)
    assert not putter.is_alive(), "close() left a put waiting for room forever"
    assert len(put_errors) == 1 and "closed" in str(put_errors[0]), put_errors


# -- a local stream: SRL's in-process transport ----------------------------------------------------------
class LocalStream:
    """An in-process sample stream: ``post``/``flush`` on one side, ``consume_to``/``consume`` on the other.

    Messages are pickled on flush, as a transport would send them.
    """

    def __init__(self) -> None:
        self._posted: list[Any] = []
        self._sent: deque[bytes] = deque()
        self.closed = False

    def post(self, sample: Any) -> None:
        self._posted.append(sample)

    def flush(self) -> None:
        self._sent.extend(pickle.dumps(s) for s in self._posted)
        self._posted.clear()

    def consume_to(self, buffer: Any, max_iter: int = 16) -> int:
        n = 0
        while self._sent and n < max_iter:
            buffer.put(pickle.loads(self._sent.popleft()))
            n += 1
        return n

    def consume(self) -> Any:
        if not self._sent:
            raise NothingToConsume()
        return pickle.loads(self._sent.popleft())

    def close(self) -> None:
        self.closed = True


def coalesced(ids: list[int], k: int) -> ConduitSampleConsumer:
    """A consumer with messages of ``k`` samples waiting (the given ids, in order)."""
    stream = LocalStream()
    p = ConduitSampleProducer([stream], policy=StreamPolicy(coalesce=k, max_delay_s=0))
    for i in ids:
        p.post(make_sample([i]))
    p.flush()
    assert p.messages == [-(-len(ids) // k)]
    return ConduitSampleConsumer(stream)


class RefusingBuffer:
    """A plain (non-Conduit) buffer that holds at most ``limit`` samples and refuses more."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: list[Any] = []

    def put(self, x: Any) -> None:
        if len(self.items) >= self.limit:
            raise OverflowError(f"full ({self.limit} samples)")
        self.items.append(x)


# -- the consumer's close: the rest of a coalesced message ------------------------------------------------
def test_consumer_close_returns_the_rest_of_a_message_consume_returned_in_part() -> None:
    c = coalesced([0, 1, 2], k=3)
    assert ids_of([c.consume()]) == [0]
    left = c.close()
    assert ids_of(left) == [1, 2], "close() dropped samples that had already been received"
    assert all(np.asarray(s.obs).shape == (4, 3) for s in left), "left-over samples are [T, ...] samples"
    assert c.inner.closed
    assert c.close() == [], "a second close() returns nothing more"


def test_consumer_close_with_nothing_left_over_returns_an_empty_list() -> None:
    c = coalesced([0, 1, 2], k=3)
    assert ids_of([c.consume(), c.consume(), c.consume()]) == [0, 1, 2]
    assert c.close() == []


# -- consume_to: a buffer that refuses part of a message ---------------------------------------------------
def test_a_plain_buffer_refusing_part_way_gets_the_unstored_samples_in_a_typed_error() -> None:
    c = coalesced([0, 1, 2, 3, 4], k=5)
    buffer = RefusingBuffer(limit=2)
    with pytest.raises(UnstoredSamplesError, match="2 of its 5 samples were stored") as info:
        c.consume_to(buffer, max_iter=8)
    err = info.value
    assert (err.stored, err.total) == (2, 5)
    assert ids_of(buffer.items) == [0, 1]
    assert ids_of(err.samples) == [2, 3, 4], "the samples the buffer did not store were lost"
    assert isinstance(err.__cause__, OverflowError)
    buffer.limit = 10  # the cause dealt with: the samples can be put again, nothing lost or repeated
    for s in err.samples:
        buffer.put(s)
    assert ids_of(buffer.items) == [0, 1, 2, 3, 4]
    c.close()


def test_left_over_samples_refused_by_consume_to_are_in_the_typed_error() -> None:
    c = coalesced([0, 1, 2], k=3)
    assert ids_of([c.consume()]) == [0]
    buffer = RefusingBuffer(limit=1)
    with pytest.raises(UnstoredSamplesError) as info:
        c.consume_to(buffer, max_iter=8)
    assert ids_of(buffer.items) == [1]
    assert (info.value.stored, ids_of(info.value.samples)) == (1, [2])
    assert c.close() == [], "the unstored samples were handed out in the error, not kept twice"


def test_a_message_larger_than_a_conduit_buffers_capacity_is_stored_like_single_puts() -> None:
    c = coalesced(list(range(6)), k=6)
    buffer = ConduitBuffer(batch_size=2, capacity=4)
    reference = ConduitBuffer(batch_size=2, capacity=4)
    try:
        assert c.consume_to(buffer, max_iter=8) == 6  # was CapacityError: all 6 received samples lost
        for i in range(6):
            reference.put(make_sample([i]))
        buffer.flush()  # (both stored before delivering: eviction then does not race with background storing)
        reference.flush()
        assert buffer.stats()["queue_dropped"] == reference.stats()["queue_dropped"] == 2
        got, want = [], []
        while not reference.empty():
            want.extend(entry_ids(reference.get()).tolist())
        while not buffer.empty():
            got.extend(entry_ids(buffer.get()).tolist())
        assert want == [2, 3, 4, 5], "the reference buffer did not keep the newest samples"
        assert got == want, "a coalesced message is not stored as its single samples would be"
    finally:
        c.close()
        buffer.close()
        reference.close()


def test_an_on_policy_buffer_refusing_part_of_a_message_reports_exactly_what_was_not_stored() -> None:
    c = coalesced(list(range(6)), k=6)
    buffer = ConduitBuffer(semantics="on_policy", capacity=4, num_minibatches=1)
    try:
        with pytest.raises(UnstoredSamplesError, match="4 of its 6 samples were stored") as info:
            c.consume_to(buffer, max_iter=8)
        assert isinstance(info.value.__cause__, CapacityError)
        assert ids_of(info.value.samples) == [4, 5]
        buffer.seal()
        assert sorted(entry_ids(buffer.get()).tolist()) == [0, 1, 2, 3]
        for s in info.value.samples:  # room again: the rest can be put, nothing lost or repeated
            buffer.put(s)
        buffer.seal()
        assert sorted(entry_ids(buffer.get()).tolist()) == [4, 5]
        assert buffer.empty()
    finally:
        c.close()
        buffer.close()
