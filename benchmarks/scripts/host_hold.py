"""Sample-512 with the previous batch held or dropped, Conduit vs cpprb, paired (outside CI).

A delivered batch stays valid until the second delivery after it; for batches of 1 MiB and more Conduit reuses the
buffer it returned last when nothing references it any more. The host benchmarks drop every batch before the next
call, so they always get that reuse; the usual training loop (``batch, info = edp.deliver(512)``, then train on
``batch``) still holds the previous batch while it asks for the next one. Here each library's draw runs both ways on
the host benchmark's own buffers (``benchmarks/test_bench_host.py``: same capacities and data): ``drop`` discards
the result at once, ``hold`` keeps the last result until the next call has returned. Every round times the four
once, in a shuffled order (``--calls`` calls each, median, the thread's CPU clock); a cell is the median of the
per-round ratios with its 95% bootstrap interval.

    .venv/bin/python benchmarks/scripts/host_hold.py [--dims 1000 5000 20000] [--rounds 12] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from config_sweep import paired_rounds, ratio_cell  # noqa: E402
from results_header import header_line  # noqa: E402
from test_bench_host import build, capacity_for, check_sample  # noqa: E402


def holding(call: Callable[[], object]) -> Callable[[], None]:
    """``call``, its last result kept until the next call has returned (the training loop's pattern)."""
    held: list[object] = [None]

    def step() -> None:
        held[0] = call()
    return step


def dropping(call: Callable[[], object]) -> Callable[[], None]:
    """``call``, its result discarded at once."""
    def step() -> None:
        call()
    return step


def measure(d: int, rounds: int, calls: int, rng: random.Random) -> dict[str, list[float]]:
    data = torch.randn(1024, d)
    made = {lib: build(lib, d, capacity_for(d), data) for lib in ("conduit", "cpprb")}
    for lib, m in made.items():
        check_sample(lib, m.sample(), data)
    steps = {f"{lib} {how}": wrap(m.sample) for lib, m in made.items()
             for how, wrap in (("drop", dropping), ("hold", holding))}
    out = paired_rounds(steps, rounds=rounds, reps=calls, warmup=2, rng=rng)
    for lib, m in made.items():
        check_sample(lib, m.sample(), data)
    made.clear()
    steps.clear()
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[1000, 5000, 20000])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures to this Markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    rows = []
    for d in args.dims:
        r = measure(d, args.rounds, args.calls, rng)
        row = (f"| d={d} | {statistics.median(r['cpprb drop']) * 1e3:.4f} | "
               f"{ratio_cell(r['conduit drop'], r['cpprb drop'], rng)} | "
               f"{ratio_cell(r['conduit hold'], r['cpprb hold'], rng)} | "
               f"{ratio_cell(r['conduit hold'], r['conduit drop'], rng)} | "
               f"{ratio_cell(r['cpprb hold'], r['cpprb drop'], rng)} |")
        print(row, flush=True)
        rows.append(row)
    if args.out is not None:
        lines = ["# host_hold", "", header_line("host_hold.py", argv), "",
                 f"Paired rounds ({args.rounds} per d, {args.calls} calls per variant per round, shuffled order, "
                 "thread CPU clock, 1 torch thread): sample 512 with the previous batch dropped or held; the median "
                 "of the per-round ratios, with its 95% bootstrap interval.", "",
                 "| d | cpprb drop, ms | conduit / cpprb, drop | conduit / cpprb, hold | conduit hold / drop | "
                 "cpprb hold / drop |", "|---|---|---|---|---|---|", *rows, ""]
        args.out.write_text("\n".join(lines))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
