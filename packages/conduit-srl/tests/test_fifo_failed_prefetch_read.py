"""A queue batch whose prefetch read failed is delivered later, in order: no sample is lost.

Conduit's prefetch job selects the next queue batch (advancing :class:`FifoSampler`'s cursor), then reads it from
storage. When that read failed, the job prepared nothing and the next delivery selected in its call, past the
failed job's batch: the FIFO sampler kept no draw state for the scheduler to give back, so those samples were
skipped (neither delivered nor counted as dropped).
"""

from __future__ import annotations

import threading
from typing import Any

from conduit_srl import ConduitBuffer
from conduit_srl.testing import entry_ids, make_sample


def _fail_first_prefetch_read(b: ConduitBuffer) -> threading.Event:
    """Make the first storage read on Conduit's prefetch worker fail, once (a transient read error)."""
    storage = b.edp.storage
    gather = storage.gather
    failed = threading.Event()

    def flaky_gather(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "conduit-prefetch" and not failed.is_set():
            failed.set()
            raise OSError("injected read error")
        return gather(*args, **kwargs)

    storage.gather = flaky_gather  # type: ignore[method-assign]
    return failed


def test_the_batch_of_a_failed_prefetch_read_is_delivered_later_in_order() -> None:
    b = ConduitBuffer(batch_size=2, capacity=64, prefetch=0, overlap=True)  # (Conduit's prefetch reads)
    try:
        for i in range(12):
            b.put(make_sample([i], time_steps=2))
        b.flush()
        failed = _fail_first_prefetch_read(b)
        got = [entry_ids(b.get()).tolist() for _ in range(6)]
        assert failed.is_set(), "no prefetch read ran (nothing was injected)"
        assert got == [[i, i + 1] for i in range(0, 12, 2)], f"samples lost or reordered: {got}"
        assert b.stats()["queue_dropped"] == 0, b.stats()
        assert b.empty()
    finally:
        b.close()


def test_a_reused_batch_whose_prefetch_read_failed_keeps_its_reuses() -> None:
    b = ConduitBuffer(batch_size=2, capacity=64, reuses=2, prefetch=0, overlap=True)  # (Conduit's prefetch reads)
    try:
        for i in range(6):
            b.put(make_sample([i], time_steps=2))
        b.flush()
        failed = _fail_first_prefetch_read(b)
        got = []
        for _ in range(6):
            e = b.get()
            got.append((entry_ids(e).tolist(), e.reuses))
        assert failed.is_set(), "no prefetch read ran (nothing was injected)"
        assert got == [([i, i + 1], float(u)) for i in (0, 2, 4) for u in (0, 1)], got
        assert b.empty()
    finally:
        b.close()
