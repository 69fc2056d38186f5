"""A prefetch that found nothing stored is tried again when the data is stored; ``conduit simulate`` interrupted
before it wrote anything leaves no output directory it made; ``ExposureLog(loop_threads=...)`` for two loops on
one telemetry.

Each case was a known defect:

* ``Overlapped``'s prefetch job after a delivery drew nothing when the items it needed were handed over but not
  stored yet (a sampler that waits for new items, such as a queue, with background ingestion still storing),
  and was not tried again before the next delivery, which then drew in its call (a miss);
* Ctrl-C while ``conduit simulate --out DIR`` probed the directory it had just made (or between the simulation
  and the first file) left that directory behind, empty;
* two ``ExposureLog`` loops on one telemetry counted each other's calls as exposed, with no way to tell a log
  which threads are its loop's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import EmptyBufferError, ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Replay, Telemetry
from conduit.errors import ConfigurationError
from conduit.exposure import ExposureLog
from conduit.semantics import SampleInfo, Sampler, Selection
from conduit.storage.base import Storage
from conduit.telemetry import thread_id
from conduit.testing.lifecycle import HANG_S, ctrl_c_enabled, eventually

SCHEMA = ExperienceSchema(obs=Field((1,)))


class _Queue(Sampler):
    """Each stored item once, oldest first, ``n`` at a time; refused (EmptyBufferError) while fewer than ``n``
    new items are stored -- the shape of SRL's queue buffers, which wait for new items."""

    def reset(self, storage: Storage, seed: int) -> None:
        super().reset(storage, seed)
        self._next = 0
        self.drawn = 0  # batches selected
        self.refused = 0  # selections refused for want of stored items

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        st = self.storage
        start = max(self._next, st.oldest)
        if st.next_handle - start < n:
            self.refused += 1
            raise EmptyBufferError(f"{st.next_handle - start} new items are stored, a batch needs {n}.")
        handles = torch.arange(start, start + n, dtype=torch.int64)
        self._next = start + n
        self.drawn += 1
        return Selection(handles % st.capacity, SampleInfo(handles=handles))

    def draw_state(self) -> Any:
        return self._next

    def rewind_draws(self, state: Any) -> None:
        self._next = int(state)

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next = int(state["next"])


def _rows(lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(lo, hi, dtype=torch.float32).reshape(-1, 1)}


def _values(batch: Any) -> list[int]:
    return [int(v) for v in batch["obs"].reshape(-1).tolist()]


def _queue_plane(**overlapped: Any) -> tuple[ExperienceDataPlane, Overlapped, _Queue]:
    sampler = _Queue()
    sched = Overlapped(g_ing=1, g_del=1, **overlapped)
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=Replay(sampler), scheduler=sched)
    return edp, sched, sampler


def _gate_ingestion(sched: Overlapped, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the ingestion worker before each write until the returned event is set."""
    gate = threading.Event()
    ingestion = sched._ingestion
    store = ingestion._store

    def gated(group: Any) -> None:
        assert gate.wait(HANG_S), "the test never opened the ingestion gate"
        store(group)

    monkeypatch.setattr(ingestion, "_store", gated)
    return gate


# -- a prefetch that found nothing stored is re-armed by the write that stores it -------------------------------


def test_a_prefetch_that_found_the_items_unstored_is_prepared_once_background_ingestion_stores_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    edp, sched, sampler = _queue_plane()
    gate = threading.Event()
    try:
        edp.ingest(_rows(0, 2))
        edp.flush()
        gate = _gate_ingestion(sched, monkeypatch)
        edp.ingest(_rows(2, 4))  # handed over; the worker holds it before its write
        batch, _ = edp.deliver(2)
        assert _values(batch) == [0, 1]
        assert eventually(lambda: sampler.refused == 1, timeout=HANG_S), \
            "the prefetch after the first delivery never looked for the next batch"
        assert sampler.drawn == 1
        gate.set()
        edp.flush()  # rows 2 and 3 are stored: that write re-arms the prefetch
        assert eventually(lambda: sampler.drawn == 2, timeout=HANG_S), (
            "the prefetch that found rows 2-3 not stored yet was not tried again once they were: the next "
            "delivery would draw them in its call")
        assert sampler.refused == 1, "the prefetch was retried without anything new stored"
        batch, _ = edp.deliver(2)
        assert _values(batch) == [2, 3]
        assert (sched.prefetch_hits, sched.prefetch_misses) == (1, 1), (
            f"the delivery after the rows were stored was not served from a prepared batch: "
            f"hits {sched.prefetch_hits}, misses {sched.prefetch_misses}")
    finally:
        gate.set()
        edp.close()


def test_a_prefetch_that_found_nothing_is_prepared_once_an_ingest_in_the_caller_stores_more() -> None:
    """Ingestion in the caller (``background_ingest=False``) with prefetch: the ``ingest`` that stores the next
    items re-arms it too."""
    edp, sched, sampler = _queue_plane(background_ingest=False)
    try:
        edp.ingest(_rows(0, 2))
        batch, _ = edp.deliver(2)
        assert _values(batch) == [0, 1]
        assert eventually(lambda: sampler.refused == 1, timeout=HANG_S)
        edp.ingest(_rows(2, 4))  # stored in this call
        assert eventually(lambda: sampler.drawn == 2, timeout=HANG_S), \
            "the ingest that stored the next items did not re-arm the prefetch"
        batch, _ = edp.deliver(2)
        assert _values(batch) == [2, 3]
        assert (sched.prefetch_hits, sched.prefetch_misses) == (1, 1)
    finally:
        edp.close()


def test_a_queue_delivers_the_same_batches_in_order_with_retried_prefetch_as_without() -> None:
    """Semantics unchanged: many small ingests racing the deliveries, each item delivered once, in order."""
    edp, _, _ = _queue_plane()
    delivered: list[int] = []
    try:
        for i in range(0, 40, 2):
            edp.ingest(_rows(i, i + 2))
            while True:
                try:
                    batch, _ = edp.deliver(2)
                except EmptyBufferError:
                    edp.flush()
                    continue
                delivered += _values(batch)
                break
    finally:
        edp.close()
    assert delivered == list(range(40)), "an item was lost, repeated or reordered"


def test_close_while_a_starved_prefetch_waits_for_a_write_stores_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """The write that comes after ``close()`` stopped the prefetch worker re-arms nothing and loses nothing."""
    edp, sched, sampler = _queue_plane()
    gate = threading.Event()
    try:
        edp.ingest(_rows(0, 2))
        edp.flush()
        gate = _gate_ingestion(sched, monkeypatch)
        edp.ingest(_rows(2, 4))
        edp.deliver(2)
        assert eventually(lambda: sampler.refused == 1, timeout=HANG_S)
        closing = threading.Thread(target=edp.close, name="closer", daemon=True)
        closing.start()
        assert eventually(lambda: sched._closed, timeout=HANG_S)
        gate.set()
        closing.join(HANG_S)
        assert not closing.is_alive(), "close() hung"
        assert edp.storage.next_handle == 4 and sched.pending() == [], "a batch handed over before close() was lost"
        assert sampler.drawn == 1, "a prefetch was started after close()"
    finally:
        gate.set()
        edp.close()


# -- conduit simulate interrupted before it wrote anything: the directory it made is removed ---------------------

#: runs ``conduit <argv>`` (``conduit.cli.main``, as the console script does) with Ctrl-C sent by the process to
#: itself at the point named by argv[0]: "probe" -- as the command probes the output directory it just made (the
#: first thing after mkdir); "table" -- after the simulation, as it formats the first table (before any file)
_INTERRUPTING = textwrap.dedent("""
    import os, signal, sys, tempfile
    import conduit.simulation.cli as sim
    from conduit.cli import main

    def ctrl_c(real):
        def call(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # raised as KeyboardInterrupt at once, in this thread
            return real(*args, **kwargs)
        return call

    where = sys.argv[1]
    if where == "probe":
        tempfile.NamedTemporaryFile = ctrl_c(tempfile.NamedTemporaryFile)
    else:
        sim.table = ctrl_c(sim.table)
    sys.exit(main(sys.argv[2:]))
""")


def _simulate_interrupted(where: str, out: Path) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTING, where, "simulate", "--scenario", "a100", "--gpus", "8",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=HANG_S * 4,
                          start_new_session=True, preexec_fn=ctrl_c_enabled)
    return proc.returncode, proc.stderr


def _one_interrupted_line(rc: int, err: str) -> None:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted"), err[-3000:]
    assert rc == 130, (rc, err[-3000:])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["probe", "table"])
def test_ctrl_c_before_simulate_wrote_anything_removes_the_directory_it_made(where: str, tmp_path: Path) -> None:
    out = tmp_path / "sim"
    rc, err = _simulate_interrupted(where, out)
    _one_interrupted_line(rc, err)
    assert not out.exists(), f"Ctrl-C at {where!r} left the empty output directory the command made"


@pytest.mark.timeout(600)
def test_ctrl_c_before_simulate_wrote_anything_keeps_a_directory_that_existed(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    out.mkdir()
    rc, err = _simulate_interrupted("probe", out)
    _one_interrupted_line(rc, err)
    assert out.is_dir() and list(out.iterdir()) == [], "a directory that existed before the command was removed"


# -- two loops on one telemetry: each ExposureLog told its loop's threads ------------------------------------------


def _two_loops(tel: Telemetry, *, own_threads: bool) -> tuple[ExposureLog, ExposureLog]:
    """Loop A's iteration spans the whole of loop B's, which waits 2 ms for a delivery; A makes no experience-path
    call. Each loop builds its log on its own thread (with ``loop_threads={thread_id()}`` when ``own_threads``)."""
    logs: dict[str, ExposureLog] = {}
    b_may_run, b_done = threading.Event(), threading.Event()

    def log_for(name: str) -> ExposureLog:
        logs[name] = ExposureLog(tel, loop_threads={thread_id()}) if own_threads else ExposureLog(tel)
        return logs[name]

    def loop_a() -> None:
        log = log_for("a")
        with log.iteration():
            with tel.span("rollout"):
                b_may_run.set()
                assert b_done.wait(HANG_S), "loop B never ran"

    def loop_b() -> None:
        log = log_for("b")
        assert b_may_run.wait(HANG_S)
        with log.iteration():
            with tel.span("update"):
                time.sleep(0.001)
            with tel.span("deliver_wait"):
                time.sleep(0.002)
        b_done.set()

    threads = [threading.Thread(target=f, name=f.__name__, daemon=True) for f in (loop_a, loop_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
        assert not t.is_alive(), f"{t.name} hung"
    assert set(logs) == {"a", "b"} and all(log.accounted == 1 for log in logs.values())
    return logs["a"], logs["b"]


def test_two_loops_on_one_telemetry_count_only_their_own_calls_when_told_their_threads() -> None:
    a, b = _two_loops(Telemetry(), own_threads=True)
    assert a.iterations[-1].exposed_s == 0, (
        f"loop A made no experience-path call, yet {a.iterations[-1].exposed_s:.4f}s were exposed: loop B's wait")
    assert b.iterations[-1].exposed_s >= 0.002


def test_by_default_a_loop_counts_another_loops_calls_on_the_same_telemetry_as_documented() -> None:
    """The default (the threads that record rollout/update/iteration spans) is kept: it is what a loop whose rollout
    runs on a helper thread needs, and the docstring says to give ``loop_threads`` when two loops share one
    telemetry."""
    a, _ = _two_loops(Telemetry(), own_threads=False)
    assert a.iterations[-1].exposed_s >= 0.002


@pytest.mark.parametrize("bad", [set(), [1.5], [True], 7, "12", [[1]]])
def test_exposure_log_refuses_loop_threads_that_are_not_thread_ids(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="thread_id"):
        ExposureLog(Telemetry(), loop_threads=bad)
