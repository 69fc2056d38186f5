"""TorchRL's one-item ingestion, paired: ``add`` of one item against ``extend`` of a batch of one (outside CI).

The host benchmarks (``benchmarks/test_bench_host.py``) time TorchRL's ``add``, its documented call for one item;
earlier tables timed ``extend`` of a batch of one. Both calls go to the same TorchRL buffer (the host benchmark's
own, ``build("torchrl", ...)``: same capacity and data), beside the host benchmark's copy floor (one ``copy_``
into a preallocated ring). Every round times the three once, in a shuffled order (``--calls`` calls each, median,
the thread's CPU clock); the cell is the median of the per-round ratios with its 95% bootstrap interval. After
every timing the row the buffer stored last must be the one handed over.

    .venv/bin/python benchmarks/scripts/torchrl_add_extend.py [--dims 128 1000 5000 20000] [--rounds 20] [--out FILE]

Prints one line per d; with ``--out``, also writes them as a Markdown table to FILE, after a line naming the machine,
the command and the date.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from config_sweep import paired_rounds, ratio_cell  # noqa: E402
from results_header import header_line  # noqa: E402
from test_bench_host import build, capacity_for, check_ingest  # noqa: E402


def measure(d: int, rounds: int, calls: int, rng: random.Random) -> dict[str, list[float]]:
    """Per variant (floor, add, extend1): one median per round, in seconds."""
    from tensordict import TensorDict

    data = torch.randn(1024, d)
    cap = capacity_for(d)
    floor = build("floor", d, cap, data)
    trl = build("torchrl", d, cap, data)
    batch_of_one = TensorDict({"obs": data[:1]}, batch_size=[1])
    buffer = _torchrl_buffer(trl)
    variants = {"floor": floor.ingest1, "add": trl.ingest1, "extend1": lambda: buffer.extend(batch_of_one)}
    owners = {"floor": floor, "add": trl, "extend1": trl}
    return paired_rounds(variants, rounds=rounds, reps=calls, warmup=1, rng=rng,
                         after=lambda k: check_ingest(k, owners[k], 1, data))


def _torchrl_buffer(calls: object) -> Any:
    """The TorchRL ``ReplayBuffer`` behind ``build("torchrl", ...)``'s calls (its ``newest`` closes over it)."""
    for c in calls.newest.__closure__ or ():  # type: ignore[attr-defined]
        if type(c.cell_contents).__name__ == "ReplayBuffer":
            return c.cell_contents
    raise RuntimeError("no TorchRL ReplayBuffer behind these calls")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 1000, 5000, 20000])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures to this Markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    rows = []
    for d in args.dims:
        r = measure(d, args.rounds, args.calls, rng)
        row = (f"| d={d} | {statistics.median(r['floor']) * 1e3:.4f} | {ratio_cell(r['add'], r['floor'], rng)} | "
               f"{ratio_cell(r['extend1'], r['floor'], rng)} | {ratio_cell(r['add'], r['extend1'], rng)} |")
        print(row, flush=True)
        rows.append(row)
    if args.out is not None:
        lines = ["# torchrl_add_extend", "", header_line("torchrl_add_extend.py", argv), "",
                 f"Paired rounds ({args.rounds} per d, {args.calls} calls per variant per round, shuffled order, "
                 "thread CPU clock, 1 torch thread): TorchRL 'add' of one item and 'extend' of a batch of one into "
                 "the same buffer, and the copy floor; the median of the per-round ratios, with its 95% bootstrap "
                 "interval.", "",
                 "| d | floor, ms | add / floor | extend1 / floor | add / extend1 |", "|---|---|---|---|---|",
                 *rows, ""]
        args.out.write_text("\n".join(lines))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
