"""Concurrent ``AdaptivePlacement.rebalance`` calls run one migration at a time and leave a consistent record.

Before, ``rebalance`` set ``edp.placement`` back to the adaptive placement and ``current`` after the migration
returned, outside any lock: a second rebalance starting in between saw the migration's inner placement as the
buffer's owner (so it never handed the buffer back to the adaptive placement) and its bookkeeping could be
overwritten by the first call's, leaving ``current`` naming a tier the storage was no longer in.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Synchronous
from conduit.errors import ConfigurationError
from conduit.placement import AdaptivePlacement, PlacementSpec, Workload
from conduit.placement.placement_map import MapRange, PlacementMap, storage_spec
from conduit.testing.lifecycle import HANG_S

HOST = PlacementSpec("host", ("cpu",))
DISK = PlacementSpec("disk", ("disk",))
CAPACITY = 32
#: 8 B id + 4 float32 = 24 B per item
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))


class _PauseAfterSwap(Synchronous):
    """A synchronous scheduler whose first ``invalidate("contents")`` (a migration's, right after its swap) waits
    until ``go`` is set, announcing the wait on ``paused``."""

    def __init__(self) -> None:
        self.paused, self.go = threading.Event(), threading.Event()

    def invalidate(self, reason: str = "contents") -> None:
        if reason == "contents" and not self.paused.is_set():
            self.paused.set()
            assert self.go.wait(HANG_S), "the test never let the first migration go on"


def _run(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - checked by the test
            out.append(e)
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def _paused_buffer(tmp_path: Path) -> tuple[ExperienceDataPlane, AdaptivePlacement, _PauseAfterSwap]:
    """A buffer holding ids 0..9 on the host tier of an adaptive placement (host below 30 B per item, disk from
    there), whose scheduler pauses the first migration right after its swap."""
    pmap = PlacementMap([MapRange(1.0, 30.0, HOST), MapRange(30.0, float("inf"), DISK)],
                        Workload.from_schema(SCHEMA, capacity=CAPACITY, batch=1), "test", max_item_bytes=10_000)
    adaptive = AdaptivePlacement(pmap, directory=tmp_path)
    sched = _PauseAfterSwap()
    edp = ExperienceDataPlane(SCHEMA, capacity=CAPACITY, placement=adaptive, scheduler=sched)
    edp.ingest({"id": torch.arange(10), "obs": torch.ones(10, 4)})
    return edp, adaptive, sched


def test_concurrent_rebalances_leave_the_buffer_on_the_adaptive_placement_where_current_says(tmp_path: Path) -> None:
    edp, adaptive, sched = _paused_buffer(tmp_path)
    assert adaptive.current == HOST

    first, first_out = _run(lambda: adaptive.rebalance(edp, item_bytes=40))  # to disk; pauses after its swap
    assert sched.paused.wait(HANG_S), "the first rebalance never swapped"
    second, second_out = _run(lambda: adaptive.rebalance(edp, item_bytes=20))  # back to the host
    second.join(3)  # (before: it runs to its end meanwhile; after: it waits for the first one)
    sched.go.set()
    first.join(HANG_S)
    second.join(HANG_S)
    assert not first.is_alive() and not second.is_alive(), "a rebalance hung"
    for out in (first_out, second_out):
        assert not isinstance(out[0], BaseException), out[0]

    assert edp.placement is adaptive, f"the buffer no longer follows the map: its placement is {edp.placement!r}"
    assert adaptive.current == storage_spec(edp.storage) == HOST, (
        f"current says {adaptive.current} while the storage is {storage_spec(edp.storage)}")
    assert edp.storage.gather(torch.arange(10))["id"].tolist() == list(range(10))
    assert len(adaptive.migrations) == 2
    assert adaptive.rebalance(edp, item_bytes=20) is None  # it stays: the record agrees with the storage


def test_a_rebalance_that_would_wait_holding_the_buffers_lock_is_refused(tmp_path: Path) -> None:
    edp, adaptive, sched = _paused_buffer(tmp_path)
    first, first_out = _run(lambda: adaptive.rebalance(edp, item_bytes=40))
    assert sched.paused.wait(HANG_S)
    try:
        # inside the buffer's lock, waiting for the running rebalance (which may need that lock) could last forever
        refused, refused_out = _run(lambda: edp.read_locked(lambda: adaptive.rebalance(edp, item_bytes=20)))
        refused.join(HANG_S)
        assert isinstance(refused_out[0], ConfigurationError), refused_out
    finally:
        sched.go.set()
        first.join(HANG_S)
    assert first_out and first_out[0] is not None and not isinstance(first_out[0], BaseException), first_out
    assert edp.placement is adaptive and adaptive.current == storage_spec(edp.storage) == DISK
