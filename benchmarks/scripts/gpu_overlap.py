"""GPU check (run once when a GPU machine is lent): the next batch's H2D copy on a side stream, hidden behind a
matmul-heavy update.

Three runs of the synthetic loop with the learner on ``cuda:0`` and a wide MLP (``--hidden``, matmul-heavy):

* ``sync``       -- host storage, synchronous delivery: gather into page-locked output, H2D on the learner's
  stream, all on the critical path;
* ``overlapped`` -- host storage, :class:`conduit.Overlapped`: gather into page-locked staging and a
  ``non_blocking`` H2D on a side stream while the learner updates on the previous batch;
* ``on-gpu``     -- the buffer itself on the GPU, synchronous: the same loop with no host-to-device path at all
  (the floor: what the iteration costs when experience never crosses PCIe).

Per run it prints the medians of the per-iteration accounting (iteration, update, experience path total /
hidden / exposed as seen by the host) and, from the iteration times, the device-side view: the time the
experience path adds to an iteration over the on-GPU floor, synchronous vs overlapped. The update span
synchronizes the device, so a learner stream stalled on a copy shows up in the iteration time.

    .venv/bin/python benchmarks/scripts/gpu_overlap.py            # d = 1000 and 10000
    .venv/bin/python benchmarks/scripts/gpu_overlap.py --out DIR  # also write gpu_overlap.json there
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from conduit import Overlapped, Synchronous
from conduit.demo import run_loop
from conduit.placement import DevicePlacement, HostPlacement


def caller_waits(trace: Path, iterations: int) -> dict[str, float]:
    """Seconds per iteration the loop's thread spent in ``ingest`` and ``deliver`` calls (from a Chrome trace)."""
    events = json.loads(trace.read_text())["traceEvents"]
    loop = next(e["tid"] for e in events if e.get("name") == "update")
    return {f"{kind}_s": sum(e["dur"] for e in events if e.get("name") == kind and e["tid"] == loop) * 1e-6
            / iterations for kind in ("ingest_wait", "deliver_wait")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--hidden", type=int, default=4096, help="MLP width: the update's matmuls")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--g-del", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (the CPU path is covered by the test suite)")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    results: dict[str, dict[str, dict[str, float]]] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for d in args.dims:
        common = dict(obs_dim=d, iterations=args.iterations, warmup=5, rollout=args.batch, batch=args.batch,
                      updates=args.updates, hidden=args.hidden, capacity=min(65536, (2 << 30) // (8 * d)),
                      device="cuda")
        setups = {"sync": (Synchronous, HostPlacement()),
                  "overlapped": (lambda: Overlapped(g_del=args.g_del), HostPlacement()),
                  "on-gpu": (Synchronous, DevicePlacement("cuda:0"))}
        runs, waits = {}, {}
        for name, (sched, plc) in setups.items():
            trace = args.out / f"trace-{d}-{name}.json"
            runs[name] = run_loop(scheduler=sched(), placement=plc, trace=trace, **common)
            waits[name] = caller_waits(trace, args.iterations)
            trace.unlink()
        results[str(d)] = {k: {**{m: r.median(m) for m in ("iteration_s", "update_s", "total_s", "hidden_s",
                                                           "exposed_s", "rollout_s")}, **waits[k]}
                           for k, r in runs.items()}
        floor = results[str(d)]["on-gpu"]["iteration_s"]
        print(f"\nd = {d}, batch {args.batch}, {args.updates} updates of a {args.hidden}-wide MLP per iteration (ms):")
        for k, m in results[str(d)].items():
            print(f"  {k:11} iteration {m['iteration_s'] * 1e3:8.2f}  update {m['update_s'] * 1e3:8.2f}  "
                  f"experience path {m['total_s'] * 1e3:7.2f}, hidden {m['hidden_s'] * 1e3:7.2f}, exposed "
                  f"{m['exposed_s'] * 1e3:7.2f} (ingest {m['ingest_wait_s'] * 1e3:.2f}, deliver "
                  f"{m['deliver_wait_s'] * 1e3:.2f})   over the on-GPU floor {(m['iteration_s'] - floor) * 1e3:+8.2f}")
        s, o = (results[str(d)][k]["iteration_s"] - floor for k in ("sync", "overlapped"))
        if s > 0:
            print(f"  the H2D path adds {s * 1e3:.2f} ms synchronously and {o * 1e3:.2f} ms overlapped "
                  f"({1 - o / s:.0%} of it hidden)")
    (args.out / "gpu_overlap.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
