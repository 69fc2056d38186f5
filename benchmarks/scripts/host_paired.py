"""Host tier, paired: Conduit vs cpprb vs TorchRL vs the floor, in alternating rounds (outside CI).

pytest-benchmark times one library after the other, so the machine's slow drift (on these
shared vCPUs, 10-30% within a minute) lands on whichever library ran during it. Here every
round times every library once, in a shuffled order, ``--calls`` calls each (median of the
calls, the thread's CPU clock), and a ratio is taken within the round. The figure per cell is
the median of the per-round ratios with a 95% bootstrap interval: the form in which "faster
than cpprb" can be told apart from a tie. The buffers are the benchmark's own
(``benchmarks/test_bench_host.py``: same capacities, data and floor). Ops: sample 512; sample 512 then one read of
the batch (``sample512_read``: where the gather left the batch shows in the reader's time); ingest 256; ingest 1.

    .venv/bin/python benchmarks/scripts/host_paired.py [--dims 128 1000 5000 20000] [--rounds 30]

Writes ``benchmarks/results/host_paired.md`` (``--out``: another file), after a line naming the machine, the command
and the date.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from conduit.placement.profile import _median_seconds

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from config_sweep import ratio_cell  # noqa: E402
from results_header import header_line  # noqa: E402
from test_bench_host import LIBS, Calls, build, capacity_for, check_ingest, check_sample, draw_then_read  # noqa: E402

#: op -> the call it times, from a library's name and build()'s (ingest one, ingest 256, sample); sample512_read:
#: the draw, then one read of the batch (a sum), as a learner uses it
INGEST_ROWS = {"ingest256": 256, "ingest1": 1}
OPS: dict[str, Callable[[str, Calls], Callable[[], object]]] = {
    "sample512": lambda lib, calls: calls[2],
    "sample512_read": lambda lib, calls: draw_then_read(lib, calls[2]),
    "ingest256": lambda lib, calls: calls[1],
    "ingest1": lambda lib, calls: calls[0],
}


def time_call(fn: Callable[[], object], calls: int) -> float:
    """Median thread-CPU seconds of one call, after one untimed warm-up call."""
    return _median_seconds(fn, reps=calls, warmup=1, clock=time.thread_time, min_total=0)


def measure(d: int, rounds: int, reps: int, libs: list[str], rng: random.Random) -> dict[str, dict[str, list[float]]]:
    """Per op, per library: one median per round. Every library's draws are checked before and after the rounds
    (``BATCH`` rows of the data ingested) and its ingestion after each timing (the rows it stored last are the
    ones handed over): a fast wrong answer is not a measurement."""
    data = torch.randn(1024, d)
    made = {lib: build(lib, d, capacity_for(d), data) for lib in libs}
    calls = {op: {lib: pick(lib, made[lib]) for lib in libs} for op, pick in OPS.items()}
    out: dict[str, dict[str, list[float]]] = {op: {lib: [] for lib in libs} for op in OPS}
    for lib in libs:
        check_sample(lib, made[lib].sample(), data)
    for _ in range(rounds):
        for op in OPS:
            order = list(libs)
            rng.shuffle(order)
            for lib in order:
                out[op][lib].append(time_call(calls[op][lib], reps))
                if op in INGEST_ROWS:
                    check_ingest(lib, made[lib], INGEST_ROWS[op], data)
    for lib in libs:
        check_sample(lib, made[lib].sample(), data)
    made.clear()
    calls.clear()
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 1000, 5000, 20000])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--no-torchrl", action="store_true", help="leave TorchRL out (its d = 20000 sample takes ~50 ms)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "host_paired.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    libs = [lib for lib in LIBS if not (args.no_torchrl and lib == "torchrl")]
    others = [lib for lib in libs if lib != "floor"]
    rng = random.Random(0)
    rows: dict[str, list[str]] = {op: [] for op in OPS}
    for d in args.dims:
        res = measure(d, args.rounds, args.calls, libs, rng)
        for op in OPS:
            r = res[op]
            cells = [ratio_cell(r[lib], r["floor"], rng) for lib in others]
            row = (f"| d={d} | {statistics.median(r['floor']) * 1e3:.4f} | " + " | ".join(cells)
                   + f" | {ratio_cell(r['conduit'], r['cpprb'], rng)} |")
            rows[op].append(row)
            print(op, row, flush=True)
    lines = ["# host_paired", "", header_line("host_paired.py", argv), "",
             f"Paired rounds ({args.rounds} per d, {args.calls} calls per library per round, shuffled order, "
             "thread CPU clock, 1 torch thread): the median of the per-round ratios, with its 95% bootstrap "
             "interval. `benchmarks/scripts/host_paired.py`.", ""]
    for op in OPS:
        lines += [f"## {op}", "", "| d | floor, ms | " + " | ".join(f"{lib} / floor" for lib in others)
                  + " | conduit / cpprb |", "|---" * (len(others) + 3) + "|", *rows[op], ""]
    text = "\n".join(lines)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
