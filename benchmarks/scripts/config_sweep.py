"""Configuration sweep on the synthetic actor/learner loop: placement x overlap x granularity, and the automatic choice.

For each observation size d, every placement available on this machine (host memory and
memory-mapped disk files here; page-locked host, one GPU and sharded GPUs where CUDA
exists) is run with overlap off and on, at g = g_ing = g_del in {1, 2, 4, 8}, plus the
synchronous baseline and the automatic configuration (placement from the planner,
scheduling from :class:`conduit.Automatic`, which calibrates on the running loop during
its warm-up iterations). Rounds interleave every configuration, in a shuffled order, so
the load other jobs put on a shared machine falls on all of them alike; each figure is the
median over rounds of the per-round median iteration.

Run::

    .venv/bin/python benchmarks/scripts/config_sweep.py            # d = 128, 1000, 5000, 10000
    .venv/bin/python benchmarks/scripts/config_sweep.py --dims 128 1000 --rounds 2

It writes ``benchmarks/results/config_sweep.json`` and the plot
``benchmarks/docs/config_sweep.png``, and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from conduit import Automatic, Overlapped, Synchronous
from conduit.demo import run_loop
from conduit.placement import DevicePlacement, DiskPlacement, HostPlacement, Placement
from conduit.placement.profile import _median_seconds

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "config_sweep.json"
PLOT = ROOT / "benchmarks" / "docs" / "config_sweep.png"
GS = (1, 2, 4, 8)
#: short iterations get more of them, so each figure covers a few tenths of a second of the loop (at d = 128
#: an iteration is ~9 ms and the learner step alone varies by +-25% from one iteration to the next)
MIN_ITERATIONS = {128: 40, 1000: 12}

#: the loop's shape: transitions per rollout, updates of ``BATCH`` per iteration, MLP width
ROLLOUT, BATCH, UPDATES, HIDDEN = 256, 512, 4, 64


@dataclass(frozen=True)
class Config:
    """One point of the sweep: ``placement`` x overlap x g, or a named special one."""

    placement: str
    overlap: bool | None = None
    g: int | None = None
    special: str = ""  # "sync" (the synchronous baseline) or "auto"

    @property
    def name(self) -> str:
        if self.special:
            return self.special
        return f"{self.placement}/{'overlap' if self.overlap else 'sequential'}/g={self.g}"


def placements() -> dict[str, Callable[[], Placement]]:
    """Every placement this machine offers (the disk tier's files live in the temp dir, removed with the storage)."""
    out: dict[str, Callable[[], Placement]] = {"host": HostPlacement, "disk": DiskPlacement}
    if torch.cuda.is_available():
        out["pinned"] = lambda: HostPlacement(pin_memory=True)
        out["gpu"] = lambda: DevicePlacement("cuda:0")
    return out


def capacity_for(d: int) -> int:
    """At most 16k transitions and about 512 MiB of columns."""
    return int(min(16384, (512 << 20) // (8 * d + 13)))


def auto_placement(d: int) -> tuple[Placement, str]:
    """The planner's choice for this machine and workload (host memory if it cannot plan here)."""
    try:
        from conduit.placement import Planner, Workload, discover_topology, profile_machine

        plan = Planner(discover_topology(), profile_machine(quick=True)).plan(
            Workload.transitions(d, capacity=capacity_for(d), batch=BATCH))
        spec = plan.placement
        return spec.build(), f"planner: {spec}"
    except Exception as e:  # noqa: BLE001 - report and fall back
        return HostPlacement(), f"planner unavailable ({type(e).__name__}: {e}); host"


def run_config(cfg: Config, d: int, *, iterations: int, warmup: int, auto_warmup: int) -> dict[str, Any]:
    """One run of the loop; medians of its accounted iterations (seconds)."""
    note = ""
    if cfg.special == "sync":
        sched: Any = Synchronous()
        plc: Placement = HostPlacement()
    elif cfg.special == "auto":
        sched = Automatic()
        plc, note = auto_placement(d)
    else:
        assert cfg.g is not None and cfg.overlap is not None
        sched = Overlapped(g_ing=cfg.g, g_del=cfg.g, overlap=cfg.overlap)
        plc = placements()[cfg.placement]()
    cap = capacity_for(d)
    res = run_loop(obs_dim=d, scheduler=sched, placement=plc, iterations=iterations,
                   warmup=auto_warmup if cfg.special == "auto" else warmup, rollout=ROLLOUT, batch=BATCH,
                   updates=UPDATES, capacity=cap, hidden=HIDDEN, prefill=min(cap, 8 * BATCH))
    keys = ("iteration_s", "exposed_s", "hidden_s", "total_s", "update_s", "rollout_s")
    out: dict[str, Any] = {k: res.median(k) for k in keys}
    out["note"] = note
    out["decision"] = res.decision
    out["calibrated"] = cfg.special != "auto" or bool(res.decision)  # auto finished calibrating in its warm-up
    return out


def sweep(dims: Sequence[int], *, gs: Sequence[int] = GS, rounds: int = 3, iterations: int = 5, warmup: int = 2,
          auto_warmup: int = 28, placement_names: Sequence[str] | None = None, seed: int = 0, confirm_rounds: int = 0,
          log: Callable[[str], None] = print, save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the sweep; returns ``{"dims": {d: {config: {...medians...}}}, ...}`` (``save`` gets it after each d)."""
    torch.set_num_threads(1)
    names = list(placement_names) if placement_names is not None else list(placements())
    configs = [Config("host", special="sync"), Config("auto", special="auto")]
    configs += [Config(p, ov, g) for p in names for ov in (False, True) for g in gs]
    rng = random.Random(seed)
    out: dict[str, Any] = {"machine": _machine(), "loop": {"rollout": ROLLOUT, "batch": BATCH, "updates": UPDATES,
                                                            "hidden": HIDDEN},
                           "rounds": rounds, "iterations": iterations, "dims": {}}
    for d in dims:
        runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
        t0 = time.perf_counter()
        for r in range(rounds):
            order = configs[:]
            rng.shuffle(order)
            for cfg in order:
                runs[cfg.name].append(run_config(cfg, d, iterations=max(iterations, MIN_ITERATIONS.get(d, 0)),
                                                 warmup=warmup, auto_warmup=auto_warmup))
                gc.collect()  # the next configuration gets the memory of this one's buffer
            log(f"d={d}: round {r + 1}/{rounds} done ({time.perf_counter() - t0:.0f} s)")
        table = {}
        for name, rs in runs.items():
            med = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k.endswith("_s")}
            med["rounds"] = [x["iteration_s"] for x in rs]
            med["note"] = rs[-1]["note"]
            med["calibrated"] = all(x["calibrated"] for x in rs)
            med["decision"] = rs[-1]["decision"]
            table[name] = med
        summary = summarize(table)
        if confirm_rounds:
            summary["confirm"] = head_to_head(summary["best"], configs, d, rounds=confirm_rounds,
                                              iterations=max(iterations, MIN_ITERATIONS.get(d, 0)), warmup=warmup,
                                              auto_warmup=auto_warmup, rng=rng)
            log(f"d={d}: head-to-head auto vs {summary['best']}: {summary['confirm']['auto_vs_best']:.3f}x")
        out["dims"][str(d)] = summary
        if save is not None:
            save(out)
    return out


def head_to_head(best: str, configs: Sequence[Config], d: int, *, rounds: int, iterations: int, warmup: int,
                 auto_warmup: int, rng: random.Random) -> dict[str, Any]:
    """Re-measure the automatic choice against the sweep's best manual configuration, alternating, in fresh runs.

    The sweep's best is the minimum over many noisy configurations, so its own figure is biased
    low (the winner's curse); runs independent of the selection compare the two without that bias.
    """
    pair = [c for c in configs if c.name in (best, "auto")]
    times: dict[str, list[float]] = {c.name: [] for c in pair}
    for _ in range(rounds):
        rng.shuffle(pair)
        for cfg in pair:
            times[cfg.name].append(run_config(cfg, d, iterations=iterations, warmup=warmup,
                                              auto_warmup=auto_warmup)["iteration_s"])
            gc.collect()
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = [a / b for a, b in zip(times["auto"], times[best], strict=True)]
    return {"best": best, "rounds": rounds, "iteration_s": med, "per_round": times,
            "auto_vs_best": med["auto"] / med[best], "paired_ratio": statistics.median(paired),
            "paired_ratio_ci95": bootstrap_ci(paired, rng=rng)}


def bootstrap_ci(values: Sequence[float], *, rng: random.Random, draws: int = 2000) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of ``values``."""
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def ratio_cell(num: Sequence[float], den: Sequence[float], rng: random.Random) -> str:
    """The median of the per-round ratios ``num / den`` with its 95% bootstrap interval, as a table cell."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    lo, hi = bootstrap_ci(ratios, rng=rng)
    return f"{statistics.median(ratios):.2f}x ({lo:.2f}-{hi:.2f})"


def paired_rounds(calls: Mapping[str, Callable[[], object]], *, rounds: int, reps: int, warmup: int,
                  rng: random.Random, after: Callable[[str], object] | None = None) -> dict[str, list[float]]:
    """Time every call of ``calls`` once per round, in an order ``rng`` shuffles afresh each round.

    One timing is the median thread-CPU seconds of one call over ``reps`` calls, after ``warmup`` untimed ones
    (``_median_seconds`` with ``min_total=0``: exactly ``reps`` timed calls, whatever a call costs); ``after(key)``
    runs untimed after each timing (a check that the call did its work). Returns, per key in ``calls``' order, one
    time per round: the i-th times of two keys were taken in the same round, under the same load from other jobs, so
    their ratio is a paired one (``ratio_cell``).
    """
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        order = list(calls)
        rng.shuffle(order)
        for k in order:
            times[k].append(_median_seconds(calls[k], reps=reps, warmup=warmup, clock=time.thread_time, min_total=0))
            if after is not None:
                after(k)
    return times


def exposed_pairs(d: int, overlapped: str, *, rounds: int, iterations: int, warmup: int, rng: random.Random,
                  ) -> dict[str, Any]:
    """Exposed experience-path time of an overlapped configuration against the synchronous baseline, paired rounds."""
    placement, _, g = overlapped.split("/")
    pair = [Config("host", special="sync"), Config(placement, True, int(g.split("=")[1]))]
    exposed: dict[str, list[float]] = {c.name: [] for c in pair}
    for _ in range(rounds):
        rng.shuffle(pair)
        for cfg in pair:
            exposed[cfg.name].append(run_config(cfg, d, iterations=iterations, warmup=warmup,
                                                auto_warmup=0)["exposed_s"])
            gc.collect()
    reduction = [1 - o / s for o, s in zip(exposed[overlapped], exposed["sync"], strict=True)]
    return {"overlapped": overlapped, "rounds": rounds, "exposed_s": exposed,
            "reduction": statistics.median(reduction), "reduction_ci95": bootstrap_ci(reduction, rng=rng)}


def confirm_only(path: Path, dims: Sequence[int] | None, *, rounds: int, iterations: int, warmup: int = 2,
                 auto_warmup: int = 28, seed: int = 1, exposed_rounds: int = 0,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Head-to-head runs only: the automatic configuration against the best manual one a previous sweep found."""
    torch.set_num_threads(1)
    sweep_res = json.loads(path.read_text())
    rng = random.Random(seed)
    configs = [Config("auto", special="auto")] + [Config(p, ov, g) for p in placements() for ov in (False, True)
                                                  for g in GS]
    out: dict[str, Any] = {"machine": _machine(), "from": path.name, "dims": {}}
    for d in dims or [int(k) for k in sweep_res["dims"]]:
        best = sweep_res["dims"][str(d)]["best"]
        t0 = time.perf_counter()
        its = max(iterations, MIN_ITERATIONS.get(d, 0))
        h: dict[str, Any] = {}
        if rounds:
            h = head_to_head(best, configs, d, rounds=rounds, iterations=its, warmup=warmup,
                             auto_warmup=auto_warmup, rng=rng)
            lo, hi = h["paired_ratio_ci95"]
            log(f"d={d}: auto vs {best}, {rounds} paired rounds: median ratio {h['paired_ratio']:.3f} "
                f"(95% CI {lo:.3f}-{hi:.3f}), {time.perf_counter() - t0:.0f} s")
        if exposed_rounds:
            ovl = sweep_res["dims"][str(d)]["best_overlap_exposed"]
            e = h["exposed"] = exposed_pairs(d, ovl, rounds=exposed_rounds, iterations=its, warmup=warmup, rng=rng)
            lo, hi = e["reduction_ci95"]
            log(f"d={d}: exposed, {ovl} vs synchronous, {exposed_rounds} paired rounds: median "
                f"{e['reduction']:.2%} lower (95% CI {lo:.2%}-{hi:.2%})")
        out["dims"][str(d)] = h
    return out


def summarize(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Add the comparisons: best manual configuration, auto vs best, overlap vs the synchronous baseline."""
    manual = {k: v for k, v in table.items() if k not in ("sync", "auto")}
    best = min(manual, key=lambda k: manual[k]["iteration_s"])
    worst = max(manual, key=lambda k: manual[k]["iteration_s"])
    overl = {k: v for k, v in manual.items() if "/overlap/" in k}
    best_ovl = min(overl, key=lambda k: overl[k]["exposed_s"]) if overl else best
    sync = table["sync"]
    auto = table["auto"]
    return {"configs": table, "best": best, "worst": worst,
            "spread_s": manual[worst]["iteration_s"] - manual[best]["iteration_s"],
            "auto_vs_best": auto["iteration_s"] / manual[best]["iteration_s"],
            "best_overlap_exposed": best_ovl,
            "exposed_reduction": 1 - overl[best_ovl]["exposed_s"] / sync["exposed_s"] if overl else 0.0,
            "exposed_reduction_host_g1": (1 - table["host/overlap/g=1"]["exposed_s"] / sync["exposed_s"]
                                          if "host/overlap/g=1" in table else None)}


def _machine() -> dict[str, Any]:
    import os
    import platform

    return {"cpus": os.cpu_count(), "cuda": torch.cuda.is_available(), "torch": torch.__version__,
            "python": platform.python_version(), "torch_threads": 1}


def plot(results: dict[str, Any], path: Path = PLOT) -> Path:
    """Iteration time per configuration against d, with the automatic choice on top (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted(int(d) for d in results["dims"])
    names = sorted({n for d in dims for n in results["dims"][str(d)]["configs"]} - {"auto", "sync"})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    for n in names:
        ys = [results["dims"][str(d)]["configs"][n]["iteration_s"] * 1e3 for d in dims]
        style = "-" if "/overlap/" in n else "--"
        ax.plot(dims, ys, style, color="0.75" if "disk" in n else "0.55", lw=0.9)
    env = [min(results["dims"][str(d)]["configs"][n]["iteration_s"] for n in names) * 1e3 for d in dims]
    ax.plot(dims, env, color="tab:green", lw=2.5, label="lower envelope (best manual)")
    ax.plot(dims, [results["dims"][str(d)]["configs"]["sync"]["iteration_s"] * 1e3 for d in dims], color="tab:red",
            lw=1.5, label="synchronous baseline")
    ax.plot(dims, [results["dims"][str(d)]["configs"]["auto"]["iteration_s"] * 1e3 for d in dims], "o",
            color="tab:blue", ms=8, label="automatic choice")
    ax.set(xscale="log", yscale="log", xlabel="transition dimension d", ylabel="iteration time (ms, median)",
           title=f"{len(names)} manual configurations (grey; dashed = sequential)")
    ax.legend(fontsize=8)
    ax = axes[1]
    width = 0.35
    xs = range(len(dims))
    sync_e = [results["dims"][str(d)]["configs"]["sync"]["exposed_s"] * 1e3 for d in dims]
    best_e = [results["dims"][str(d)]["configs"][results["dims"][str(d)]["best_overlap_exposed"]]["exposed_s"] * 1e3
              for d in dims]
    ax.bar([x - width / 2 for x in xs], sync_e, width, color="tab:red", label="synchronous")
    ax.bar([x + width / 2 for x in xs], best_e, width, color="tab:blue", label="overlapped (best)")
    ax.set_xticks(list(xs), [str(d) for d in dims])
    ax.set(yscale="log", xlabel="transition dimension d", ylabel="exposed experience path (ms / iteration)",
           title="exposed experience-path latency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table_text(results: dict[str, Any]) -> str:
    lines = []
    for d, r in results["dims"].items():
        c = r["configs"]
        lines.append(f"\nd = {d}: best manual {r['best']} {c[r['best']]['iteration_s'] * 1e3:.1f} ms, auto "
                     f"{c['auto']['iteration_s'] * 1e3:.1f} ms ({r['auto_vs_best']:.3f}x best), spread "
                     f"{r['spread_s'] * 1e3:.1f} ms; exposed with overlap ({r['best_overlap_exposed']}) "
                     f"{r['exposed_reduction']:.1%} below synchronous")
        if "confirm" in r:
            h = r["confirm"]
            t_auto, t_best = h["iteration_s"]["auto"] * 1e3, h["iteration_s"][h["best"]] * 1e3
            lines.append(f"  head-to-head ({h['rounds']} fresh alternating rounds): auto {t_auto:.2f} ms vs "
                         f"{h['best']} {t_best:.2f} ms = {h['auto_vs_best']:.3f}x")
        for name in sorted(c, key=lambda k: c[k]["iteration_s"]):
            v = c[name]
            lines.append(f"  {name:26} iteration {v['iteration_s'] * 1e3:8.2f}  exposed {v['exposed_s'] * 1e3:7.3f}  "
                         f"hidden {v['hidden_s'] * 1e3:7.3f}  update {v['update_s'] * 1e3:7.2f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[128, 1000, 5000, 10000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--confirm-rounds", type=int, default=5,
                   help="head-to-head rounds of the automatic choice against the best manual configuration")
    p.add_argument("--confirm-only", action="store_true",
                   help="skip the sweep: run --confirm-rounds paired head-to-head rounds against the best manual "
                        "configurations in --out, and write them to config_sweep_confirm.json beside it")
    p.add_argument("--exposed-rounds", type=int, default=0,
                   help="with --confirm-only: also pair the synchronous baseline with the sweep's best overlapped "
                        "configuration this many times and report the exposed-time reduction")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, default=PLOT)
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.confirm_only:
        res = confirm_only(args.out, args.dims, rounds=args.confirm_rounds, iterations=args.iterations,
                           exposed_rounds=args.exposed_rounds)
        dest = args.out.with_name(f"config_sweep_confirm{'_exposed' if not args.confirm_rounds else ''}.json")
        dest.write_text(json.dumps(res, indent=1, default=str))
        print(f"wrote {dest}")
        return 0

    def save(res: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(res, indent=1, default=str))

    res = sweep(args.dims, rounds=args.rounds, iterations=args.iterations, confirm_rounds=args.confirm_rounds,
                save=save)
    print(table_text(res))
    print(f"\nwrote {args.out} and {plot(res, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
