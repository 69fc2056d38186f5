"""Streams, refusals and clean-up: the SRL adapter as a demanding SRL user drives it.

Coalesced streams into a buffer whose puts are batched ``[T, B, ...]`` samples, stream policies that
no stream could use (or that a multi-agent stream would garble), batch sizes given as NumPy integers,
and what is left behind: sockets of a producer build that failed, threads of a refused restore, and
driver runs held past their bound by a put that waits for room.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

import conduit_srl
import numpy as np
import pytest
from conduit import ConfigurationError
from conduit.testing.lifecycle import eventually
from conduit_srl import (
    ConduitBuffer,
    ConduitSampleConsumer,
    ConduitSampleProducer,
    StreamClaimError,
    StreamPolicy,
    UnstoredSamplesError,
)
from conduit_srl.testing import entry_ids, make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

sys.path.insert(0, str(Path(__file__).parent))
from test_driver_close import call_until_stuck  # noqa: E402, I001  (sibling test helpers)
from test_stream_close_and_coalescing import receive  # noqa: E402, I001


# -- coalescing into a buffer whose puts are [T, B, ...] -----------------------------------------------
def test_coalesced_batched_samples_reach_a_batched_puts_buffer_as_their_own_columns(closing: Any) -> None:
    """A buffer worker that posts ``[T, B, ...]`` batches (SRL's ``unpack_batch_before_post=False``) to a
    trainer whose Conduit buffer has ``batched_puts=True``, over a coalescing stream.

    The consumer handed the coalesced ``[T, k, B, ...]`` message to ``put_batch``, which read ``k`` as the
    batch axis: the buffer stored ``k`` samples of shape ``[T, B, ...]`` instead of ``k * B`` samples
    (and a message sent alone afterwards was refused as another schema).
    """
    stream = ZmqSampleConsumer()
    producer = ConduitSampleProducer([ZmqSampleProducer(stream.address)],
                                     policy=StreamPolicy(coalesce=2, max_delay_s=10.0))
    consumer = ConduitSampleConsumer(stream)
    buffer = closing(semantics="queue", batch_size=6, capacity=64, batched_puts=True, pin_memory=False)
    try:
        for i in range(3):  # two stacked into one message, the third sent alone at close
            producer.post(make_sample([2 * i, 2 * i + 1], time_steps=3, batched=True))
        producer.flush()
        producer.close()
        assert receive(consumer, buffer, 3) == 3  # the posted samples, each [T, B=2, ...]
        entry = buffer.get()
        assert entry.sample.id.shape == (3, 6)
        assert entry.sample.obs.shape == (3, 6, 3)
        assert entry_ids(entry).tolist() == [0, 1, 2, 3, 4, 5]
        assert buffer.stats()["samples_put"] == 6
    finally:
        assert consumer.close() == []


def test_a_batched_sample_a_conduit_buffer_took_in_part_is_carried_without_its_stored_columns() -> None:
    """On-policy, ``rollout_size=2``, ``batched_puts=True``: the second ``[T, 3, ...]`` sample of a coalesced
    message completes a rollout with its first column, then waits for room; the buffer is closed meanwhile.

    Its put says ``samples_stored=1``; the typed error carried the whole sample (ids 3, 4, 5), so putting
    the carried samples again would have stored id 3 twice.
    """
    stream = ZmqSampleConsumer()
    producer = ConduitSampleProducer([ZmqSampleProducer(stream.address)],
                                     policy=StreamPolicy(coalesce=2, max_delay_s=10.0))
    consumer = ConduitSampleConsumer(stream)
    buffer = ConduitBuffer(semantics="on_policy", capacity=4, rollout_size=2, num_minibatches=1,
                           batched_puts=True, pin_memory=False)
    errors: list[BaseException] = []

    def trainer_main_thread() -> None:
        try:
            receive(consumer, buffer, 2)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=trainer_main_thread, daemon=True)
    try:
        producer.post(make_sample([0, 1, 2], time_steps=2, batched=True))
        producer.post(make_sample([3, 4, 5], time_steps=2, batched=True))
        producer.close()
        thread.start()
        deadline = time.monotonic() + 20.0
        while buffer.stats()["samples_put"] < 4:  # 0, 1, 2, then 3 (which completes the second rollout)
            assert thread.is_alive() and time.monotonic() < deadline, errors
            time.sleep(0.002)
        buffer.close()  # the rest of the put (4, 5) waits for room that never comes
        thread.join(20.0)
        assert not thread.is_alive(), "closing the buffer left consume_to waiting"
        assert len(errors) == 1 and isinstance(errors[0], UnstoredSamplesError), errors
        err = errors[0]
        assert err.stored == 1 and err.total == 2
        assert [np.asarray(s.id)[0].tolist() for s in err.samples] == [[4, 5]], "stored columns carried again"
    finally:
        buffer.close()
        consumer.close()


# -- install: stream policies that would be silently unused or fail in the actor ---------------------------
@pytest.mark.parametrize("kwargs", [
    {"stream_policies": {"conduit:traj": StreamPolicy(coalesce=3)}},  # keyed by the claimed name: never used
    {"stream_policies": {"traj": {"coalesce": 3}}},  # not a StreamPolicy: the actor's first flush raised
    {"stream_policy": {"coalesce": 3}},
    {"stream_policies": [StreamPolicy()]},
])
def test_install_refuses_stream_policies_no_stream_could_use_and_changes_nothing(srl_layout, kwargs) -> None:
    """``stream_policies={"conduit:traj": ...}`` was accepted and silently ignored (the stream ``conduit:traj``
    looks its policy up as ``traj``); a dict instead of a StreamPolicy was accepted and every flush of the
    actor's producer raised an AttributeError."""
    layout = srl_layout("distributed")
    buffers = layout["base.buffer"]
    streams = layout["distributed.system.sample_stream"]
    before = (buffers.make_buffer, streams.make_producer, streams.make_consumer)
    with pytest.raises(ConfigurationError, match="StreamPolicy|bare name"):
        conduit_srl.install(**kwargs)
    assert conduit_srl.installed() is None
    assert (buffers.make_buffer, streams.make_producer, streams.make_consumer) == before


def test_install_uses_the_policy_keyed_by_the_bare_stream_name(srl_layout) -> None:
    layout = srl_layout("distributed")
    streams = layout["distributed.system.sample_stream"]
    cfg = layout["api.config"]
    policy = StreamPolicy(coalesce=3, max_delay_s=1.0)
    conduit_srl.install(stream_policies={"traj": policy})
    trainer = streams.make_consumer("conduit:traj", cfg.WorkerInformation())
    producer = streams.make_producer("conduit:traj", cfg.WorkerInformation())
    try:
        assert producer.policy is policy
    finally:
        producer.close()
        trainer.close()


def test_a_producer_built_with_a_policy_that_is_not_a_stream_policy_is_refused() -> None:
    stream = ZmqSampleConsumer()
    target = ZmqSampleProducer(stream.address)
    try:
        with pytest.raises(ConfigurationError, match="StreamPolicy"):
            ConduitSampleProducer([target], policy={"coalesce": 2})  # type: ignore[arg-type]
    finally:
        target.close()
        stream.close()


# -- get(batch_size) with a NumPy integer -------------------------------------------------------------
def test_replay_get_takes_a_batch_size_computed_with_numpy(closing) -> None:
    """``get(np.int64(3))`` was refused with "batch size must be a positive int, got np.int64(3)" while
    ``get(np.int64(2))`` (the configured size) was taken: a trainer sizing its draws with NumPy failed."""
    b = closing(semantics="replay", batch_size=2, capacity=8, pin_memory=False)
    for i in range(4):
        b.put(make_sample([i]))
    b.flush()
    entry = b.get(np.int64(3))
    assert entry.sample.id.shape == (4, 3)
    assert set(entry_ids(entry).tolist()) <= {0, 1, 2, 3}
    assert b.get().sample.id.shape == (4, 2), "the configured batch size changed"
    with pytest.raises(ConfigurationError, match="positive int"):
        b.get(np.int64(0))
    with pytest.raises(ConfigurationError, match="positive int"):
        b.get(np.float64(3.0))


# -- restoring a damaged checkpoint ------------------------------------------------------------------------
def test_a_damaged_checkpoint_raises_and_leaves_no_thread_behind(closing) -> None:
    """SRL's ``load_buffer_on_restart`` unpickles a saved buffer. A damaged one raised a typed error but
    left the data plane it had started for it running (a ``conduit-prefetch`` thread per attempt)."""
    b = closing(semantics="queue", batch_size=2, capacity=8, pin_memory=False)
    for i in range(4):
        b.put(make_sample([i]))
    b.flush()
    restore, (srl_base, state) = b.__reduce__()  # what pickle.loads calls
    before = set(threading.enumerate())
    damaged = {**state, "edp": {**state["edp"], "format": 99}}
    for _ in range(3):
        with pytest.raises(ConfigurationError, match="checkpoint"):
            restore(srl_base, damaged)
    left = [t for t in threading.enumerate() if t not in before]
    assert not left, f"threads left behind by refused restores: {left}"
    good = restore(srl_base, state)  # the undamaged checkpoint still restores
    try:
        assert entry_ids(good.get()).tolist() == [0, 1]
    finally:
        good.close()


# -- a claimed producer whose targets cannot all be built -----------------------------------------------
def test_a_claimed_producer_that_cannot_reach_every_trainer_closes_the_sockets_it_opened(srl_layout,
                                                                                        monkeypatch) -> None:
    """Three trainers registered; the native producer for the third fails (its name-resolve entry expired
    meanwhile). The error propagated, but the two PUSH sockets already opened stayed open, unreachable."""
    layout = srl_layout("distributed")
    ss = layout["distributed.system.sample_stream"]
    cfg = layout["api.config"]
    conduit_srl.install()
    trainers = [ss.make_consumer("conduit:traj", cfg.WorkerInformation(worker_index=i)) for i in range(3)]
    opened: list[Any] = []
    native = ss.NameResolvingSampleProducer

    class Expiring(native):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs["rank"] == 2:
                raise ConnectionError("name-resolve entry of trainer 2 expired")
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(ss, "NameResolvingSampleProducer", Expiring)
    try:
        with pytest.raises(ConnectionError, match="expired"):
            ss.make_producer("conduit:traj", cfg.WorkerInformation(worker_index=0))
        assert len(opened) == 2
        assert all(p._closed and p._socket.closed for p in opened), "sockets of the failed build left open"
    finally:
        for p in opened:
            p.close()
        for t in trainers:
            t.close()



# -- a claimed multi-agent stream that would coalesce -------------------------------------------------------
class _Kind(enum.Enum):
    NAME_MULTI_AGENT = 5


@dataclasses.dataclass
class _MultiAgentSpec:
    """An SRL sample-stream spec of type NAME_MULTI_AGENT (the stand-in config's enum has no such member)."""

    type_: _Kind = _Kind.NAME_MULTI_AGENT
    stream_name: str = ""


def test_a_coalescing_policy_on_a_multi_agent_stream_is_refused_before_any_socket_opens(srl_layout,
                                                                                       monkeypatch) -> None:
    """SRL's multi-agent producer stacks every post of a flush along axis 1 (one column per agent). Claimed
    with coalesce > 1, it was handed [T, k, ...] messages and stacked those: the trainer received records
    with an extra axis and no coalesced marker (silently garbled samples)."""
    layout = srl_layout("distributed")
    ss = layout["distributed.system.sample_stream"]
    stream = ZmqSampleConsumer()
    built: list[ZmqSampleProducer] = []

    def native_make_producer(spec: Any, worker_info: Any = None) -> ZmqSampleProducer:
        built.append(ZmqSampleProducer(stream.address))  # (stands in for SRL's multi-agent producer)
        return built[-1]

    monkeypatch.setattr(ss, "make_producer", native_make_producer)
    conduit_srl.install(stream_policy=StreamPolicy(coalesce=4), stream_policies={"team": StreamPolicy(coalesce=1)})
    try:
        with pytest.raises(StreamClaimError, match="NAME_MULTI_AGENT.*coalesce=1"):
            ss.make_producer(_MultiAgentSpec(stream_name="conduit:agents"))
        assert built == [], "a socket was opened for a producer that was refused"
        producer = ss.make_producer(_MultiAgentSpec(stream_name="conduit:team"))  # its own policy: coalesce=1
        assert isinstance(producer, ConduitSampleProducer) and producer.policy.coalesce == 1
        producer.close()
        assert len(built) == 1 and built[0]._closed
    finally:
        for p in built:
            p.close()
        stream.close()


# -- the driver: a put that waits for room on the trainer's main thread ---------------------------------------
def test_driver_run_with_a_put_waiting_for_room_returns_within_its_bound() -> None:
    """An on-policy buffer (capacity 8, rollouts of 4) whose training thread stops after one step: the
    trainer's main thread then waits in ``consume_to`` for room nobody makes. ``SrlDriver.run(timeout_s=2)``
    never returned (its deadline was only checked between ``consume_to`` calls)."""
    from conduit_srl.testing.driver import SrlDriver

    made: list[ConduitBuffer] = []

    def call(timeout_s: float) -> object:
        made.append(ConduitBuffer(semantics="on_policy", capacity=8, rollout_size=4, num_minibatches=1,
                                  pin_memory=False))
        return SrlDriver(made[-1], actors=1, samples_per_actor=32, max_steps=1).run(timeout_s=timeout_s)

    left: list[threading.Thread] = []
    try:
        outcome, left = call_until_stuck(call, lambda _, names: "trainer-main-thread" in names)
        assert isinstance(outcome, TimeoutError), f"expected a TimeoutError, got {outcome!r}"
        assert "consume_to" in str(outcome) and "room" in str(outcome), str(outcome)
    finally:
        for b in made:
            b.close()  # ends the put waiting for room: the left-behind thread ends and closes its socket
    for t in left:
        t.join(20.0)
        assert not t.is_alive(), f"{t.name} still running after the buffer was closed"


def test_run_buffer_worker_whose_own_put_waits_for_room_returns_within_its_bound() -> None:
    """SRL's buffer worker calls ``consume_to`` and ``get`` on one thread. With an on-policy buffer too small for
    what one ``consume_to`` receives, its put waits for room only that same thread's ``get`` could make:
    ``run_buffer_worker(timeout_s=2)`` never returned (the deadline was checked between calls only).

    The buffer takes ``[T, B, ...]`` puts (capacity 8, rollouts of 4). The first message (one sample) opens a
    rollout, which nothing can deliver; the second (eight samples) completes two rollouts, which fill the capacity,
    and its last sample waits for room. However the two messages arrive (in one ``consume_to`` or two), the worker's
    put waits there (unlike single samples, which a worker faster than its actor takes a few at a time, delivering
    each rollout before the next fills the buffer)."""
    from conduit_srl.testing.driver import run_buffer_worker

    upstream = [make_sample([0], batched=True), make_sample(list(range(1, 9)), batched=True)]
    made: list[ConduitBuffer] = []

    def call(timeout_s: float) -> object:
        made.append(ConduitBuffer(semantics="on_policy", capacity=8, rollout_size=4, num_minibatches=1,
                                  batched_puts=True, pin_memory=False))
        made.append(ConduitBuffer(semantics="queue", batch_size=1, capacity=64, pin_memory=False))
        return run_buffer_worker(upstream, made[-2], made[-1], timeout_s=timeout_s)

    left: list[threading.Thread] = []
    try:
        outcome, left = call_until_stuck(call, lambda _, names: "buffer-worker" in names)
        assert isinstance(outcome, TimeoutError), f"expected a TimeoutError, got {outcome!r}"
        assert "buffer worker" in str(outcome) and "room" in str(outcome), str(outcome)
    finally:
        for b in made:
            b.close()  # ends the put waiting for room: the left-behind worker ends and closes its socket
    for t in left:
        t.join(20.0)
        assert not t.is_alive(), f"{t.name} still running after the buffer was closed"


def _queue_run(ops: list[tuple[str, int]], *, wait_prepared: bool, checkpoint: bool,
               prepared: list[int]) -> tuple[list[int], int]:
    """Run ``ops`` (("put", id) or ("get", 0)) on a queue buffer of capacity 4; the ids delivered and dropped.

    ``wait_prepared``: after each get, wait until Conduit prepared the next batch ahead (when one is there to
    prepare; ``prepared[0]`` counts those); ``checkpoint``: then pickle the buffer (a checkpoint discards
    prepared batches).
    """
    b = ConduitBuffer(batch_size=1, capacity=4, prefetch=0, overlap=True)  # (Conduit prepares ahead)
    out: list[int] = []
    try:
        for op, i in ops:
            if op == "put":
                b.put(make_sample([i]))
                continue
            if b.empty():
                continue
            if wait_prepared:  # (stored before the get: the prefetch its delivery starts then sees every put)
                b.flush()
            out += entry_ids(b.get()).tolist()
            if wait_prepared:  # (Conduit prepares the next batch after a delivery, when one is stored)
                fifo = b._a._fifo()

                def prepared_ahead(f: Any = fifo) -> bool:
                    return bool(f._selected > f._confirmed)

                # (a wait for Conduit's prefetch worker, only reached when it never prepares the batch)
                if fifo.undelivered() > 0 and eventually(prepared_ahead, timeout=30):
                    prepared[0] += 1
            if checkpoint:
                pickle.dumps(b)
        while not b.empty():
            out += entry_ids(b.get()).tolist()
        return out, int(b.stats()["queue_dropped"])
    finally:
        b.close()


def _queue_reference(ops: list[tuple[str, int]]) -> tuple[list[int], int]:
    """A queue of capacity 4 without prefetch: a put past capacity drops the oldest, get takes the oldest."""
    q: list[int] = []
    out: list[int] = []
    dropped = 0
    for op, i in ops:
        if op == "put":
            q.append(i)
            if len(q) > 4:
                q.pop(0)
                dropped += 1
        elif q:
            out.append(q.pop(0))
    return out + q, dropped


@pytest.mark.parametrize("seed", range(6))
def test_a_queue_delivers_the_same_with_or_without_prefetch_and_checkpoints(seed: int) -> None:
    """What a queue delivers (and drops) does not depend on whether Conduit prepared the next batch ahead before
    later puts evicted it, nor on checkpoints taken meanwhile: it is what a queue without prefetch delivers. (A
    batch prepared ahead and then evicted used to be delivered, unless a checkpoint had discarded it first.)"""
    rng = np.random.default_rng(seed)
    ops: list[tuple[str, int]] = []
    nxt = 0
    for _ in range(40):
        if rng.random() < 0.6:
            for _ in range(int(rng.integers(1, 7))):
                ops.append(("put", nxt))
                nxt += 1
        else:
            ops.append(("get", 0))
    expected = _queue_reference(ops)
    assert expected[1] > 0, "the sequence drops nothing: it does not test eviction of a prepared batch"
    for wait_prepared, checkpoint in ((True, False), (True, True), (False, False)):
        prepared = [0]
        got = _queue_run(ops, wait_prepared=wait_prepared, checkpoint=checkpoint, prepared=prepared)
        if wait_prepared:
            assert prepared[0] > 0, "Conduit never prepared a batch ahead: the test checks nothing of prefetch"
        assert got == expected, (f"seed {seed}, wait_prepared={wait_prepared}, checkpoint={checkpoint}: delivered "
                                 f"{got[0]} (dropped {got[1]}), a queue without prefetch {expected[0]} "
                                 f"(dropped {expected[1]})")
