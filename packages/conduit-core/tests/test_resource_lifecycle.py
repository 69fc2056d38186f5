"""What a buffer, its storage, its telemetry and its streams hold is released when they are dropped or closed.

* Telemetry keeps a thread's name only while the ring holds a call of that thread (or the thread
  still runs): before, a process that started many short-lived producer threads kept one name per
  thread for the life of the telemetry, however small its ring; and ``thread_id()`` remembered one
  number per thread ever started, for the life of the process, where the distinct OS idents suffice.
* Guards for what was probed and found released: SRL's Conduit buffer dropped without ``close()``
  (every semantics), the disk tier's files after a drop and after migrating off it, the ZMQ sample
  streams' sockets, and repeated build/close cycles (threads and file descriptors do not grow).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Replay, Telemetry
from conduit.placement import DiskPlacement, HostPlacement

SCHEMA = ExperienceSchema(x=Field((64,)))
CONDUIT_THREADS = ("conduit-ingest", "conduit-prefetch", "conduit-srl-assembler")


def _poll(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``cond()`` holds within ``timeout`` (collecting garbage between tries)."""
    end = time.monotonic() + timeout
    while True:
        gc.collect()
        if cond():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def _conduit_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name in CONDUIT_THREADS)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- telemetry: thread names -----------------------------------------------------------------------------------
def test_telemetry_forgets_the_names_of_exited_threads_whose_calls_left_the_ring() -> None:
    tel = Telemetry(maxlen=16, fold_every=1)
    for i in range(200):  # 200 short-lived producers, one call each
        t = threading.Thread(target=tel.record, args=("ingest", 1, 8, float(i), i + 0.5), name=f"producer-{i}")
        t.start()
        t.join()
    tel.records  # noqa: B018 - a read folds
    bound = 2 * (tel.maxlen + threading.active_count()) + 64 + 1
    assert len(tel._names) <= bound, (
        f"the telemetry keeps {len(tel._names)} thread names for a ring of {tel.maxlen} calls (at most {bound} "
        f"expected): names of exited threads with no call left in the ring are never forgotten")
    # the names a trace needs are kept: the ring's calls come from exited threads, each still named
    trace = tel.chrome_trace()
    names = sorted(e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name")
    assert names == sorted(f"producer-{i}" for i in range(184, 200)), names


def test_telemetry_keeps_the_names_of_live_threads_and_of_calls_in_the_ring() -> None:
    tel = Telemetry(maxlen=1000, fold_every=1)
    for i in range(300):
        t = threading.Thread(target=tel.record, args=("ingest", 1, 8, float(i), i + 0.5), name=f"p-{i}")
        t.start()
        t.join()
    trace = tel.chrome_trace()
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {f"p-{i}" for i in range(300)}, "a thread with a call in the ring lost its name"


def test_thread_ids_stay_unique_without_remembering_every_short_lived_thread() -> None:
    import conduit.telemetry as telemetry

    before = len(telemetry._taken)
    seen: list[tuple[int, int]] = []  # (the OS's ident, thread_id()) of each thread

    def run() -> None:
        seen.append((threading.get_ident(), telemetry.thread_id()))

    for i in range(200):
        t = threading.Thread(target=run, name=f"short-{i}")
        t.start()
        t.join()
    tids = [tid for _, tid in seen]
    assert len(set(tids)) == 200, "two threads got the same thread_id()"
    assert telemetry.thread_id() not in tids
    idents = {ident for ident, _ in seen}  # the OS reuses idents of exited threads
    grew = len(telemetry._taken) - before
    assert grew <= len(idents), (
        f"200 short-lived threads with {len(idents)} distinct idents grew the process-wide id set by {grew}: "
        f"one entry per thread is kept for the life of the process")


# -- SRL's buffer dropped without close --------------------------------------------------------------------------
SRL_CASES: dict[str, dict[str, Any]] = {
    "queue": {"semantics": "queue", "batch_size": 4, "capacity": 64, "prefetch": 2},
    "replay": {"semantics": "replay", "batch_size": 4, "capacity": 64, "warmup": 4, "prefetch": 2, "g_del": 2},
    "replay-no-overlap": {"semantics": "replay", "batch_size": 4, "capacity": 64, "warmup": 4, "overlap": False},
    "prioritized": {"semantics": "prioritized", "batch_size": 4, "capacity": 64, "warmup": 4},
    "on_policy": {"semantics": "on_policy", "num_minibatches": 2, "capacity": 64},
}


@pytest.mark.parametrize("case", sorted(SRL_CASES))
def test_an_srl_buffer_dropped_without_close_is_freed_and_its_threads_end(case: str) -> None:
    from conduit_srl import ConduitBuffer
    from conduit_srl.testing import make_sample

    before = _conduit_threads()
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
    assert _poll(lambda: ref() is None and edp_ref() is None), f"{case}: the dropped buffer (or its EDP) is alive"
    assert _poll(lambda: _conduit_threads() == before), f"{case}: threads left running: {_conduit_threads()}"


def test_srl_streams_dropped_without_close_release_their_sockets() -> None:
    pytest.importorskip("zmq")
    from conduit_srl import ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy
    from conduit_srl.testing import make_sample
    from conduit_srl.testing.driver import ZmqSampleConsumer, ZmqSampleProducer

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
        assert _poll(lambda: consumer.consume_to(sink) >= 0 and len(sink.items) == 2), "the stream lost samples"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # pyzmq warns when it closes a dropped socket
        one_round()  # (the ZMQ context's own descriptors open on first use)
        gc.collect()
        base = _fds()
        for _ in range(10):
            one_round()
        assert _poll(lambda: _fds() <= base), f"{_fds() - base} descriptors left open by 10 dropped streams"


# -- the disk tier -----------------------------------------------------------------------------------------------
def _disk_dirs(root: Path) -> list[Path]:
    return sorted(root.glob("conduit-disk-*"))


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_a_disk_buffer_dropped_without_close_deletes_its_files(tmp_path: Path, overlapped: bool) -> None:
    kw: dict[str, Any] = {"scheduler": Overlapped(g_ing=2, g_del=2)} if overlapped else {}
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=Replay(seed=0),
                              placement=DiskPlacement(directory=tmp_path), **kw)
    del kw  # (the scheduler refers to its buffer)
    for _ in range(4):
        edp.ingest({"x": torch.ones(32, 64)})
    edp.flush()
    edp.deliver(8)
    assert len(_disk_dirs(tmp_path)) == 1
    ref = weakref.ref(edp)
    del edp
    assert _poll(lambda: ref() is None), "the dropped disk buffer is still alive"
    assert _poll(lambda: not _disk_dirs(tmp_path)), f"files left behind: {_disk_dirs(tmp_path)}"


@pytest.mark.parametrize("overlapped", [False, True], ids=["sync", "overlapped"])
def test_migrating_host_disk_host_releases_the_abandoned_storages(tmp_path: Path, overlapped: bool) -> None:
    kw: dict[str, Any] = {"scheduler": Overlapped(g_ing=2, g_del=2)} if overlapped else {}
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=Replay(seed=0), **kw)
    del kw
    for _ in range(4):
        edp.ingest({"x": torch.ones(32, 64)})
    edp.flush()
    edp.deliver(8)
    host = weakref.ref(edp.storage)
    edp.migrate(DiskPlacement(directory=tmp_path))
    edp.deliver(8)
    disk = weakref.ref(edp.storage)
    assert len(_disk_dirs(tmp_path)) == 1
    assert _poll(lambda: host() is None), "the host storage migrated off is still alive"
    edp.migrate(HostPlacement())
    edp.deliver(8)
    assert _poll(lambda: disk() is None), "the disk storage migrated off is still alive"
    assert _poll(lambda: not _disk_dirs(tmp_path)), f"the abandoned disk tier's files remain: {_disk_dirs(tmp_path)}"
    assert len(edp) == 128
    edp.close()


# -- repeated build/close cycles ---------------------------------------------------------------------------------
def test_fifty_build_close_cycles_leave_no_threads_files_or_descriptors(tmp_path: Path) -> None:
    from conduit_srl import ConduitBuffer
    from conduit_srl.testing import make_sample

    semantics = ("queue", "replay", "prioritized", "on_policy")

    def cycle(i: int) -> None:
        edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=Replay(seed=0),
                                  scheduler=Overlapped(g_ing=2, g_del=2),
                                  placement=DiskPlacement(directory=tmp_path) if i % 2 else HostPlacement())
        for _ in range(4):
            edp.ingest({"x": torch.ones(32, 64)})
        edp.flush()
        edp.deliver(8)
        edp.close()
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

    before = threading.active_count()
    cycle(0)
    cycle(1)
    assert _poll(lambda: threading.active_count() <= before and not _disk_dirs(tmp_path))
    threads, fds = threading.active_count(), _fds()
    for i in range(50):
        cycle(i)
    assert _poll(lambda: threading.active_count() <= threads), \
        f"{threading.active_count() - threads} threads left by 50 cycles: {_conduit_threads()}"
    assert _poll(lambda: not _disk_dirs(tmp_path)), f"files left by 50 cycles: {_disk_dirs(tmp_path)}"
    assert _poll(lambda: _fds() <= fds), f"{_fds() - fds} descriptors left open by 50 cycles"
