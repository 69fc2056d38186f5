"""Markdown tables from the ``rllib_breakdown.py`` results (``benchmarks/results/rllib_breakdown_*.json``).

    .venv/bin/python benchmarks/scripts/rllib_report.py
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
PARTS = ("add", "sample", "priorities", "batch", "minibatch", "background")
#: the rest of an iteration (not experience path), where the probe recorded it
CONTEXT = ("env", "weights", "update")


def main() -> int:
    files = sorted(RESULTS.glob("rllib_breakdown_*.json"))
    if not files:
        print("no results: run benchmarks/scripts/rllib_breakdown.py first")
        return 1
    print("| workload | experience path ms (native -> Conduit) | exposed | iteration s | CPU s |")
    print("|---|---|---|---|---|")
    parts = []
    for f in files:
        d = json.loads(f.read_text())
        s = d["summary"]
        n, c, ch = s["native"], s["conduit"], s["conduit"]["change"]
        print(f"| {d['workload']} | {n['experience_s'] * 1e3:.0f} -> {c['experience_s'] * 1e3:.0f} "
              f"({ch['experience_s']:+.0%}) | {n['exposed_s'] * 1e3:.0f} -> {c['exposed_s'] * 1e3:.0f} "
              f"(**{ch['exposed_s']:+.0%}**) | {n['iteration_s']:.2f} -> {c['iteration_s']:.2f} "
              f"(**{ch['iteration_s']:+.0%}**) | {n['cpu_s']:.2f} -> {c['cpu_s']:.2f} ({ch['cpu_s']:+.0%}) |")
        parts.append((d["workload"], n["parts"], c["parts"]))
    print()
    print("| workload | variant | " + " | ".join(PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    for name, n, c in parts:
        for variant, p in (("native", n), ("conduit", c)):
            print(f"| {name} | {variant} | " + " | ".join(f"{p.get(k, 0.0) * 1e3:.0f}" for k in PARTS) + " |")
    context = [(f, json.loads(f.read_text())) for f in files]
    context = [(d["workload"], d["summary"]) for f, d in context if "env" in d["summary"]["native"]["parts"]]
    if context:
        print()
        print("| workload | variant | iteration ms | exposed | " + " | ".join(CONTEXT) + " | other |")
        print("|---|---|---|---|" + "---|" * (len(CONTEXT) + 1))
        for name, s in context:
            for variant in ("native", "conduit"):
                v, p = s[variant], s[variant]["parts"]
                other = v["iteration_s"] - v["exposed_s"] - sum(p[k] for k in CONTEXT)
                print(f"| {name} | {variant} | {v['iteration_s'] * 1e3:.0f} | {v['exposed_s'] * 1e3:.0f} | "
                      + " | ".join(f"{p[k] * 1e3:.0f}" for k in CONTEXT) + f" | {other * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
