"""Where the exposed experience-path time of the overlapped synthetic loop goes, call by call (outside CI).

Runs the configuration sweep's loop (``conduit.demo.run_loop``: rollout 256, batch 512, 4 updates per
iteration) overlapped at one d and g, and times on the loop's thread, by wall clock and by the thread's CPU
clock: every ``ingest`` and ``deliver`` call (deliveries by their position in the iteration), and the hand-offs
that wake a background thread (the prefetch worker's job submission, the ingestion queue's hand-over). Then,
outside the loop, the cost to a thread of waking another one that sleeps on a queue, after the waker slept and
after it computed for 3 ms (what the loop's thread does before it hands a job over); and, against the synchronous
loop run after it, the most the overlap could hide if every delivery cost what the cheapest one in the iteration
does (no wake-up, no GIL contention)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scripts/exposed_breakdown.py [--d 128] [--g 4] [--iterations 400]

Run it on a quiet machine: other processes' load changes every figure.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from conduit import Overlapped
from conduit.demo import run_loop
from conduit.edp import ExperienceDataPlane
from conduit.placement import DiskPlacement, HostPlacement
from conduit.scheduling import ingestion, worker

Samples = dict[str, list[float]]


def _timed(owner: Any, name: str, label: str, samples: Samples, main: int) -> Callable[[], None]:
    """Time ``owner.name`` on the loop's thread (wall and CPU); returns the undo."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != main:
            return original(*args, **kwargs)
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            samples[label + " wall"].append(time.perf_counter() - w0)
            samples[label + " cpu"].append(time.thread_time() - c0)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


#: the configuration sweep's loop (the rest of run_loop's arguments)
LOOP: dict[str, Any] = dict(warmup=2, rollout=256, batch=512, updates=4, capacity=16384, hidden=64, prefill=4096)


def overlapped_run(d: int, g: int, iterations: int, placement: str, **kwargs: Any) -> Any:
    """One run of :data:`LOOP` overlapped at ``g`` (``g_ing = g_del``) on ``placement`` ("disk" or "host")."""
    return run_loop(obs_dim=d, scheduler=Overlapped(g_ing=g, g_del=g, overlap=True), iterations=iterations,
                    placement=DiskPlacement() if placement == "disk" else HostPlacement(), **LOOP, **kwargs)


def loop_breakdown(d: int, g: int, iterations: int, placement: str) -> tuple[Samples, float, float]:
    """Per-call samples of one overlapped run; and its median and mean exposed time per iteration (s)."""
    samples: Samples = defaultdict(list)
    main = threading.get_ident()
    undo = [_timed(ExperienceDataPlane, "ingest", "ingest", samples, main),
            _timed(ExperienceDataPlane, "deliver", "deliver", samples, main),
            _timed(worker.Worker, "submit", "prefetch job submission", samples, main),
            _timed(ingestion.Ingestion, "handover", "ingestion hand-over", samples, main)]
    try:
        res = overlapped_run(d, g, iterations, placement)
    finally:
        for u in undo:
            u()
    exposed = [it.exposed_s for it in res.iterations]
    return samples, statistics.median(exposed), statistics.mean(exposed)


def wake_cost(busy_s: float, rounds: int = 400) -> tuple[float, float]:
    """Median (wall, CPU) seconds of a ``put`` that wakes a thread blocked on the queue, after the waker slept
    (``busy_s`` = 0) or computed for ``busy_s`` seconds."""
    jobs: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[int] = queue.SimpleQueue()

    def serve() -> None:
        while (job := jobs.get()) is not None:
            done.put(job)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    a = torch.randn(256, 256)
    wall, cpu = [], []
    for i in range(rounds):
        if busy_s:
            end = time.perf_counter() + busy_s
            while time.perf_counter() < end:
                a @ a
        else:
            time.sleep(0.003)
        w0, c0 = time.perf_counter(), time.thread_time()
        jobs.put(i)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        done.get()
    jobs.put(None)
    t.join()
    return statistics.median(wall), statistics.median(cpu)


def bound(d: int, g: int, iterations: int, placement: str) -> str:
    """The most the overlap could hide on this loop: an overlapped run's exposed spans (``ingest_wait``,
    ``deliver_wait``) by position in the iteration, and what the iteration would expose if every delivery cost what
    the cheapest position's median does (no wake-up, no GIL contention), against a synchronous run's exposed time."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        res = overlapped_run(d, g, iterations, placement, trace=trace)
        spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    sync = statistics.median(it.exposed_s for it in run_loop(obs_dim=d, iterations=iterations, **LOOP).iterations)
    sync *= 1e6
    loop = sorted((e for e in spans if e["name"] in ("rollout", "ingest_wait", "deliver_wait")), key=lambda e: e["ts"])
    ingest: list[float] = []
    delivery: dict[int, list[float]] = defaultdict(list)
    pos = 0
    for e in loop:  # (trace times are in us)
        if e["name"] == "rollout":
            pos = 0
        elif e["name"] == "ingest_wait":
            ingest.append(e["dur"])
        else:
            delivery[pos].append(e["dur"])
            pos += 1
    med = {k: statistics.median(v) for k, v in sorted(delivery.items())}
    floor = statistics.median(ingest) + LOOP["updates"] * min(med.values())
    exposed = statistics.median(it.exposed_s for it in res.iterations) * 1e6
    return (f"exposed spans (us, medians): ingest {statistics.median(ingest):.1f}, deliveries by position "
            f"{', '.join(f'{v:.1f}' for v in med.values())}; overlapped exposed {exposed:.1f} us per iteration "
            f"({1 - exposed / sync:.1%} below the synchronous loop's {sync:.1f}); with every delivery at the cheapest "
            f"position {floor:.1f} us: at most {1 - floor / sync:.1%} below")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--g", type=int, default=4)
    p.add_argument("--iterations", type=int, default=400)
    p.add_argument("--placement", choices=("disk", "host"), default="disk")
    args = p.parse_args()
    torch.set_num_threads(1)
    samples, med, mean = loop_breakdown(args.d, args.g, args.iterations, args.placement)
    us = 1e6
    print(f"d={args.d} {args.placement}/overlap/g={args.g}: exposed per iteration median {med * us:.1f} us, "
          f"mean {mean * us:.1f} us ({args.iterations} iterations)")
    print(f"{'call (on the loop thread)':34s} {'n':>5s} {'wall med':>9s} {'wall mean':>9s} {'cpu med':>8s} "
          f"{'cpu mean':>8s}")
    for label in ("ingest", "ingestion hand-over", "deliver", "prefetch job submission"):
        w, c = samples[label + " wall"], samples[label + " cpu"]
        skip = len(w) // 5  # (warm-up and calibration)
        w, c = w[skip:], c[skip:]
        if w:
            print(f"{label:34s} {len(w):5d} {statistics.median(w) * us:9.1f} {statistics.mean(w) * us:9.1f} "
                  f"{statistics.median(c) * us:8.1f} {statistics.mean(c) * us:8.1f}")
    dw = samples["deliver wall"][len(samples["deliver wall"]) // 5:]
    start = len(samples["deliver wall"]) // 5 % 4  # (position 0 is an iteration's first delivery)
    for pos in range(4):
        xs = dw[(pos - start) % 4::4]
        print(f"  deliver, position {pos} in the iteration: wall median {statistics.median(xs) * us:.1f} us, "
              f"mean {statistics.mean(xs) * us:.1f} us")
    print(bound(args.d, args.g, args.iterations, args.placement))
    for busy, what in ((0.0, "after sleeping 3 ms"), (0.003, "after 3 ms of matmuls")):
        wake_wall, wake_cpu = wake_cost(busy)
        print(f"waking a thread blocked on a queue, {what}: wall {wake_wall * us:.1f} us, "
              f"waker's CPU {wake_cpu * us:.1f} us")


if __name__ == "__main__":
    main()
