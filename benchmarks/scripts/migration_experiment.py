"""The paper's online-migration experiment, as a COST-MODEL SIMULATION (nothing runs on GPUs).

Over 40 iterations the observation size grows from 128 to 20000 on the declared
``dgx-a100-80g`` topology (8 x A100 80 GB): Greedy keeps its first placement and runs out
of GPU memory, Conservative shards over all 8 GPUs from the start, Conduit follows a
placement map computed ahead and migrates online. Every latency is the cost model's
prediction from the topology's declared link figures.

The planner and cost model are core's (:class:`conduit.placement.Planner`,
:class:`conduit.placement.CostModel`), which price Conduit's implementation: one GPU takes
a pageable copy from the actors' tensors; a sharded buffer stages each shard's rows in
page-locked memory and fills the shards over their GPUs' host links in parallel (GPUs
behind one PCIe switch share it); a sharded delivery uploads per-shard row indices and
per-field positions.

Run:  .venv/bin/python benchmarks/scripts/migration_experiment.py [--json out.json]
Writes benchmarks/docs/migration.png and prints the markdown table used in docs/placement.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from conduit.placement import Planner, load_topology
from conduit.placement.growth import paper_schedule, simulate_growth

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _ms(seconds: float | None) -> str:
    """A table cell: milliseconds, or OOM where the strategy had no placement that fit."""
    return "OOM" if seconds is None else f"{seconds * 1e3:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", default="dgx-a100-80g")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--updates", type=int, default=16, help="learner updates (ingest + deliver) per iteration")
    ap.add_argument("--capacity", type=int, default=10**6)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--json", type=Path, help="also write the full result as JSON here")
    ap.add_argument("--png", type=Path, default=DOCS / "migration.png")
    args = ap.parse_args()

    schedule = paper_schedule(args.iterations)
    planner = Planner(load_topology(args.topology))
    res = simulate_growth(planner, schedule, capacity=args.capacity,
                          batch=args.batch, updates=args.updates)
    g, c, k = (res.strategies[n] for n in ("greedy", "conservative", "conduit"))

    print(f"Cost-model simulation on {args.topology}: "
          f"capacity {args.capacity}, batch {args.batch}, "
          f"{args.updates} updates per iteration, d = {sorted(set(schedule))} over {len(schedule)} iterations.\n")
    print("| d | iterations | Greedy ms/iter | Conservative ms/iter | Conduit ms/iter | Conduit below Conservative "
          "| Conduit placement |")
    print("|---|---|---|---|---|---|---|")
    for d in sorted(set(schedule)):
        its = [i for i, x in enumerate(schedule) if x == d]
        steady = [i for i in its if not any(m[0] == i for m in k.migrations)]
        gl, cl, kl = (s.latency_s[steady[0]] for s in (g, c, k))
        below = "-" if cl is None or kl is None else f"{1 - kl / cl:.0%}"
        print(f"| {d} | {its[0]}-{its[-1]} | {_ms(gl)} | {_ms(cl)} | {_ms(kl)} | {below} | {k.placements[its[0]]} |")
    print()
    for i, s, a, b in k.migrations:
        print(f"- migration at iteration {i} (d = {schedule[i]}): {a} -> {b}, {s * 1e3:.1f} ms predicted")
    failed_d = schedule[g.failed_at] if g.failed_at is not None else "-"
    print(f"- Greedy: fails at iteration {g.failed_at} (d = {failed_d}): {g.reason}")
    print(f"- cumulative over {len(schedule)} iterations: Conservative {c.cumulative_s * 1e3:.0f} ms, Conduit "
          f"{k.cumulative_s * 1e3:.0f} ms: Conservative / Conduit = {res.conservative_over_conduit:.2f}x "
          f"(paper: 1.9x); Greedy completes only {g.failed_at} iterations ({g.cumulative_s * 1e3:.0f} ms).")

    if args.json:
        args.json.write_text(json.dumps(res.to_dict(), indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    it = list(range(len(schedule)))
    for tr, style, kw in ((g, "-", {"lw": 6, "alpha": 0.35}), (c, "s-", {"ms": 3}), (k, "^-", {"ms": 3})):
        ys = [float("nan") if x is None else x * 1e3 for x in tr.latency_s]
        ax.plot(it, ys, style, label=tr.name.capitalize(), **kw)
    if g.failed_at is not None:
        ax.axvline(g.failed_at, color="C0", ls=":", lw=1)
        ax.annotate("Greedy: out of GPU memory", (g.failed_at, ax.get_ylim()[1] * 0.6), color="C0", fontsize=8,
                    xytext=(4, 0), textcoords="offset points")
    for i, s, _, b in k.migrations:
        lat = k.latency_s[i]
        assert lat is not None  # the iteration that migrated ran (its latency includes the migration)
        ax.annotate(f"migrate -> {b.split('[')[0]} x{b.count('cuda')}\n(+{s * 1e3:.0f} ms)",
                    (i, lat * 1e3), fontsize=7, xytext=(-105, -4), textcoords="offset points",
                    arrowprops={"arrowstyle": "->", "lw": 0.6})
    ax.set_ylabel("experience-path latency per iteration (ms)")
    ax.set_title(f"Online migration, cost-model simulation on {args.topology}\n"
                 f"cumulative: Conservative / Conduit = {res.conservative_over_conduit:.2f}x (paper: 1.9x)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax2.step(it, schedule, where="post", color="gray")
    ax2.set_yscale("log")
    ax2.set_ylabel("obs dim d")
    ax2.set_xlabel("iteration")
    ax2.grid(alpha=0.3)
    fig.text(0.01, 0.005, "Simulated with Conduit's cost model and the declared topology figures; not a measurement.",
             fontsize=7, color="gray")
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
