"""The published RLlib figures are measured as the paper defines them (review of profiling, compare, scripts).

``ExperiencePathProbe.take()["background"]`` is the *hidden* experience-path time of
:mod:`conduit.exposure`: the union of Conduit's worker-thread spans (ingest, deliver, stage),
clipped to the window, minus what coincided with the loop waiting inside a wrapped call.
Worker spans here are recorded into the real data plane's telemetry by a real thread, as the
scheduler's workers record theirs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from conduit.exposure import WORK_KINDS
from conduit.telemetry import thread_id
from conduit_rllib.compare import Variant
from conduit_rllib.workloads import dqn_large_obs


def _worker(fn: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=fn, name="conduit-test-worker")
    t.start()
    return t


def _span_of(edp: Any, thread: int, kind: str) -> tuple[float, float]:
    """The one ``kind`` span the test's worker thread (``thread``: its ``thread_id()``) recorded."""
    spans = [(r.start, r.end) for r in edp.telemetry.records if r.thread == thread and r.kind == kind]
    assert len(spans) == 1, f"the test's worker recorded {len(spans)} {kind!r} spans"
    return spans[0]


def _outside(intervals: list[tuple[float, float]], hole: tuple[float, float]) -> float:
    """Seconds the union of ``intervals`` lies outside the interval ``hole``."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        a = max(a, end)
        if b > a:
            total += b - a - max(0.0, min(b, hole[1]) - max(a, hole[0]))
            end = b
    return total


def _other_work(probe: Any, edp: Any, worker: int, since: float, until: float) -> list[tuple[float, float]]:
    """Experience-path work off the loop in ``[since, until)`` other than the test worker's (Conduit's own
    prefetch after a delivery, for one), clipped to it."""
    return [(max(r.start, since), min(r.end, until)) for r in edp.telemetry.records
            if r.kind in WORK_KINDS and r.thread != worker and r.thread not in probe._loop_threads
            and r.end > since and r.start < until]


def test_background_work_the_loop_waited_for_is_not_counted_again(conduit_variant: Variant) -> None:
    """A worker's gather holds the buffer's lock while the loop waits for it in sample(): the part of the gather
    the loop waited through is exposed (the sample part), not hidden as well. Checked against the spans the
    worker and the loop recorded, not against how soon a loaded machine ran them."""
    probe = conduit_variant.probe
    buf = probe.buffer
    edp = buf.edp
    for _ in range(5):  # until the loop waited through most of the gather (a loaded machine may run it late)
        holding, calling = threading.Event(), threading.Event()
        worker: list[int] = []

        def gather_under_the_buffers_lock(holding: threading.Event = holding, calling: threading.Event = calling,
                                          worker: list[int] = worker) -> None:  # a prefetch sample() must wait for
            worker.append(thread_id())
            with edp.telemetry.span("deliver"), buf._lock:
                holding.set()
                calling.wait()
                time.sleep(0.3)

        since = time.perf_counter()
        probe.take()
        w = _worker(gather_under_the_buffers_lock)
        holding.wait()
        calling.set()
        buf.sample(num_items=4, n_step=1, beta=0.4)  # wrapped: the loop waits for the worker's lock here
        w.join()
        waited = probe._waits[-1]  # the loop's wrapped sample() call (the last wrapped call it made)
        p = probe.take()
        until = time.perf_counter()
        loop = (waited.start, waited.end)
        gather = _span_of(edp, worker[0], "deliver")
        hidden = _outside([gather], loop)  # the gather's part before the loop began to wait for it
        shared = gather[1] - gather[0] - hidden
        others = _outside(_other_work(probe, edp, worker[0], since, until), loop)
        if shared < max(0.1, 2 * others):
            continue  # the loop reached sample() only as the gather ended: this round shows nothing
        assert p["sample"] == pytest.approx(loop[1] - loop[0], abs=1e-6), p
        assert hidden - 1e-6 <= p["background"] <= hidden + others + 1e-6, (
            f"the worker's gather ({gather[1] - gather[0]:.3f} s, {shared:.3f} s of it while the loop waited in "
            f"sample()) is {hidden:.3f} s of hidden time ({others:.3f} s of other work off the loop), but "
            f"background={p['background']:.3f} s: {p}")
        assert p["total"] <= (loop[1] - loop[0]) + hidden + others + 1e-6, f"counted twice: {p}"
        return
    pytest.fail("in 5 rounds the loop never waited in sample() through most of the worker's gather")


def test_background_span_that_started_before_the_window_counts_for_its_part_inside_it(
        conduit_variant: Variant) -> None:
    probe = conduit_variant.probe
    edp = probe.buffer.edp
    started, opened = threading.Event(), threading.Event()
    worker: list[int] = []

    def long_ingest() -> None:
        worker.append(thread_id())
        with edp.telemetry.span("ingest"):
            started.set()
            opened.wait()  # runs on into the window, however late the loop opens it
            time.sleep(0.3)

    w = _worker(long_ingest)
    started.wait()
    before = time.perf_counter()
    probe.take()  # the window starts while the worker's span runs
    t0 = time.perf_counter()
    opened.set()
    w.join()  # the loop does something else (not experience path) meanwhile
    p = probe.take()
    until = time.perf_counter()
    span = _span_of(edp, worker[0], "ingest")
    others = _outside(_other_work(probe, edp, worker[0], before, until), (until, until))  # (their union's length)
    assert span[0] < before and span[1] - t0 >= 0.3  # (the span began before the window and ran on into it)
    # the window starts inside the first take(), between `before` and `t0`: its part inside is hidden
    assert span[1] - t0 - 1e-6 <= p["background"] <= span[1] - before + others + 1e-6, (
        f"{span[1] - t0:.3f} s of the worker's ingest ran inside the window, hidden: "
        f"background={p['background']:.3f} s")


@pytest.mark.parametrize("kinds", [("deliver", "deliver"), ("stage",)], ids=["two-gathers", "staging"])
def test_worker_spans_count_once_as_time_and_staging_counts(conduit_variant: Variant, kinds: tuple[str, ...]) -> None:
    probe = conduit_variant.probe
    edp = probe.buffer.edp
    go = threading.Barrier(len(kinds) + 1)

    def span(kind: str) -> Callable[[], None]:
        def run() -> None:
            go.wait()
            with edp.telemetry.span(kind):
                time.sleep(0.3)
        return run

    probe.take()
    t0 = time.perf_counter()
    ws = [_worker(span(k)) for k in kinds]
    go.wait()
    for w in ws:
        w.join()
    wall = time.perf_counter() - t0
    p = probe.take()
    assert 0.25 <= p["background"] <= wall, (f"workers busy with {kinds} over the same 0.3 s are 0.3 s of hidden "
                                             f"experience path: background={p['background']:.3f} s in a "
                                             f"{wall:.3f} s window")


def _breakdown_script() -> object:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "scripts" / "rllib_breakdown.py"
    spec = importlib.util.spec_from_file_location("rllib_breakdown_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_breakdown_runs_with_prefetch_do_not_overwrite_the_plain_comparison() -> None:
    from argparse import Namespace

    script = _breakdown_script()

    def name(**kw: object) -> str:
        args = dict(algo="dqn", obs_dim=5000, iterations=8, steps=200, batch=None, uniform=False, capacity=50000,
                    seed=0, overlap=0, ingest_in_caller=False, sequential=False, agents=1, out=None) | kw
        return script.result_name(Namespace(**args))  # type: ignore[attr-defined]

    # the files benchmarks/docs/rllib.md cites for each command
    assert name() == "dqn_d5000_b32_cap50000"
    assert name(overlap=2) == "dqn_d5000_b32_cap50000_overlap2"
    assert name(overlap=2, ingest_in_caller=True) == "dqn_d5000_b32_cap50000_overlap2_caller"
    assert name(overlap=2, capacity=5000) == "dqn_d5000_b32_overlap2"
    assert name(algo="sac", overlap=2) == "sac_pendulum_b256_overlap2"
    assert name(algo="ppo", steps=2000, sequential=True) == "ppo_cartpole_2000"
    assert name(algo="ppo", steps=2000, sequential=True, agents=2) == "ppo_2_agent_cartpole_2000"


def test_interleaved_variants_with_the_same_seed_draw_the_same_random_streams(ray_local: None) -> None:
    """rllib_breakdown.py alternates the variants' train() calls in one process; RLlib draws exploration
    from the process-global torch RNG, so without per-variant states the second variant continued the
    first one's stream. Two identical (seeded, deterministic) Conduit variants must train identically."""
    import torch

    def weights(v: Variant) -> dict[str, torch.Tensor]:
        return {k: t.detach().clone() for k, t in v.algo.get_module().state_dict().items()}

    a = Variant("conduit", dqn_large_obs(8, steps=30, learning_starts=15, capacity=300))
    b = Variant("conduit", dqn_large_obs(8, steps=30, learning_starts=15, capacity=300))
    try:
        rows = [(a.iteration(), b.iteration()) for _ in range(2)]
        wa, wb = weights(a), weights(b)
    finally:
        a.close()
        b.close()
    returns = [(ra.episode_return, rb.episode_return) for ra, rb in rows]
    same = all(x == y or (x != x and y != y) for x, y in returns)  # NaN: no episode ended in either
    assert same, f"same seed and config, different episodes: returns {returns}"
    differing = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differing, f"same seed and config, different trained weights in {differing}"


def test_take_refuses_a_window_whose_worker_spans_the_telemetry_ring_dropped(conduit_variant: Variant) -> None:
    """The probe read background time with Telemetry.during(), which cannot see the calls the data plane's
    bounded ring (Telemetry(maxlen=...)) dropped inside the window: a window whose workers recorded more spans
    than the ring holds reported the hidden time of the last maxlen of them only, without a word. It is now
    refused (CapacityError), as ExposureLog refuses such an iteration, and the next window is measured again."""
    from conduit.errors import CapacityError

    probe = conduit_variant.probe
    tel = probe.buffer.edp.telemetry
    probe.take()

    def many_short_ingests() -> None:  # the first ones, 0.1 s long, fall out of the ring before take() reads it
        t = time.perf_counter()
        tel.record("ingest", 1, 0, t, t + 0.1)
        for _ in range(tel.maxlen):
            t = time.perf_counter()
            tel.record("ingest", 1, 0, t, t)

    w = _worker(many_short_ingests)
    w.join()
    with pytest.raises(CapacityError, match="maxlen"):
        probe.take()
    p = probe.take()  # the refused window is over: the next one (no drops in it) is measured
    assert p["background"] >= 0.0, p


def test_exposure_log_counts_a_long_background_span_that_started_before_the_iteration() -> None:
    """conduit.exposure.ExposureLog: every span overlapping the iteration counts for its part inside it,
    also one that started more than a minute before (it looked only at spans started in the last 60 s)."""
    from conduit import Telemetry
    from conduit.exposure import ExposureLog

    tel = Telemetry()
    log = ExposureLog(tel)
    with log.iteration():
        with tel.span("rollout"):
            t = threading.Thread(target=lambda: (time.sleep(0.2), tel.record("ingest", 1, 0, time.perf_counter()
                                                                              - 100.0, time.perf_counter())))
            t.start()
            t.join()
    it = log.iterations[-1]
    (ingest,) = [r for r in tel.records if r.kind == "ingest"]
    assert ingest.start < it.start - 60 and ingest.end - it.start >= 0.2
    # hidden: the ingest's part inside the iteration, from the iteration's start to the ingest's end (the loop
    # ran its rollout all along); compared with the recorded span, not with how late the machine ran the thread
    assert it.hidden_s == pytest.approx(ingest.end - it.start, abs=1e-9), (
        f"a worker ingested through the iteration's first {ingest.end - it.start:.3f} s (of {it.iteration_s:.3f} s) "
        f"while the loop ran its rollout: hidden {it.hidden_s:.3f} s")


def test_summarize_refuses_a_variant_without_iterations() -> None:
    from conduit.errors import ConfigurationError
    from conduit_rllib.compare import summarize

    with pytest.raises(ConfigurationError, match="'conduit'"):
        summarize({"native": [], "conduit": []})


def test_a_conduit_variant_leaves_the_config_it_was_given_unchanged(ray_local: None) -> None:
    """Variant("conduit", cfg) enabled Conduit in ``cfg`` itself: the same config then built a "native" variant
    that ran Conduit (run_sequential/run_interleaved with one config object under both names)."""
    import conduit_rllib

    cfg = dqn_large_obs(8, steps=20, learning_starts=10, capacity=200)
    v = Variant("conduit", cfg)
    try:
        assert conduit_rllib.is_enabled(v.algo.config), "the conduit variant runs Conduit"
        assert not conduit_rllib.is_enabled(cfg), "the caller's config was changed"
    finally:
        v.close()


def test_a_variant_given_an_enable_function_runs_it_whatever_its_name(ray_local: None) -> None:
    """``Variant("overlapped", cfg, enable=...)`` dropped the function (only a variant named "conduit" was
    enabled): the variant ran native RLlib, and its rows were reported as the Conduit set-up it was named for."""
    import conduit
    import conduit_rllib

    cfg = dqn_large_obs(8, steps=20, learning_starts=10, capacity=200)
    v = Variant("overlapped", cfg, enable=lambda c: conduit_rllib.enable(
        c, scheduler=lambda: conduit.Overlapped(g_del=2, background_ingest=False)))
    try:
        assert conduit_rllib.is_enabled(v.algo.config), "the variant given an enable function runs native RLlib"
        assert isinstance(v.algo.local_replay_buffer, conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer)
        assert not conduit_rllib.is_enabled(cfg), "the caller's config was changed"
    finally:
        v.close()
    native = Variant("native", cfg)
    try:
        assert not conduit_rllib.is_enabled(native.algo.config), "a variant without an enable function is native"
    finally:
        native.close()
