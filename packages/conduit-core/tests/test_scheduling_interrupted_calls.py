"""``Overlapped`` calls interrupted (Ctrl-C's ``KeyboardInterrupt``) while they wait for the scheduler's workers.

Each case was a known defect:

* a delivery interrupted while it waited for the prefetch job forgot the job: the batches the job drew were
  dropped once it ended, so a sampler that hands every item out once (a queue) skipped them for good, and the
  chunk buffer they were gathered into stayed marked busy.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conduit import ExperienceDataPlane, Overlapped, Replay
from conduit.semantics import Selection
from conduit.testing.lifecycle import HANG_S, eventually

sys.path.insert(0, str(Path(__file__).parent))
from test_prefetch_retry_and_cli_interrupts import SCHEMA, _Queue, _rows, _values  # noqa: E402, I001


class _GatedQueue(_Queue):
    """:class:`_Queue` whose draws on the prefetch worker wait for ``gate`` (set: they go on at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        if threading.current_thread().name == "conduit-prefetch":
            assert self.gate.wait(HANG_S), "the test never let the prefetch draw"
        return super().sample(n, replace=replace, beta=beta)


@pytest.fixture
def interrupt_main() -> Iterator[Any]:
    """A function that raises ``KeyboardInterrupt`` in the main thread (this test's), as Ctrl-C does: a signal
    whose handler raises it, so that it also interrupts the main thread's wait for a lock. (SIGUSR1, not SIGINT:
    a test runner started in the background ignores SIGINT.)"""
    assert threading.current_thread() is threading.main_thread(), "signals are handled on the main thread only"

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, raise_interrupt)
    main = threading.main_thread().ident
    assert main is not None
    try:
        yield lambda: signal.pthread_kill(main, signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_delivery_interrupted_while_it_waits_for_the_prefetch_keeps_the_prefetched_batch(
        interrupt_main: Any) -> None:
    sampler = _GatedQueue()
    sched = Overlapped(g_ing=1, g_del=1)
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=Replay(sampler), scheduler=sched)
    try:
        edp.ingest(_rows(0, 8))
        edp.flush()
        sampler.gate.clear()
        batch, _ = edp.deliver(2)
        assert _values(batch) == [0, 1]
        job = sched._job
        assert job is not None, "no prefetch after the first delivery"

        def kick() -> None:  # once the next delivery waits for the job (it is stuck in the gated draw)
            if eventually(lambda: sched._awaited is job, timeout=HANG_S):
                interrupt_main()

        kicker = threading.Thread(target=kick, daemon=True)
        kicker.start()
        with pytest.raises(KeyboardInterrupt):
            edp.deliver(2)
        kicker.join(HANG_S)
        sampler.gate.set()
        assert eventually(job.done, timeout=HANG_S)
        got = [_values(edp.deliver(2)[0]) for _ in range(3)]
        assert got == [[2, 3], [4, 5], [6, 7]], f"the prefetched batch [2, 3] was lost: {got}"
        assert sampler.drawn == 4
        assert eventually(lambda: sched._job is None or sched._job.done(), timeout=HANG_S)
        sched._await_job()  # (the prefetch after the last delivery, which found nothing)
        assert not any(s.busy for s in sched._ring.slots), "a chunk buffer stayed marked busy"
    finally:
        sampler.gate.set()
        edp.close()
