"""Prioritized replay step, the compiled sum tree against NumPy's, in alternating paired rounds (outside CI).

One training step's buffer work as ``benchmarks/test_bench_prioritized.py`` times it (draw 32 with importance
weights, then update their 32 priorities; alpha 0.6, beta 0.4, a full buffer of 4-float observations), on three
buffers that differ only in their sampler's tree, loaded with the same priorities:

* ``compiled``: ``CompiledSumTree``, whose draw and update the sampler makes one C call each;
* ``general``: the same compiled tree under another type, so the sampler takes its general NumPy path around
  the tree's kernels (find, get, the weights, set: the path before the one-call kernels);
* ``numpy``: NumPy's ``SumTree`` (leaves only up to 16384 slots, two levels above), on that general path.

Each round times all three, in a shuffled order (median of ``--calls`` calls, the thread's CPU clock); each figure
is the median of the per-round ratios with a 95% bootstrap interval.

    .venv/bin/python benchmarks/scripts/prioritized_trees.py [--capacities 5000 50000] [--rounds 12] [--out FILE]

Prints one line per capacity; with ``--out``, also writes them as a Markdown table to FILE, after a line naming
the machine, the command and the date.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay
from conduit.semantics.sumtree import COMPILED, CompiledSumTree, SumTree

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_sweep import bootstrap_ci, paired_rounds  # noqa: E402
from results_header import header_line  # noqa: E402

VARIANTS = ("compiled", "general", "numpy")


class GeneralPathTree(CompiledSumTree):
    """The compiled tree under another type: the sampler's general path runs on it."""


def step_of(capacity: int, variant: str) -> Callable[[], object]:
    """A full prioritized buffer whose sampler has the tree of ``variant`` (see above); returns one training step."""
    obs = np.random.default_rng(0).random((capacity, 4), dtype=np.float32)
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((4,))), capacity=capacity,
                              semantics=Replay(PrioritizedSampler(alpha=0.6, beta=0.4), seed=0))
    edp.ingest({"obs": torch.from_numpy(obs)})
    assert isinstance(edp.semantics, Replay)
    sampler = edp.semantics.sampler
    if variant != "compiled":
        tree = SumTree(capacity) if variant == "numpy" else GeneralPathTree(capacity)
        tree.load(sampler._tree.state())  # type: ignore[attr-defined]
        sampler._tree = tree  # type: ignore[attr-defined]
    prios = np.random.default_rng(1)

    def step() -> object:
        _, info = edp.deliver(32)
        return edp.update_priorities(info.handles.numpy(), prios.random(32) + 0.01)
    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacities", type=int, nargs="+", default=[5000, 50000])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures to this Markdown file")
    args = ap.parse_args(argv)
    if not COMPILED:
        sys.exit("this install has no compiled sum tree (see packages/conduit-core/hatch_build.py)")
    torch.set_num_threads(1)
    rng = random.Random(0)
    rows = []
    for cap in args.capacities:
        steps = {k: step_of(cap, k) for k in VARIANTS}
        times = paired_rounds(steps, rounds=args.rounds, reps=args.calls, warmup=50, rng=rng)
        medians = ", ".join(f"{k} {statistics.median(t) * 1e6:.1f} us" for k, t in times.items())
        figures = []
        cells = [f"{statistics.median(times[k]) * 1e6:.1f}" for k in VARIANTS]
        for other in ("general", "numpy"):
            ratios = [c / o for c, o in zip(times["compiled"], times[other], strict=True)]
            lo, hi = bootstrap_ci(ratios, rng=rng)
            figures.append(f"compiled / {other} {statistics.median(ratios):.3f}x ({lo:.3f}-{hi:.3f})")
            cells.append(f"{statistics.median(ratios):.3f}x ({lo:.3f}-{hi:.3f})")
        print(f"capacity {cap}: {medians}; {'; '.join(figures)}", flush=True)
        rows.append(f"| {cap} | " + " | ".join(cells) + " |")
    if args.out is not None:
        lines = ["# prioritized_trees", "", header_line("prioritized_trees.py", argv), "",
                 f"Paired rounds ({args.rounds}, {args.calls} calls per variant per round, shuffled order, thread "
                 "CPU clock, 1 torch thread): one step is draw 32 with weights + update their 32 priorities. "
                 "Times: the median of the per-round medians; ratios: the median of the per-round ratios, with its "
                 "95% bootstrap interval.", "",
                 "| capacity | compiled, us | general, us | numpy, us | compiled / general | compiled / numpy |",
                 "|---|---|---|---|---|---|", *rows, ""]
        args.out.write_text("\n".join(lines))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
