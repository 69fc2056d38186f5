"""Host columns' memory, paired (outside CI): committing pages at construction, and huge pages for gathers.

Prefault: two ``ColumnarStorage`` of the same schema (two float32 fields of ``--item-dim`` 5000: one 40 KB item)
and capacity (``--item-capacity`` 5000 items, 200 MB), one built with ``prefault=True`` (the default: every page
zeroed at construction), one with ``prefault=False`` (the OS commits a page when it is first written). Per round,
in a shuffled order: the build's time, then the mean time of one single-item ``append_rows`` over the first pass of
the ring, and for the storage built without prefault a second pass (its pages committed by then).

Huge pages: sample-512's gather (``torch.index_select`` of 512 random rows into a reused buffer, the host
benchmark's floor) from a column allocated as Conduit's are (``empty_column``: NumPy memory, which asks Linux for
transparent huge pages from 4 MiB) and from one of ``torch.empty`` (no such request), both filled, same capacity as
the host benchmark (``capacity_for``). The process's ``AnonHugePages`` (``/proc/self/smaps_rollup``) after each
column is filled says whether the kernel granted any.

Every time is the thread's CPU clock (page faults are counted: the kernel works on the faulting thread).

    .venv/bin/python benchmarks/scripts/host_memory.py [--rounds 5] [--dims 1000 5000] [--out FILE]
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
from conduit import ExperienceSchema, Field
from conduit.storage.columnar import ColumnarStorage, empty_column

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from config_sweep import bootstrap_ci, paired_rounds, ratio_cell  # noqa: E402
from results_header import header_line  # noqa: E402
from test_bench_host import BATCH, capacity_for  # noqa: E402


def anon_huge_kib() -> int:
    """This process's anonymous memory backed by transparent huge pages, KiB (0 where Linux does not say)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def prefault_round(prefault: bool, item: dict[str, torch.Tensor], cap: int) -> dict[str, float]:
    """Build time (s) and mean single-item append time over the first pass (s); without prefault, the second's too."""
    d = item["obs"].shape[1]
    schema = ExperienceSchema(obs=Field((d,)), next_obs=Field((d,)))
    t0 = time.thread_time()
    store = ColumnarStorage(schema, cap, prefault=prefault)
    out = {"build": time.thread_time() - t0}
    for name in ("first", "second") if not prefault else ("first",):
        t0 = time.thread_time()
        for _ in range(cap):
            if store.append_rows(item) is None:
                sys.exit("this install has no compiled row store (see packages/conduit-core/hatch_build.py)")
        out[name] = (time.thread_time() - t0) / cap
    assert torch.equal(store._cols["obs"][cap - 1], item["obs"][0])
    del store
    gc.collect()
    return out


def gather_call(column: torch.Tensor) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """The floor's sample-512 over ``column`` (filled), and its output buffer."""
    cap, d = column.shape
    out = torch.empty(BATCH, d)
    gen = torch.Generator().manual_seed(0)
    return (lambda: torch.index_select(column, 0, torch.randint(cap, (BATCH,), generator=gen), out=out)), out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--item-dim", type=int, default=5000, help="prefault: d of each of the two fields")
    ap.add_argument("--item-capacity", type=int, default=5000, help="prefault: the storage's capacity")
    ap.add_argument("--dims", type=int, nargs="+", default=[1000, 5000], help="huge pages: the d of the gathers")
    ap.add_argument("--gather-rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures to this Markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    lines: list[str] = []

    dim, cap = args.item_dim, args.item_capacity
    item = {"obs": torch.randn(1, dim), "next_obs": torch.randn(1, dim)}
    res: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        order = [True, False]
        rng.shuffle(order)
        for p in order:
            res[p].append(prefault_round(p, item, cap))
    on, off = res[True], res[False]
    build_extra = [b["build"] - a["build"] for a, b in zip(off, on, strict=True)]
    first_ratio = [b["first"] / a["first"] for a, b in zip(on, off, strict=True)]
    lo, hi = bootstrap_ci(first_ratio, rng=rng)
    us = [f"{statistics.median(r[k] for r in rs) * 1e6:.1f}" for rs, k in ((off, "first"), (off, "second"),
                                                                            (on, "first"))]
    lines += ["## prefault", "",
              f"d = {dim}, two float32 fields (one item {8 * dim / 1000:g} KB), capacity {cap} "
              f"({8 * dim * cap / 1e6:g} MB); {args.rounds} paired rounds; medians.", "",
              "| append one item, first pass without prefault, us | second pass without prefault, us | "
              "first pass with prefault, us | first pass without / with prefault | build with prefault, ms | "
              "build without, ms | build: extra for prefault, ms |",
              "|---|---|---|---|---|---|---|",
              f"| {us[0]} | {us[1]} | {us[2]} | {statistics.median(first_ratio):.2f}x ({lo:.2f}-{hi:.2f}) | "
              f"{statistics.median(r['build'] for r in on) * 1e3:.1f} | "
              f"{statistics.median(r['build'] for r in off) * 1e3:.1f} | "
              f"{statistics.median(build_extra) * 1e3:.1f} ({min(build_extra) * 1e3:.1f}-"
              f"{max(build_extra) * 1e3:.1f}) |", ""]
    print("\n".join(lines[-2:]), flush=True)

    lines += ["## huge pages", "",
              f"Sample-512 gather (index_select into a reused buffer), {args.gather_rounds} paired rounds of "
              f"{args.calls} calls; ratio: NumPy-allocated column (`empty_column`) / `torch.empty` column. "
              "AnonHugePages: this process's, after the column was filled.", "",
              "| d | capacity | torch.empty, ms | empty_column / torch.empty | AnonHugePages, torch.empty, KiB | "
              "AnonHugePages, empty_column, KiB |", "|---|---|---|---|---|---|"]
    for d in args.dims:
        cap = capacity_for(d)
        huge0 = anon_huge_kib()
        plain = torch.empty(cap, d).normal_()
        huge_plain = anon_huge_kib() - huge0
        numpy_col = empty_column((cap, d), torch.float32)
        numpy_col.normal_()
        huge_numpy = anon_huge_kib() - huge0 - huge_plain
        calls = {"torch": gather_call(plain)[0], "numpy": gather_call(numpy_col)[0]}
        times = paired_rounds(calls, rounds=args.gather_rounds, reps=args.calls, warmup=1, rng=rng)
        row = (f"| {d} | {cap} | {statistics.median(times['torch']) * 1e3:.4f} | "
               f"{ratio_cell(times['numpy'], times['torch'], rng)} | {huge_plain} | {huge_numpy} |")
        print(row, flush=True)
        lines.append(row)
        del plain, numpy_col, calls
        gc.collect()
    lines.append("")
    if args.out is not None:
        head = ["# host_memory", "", header_line("host_memory.py", argv), "",
                "Paired rounds, thread CPU clock, 1 torch thread (`benchmarks/scripts/host_memory.py`). The "
                "machine's transparent huge pages: `" + _thp_mode() + "`.", ""]
        args.out.write_text("\n".join(head + lines))
        print(f"wrote {args.out}")


def _thp_mode() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
