"""The d = 5000 DQN comparison with the learner on a GPU (prepared for a machine with CUDA; outside CI).

Three variants, iterations interleaved, the same table as ``rllib_breakdown.py``:

* ``native``: RLlib's replay buffer and learner connector, learner on ``cuda:0``;
* ``conduit``: Conduit, transitions in pinned host memory, delivered to the GPU by Conduit;
* ``conduit-gpu``: Conduit with the buffer on the GPU tier (``DevicePlacement("cuda:0")``):
  ingestion copies each step to the GPU once, sampling gathers on the GPU.

    .venv/bin/python benchmarks/scripts/rllib_gpu_dqn.py --iterations 6 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--obs-dim", type=int, default=5000)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--uniform", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" /
                   "rllib_gpu_dqn.json")
    args = p.parse_args()

    import ray
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU (the CPU comparison is rllib_breakdown.py)")
        return 2
    import conduit_rllib
    from conduit import DevicePlacement
    from conduit_rllib.compare import Variant, summarize, table
    from conduit_rllib.workloads import dqn_large_obs

    torch.set_num_threads(1)

    def config():
        return dqn_large_obs(args.obs_dim, steps=args.steps, batch=args.batch, prioritized=not args.uniform,
                             capacity=20_000).learners(num_learners=0, num_gpus_per_learner=1)

    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    try:
        variants = [Variant("native", config()), Variant("conduit", config())]
        gpu = Variant("conduit", config(),
                      enable=lambda c: conduit_rllib.enable(c, placement=DevicePlacement("cuda:0")))
        gpu.name = "conduit-gpu"
        variants.append(gpu)
        print({v.name: v.algo.local_replay_buffer.__class__.__name__ for v in variants})
        for _ in range(args.iterations):
            for v in variants:
                v.iteration()
        for v in variants:
            for r in v.rows:
                r.variant = v.name
        rows = {v.name: v.rows for v in variants}
        for v in variants:
            v.close()
    finally:
        ray.shutdown()
    print(table(rows))
    s = summarize(rows)
    for name in rows:
        ch = s[name].get("change")
        tail = "" if ch is None else (f"  vs native: exposed {ch['exposed_s']:+.0%}, iteration "
                                      f"{ch['iteration_s']:+.0%}")
        print(f"{name:>12}: exposed {s[name]['exposed_s'] * 1e3:.1f} ms, iteration {s[name]['iteration_s']:.2f} s"
              + tail)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": s, "rows": {k: [r.to_dict() for r in v] for k, v in rows.items()}},
                                   indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
