"""What a buffer, its storage, its telemetry and its streams hold is released when they are dropped or closed.

* Telemetry keeps a thread's name only while the ring holds a call of that thread (or the thread
  still runs): before, a process that started many short-lived producer threads kept one name per
  thread for the life of the telemetry, however small its ring; and ``thread_id()`` remembered one
  number per thread ever started, for the life of the process, where the distinct OS idents suffice.
* Guards for what was probed and found released: the disk tier's files after a drop and after
  migrating off it, and repeated build/close cycles (threads and file descriptors do not grow).
  SRL's buffer and streams: ``packages/conduit-srl/tests/test_dropped_without_close.py``.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Replay, Telemetry
from conduit.placement import DiskPlacement, HostPlacement
from conduit.testing.lifecycle import eventually, open_fds, worker_threads

SCHEMA = ExperienceSchema(x=Field((64,)))
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
    assert eventually(lambda: ref() is None), "the dropped disk buffer is still alive"
    assert eventually(lambda: not _disk_dirs(tmp_path)), f"files left behind: {_disk_dirs(tmp_path)}"


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
    assert eventually(lambda: host() is None), "the host storage migrated off is still alive"
    edp.migrate(HostPlacement())
    edp.deliver(8)
    assert eventually(lambda: disk() is None), "the disk storage migrated off is still alive"
    assert eventually(lambda: not _disk_dirs(tmp_path)), \
        f"the abandoned disk tier's files remain: {_disk_dirs(tmp_path)}"
    assert len(edp) == 128
    edp.close()


# -- repeated build/close cycles ---------------------------------------------------------------------------------
def test_fifty_build_close_cycles_leave_no_threads_files_or_descriptors(tmp_path: Path) -> None:
    def cycle(i: int) -> None:
        edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=Replay(seed=0),
                                  scheduler=Overlapped(g_ing=2, g_del=2),
                                  placement=DiskPlacement(directory=tmp_path) if i % 2 else HostPlacement())
        for _ in range(4):
            edp.ingest({"x": torch.ones(32, 64)})
        edp.flush()
        edp.deliver(8)
        edp.close()

    before = threading.active_count()
    cycle(0)
    cycle(1)
    assert eventually(lambda: threading.active_count() <= before and not _disk_dirs(tmp_path))
    threads, fds = threading.active_count(), open_fds()
    for i in range(50):
        cycle(i)
    assert eventually(lambda: threading.active_count() <= threads), \
        f"{threading.active_count() - threads} threads left by 50 cycles: {worker_threads()}"
    assert eventually(lambda: not _disk_dirs(tmp_path)), f"files left by 50 cycles: {_disk_dirs(tmp_path)}"
    assert eventually(lambda: open_fds() <= fds), f"{open_fds() - fds} descriptors left open by 50 cycles"
