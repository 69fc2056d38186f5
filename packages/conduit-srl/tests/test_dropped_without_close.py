"""SRL's Conduit buffer and sample streams release what they hold when dropped without ``close()``:
the buffer, its data plane and its worker threads; the streams' sockets. And build/close cycles of
every semantics leave no threads or descriptors behind."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import pytest
from conduit.testing.lifecycle import eventually, fd_targets, live_workers, no_workers_beyond, open_fds, worker_threads
from conduit_srl import ConduitBuffer, ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

#: overlap=True where a Conduit worker thread runs beside the assembler (the default stores in put)
SRL_CASES: dict[str, dict[str, Any]] = {
    "queue": {"semantics": "queue", "batch_size": 4, "capacity": 64, "prefetch": 2, "overlap": True},
    "replay": {"semantics": "replay", "batch_size": 4, "capacity": 64, "warmup": 4, "prefetch": 2, "g_del": 2,
               "overlap": True},
    "replay-defaults": {"semantics": "replay", "batch_size": 4, "capacity": 64, "warmup": 4},
    "prioritized": {"semantics": "prioritized", "batch_size": 4, "capacity": 64, "warmup": 4, "overlap": True},
    "on_policy": {"semantics": "on_policy", "num_minibatches": 2, "capacity": 64, "overlap": True},
}


#: descriptors the test process may open meanwhile for reasons of its own (the module before this one in the same
#: pytest worker may leave a connection that opens one late); a leak in every round, or in three, is still caught
SLACK = 2


@pytest.mark.parametrize("case", sorted(SRL_CASES))
def test_an_srl_buffer_dropped_without_close_is_freed_and_its_threads_end(case: str) -> None:
    before = live_workers()
    kw = SRL_CASES[case]
    buf = ConduitBuffer(**kw)
    for i in range(16):
        buf.put(make_sample([i], version=0))
    if kw["semantics"] == "on_policy":
        buf.seal()
    buf.flush()
    buf.get()
    buf.put(make_sample([99], version=0))  # possibly still queued when the buffer is dropped
    ref, edp_ref = weakref.ref(buf), weakref.ref(buf.edp)
    del buf
    assert eventually(lambda: ref() is None and edp_ref() is None), f"{case}: the dropped buffer (or its EDP) is alive"
    assert eventually(lambda: no_workers_beyond(before)), f"{case}: threads left running: {worker_threads()}"


def test_srl_streams_dropped_without_close_release_their_sockets() -> None:
    pytest.importorskip("zmq")
    class Sink:
        def __init__(self) -> None:
            self.items: list[object] = []

        def put(self, x: object) -> None:
            self.items.append(x)

    def one_round() -> None:
        native = ZmqSampleConsumer()
        producer = ConduitSampleProducer([ZmqSampleProducer(native.address)], policy=StreamPolicy(coalesce=2))
        consumer = ConduitSampleConsumer(native)
        for i in range(2):
            producer.post(make_sample([i]))
        producer.flush()
        sink = Sink()
        assert eventually(lambda: consumer.consume_to(sink) >= 0 and len(sink.items) == 2), "the stream lost samples"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # pyzmq warns when it closes a dropped socket
        one_round()  # (the ZMQ context's own descriptors open on first use)
        assert eventually(lambda: True)  # (collects the first round's garbage)
        base, before = open_fds(), fd_targets()
        for _ in range(10):
            one_round()
        assert eventually(lambda: open_fds() <= base + SLACK), (
            f"{open_fds() - base} descriptors left open by 10 dropped streams: {_new(before)}")


def test_fifty_build_close_cycles_leave_no_threads_or_descriptors() -> None:
    semantics = ("queue", "replay", "prioritized", "on_policy")

    def cycle(i: int) -> None:
        sem = semantics[i % 4]
        kw: dict[str, Any] = {"semantics": sem, "capacity": 64}
        kw.update({"num_minibatches": 2} if sem == "on_policy" else {"batch_size": 4})
        buf = ConduitBuffer(**kw)
        for j in range(8):
            buf.put(make_sample([j], version=0))
        if sem == "on_policy":
            buf.seal()
        buf.flush()
        buf.get()
        buf.close()

    for i in range(4):
        cycle(i)
    threads, fds, before = live_workers(), open_fds(), fd_targets()
    for i in range(50):
        cycle(i)
    assert eventually(lambda: no_workers_beyond(threads)), f"threads left by 50 cycles: {worker_threads()}"
    assert eventually(lambda: open_fds() <= fds + SLACK), (
        f"{open_fds() - fds} descriptors left open by 50 cycles: {_new(before)}")


def _new(before: dict[int, str]) -> list[str]:
    """What the descriptors opened since ``before`` refer to."""
    return sorted(t for fd, t in fd_targets().items() if before.get(fd) != t)
