"""Scheduling: granularity alone (sequential), and the configuration sweep with overlap on the synthetic loop.

* ``test_granularity_sweep`` -- batch 1024, d in {128, 10000}, g = g_ing = g_del in
  {1, 2, 4, 8}, sequential (no overlap): experience-path time per training step (ingest
  one rollout of 1024 transitions + deliver one batch of 1024). The automatic choice is
  what :class:`conduit.Automatic` (overlap fixed off) picks after calibrating on the same
  job; it is measured in the same interleaved rounds and compared with the measured best.
* ``test_configuration_sweep`` -- every placement on this machine x overlap off/on x g in
  {1, 2, 4, 8} on the synthetic actor/learner loop (a real MLP update step), d in {128,
  1000, 5000, 10000}, plus the synchronous baseline and the automatic configuration
  (see ``benchmarks/scripts/config_sweep.py``, which also draws the plot). Reports the
  automatic choice against the best manual configuration, and the exposed experience-path
  latency with overlap against the synchronous baseline.

Figures go to ``benchmark.extra_info`` and ``benchmarks/results/scheduling_*.md``; nothing
here asserts a speed. ``--benchmark-disable`` (CI) runs a small smoke version of each.
Run: ``.venv/bin/python -m pytest benchmarks/test_bench_scheduling.py -s``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import Automatic, ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Replay

HERE = Path(__file__).parent
RESULTS = HERE / "results"
BATCH = 1024
GS = (1, 2, 4, 8)


def _load_sweep() -> Any:
    spec = importlib.util.spec_from_file_location("config_sweep", HERE / "scripts" / "config_sweep.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _write(name: str, text: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / name).write_text(text)


# -- granularity alone -------------------------------------------------------------------------------------------
def _schema(d: int) -> ExperienceSchema:
    return ExperienceSchema(obs=Field((d,)), action=Field((), torch.int64), reward=Field(()),
                            done=Field((), torch.bool))


def _rollout(d: int, n: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.randn(n, d), "action": torch.randint(4, (n,)), "reward": torch.randn(n),
            "done": torch.zeros(n, dtype=torch.bool)}


def _fill(edp: ExperienceDataPlane, d: int, n: int) -> None:
    chunk = _rollout(d, 1024)
    while len(edp) < n:
        edp.ingest(chunk)
        edp.flush()


def _calibrate(d: int, cap: int, batch: int, rollout: dict[str, torch.Tensor], rounds: int) -> tuple[int, int, str]:
    """What the automatic scheduler picks for this job (sequential), after calibrating on it."""
    sched = Automatic(overlap=False, g_ing_max=8, g_del_max=8, probe_rounds=rounds)
    edp = ExperienceDataPlane(_schema(d), capacity=cap, semantics=Replay(seed=1), scheduler=sched)
    try:
        _fill(edp, d, min(cap, 4 * batch))
        while sched.decision is None:
            edp.ingest(rollout)
            edp.deliver(batch)
        assert sched.decision is not None
        return int(sched.decision.g_ing), int(sched.decision.g_del), sched.decision.explain()
    finally:
        edp.close()


def _steps(edp: ExperienceDataPlane, rollout: dict[str, torch.Tensor], batch: int, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        edp.ingest(rollout)
        edp.deliver(batch)
    return time.perf_counter() - t0


@pytest.mark.parametrize("d", [128, 10000], ids=lambda d: f"d{d}")
def test_granularity_sweep(benchmark: Any, d: int) -> None:
    smoke = benchmark.disabled
    torch.set_num_threads(1)
    batch = 256 if smoke else BATCH
    cap = 4 * batch if smoke else (65536 if d <= 1000 else 8192)
    rounds, per = (1, 8) if smoke else (9, 16)
    rollout = _rollout(d, batch)
    g_ing, g_del, explain = _calibrate(d, cap, batch, rollout, 1 if smoke else 6)
    assert 1 <= g_ing <= 8 and 1 <= g_del <= 8
    configs = {f"g={g}": (g, g) for g in GS}
    auto_key = f"g={g_del}" if g_ing == g_del and g_del in GS else f"auto (g_ing={g_ing}, g_del={g_del})"
    configs.setdefault(auto_key, (g_ing, g_del))
    sched = Overlapped(overlap=False, g_ing=1, g_del=1)
    edp = ExperienceDataPlane(_schema(d), capacity=cap, semantics=Replay(seed=2), scheduler=sched)
    times: dict[str, list[float]] = {k: [] for k in configs}
    try:
        _fill(edp, d, cap)
        rng = random.Random(0)
        for _ in range(rounds):
            order = list(configs)
            rng.shuffle(order)
            for k in order:
                gi, gd = configs[k]
                sched.retune(g_ing=gi, g_del=gd)
                edp.flush()
                while sched.prepared:  # start at a chunk boundary
                    edp.deliver(batch)
                unit = math.lcm(gi, gd)  # whole ingestion groups and delivery chunks
                n = unit * -(-per // unit)
                _steps(edp, rollout, batch, n)  # warm: first use of this chunk size
                times[k].append(_steps(edp, rollout, batch, n) / n)
        gi, gd = configs[auto_key]
        sched.retune(g_ing=gi, g_del=gd)
        benchmark.group = f"granularity-d{d}"
        benchmark.pedantic(_steps, args=(edp, rollout, batch, 8 * math.lcm(gi, gd)), rounds=1 if smoke else 3,
                           iterations=1)
    finally:
        edp.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in med if k.startswith("g=")), key=med.get)  # type: ignore[arg-type]
    ratio = med[auto_key] / med[best]
    benchmark.extra_info.update({"median_s_per_step": med, "best": best, "auto": auto_key, "auto_vs_best": ratio,
                                 "decision": explain})
    if smoke:
        return  # a smoke run's figures are not results
    rows = "\n".join(f"| {k} | {v * 1e3:.3f} | {v / med[best]:.2f}x |" for k, v in sorted(med.items()))
    _write(f"scheduling_granularity_d{d}.md",
           f"# Granularity alone, sequential, d = {d}, batch {batch}\n\nExperience-path time per step (ingest one "
           f"rollout of {batch} + deliver one batch of {batch}), median of {rounds} interleaved rounds"
           f"{' (smoke run)' if smoke else ''}.\n\n| g_ing = g_del | ms per step | vs best |\n|---|---|---|\n{rows}\n\n"
           f"Automatic choice: {auto_key}, {ratio:.3f}x the measured best ({best}).\n\n```\n{explain}\n```\n")
    print(f"\nd={d}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(med.items())) +
          f"; auto {auto_key} = {ratio:.3f}x best ({best})")


# -- the configuration sweep --------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [128, 1000, 5000, 10000], ids=lambda d: f"d{d}")
def test_configuration_sweep(benchmark: Any, d: int) -> None:
    smoke = benchmark.disabled
    if smoke and d != 128:
        pytest.skip("smoke run (--benchmark-disable): the sweep runs at d=128 only")
    cs = _load_sweep()
    if smoke:
        res = cs.sweep([d], gs=(1, 2), rounds=1, iterations=1, warmup=1, auto_warmup=28, placement_names=["host"],
                       log=lambda s: None)
    else:
        res = cs.sweep([d], rounds=3, iterations=5)
    r = res["dims"][str(d)]
    c = r["configs"]
    assert "auto" in c and "sync" in c and r["best"] in c
    assert c["auto"]["calibrated"], "the automatic scheduler did not finish calibrating within its warm-up"
    for v in c.values():
        assert v["iteration_s"] > 0 and v["total_s"] >= v["exposed_s"] >= 0

    def auto_once() -> None:
        cs.run_config(cs.Config("auto", special="auto"), d, iterations=1, warmup=1, auto_warmup=28)

    benchmark.group = f"config-sweep-d{d}"
    benchmark.pedantic(auto_once, rounds=1, iterations=1)
    benchmark.extra_info.update({k: r[k] for k in ("best", "auto_vs_best", "exposed_reduction", "spread_s",
                                                    "best_overlap_exposed")})
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "config_sweep.json"
    merged = json.loads(path.read_text()) if path.exists() and not smoke else {"dims": {}}
    merged.update({k: v for k, v in res.items() if k != "dims"})
    merged["dims"][str(d)] = r
    if not smoke:
        path.write_text(json.dumps(merged, indent=1))
    print(cs.table_text({"dims": {str(d): r}}))
