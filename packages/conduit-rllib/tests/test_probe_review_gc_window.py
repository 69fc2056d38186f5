"""A garbage collection still running when :meth:`ExperiencePathProbe.take` closes a window counts in each window for
its part there, as a wrapped call does (before, the window it ran in read 0 gc, the next one all of it).

The collection runs on a real thread, inside a finalizer that blocks until the test lets it go; ``take()`` runs on the
main thread meanwhile. Assertions are on recorded values and bounds made of clock readings, not on durations.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conduit_rllib.compare import Variant
from conduit_rllib.workloads import dqn_large_obs


@pytest.fixture(scope="module")
def native_variant(ray_local: None) -> Iterator[Variant]:
    v = Variant("native", dqn_large_obs(16, steps=40, learning_starts=20, capacity=500))
    try:
        yield v
    finally:
        v.close()


def test_a_collection_running_across_take_is_split_between_the_windows(native_variant: Variant) -> None:
    probe = native_variant.probe
    entered, go = threading.Event(), threading.Event()
    t: dict[str, float] = {}

    class Cyclic:
        def __init__(self) -> None:
            self.me: Any = self

        def __del__(self) -> None:  # run by the collection, on the thread that collects
            t["in"] = time.perf_counter()
            entered.set()
            go.wait()
            t["out"] = time.perf_counter()

    def collect() -> None:
        Cyclic()  # unreachable at once, but for its cycle
        t["call"] = time.perf_counter()
        gc.collect()
        t["ret"] = time.perf_counter()

    probe.take()
    w = threading.Thread(target=collect, name="conduit-test-collector")
    w.start()
    entered.wait()
    before_a = time.perf_counter()
    a = probe.take()  # the collection is under way: its part so far belongs to this window
    go.set()
    w.join()
    b = probe.take()
    assert a["gc"] >= before_a - t["in"] > 0, f"the window the collection ran in reads {a['gc']} s of gc"
    assert b["gc"] <= t["ret"] - before_a, "the next window takes only the part after it began"
    assert t["out"] - t["in"] <= a["gc"] + b["gc"] <= t["ret"] - t["call"], "each moment counts once"
