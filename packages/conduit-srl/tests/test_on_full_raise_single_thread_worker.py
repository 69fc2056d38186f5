"""``on_full="raise"``: an on-policy Conduit buffer in SRL's single-threaded buffer worker.

SRL's buffer worker runs ``consume_to`` (which puts) and ``get`` on one thread, its poll loop. A put
into a full on-policy buffer waited for room that only a ``get`` on that same thread could make, so
the worker hung for ever once more than ``capacity`` samples arrived in one poll. ``on_full="raise"``
declares a single-threaded host: put never waits, it raises :class:`BufferFullError` (nothing of it
stored beyond what it says); a claimed stream's consumer keeps such refused samples and puts them
first on its next ``consume_to``, so the poll loop goes on and nothing is lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conduit import CapacityError, ConfigurationError
from conduit.testing.lifecycle import eventually
from conduit_srl import BufferFullError, ConduitBuffer, ConduitSampleConsumer, UnstoredSamplesError
from conduit_srl.streams import pack
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer, run_buffer_worker
from conduit_srl.testing.records import make_sample

BOUND_S = 60.0  # a generous bound on calls that must return (they take well under a second)


def bounded(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a daemon thread and return its result (or raise its error); fail if it does not return."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), "the call did not return: a put waits for room only this thread's get could make"
    if err:
        raise err[0]
    return out[0]


def ids_of(entry: Any) -> list[int]:
    """The sample ids of an entry, sorted (on-policy shuffles a rollout within each epoch)."""
    return sorted(np.asarray(entry.sample.id)[0].tolist())


class ListConsumer:
    """SRL's consumer call pattern without a transport: ``consume_to`` puts up to ``max_iter`` waiting samples."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = list(samples)

    def consume_to(self, buffer: Any, max_iter: int = 64) -> int:
        count = 0
        while self.samples and count < max_iter:
            buffer.put(self.samples[0])  # a put that raises leaves the sample with the "transport"
            self.samples.pop(0)
            count += 1
        return count


def poll_loop(consumer: Any, buffer: ConduitBuffer, expected: int, *, polls: int = 20_000) -> list[list[int]]:
    """SRL's buffer-worker poll loop on one thread: ``consume_to`` then deliver while not empty (a 1 ms sleep when
    nothing moved), until ``expected`` samples were delivered or ``polls`` polls ran."""
    delivered: list[list[int]] = []
    for _ in range(polls):
        moved = consumer.consume_to(buffer, max_iter=64)
        while not buffer.empty():
            delivered.append(ids_of(buffer.get()))
            moved = True
        if sum(map(len, delivered)) >= expected:
            break
        if not moved:
            time.sleep(0.001)
    return delivered


def on_policy(**kw: Any) -> ConduitBuffer:
    args: dict[str, Any] = dict(semantics="on_policy", capacity=8, rollout_size=4, num_minibatches=1,
                                pin_memory=False)
    args.update(kw)
    return ConduitBuffer(**args)


def test_single_thread_poll_loop_gets_a_typed_error_instead_of_waiting_for_ever() -> None:
    """24 samples waiting, one consume_to(max_iter=64) puts them on the poll loop's thread: the 9th does not fit.
    It used to wait for a get() only this thread could call; with on_full="raise" it raises BufferFullError."""
    buffer = on_policy(on_full="raise")
    try:
        consumer = ListConsumer([make_sample([i]) for i in range(24)])
        with pytest.raises(BufferFullError) as caught:
            bounded(lambda: poll_loop(consumer, buffer, 24))
        assert isinstance(caught.value, CapacityError)
        assert caught.value.samples_stored == 0  # type: ignore[attr-defined]
        assert "get()" in str(caught.value) and "capacity" in str(caught.value)
        assert len(consumer.samples) == 16, "the refused sample stays with the transport"
        assert buffer.qsize() == 8 and buffer.stats()["samples_put"] == 8
        # the same thread makes room and goes on: every sample once, in order
        delivered = bounded(lambda: [ids_of(buffer.get()) for _ in range(2)])
        delivered += bounded(lambda: poll_loop(_Resuming(consumer), buffer, 16))
        assert sum(delivered, []) == list(range(24))
    finally:
        buffer.close()


class _Resuming:
    """Re-runs ``consume_to`` after a BufferFullError once the loop made room (what a careful host does)."""

    def __init__(self, inner: ListConsumer) -> None:
        self.inner = inner

    def consume_to(self, buffer: Any, max_iter: int = 64) -> int:
        try:
            return self.inner.consume_to(buffer, max_iter)
        except BufferFullError:
            return 0


def test_run_buffer_worker_with_on_full_raise_returns_the_typed_error_not_a_timeout() -> None:
    """The driver's buffer-worker loop (one thread: consume_to, then get while not empty) with a buffer too small
    for a poll: it raises BufferFullError, or (samples arriving a few per poll) re-posts each sample once; before,
    it ran into its timeout with the worker thread left waiting."""
    upstream = [make_sample([i]) for i in range(24)]
    buffer = on_policy(on_full="raise")
    downstream = ConduitBuffer(semantics="queue", batch_size=1, capacity=64, pin_memory=False)
    try:
        try:
            reposted, reached = bounded(lambda: run_buffer_worker(upstream, buffer, downstream, timeout_s=30.0))
        except BufferFullError:
            pass
        else:
            assert reposted == reached == 24
            got = [ids_of(downstream.get())[0] for _ in range(24)]
            assert sorted(got) == list(range(24))  # (on-policy shuffles within a rollout)
    finally:
        buffer.close()
        downstream.close()


def test_a_refused_put_leaves_the_buffer_unchanged_and_the_rollout_plan_intact() -> None:
    buffer = on_policy(on_full="raise")
    try:
        for i in range(8):
            buffer.put(make_sample([i]))
        before = (buffer.qsize(), buffer.stats(), len(buffer))
        with pytest.raises(BufferFullError):
            buffer.put(make_sample([8]))
        assert (buffer.qsize(), buffer.stats(), len(buffer)) == before
        assert ids_of(buffer.get()) == [0, 1, 2, 3]
        for i in range(8, 12):
            buffer.put(make_sample([i]))
        got = [ids_of(buffer.get()) for _ in range(2)]
        assert got == [[4, 5, 6, 7], [8, 9, 10, 11]], "the refused sample did not start its rollout afresh"
        assert buffer.empty()
    finally:
        buffer.close()


def test_a_batched_put_that_completes_a_rollout_stores_through_its_end_and_says_so() -> None:
    buffer = on_policy(on_full="raise")
    try:
        buffer.put_batch(make_sample([0, 1, 2, 3], batched=True))
        buffer.put_batch(make_sample([4, 5, 6], batched=True))
        with pytest.raises(BufferFullError) as caught:
            buffer.put_batch(make_sample([7, 8, 9], batched=True))
        assert caught.value.samples_stored == 1  # type: ignore[attr-defined]
        assert "first 1" in str(caught.value)
        assert buffer.stats()["samples_put"] == 8
        assert ids_of(buffer.get()) == [0, 1, 2, 3]
        buffer.put_batch(make_sample([8, 9], batched=True))
        assert ids_of(buffer.get()) == [4, 5, 6, 7]
        assert buffer.empty() and buffer.qsize() == 2
    finally:
        buffer.close()


def test_a_rollout_that_can_never_fit_still_raises_capacity_error() -> None:
    """Nothing sealed and nothing deliverable: room can never come, on_full or not (the existing refusal)."""
    buffer = on_policy(on_full="raise", rollout_size=None, capacity=4)
    try:
        buffer.put_batch(make_sample([0, 1, 2, 3], batched=True))
        with pytest.raises(CapacityError) as caught:
            buffer.put(make_sample([4]))
        assert not isinstance(caught.value, BufferFullError)
        assert "seal" in str(caught.value)
    finally:
        buffer.close()


@pytest.mark.parametrize("args, words", [
    (dict(on_full="drop"), "'wait' or 'raise'"),
    (dict(on_full="raise", prefetch=1), "prefetch=0"),
])
def test_on_full_arguments_are_checked(args: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigurationError, match=words):
        on_policy(**args)


def test_on_full_is_refused_where_storage_evicts_instead() -> None:
    with pytest.raises(ConfigurationError, match="on_policy"):
        ConduitBuffer(semantics="queue", batch_size=2, on_full="raise", pin_memory=False)


def test_on_full_raise_prepares_nothing_ahead_and_survives_a_checkpoint() -> None:
    import pickle

    buffer = on_policy(on_full="raise", num_minibatches=2)
    assert buffer.config.resolved_prefetch == 0
    try:
        for i in range(8):
            buffer.put(make_sample([i]))
        assert len(ids_of(buffer.get())) == 2
        copy = pickle.loads(pickle.dumps(buffer))
        try:
            with pytest.raises(BufferFullError):
                copy.put(make_sample([8]))
            assert copy.config.on_full == "raise"
        finally:
            copy.close()
    finally:
        buffer.close()


def test_a_claimed_stream_keeps_refused_samples_and_the_poll_loop_moves_every_sample_once() -> None:
    """SRL's buffer worker over a claimed stream (Conduit's consumer over a real ZMQ socket), on one thread: the
    consumer holds back what the full buffer refused, puts it first next poll, and nothing is lost or repeated,
    however the 32 samples (some coalesced 3 to a message) are split across polls."""
    socket = ZmqSampleConsumer()
    consumer = ConduitSampleConsumer(socket)
    producer = ZmqSampleProducer(socket.address)
    buffer = on_policy(on_full="raise")
    try:
        for start in range(0, 18, 3):
            producer.post(pack([make_sample([i]) for i in range(start, start + 3)]))
        for i in range(18, 32):
            producer.post(make_sample([i]))
        producer.flush()
        delivered = bounded(lambda: poll_loop(consumer, buffer, 32))
        assert sum(delivered, []) == list(range(32)), "lost, repeated or reordered samples"
        assert buffer.qsize() == 0
        assert consumer.close() == []
    finally:
        producer.close()
        consumer.close()
        buffer.close()


def test_a_held_back_sample_is_returned_by_close_not_lost() -> None:
    socket = ZmqSampleConsumer()
    consumer = ConduitSampleConsumer(socket)
    producer = ZmqSampleProducer(socket.address)
    buffer = on_policy(on_full="raise", capacity=4)
    try:
        for i in range(6):
            producer.post(make_sample([i]))
        producer.flush()
        put = 0
        deadline = time.monotonic() + BOUND_S  # (a wait for the transport, only reached when samples never arrive)
        while True:  # until the 5th sample arrived and was refused
            put += bounded(lambda: consumer.consume_to(buffer, max_iter=64))
            if (put == 4 and consumer._backlog) or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        assert put == 4 and consumer._backlog, f"{put} samples put, held back: {consumer._backlog}"
        left = consumer.close()
        assert [int(np.asarray(s.id)[0]) for s in left] == [4]
    finally:
        producer.close()
        consumer.close()
        buffer.close()


def test_other_refusals_still_raise_unstored_samples_error() -> None:
    """Only BufferFullError is held back: a refusal that a retry cannot fix still raises, carrying the sample."""
    consumer = ConduitSampleConsumer(ListConsumer([make_sample([0]), make_sample([1], dim=5)]))
    buffer = on_policy(on_full="raise")
    try:
        with pytest.raises(UnstoredSamplesError) as caught:
            consumer.consume_to(buffer)
        assert len(caught.value.samples) == 1 and buffer.stats()["samples_put"] == 1
    finally:
        consumer.close()
        buffer.close()


def test_empty_drops_rollouts_too_stale_to_deliver_and_so_makes_room() -> None:
    """What BufferFullError says: room also comes from empty(), which drops rollouts a version change made stale."""
    buffer = on_policy(on_full="raise")
    try:
        for i in range(8):
            buffer.put(make_sample([i], version=0))
        with pytest.raises(BufferFullError):
            buffer.put(make_sample([8], version=1))
        buffer.set_policy_version(1)  # max_staleness=0: both stored rollouts are stale now
        assert buffer.empty()
        for i in range(8, 12):
            buffer.put(make_sample([i], version=1))
        assert ids_of(buffer.get()) == [8, 9, 10, 11]
        assert buffer.stats()["rollout_dropped"] == 8
    finally:
        buffer.close()


def test_a_queue_rewind_runs_under_the_planes_lock_so_no_eviction_goes_uncounted(monkeypatch) -> None:
    """Found in this review: when eviction took a batch Conduit had prepared ahead, the queue's cursor was rewound
    outside the plane's lock. A background store that had just evicted (storage moved on) but not yet counted what
    it evicted past the cursor (its on_append, in the same lock hold) then counted nothing: the rewind had moved
    the cursor past those items. In a stress run (a producer thread putting 1-8 samples at a time into a capacity
    of 8, prefetch 2), about 1 run in 150 ended with up to 8 samples neither delivered, nor in queue_dropped, nor
    in qsize(). The rewind now holds the plane's lock."""
    from conduit_srl.fifo import FifoSampler

    held: list[bool] = []
    buffer = ConduitBuffer(semantics="queue", batch_size=1, capacity=4, prefetch=0, pin_memory=False,
                           overlap=True)  # (Conduit selects ahead)
    real = FifoSampler.rewind

    def rewind(self: FifoSampler) -> None:
        assert buffer.edp is not None
        held.append(buffer.edp.holds_lock())
        real(self)

    monkeypatch.setattr(FifoSampler, "rewind", rewind)
    try:
        buffer.put(make_sample([0]))
        buffer.put(make_sample([1]))
        buffer.flush()
        assert ids_of(buffer.get()) == [0]
        fifo = buffer._a._fifo()
        assert eventually(lambda: fifo._selected == 2, timeout=BOUND_S)  # Conduit's worker selected [1] ahead
        for i in range(2, 8):  # evicts 0..3: the prepared [1] is discarded, 2 and 3 were never selected
            buffer.put(make_sample([i]))
        buffer.flush()
        got = [ids_of(buffer.get())[0] for _ in range(4)]
        assert got == [4, 5, 6, 7]
        assert held and all(held), "the queue cursor was rewound outside the plane's lock"
        assert buffer.stats()["queue_dropped"] == 3 and buffer.qsize() == 0 and buffer.empty()
    finally:
        buffer.close()


def test_a_put_during_a_get_that_frees_the_last_rollout_waits_instead_of_a_false_capacity_error() -> None:
    """Found in this review: SRL's trainer puts on its main thread while the training thread's get() delivers.
    Between the get taking a rollout's last minibatch and freeing its storage, a put that did not fit saw no
    rollout left to deliver and raised CapacityError ("nothing can be delivered to make room"), although the
    room was a moment away: the consuming thread died and the sample it had received was lost. That refusal is
    now decided only while no delivery is in flight; the put waits for the room instead."""
    buffer = on_policy(capacity=3, rollout_size=2, prefetch=0)
    inside, go = threading.Event(), threading.Event()
    try:
        for i in range(3):
            buffer.put(make_sample([i]))
        assert ids_of(buffer.get()) == [0, 1]
        for i in range(3, 5):  # [2, 3] sealed, [4] open: storage full
            buffer.put(make_sample([i]))
        buffer.flush()
        edp = buffer.edp
        assert edp is not None
        real_release = edp.release_now

        def release_now(sel: Any, **kw: Any) -> None:  # the training thread, between taking [2, 3] and freeing it
            inside.set()
            go.wait(BOUND_S)
            real_release(sel, **kw)

        edp.release_now = release_now  # type: ignore[method-assign,assignment]
        waited = threading.Event()
        real_runs = buffer._a._runs_with_room

        def runs_with_room(plan: Any, *, stored_before: int) -> Any:
            runs = real_runs(plan, stored_before=stored_before)
            if runs is None:
                waited.set()
            return runs

        buffer._a._runs_with_room = runs_with_room  # type: ignore[method-assign]
        got: list[list[int]] = []
        outcome: list[BaseException | None] = []

        def put() -> None:
            try:
                buffer.put(make_sample([5]))
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - checked below
                outcome.append(e)

        training = threading.Thread(target=lambda: got.append(ids_of(buffer.get())), daemon=True)
        training.start()
        assert inside.wait(BOUND_S)
        main = threading.Thread(target=put, daemon=True)
        main.start()
        assert eventually(lambda: waited.is_set() or not main.is_alive(), timeout=BOUND_S)
        assert not outcome, f"the put did not wait for the delivery in flight: {outcome}"
        go.set()
        training.join(BOUND_S)
        main.join(BOUND_S)
        assert not training.is_alive() and not main.is_alive()
        assert outcome == [None] and got == [[2, 3]]
        assert ids_of(buffer.get()) == [4, 5]
    finally:
        go.set()
        buffer.close()
