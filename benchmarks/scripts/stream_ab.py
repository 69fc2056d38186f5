"""Host tier, paired: Conduit's row copies with and without non-temporal stores, on this machine (outside CI).

``conduit.storage._rows`` writes a large gather, and a large run into the ring, with non-temporal stores (around
the caches). Whether that wins depends on the machine's caches. Here one Conduit buffer per d is timed in
alternating rounds with streaming from the given sizes (default: gathers from 4 MiB, ring runs from 1 MiB, the
thresholds measured on a 16 MiB L3) and without it (``_rows.streaming``), in a shuffled order, and
the ratio ``plain / streamed`` is taken within each round: above 1 means the non-temporal stores win. Same
buffers, data and ops as ``benchmarks/scripts/host_paired.py`` (median of the calls, the thread's CPU clock).

    .venv/bin/python benchmarks/scripts/stream_ab.py [--dims 5000 10000 20000 40000] [--rounds 20]

Writes ``benchmarks/results/stream_ab.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from conduit.storage import columnar

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from config_sweep import ratio_cell  # noqa: E402
from host_paired import OPS, time_call  # noqa: E402
from test_bench_host import build, capacity_for  # noqa: E402

NEVER = 1 << 62
ABOVE = {"sample512", "sample512_read", "ingest256"}  # the ops whose copies can reach the thresholds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[5000, 10000, 20000, 40000])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--gather-min", type=int, default=4 << 20, help="bytes from which a gather streams")
    ap.add_argument("--run-min", type=int, default=1 << 20, help="bytes from which a ring run streams")
    ap.add_argument("--machine", default="(not described)", help="the machine and its load, for the record")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "stream_ab.md")
    args = ap.parse_args()
    if columnar._rows is None:
        raise SystemExit("conduit.storage._rows is not compiled here: nothing to compare")
    torch.set_num_threads(1)
    defaults = columnar._rows.streaming(None, None)
    streamed = (args.gather_min, args.run_min)
    rng = random.Random(0)
    rows = []
    for d in args.dims:
        data = torch.randn(1024, d)
        calls = build("conduit", d, capacity_for(d), data)
        times: dict[str, dict[str, list[float]]] = {op: {"streamed": [], "plain": []} for op in ABOVE}
        for _ in range(args.rounds):
            for op in sorted(ABOVE):
                fn = OPS[op]("conduit", calls)
                order = ["streamed", "plain"]
                rng.shuffle(order)
                for variant in order:
                    columnar._rows.streaming(*(streamed if variant == "streamed" else (NEVER, NEVER)))
                    try:
                        times[op][variant].append(time_call(fn, args.calls))
                    finally:
                        columnar._rows.streaming(*defaults)
        cells = [f"{statistics.median(times[op]['streamed']) * 1e3:.3f} ms, "
                 + ratio_cell(times[op]["plain"], times[op]["streamed"], rng) for op in sorted(ABOVE)]
        row = f"| d={d} | " + " | ".join(cells) + " |"
        rows.append(row)
        print(row, flush=True)
    llc = columnar.last_level_cache()
    lines = ["# stream_ab", "",
             f"Conduit alone, non-temporal stores on (gathers from {streamed[0]} B, ring runs from {streamed[1]} B) "
             f"against off, in paired rounds ({args.rounds} per d, {args.calls} calls per setting per round, "
             "shuffled order, thread CPU clock, 1 torch thread). Each cell: the streamed time, then the median of "
             "the per-round ratios plain / streamed with its 95% bootstrap interval (above 1: streaming wins). "
             f"Last-level cache reported: {'unknown' if llc is None else f'{llc >> 20} MiB'}. "
             "`benchmarks/scripts/stream_ab.py`.", "", f"Machine: {args.machine}", "",
             "| d | " + " | ".join(sorted(ABOVE)) + " |", "|---" * (len(ABOVE) + 1) + "|", *rows, ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
