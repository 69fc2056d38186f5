"""SRL driver, interleaved: the Conduit buffer with and without overlap, beside the plain FIFO (outside CI).

Each round runs every configuration once, at every d, in the same order: the FIFO, ``ConduitBuffer`` defaults
(``overlap=False``), ``overlap=True`` and ``prefetch=0``, each through the driver of
``benchmarks/test_bench_srl.py`` (2 actor threads, ZMQ on 127.0.0.1, ``consume_to``, a training thread with a
2 ms step; 256 samples, batches of 32, no coalescing). Interleaving keeps a change of machine load from
falling on one configuration only. Per configuration: median samples/s, ``consume_to`` time per sample and
``get`` median over the rounds, and in how many rounds it moved more samples/s than the defaults.

    .venv/bin/python benchmarks/scripts/srl_overlap_ab.py [--dims 128 5000] [--rounds 5]

Writes ``benchmarks/results/srl_overlap_ab.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from results_header import header_line  # noqa: E402
from test_bench_srl import SAMPLES, drive, make  # noqa: E402

#: configuration name -> ConduitBuffer arguments (None: the FIFO)
CONFIGS: dict[str, dict[str, Any] | None] = {
    "fifo": None, "defaults": {}, "overlap=True": {"overlap": True}, "prefetch=0": {"prefetch": 0}}


def run_once(kw: dict[str, Any] | None, d: int) -> tuple[float, float, float]:
    """(samples/s, consume_to seconds per sample, get median seconds) of one checked driver run."""
    buffer = make("fifo") if kw is None else make("conduit", **kw)
    t0 = time.perf_counter()
    r = drive(buffer, d)
    elapsed = time.perf_counter() - t0
    return SAMPLES / elapsed, r.consume_seconds / SAMPLES, float(np.median(r.get_latencies))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 5000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "srl_overlap_ab.md")
    args = ap.parse_args()
    runs: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for d in args.dims:
            for name, kw in CONFIGS.items():
                runs.setdefault((d, name), []).append(run_once(kw, d))
    lines = ["# srl_overlap_ab", "", header_line("srl_overlap_ab.py"), "",
             f"{args.rounds} rounds, every configuration once per round and d, in the same order. Medians over the "
             "rounds; `wins`: rounds in which it moved more samples/s than the defaults.", "",
             "| d | buffer | samples/s | consume_to per sample | get median | wins |", "|---|---|---|---|---|---|"]
    for d in args.dims:
        base = [r[0] for r in runs[(d, "defaults")]]
        for name in CONFIGS:
            rs = runs[(d, name)]
            wins = "-" if name == "defaults" else f"{sum(r[0] > b for r, b in zip(rs, base, strict=True))}/{len(rs)}"
            lines.append(f"| {d} | {name} | {statistics.median(r[0] for r in rs):.0f} | "
                         f"{statistics.median(r[1] for r in rs) * 1e6:.0f} us | "
                         f"{statistics.median(r[2] for r in rs) * 1e3:.3f} ms | {wins} |")
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
