"""``get()`` beside an assembler that slips in aged entries, and refused samples taken off a native stream.

1. ``get()`` let go of the delivery lock between discarding an entry assembled ahead that had aged and its
   next try. The assembler thread, still filling its ``prefetch`` entries, took the lock in that gap and put
   another entry in front of ``get()``, which could age in turn (priority updates from another thread), so
   ``get()`` went round discarding entries for as long as that went on instead of delivering for itself.
   The gap is widened here by a hook on the delivery lock: when ``get()``'s thread comes back for it, the
   assembler is let through once and two priority updates age what it assembled.
2. ``on_full="raise"`` over SRL's own sample streams: SRL's ``consume_to`` takes a message off its socket and
   then calls ``put``; a full buffer refused it with ``BufferFullError`` saying "put the samples not stored
   again", but nothing held them any more: the sample was gone. The refused sample now leaves with the error
   (``error.sample``), so the host that meets the error can put it again. Reproduced with the package's own
   ZMQ stream driver (a consumer that takes the message off the socket before it puts, as SRL's does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conduit_srl import BufferFullError, ConduitBuffer
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

#: a bound on waits that is reached only when something hangs
HANG_S = 30.0


def _ids(entry: Any) -> list[int]:
    return sorted(np.asarray(entry.sample.id)[0].tolist())


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + HANG_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.001)


class _HookedLock:
    """A lock that runs ``before(thread_name)`` ahead of each blocking acquire (the real lock does the locking)."""

    def __init__(self, lock: Any, before: Callable[[str], None]) -> None:
        self._lock = lock
        self._before = before

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking:
            self._before(threading.current_thread().name)
        return bool(self._lock.acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- 1. get() keeps the delivery lock until it has an entry to hand out ------------------------------------------
def test_get_is_not_held_in_a_loop_by_entries_the_assembler_slips_in_after_an_aged_one(closing) -> None:
    rounds = 10
    b = closing(semantics="prioritized", batch_size=2, capacity=32, prefetch=1, alpha=1.0, seed=1, pin_memory=False)
    a = b._a
    for i in range(16):
        b.put(make_sample([i]))
    b.flush()

    permits = threading.Semaphore(0)  # the assembler's acquisitions after its first one wait for a permit
    open_gate = threading.Event()
    counts = {"assembler": 0, "getter": 0}
    failures: list[str] = []

    def age_ready_entry() -> None:  # more than prefetch (1) priority updates since it was assembled
        for _ in range(2):
            b.update_priorities(np.array([0, 1]), np.array([1.0, 1.0]))

    def before(name: str) -> None:
        if name == "conduit-srl-assembler":
            counts["assembler"] += 1
            if counts["assembler"] > 1 and not open_gate.is_set():
                if not permits.acquire(timeout=HANG_S) and not open_gate.is_set():
                    failures.append("the assembler was never let through")
        elif name == "getter":
            counts["getter"] += 1
            if 1 < counts["getter"] <= rounds + 1:  # get() came back for the lock after discarding an entry
                permits.release()  # the assembler takes the lock first and assembles one more entry
                _wait_for(lambda: len(a._ready) == 1, "the assembler's next entry")
                age_ready_entry()

    a._deliver_lock = _HookedLock(a._deliver_lock, before)
    first = b.get()  # (arms the assembler: it assembles one entry ahead, then waits at the gate)
    assert len(_ids(first)) == 2
    _wait_for(lambda: len(a._ready) == 1, "the entry assembled ahead")
    age_ready_entry()
    redrawn = b.stats()["redrawn"]

    got: list[Any] = []
    errors: list[BaseException] = []

    def getter() -> None:
        try:
            got.append(b.get())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=getter, name="getter", daemon=True)
    t.start()
    t.join(HANG_S * (rounds + 2))
    open_gate.set()
    for _ in range(rounds + 2):
        permits.release()
    assert not t.is_alive(), "get() did not return"
    assert not errors and not failures, (errors, failures)
    assert len(_ids(got[0])) == 2
    extra = b.stats()["redrawn"] - redrawn
    assert extra == 1, (f"get() discarded {extra} entries assembled ahead: after the aged one it let the assembler "
                        f"slip in {extra - 1} more that aged in turn, instead of delivering for itself")
    assert counts["getter"] == 1, f"get() let go of the delivery lock {counts['getter'] - 1} times between tries"


# -- 2. on_full="raise" over SRL's own stream: the refused sample is handed back ------------------------------------
def _on_policy_raise(**kw: Any) -> ConduitBuffer:
    args: dict[str, Any] = dict(semantics="on_policy", capacity=8, rollout_size=4, num_minibatches=1,
                                on_full="raise", pin_memory=False)
    args.update(kw)
    return ConduitBuffer(**args)


def test_a_refused_sample_taken_off_a_native_stream_leaves_with_the_error_and_can_be_put_again() -> None:
    """SRL's native consume_to (the driver's ZMQ consumer) takes each message off its socket, then puts it: the 9th
    of 12 does not fit. The error carries that sample, the host puts it again after get() made room, and every
    sample is delivered once, in order."""
    socket = ZmqSampleConsumer()
    producer = ZmqSampleProducer(socket.address)
    buffer = _on_policy_raise()
    try:
        for i in range(12):
            producer.post(make_sample([i]))
        producer.flush()
        put = 0
        end = time.monotonic() + HANG_S
        with pytest.raises(BufferFullError) as caught:
            while True:  # (the messages arrive over TCP: poll until the refusal)
                put += socket.consume_to(buffer, max_iter=64)
                assert time.monotonic() < end, f"only {put} samples arrived"
                time.sleep(0.001)
        err = caught.value
        assert buffer.stats()["samples_put"] == 8
        assert socket.received == 9, "the 9th message left the socket"
        refused = getattr(err, "sample", None)
        assert refused is not None, ("the refused sample was taken off the socket and is neither in the buffer nor "
                                     "in the error: lost")
        assert int(np.asarray(refused.id)[0]) == 8 and err.samples_stored == 0  # type: ignore[attr-defined]
        assert ".sample" in str(err)
        delivered = [_ids(buffer.get())]
        buffer.put(refused)  # what the error says to do, once get() made room
        while len(delivered) < 3:
            put += socket.consume_to(buffer, max_iter=64)
            while not buffer.empty():
                delivered.append(_ids(buffer.get()))
            assert time.monotonic() < end, f"delivered {delivered}"
        assert sum(delivered, []) == list(range(12)), "lost, repeated or reordered samples"
        assert socket.received == 12 and buffer.stats()["samples_put"] == 12
    finally:
        producer.close()
        socket.close()
        buffer.close()


def test_a_batched_put_refused_in_part_carries_the_sample_and_how_much_of_it_was_taken() -> None:
    buffer = _on_policy_raise()
    try:
        buffer.put_batch(make_sample([0, 1, 2, 3], batched=True))
        buffer.put_batch(make_sample([4, 5, 6], batched=True))
        sample = make_sample([7, 8, 9], batched=True)
        with pytest.raises(BufferFullError) as caught:
            buffer.put_batch(sample)
        assert caught.value.sample is sample and caught.value.samples_stored == 1  # type: ignore[attr-defined]
        assert _ids(buffer.get()) == [0, 1, 2, 3]
        buffer.put_batch(sample[:, caught.value.samples_stored:])  # type: ignore[attr-defined]
        assert _ids(buffer.get()) == [4, 5, 6, 7]
        assert buffer.empty() and buffer.stats()["samples_put"] == 10
    finally:
        buffer.close()
