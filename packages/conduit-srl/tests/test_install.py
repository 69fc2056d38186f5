"""install()/uninstall() against stand-in modules shaped like SRL's layouts (see conftest.py)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time

import conduit_srl
import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_srl import (
    ConduitBuffer,
    ConduitSampleConsumer,
    ConduitSampleProducer,
    SrlNotFoundError,
    StreamClaimError,
    StreamPolicy,
    ZeroCopyStreamError,
    check_trainer_config,
)
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer


def test_importing_conduit_srl_imports_nothing_from_srl_and_no_transport() -> None:
    """A fresh interpreter that imports conduit_srl has no SRL module (nor zmq) loaded."""
    code = ("import sys, conduit_srl, conduit_srl.testing; "
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('base', 'api', 'local', 'distributed', 'rlsrl', 'legacy', 'zmq')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_install_without_srl_raises_and_changes_nothing() -> None:
    with pytest.raises(SrlNotFoundError, match="PYTHONPATH"):
        conduit_srl.install()
    assert conduit_srl.installed() is None


def test_distributed_layout_wraps_make_buffer_and_passes_other_names_through(srl_layout) -> None:
    layout = srl_layout("distributed")
    buf_mod = layout["base.buffer"]
    original = buf_mod.make_buffer
    inst = conduit_srl.install()
    assert inst.flavours == ["distributed"], inst
    assert "base.buffer.make_buffer" in inst.patched
    assert "distributed.system.sample_stream.make_producer" in inst.patched
    assert buf_mod.make_buffer is not original

    b = buf_mod.make_buffer("conduit", batch_size=2, capacity=8)
    assert isinstance(b, ConduitBuffer) and b.config.semantics == "queue"
    b.close()
    r = buf_mod.make_buffer("conduit:replay", batch_size=2, capacity=8)
    assert r.config.semantics == "replay"
    r.close()
    # every other name reaches SRL's own factory untouched, unknown ones included
    assert type(buf_mod.make_buffer("simple_queue", max_size=3)).__name__ == "SimpleQueueBuffer"
    assert buf_mod.make_buffer("no_such_buffer") is None
    with pytest.raises(ConfigurationError, match="semantics"):
        buf_mod.make_buffer("conduit:lifo", batch_size=2)
    with pytest.raises(ConfigurationError, match="disagree"):
        buf_mod.make_buffer("conduit:replay", semantics="queue", batch_size=2, capacity=8)
    with pytest.raises(ConfigurationError, match="capacity="):
        buf_mod.make_buffer("conduit", batch_size=2, max_size=16)

    assert conduit_srl.uninstall() is True
    assert buf_mod.make_buffer is original
    assert conduit_srl.uninstall() is False


def test_install_is_idempotent_and_reversible(srl_layout) -> None:
    layout = srl_layout("both")
    mods = {n: layout[n] for n in ("base.buffer", "distributed.system.sample_stream", "local.system.sample_stream")}
    before = (mods["base.buffer"].make_buffer, mods["distributed.system.sample_stream"].make_producer,
              mods["distributed.system.sample_stream"].make_consumer,
              dict(mods["local.system.sample_stream"].ALL_SAMPLE_PRODUCER_CLS),
              mods["local.system.sample_stream"].register_producer, layout["api.config"].TrainerWorker.__init__)
    first = conduit_srl.install()
    assert first.flavours == ["distributed", "local"]
    patched = (mods["base.buffer"].make_buffer, mods["distributed.system.sample_stream"].make_producer)
    assert conduit_srl.install() is first  # a second call changes nothing
    assert (mods["base.buffer"].make_buffer, mods["distributed.system.sample_stream"].make_producer) == patched
    assert first.patched.count("base.buffer.make_buffer") == 1  # shared by both halves, wrapped once
    conduit_srl.uninstall()
    after = (mods["base.buffer"].make_buffer, mods["distributed.system.sample_stream"].make_producer,
             mods["distributed.system.sample_stream"].make_consumer,
             dict(mods["local.system.sample_stream"].ALL_SAMPLE_PRODUCER_CLS),
             mods["local.system.sample_stream"].register_producer, layout["api.config"].TrainerWorker.__init__)
    assert after == before
    again = conduit_srl.install()  # and it can be installed again
    assert again is not first and mods["base.buffer"].make_buffer is not before[0]


def test_srl_local_layout(srl_layout) -> None:
    layout = srl_layout("srl-local")
    inst = conduit_srl.install()
    assert inst.flavours == ["srl-local"]
    b = layout["rlsrl.base.buffer"].make_buffer("conduit", batch_size=1, capacity=4)
    assert isinstance(b, ConduitBuffer)
    b.close()


def test_prioritized_conduit_buffer_passes_srls_isinstance_check_and_pickles(srl_layout) -> None:
    """SRL's trainer sends priorities only to instances of its prioritized class."""
    layout = srl_layout("distributed")
    conduit_srl.install()
    mod = layout["base.buffer"]
    b = mod.make_buffer("conduit", semantics="prioritized", batch_size=4, capacity=16)
    assert isinstance(b, mod.PrioritizedReplayBuffer) and isinstance(b, ConduitBuffer)
    q = mod.make_buffer("conduit", batch_size=4, capacity=16)
    assert not isinstance(q, mod.PrioritizedReplayBuffer)
    for i in range(8):
        b.put(make_sample([i]))
    e = b.get()
    assert b.update_priorities(e.sampling_indices, np.full(4, 2.0)) == 4  # Conduit's method, not the stand-in's
    restored = pickle.loads(pickle.dumps(b))
    assert isinstance(restored, mod.PrioritizedReplayBuffer) and len(restored) == 8
    for x in (b, q, restored):
        x.close()


def test_trainer_config_with_zero_copy_shared_memory_is_refused_when_built(srl_layout) -> None:
    layout = srl_layout("distributed")
    conduit_srl.install()
    cfg = layout["api.config"]
    shm = cfg.SampleStream(type_=cfg.SampleStream.Type.SHARED_MEMORY, stream_name="s", batch_size=8)
    with pytest.raises(ZeroCopyStreamError, match="buffer_zero_copy=False"):
        cfg.TrainerWorker(buffer_name="conduit", buffer_args={"batch_size": 8}, sample_stream=shm,
                          buffer_zero_copy=True)
    with pytest.raises(ConfigurationError, match="batched_puts=True"):
        cfg.TrainerWorker(buffer_name="conduit", buffer_args={"batch_size": 8}, sample_stream=shm)
    ok = cfg.TrainerWorker(buffer_name="conduit", buffer_args={"batch_size": 8, "batched_puts": True},
                           sample_stream=shm)
    check_trainer_config(ok)
    # SRL's own buffers keep zero copy
    cfg.TrainerWorker(buffer_name="priority_queue", sample_stream=shm, buffer_zero_copy=True)
    conduit_srl.uninstall()
    cfg.TrainerWorker(buffer_name="conduit", sample_stream=shm, buffer_zero_copy=True)  # hook gone


def test_check_trainer_config_needs_no_srl() -> None:
    class Kind:
        name = "SHARED_MEMORY"

    class Stream:
        type_ = Kind()
        batch_size = None

    class Cfg:
        buffer_name = "conduit:replay"
        buffer_args: dict = {}
        sample_stream = Stream()
        buffer_zero_copy = True

    with pytest.raises(ZeroCopyStreamError):
        check_trainer_config(Cfg())
    Cfg.buffer_zero_copy = False
    with pytest.raises(ConfigurationError, match="copy_on_put=True"):  # (an unbatched read is a view of its slot)
        check_trainer_config(Cfg())
    Cfg.buffer_args = {"copy_on_put": True}
    check_trainer_config(Cfg())


def _drain(consumer: object, buffer: object, expected: int, timeout_s: float = 10.0) -> int:
    got, deadline = 0, time.monotonic() + timeout_s
    while got < expected:
        assert time.monotonic() < deadline, f"{got} of {expected} samples arrived"
        n = consumer.consume_to(buffer, max_iter=64)  # type: ignore[attr-defined]
        got += n
        if not n:
            time.sleep(0.001)
    return got


def test_claimed_name_stream_routes_over_every_trainer_and_coalesces(srl_layout) -> None:
    """'conduit:' NAME streams: one native producer per registered trainer; Conduit picks the trainer."""
    layout = srl_layout("distributed")
    ss = layout["distributed.system.sample_stream"]
    cfg = layout["api.config"]
    conduit_srl.install(stream_policies={"traj": StreamPolicy(route="round_robin", coalesce=3, max_delay_s=60)})
    trainers = [ss.make_consumer("conduit:traj", cfg.WorkerInformation(worker_index=i)) for i in range(2)]
    buffers = [ConduitBuffer(batch_size=3, capacity=64) for _ in trainers]
    producer = ss.make_producer(cfg.SampleStream(stream_name="conduit:traj"), cfg.WorkerInformation(worker_index=1))
    try:
        assert all(isinstance(t, ConduitSampleConsumer) for t in trainers)
        assert isinstance(producer, ConduitSampleProducer) and len(producer.targets) == 2
        for i in range(12):  # 4 messages of 3 samples, alternating trainers from rank 1
            producer.post(make_sample([i]))
            producer.flush()
        assert producer.messages == [2, 2] and producer.sent == [6, 6]
        got = {}
        for t, b in zip(trainers, buffers, strict=True):
            assert _drain(t, b, 6) == 6  # each trainer got 2 messages = 6 samples, as 2 puts
            got[t.address] = sorted(np.concatenate([b.get().sample.id[0] for _ in range(2)]).tolist())
        # target i is the i-th registered trainer (SRL's order); the rank-1 actor starts on target 1
        assert got[producer.targets[1].target] == [0, 1, 2, 6, 7, 8]
        assert got[producer.targets[0].target] == [3, 4, 5, 9, 10, 11]
        # unclaimed names are SRL's own streams
        plain = ss.make_consumer("traj", cfg.WorkerInformation())
        assert type(plain).__name__ == "NameResolvingSampleConsumer"
        plain.close()
    finally:
        producer.close()
        for t in trainers:
            t.close()
        for b in buffers:
            b.close()


def test_claimed_stream_delivers_the_same_samples_to_an_srl_buffer(srl_layout) -> None:
    """A coalesced message reaches a non-Conduit buffer as ordinary puts, in order."""
    layout = srl_layout("distributed")
    ss = layout["distributed.system.sample_stream"]
    cfg = layout["api.config"]
    conduit_srl.install(stream_policy=StreamPolicy(coalesce=4, max_delay_s=0))
    consumer = ss.make_consumer(cfg.SampleStream(type_=cfg.SampleStream.Type.IP, stream_name="conduit:x"))
    producer = ss.make_producer(cfg.SampleStream(type_=cfg.SampleStream.Type.IP, stream_name="conduit:x",
                                                 address=consumer.address))
    srl_buffer = layout["base.buffer"].make_buffer("simple_queue")
    try:
        for i in range(10):
            producer.post(make_sample([i]))
        producer.flush()  # 2 full messages of 4 and, with max_delay_s=0, the remaining 2
        assert producer.messages == [3]
        assert _drain(consumer, srl_buffer, 10) == 10
        assert [int(s.id[0]) for s in srl_buffer.items] == list(range(10))
        assert all(s.id.shape == (4,) and "conduit_coalesced" not in s.metadata for s in srl_buffer.items)
    finally:
        producer.close()
        consumer.close()


def test_shared_memory_streams_cannot_be_claimed(srl_layout) -> None:
    layout = srl_layout("distributed")
    ss = layout["distributed.system.sample_stream"]
    cfg = layout["api.config"]
    conduit_srl.install()
    with pytest.raises(StreamClaimError, match="SHARED_MEMORY"):
        ss.make_consumer(cfg.SampleStream(type_=cfg.SampleStream.Type.SHARED_MEMORY, stream_name="conduit:s"))


def test_local_registry_entries_are_wrapped_including_later_registrations(srl_layout) -> None:
    layout = srl_layout("local")
    ss = layout["local.system.sample_stream"]
    cfg = layout["api.config"]
    conduit_srl.install(stream_policy=StreamPolicy(coalesce=2, max_delay_s=0))

    class LateProducer(ZmqSampleProducer):
        def __init__(self, spec: object) -> None:
            super().__init__(spec.address)  # type: ignore[attr-defined]

    ss.register_producer(cfg.SampleStream.Type.NAME, LateProducer)
    consumer = ss.make_consumer(cfg.SampleStream(type_=cfg.SampleStream.Type.IP, stream_name="conduit:l"))
    assert isinstance(consumer, ConduitSampleConsumer)
    producer = ss.make_producer(cfg.SampleStream(type_=cfg.SampleStream.Type.NAME, stream_name="conduit:l",
                                                 address=consumer.address))
    assert isinstance(producer, ConduitSampleProducer)
    assert isinstance(producer.targets[0], LateProducer)
    buffer = ConduitBuffer(batch_size=2, capacity=16)
    try:
        for i in range(4):
            producer.post(make_sample([i]))
        producer.flush()
        assert _drain(consumer, buffer, 4) == 4
        assert buffer.get().sample.id[0].tolist() == [0, 1]
    finally:
        producer.close()
        consumer.close()
        buffer.close()
    conduit_srl.uninstall()
    assert ss.ALL_SAMPLE_PRODUCER_CLS[cfg.SampleStream.Type.NAME] is LateProducer
    plain = ss.make_consumer(cfg.SampleStream(type_=cfg.SampleStream.Type.IP, stream_name="conduit:l"))
    assert isinstance(plain, ZmqSampleConsumer) and not isinstance(plain, ConduitSampleConsumer)
    plain.close()
