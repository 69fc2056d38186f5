"""Placement on a GPU machine: profile it, and sample-512 on the GPU tier against the on-GPU gather floor.

Prepared for a lent GPU machine (the project's H200). Run there, from the repository root::

    .venv/bin/python -m pytest packages/conduit-core/tests/test_tiers.py -k "Gpu or Pinned or Mixed or gpu" -q
    .venv/bin/python benchmarks/scripts/gpu_placement.py --out "$OUT"

Writes ``profile.json`` (the measured bandwidth profile), ``gpu_sample512.md`` and
``gpu_sample512.json`` into ``--out``:

* Conduit's GPU tier (``DevicePlacement("cuda:0")``, learner on ``cuda:0``): ``deliver(512)``
  of transitions, CUDA-synchronised, median of ``--reps`` after warm-up;
* the floor: ``torch.index_select`` of the same columns with indices drawn on the GPU, into
  reused outputs: the gathers and nothing else;
* the cost model's prediction for the GPU tier from the profile just measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import cast

import torch
from conduit import ExperienceDataPlane, Replay
from conduit.placement import (
    CostModel,
    DevicePlacement,
    PlacementSpec,
    Workload,
    discover_topology,
    profile_machine,
    transition_schema,
)
from conduit.storage.columnar import ColumnarStorage

DIMS = [128, 1000, 5000, 20000]
BATCH = 512


def median_cuda(fn, reps: int, warmup: int = 10) -> float:  # noqa: ANN001
    times = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=101)
    ap.add_argument("--buffer-gib", type=float, default=4.0, help="bytes of each transition buffer")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this script is for the GPU machine")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    prof = profile_machine(cache=False, refresh=True)
    (args.out / "profile.json").write_text(json.dumps(prof.to_dict(), indent=1))
    print(f"profiled in {time.time() - t0:.1f} s")
    model = CostModel(discover_topology(), prof)
    rows = []
    for d in DIMS:
        schema = transition_schema(d)
        cap = int(args.buffer_gib * 2**30 // schema.fixed_item_bytes)
        edp = ExperienceDataPlane(schema, capacity=cap, placement=DevicePlacement("cuda:0"), semantics=Replay(seed=0))
        chunk = max(1, (256 << 20) // schema.fixed_item_bytes)
        for s in range(0, cap, chunk):
            n = min(chunk, cap - s)
            ids = torch.arange(s, s + n)
            edp.ingest({"obs": ids[:, None].float().expand(n, d), "next_obs": ids[:, None].float().expand(n, d),
                        "action": ids % 16, "reward": ids.float(), "done": ids % 100 == 0})
        conduit_s = median_cuda(lambda edp=edp: edp.deliver(BATCH), args.reps)
        storage = cast(ColumnarStorage, edp.storage)
        cols = [storage._cols[n] for n in schema]  # the very memory the GPU tier gathers from
        outs = [torch.empty((BATCH, *c.shape[1:]), dtype=c.dtype, device="cuda:0") for c in cols]
        gen = torch.Generator(device="cuda:0").manual_seed(0)

        def floor(cols=cols, outs=outs, gen=gen, cap=cap) -> None:  # noqa: ANN001
            idx = torch.randint(cap, (BATCH,), generator=gen, device="cuda:0")
            for c, o in zip(cols, outs, strict=True):
                torch.index_select(c, 0, idx, out=o)

        floor_s = median_cuda(floor, args.reps)
        w = Workload.transitions(d, capacity=cap, batch=BATCH)
        pred = sum(model.deliver_one(PlacementSpec("gpu", ("cuda:0",)), w, "cuda:0").values())
        rows.append({"d": d, "capacity": cap, "conduit_ms": conduit_s * 1e3, "floor_ms": floor_s * 1e3,
                     "ratio": conduit_s / floor_s, "predicted_ms": pred * 1e3,
                     "error": (pred - conduit_s) / conduit_s})
        print(rows[-1], flush=True)
        del edp, cols, outs
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0)
    lines = [f"# gpu_sample512 ({name})", "",
             f"`deliver({BATCH})` of transitions on the GPU tier (`DevicePlacement('cuda:0')`, learner on cuda:0), "
             f"{args.buffer_gib:g} GiB buffers, CUDA-synchronised medians of {args.reps}; the floor is "
             "`index_select` of the same columns with GPU-drawn indices into reused outputs.", "",
             "| d | capacity | Conduit | floor | Conduit / floor | cost model | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['d']} | {r['capacity']} | {r['conduit_ms']:.4f} ms | {r['floor_ms']:.4f} ms | "
                     f"{r['ratio']:.2f}x | {r['predicted_ms']:.4f} ms | {r['error']:+.1%} |")
    (args.out / "gpu_sample512.md").write_text("\n".join(lines) + "\n")
    (args.out / "gpu_sample512.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
