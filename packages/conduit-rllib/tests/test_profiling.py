"""The experience-path probe accounts an RLlib iteration without counting any time twice."""

from __future__ import annotations

import gc
import time

import pytest
from conduit_rllib.compare import Variant
from conduit_rllib.profiling import CONTEXT, PARTS
from conduit_rllib.workloads import dqn_large_obs


@pytest.mark.parametrize("variant", ["native", "conduit"])
def test_probe_parts_and_context_add_up_to_at_most_the_iteration(ray_local: None, variant: str) -> None:
    v = Variant(variant, dqn_large_obs(16, steps=40, learning_starts=20, capacity=500))
    try:
        v.iteration()  # fills the buffer; learning starts within it
        v.probe.take()
        t0 = time.perf_counter()
        v.algo.train()
        wall = time.perf_counter() - t0
        p = v.probe.take()
        gc.collect()  # a full collection between two takes is the next take's gc time, and nothing else's
        collected = v.probe.take()
    finally:
        v.close()
    assert v.probe._gc_callback not in gc.callbacks, "close() must stop timing the garbage collector"
    assert 0 <= p["gc"] <= wall
    assert collected["gc"] > 0 and collected["exposed"] == 0, collected
    for name in ("add", "sample", "batch", "env", "update"):
        assert p[name] > 0, f"{variant}: part {name!r} recorded nothing in a training iteration: {p}"
    assert p["exposed"] == pytest.approx(sum(p[k] for k in PARTS))
    accounted = p["exposed"] + sum(p[k] for k in CONTEXT)
    assert accounted <= wall * 1.001, (f"{variant}: parts and context add up to {accounted:.3f} s, more than the "
                                       f"iteration's {wall:.3f} s: something is counted twice ({p})")


def test_the_garbage_collector_callback_does_not_keep_a_probe_alive() -> None:
    import weakref

    from conduit_rllib.profiling import _gc_callback, _remove_callback

    class Probe:
        phases: list[str] = []

        def _on_gc(self, phase: str, info: dict[str, int]) -> None:
            self.phases.append(phase)

    p = Probe()
    cb = _gc_callback(weakref.ref(p))
    gc.callbacks.append(cb)
    weakref.finalize(p, _remove_callback, cb)
    gc.collect()
    assert Probe.phases[-2:] == ["start", "stop"]
    del p  # only the callback referred to it, weakly: it is freed, and the callback leaves gc.callbacks
    assert cb not in gc.callbacks
