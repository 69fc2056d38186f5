"""Experience-path breakdown, native RLlib vs Conduit, iterations interleaved (outside CI; minutes).

Both variants are built in one process and alternate ``train()`` calls, so machine load hits
both alike. Prints the per-iteration table and the medians; writes JSON with every row.

    .venv/bin/python benchmarks/scripts/rllib_breakdown.py dqn --obs-dim 5000 --iterations 6
    .venv/bin/python benchmarks/scripts/rllib_breakdown.py dqn --obs-dim 5000 --iterations 6 --overlap 2
    .venv/bin/python benchmarks/scripts/rllib_breakdown.py dqn --agents 2 --iterations 6
    .venv/bin/python benchmarks/scripts/rllib_breakdown.py sac --iterations 6
    .venv/bin/python benchmarks/scripts/rllib_breakdown.py ppo --iterations 6
    .venv/bin/python benchmarks/scripts/rllib_breakdown.py ppo --agents 2 --steps 2000 --iterations 6 --sequential
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def result_name(args: argparse.Namespace) -> str:
    """The workload's name in the results file: one per set of variants run, so that a run with
    ``--overlap``/``--ingest-in-caller`` does not overwrite the plain comparison of the same workload."""
    if args.algo == "dqn" and args.agents > 1:
        name = f"dqn_{args.agents}_agent_cartpole_b{args.batch or 32}{'_uniform' if args.uniform else ''}"
    elif args.algo == "dqn":
        name = (f"dqn_d{args.obs_dim}_b{args.batch or 32}{'_uniform' if args.uniform else ''}"
                f"{f'_cap{args.capacity}' if args.capacity != 5000 else ''}")
    elif args.algo == "sac":
        name = f"sac_pendulum_b{args.batch or 256}{'_uniform' if args.uniform else ''}"
    else:
        agents = f"{args.agents}_agent_" if args.agents > 1 else ""
        return f"ppo_{agents}cartpole_{max(args.steps, 500)}"  # --sequential only adds a variant
    if args.overlap:
        name += f"_overlap{args.overlap}{'_caller' if args.ingest_in_caller else ''}"
    return name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("algo", choices=["dqn", "sac", "ppo"])
    p.add_argument("--obs-dim", type=int, default=5000, help="DQN: observation size")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--steps", type=int, default=200, help="DQN/SAC: env steps per iteration; PPO: train batch")
    p.add_argument("--batch", type=int, default=None, help="train batch (DQN 32, SAC 256) or PPO minibatch (128)")
    p.add_argument("--uniform", action="store_true")
    p.add_argument("--capacity", type=int, default=5000, help="DQN: replay capacity (transitions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap", type=int, default=0, metavar="G_DEL",
                   help="DQN/SAC: also run Conduit with core's Overlapped scheduler prefetching G_DEL batches "
                        "(variant 'conduit-overlapped'; prioritized draws at most G_DEL updates stale)")
    p.add_argument("--ingest-in-caller", action="store_true",
                   help="with --overlap: store each add in the caller (Overlapped(background_ingest=False)); "
                        "delivery still prefetches")
    p.add_argument("--sequential", action="store_true",
                   help="PPO: also run Conduit without minibatch prefetch (variant 'conduit-sequential')")
    p.add_argument("--agents", type=int, default=1,
                   help="DQN/PPO: agents of RLlib's MultiAgentCartPole, each trained by its own module (1: DQN's "
                        "LargeObsCartPole, PPO's CartPole-v1)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import ray
    import torch
    from conduit_rllib.compare import run_interleaved, summarize, table
    from conduit_rllib.workloads import (
        dqn_large_obs,
        dqn_multi_agent_cartpole,
        ppo_cartpole,
        ppo_multi_agent_cartpole,
        sac_pendulum,
    )

    torch.set_num_threads(1)
    if args.algo == "dqn" and args.agents > 1:
        def make():
            return dqn_multi_agent_cartpole(agents=args.agents, steps=args.steps, batch=args.batch or 32,
                                            seed=args.seed, prioritized=not args.uniform, capacity=args.capacity)
    elif args.algo == "dqn":
        def make():
            return dqn_large_obs(args.obs_dim, steps=args.steps, batch=args.batch or 32, seed=args.seed,
                                 prioritized=not args.uniform, capacity=args.capacity)
    elif args.algo == "sac":
        def make():
            return sac_pendulum(steps=args.steps, batch=args.batch or 256, seed=args.seed,
                                prioritized=not args.uniform)
    elif args.agents > 1:
        def make():
            return ppo_multi_agent_cartpole(agents=args.agents, batch=max(args.steps, 500),
                                            minibatch=args.batch or 128, seed=args.seed)
    else:
        def make():
            return ppo_cartpole(batch=max(args.steps, 500), minibatch=args.batch or 128, seed=args.seed)
    name = result_name(args)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        configs = {"native": make(), "conduit": make()}
        if args.overlap and args.algo != "ppo":
            import conduit_rllib
            from conduit import Overlapped

            g, bg = args.overlap, not args.ingest_in_caller
            configs["conduit-overlapped"] = conduit_rllib.enable(
                make(), scheduler=lambda: Overlapped(g_del=g, background_ingest=bg))
        if args.sequential and args.algo == "ppo":
            import conduit_rllib

            configs["conduit-sequential"] = conduit_rllib.enable(make(), prefetch=False)
        rows = run_interleaved(configs, args.iterations)
    finally:
        ray.shutdown()
    print(table(rows))
    s = summarize(rows)
    for v in rows:
        parts = " ".join(f"{k}={x * 1e3:.1f}" for k, x in s[v]["parts"].items())
        print(f"{v:>8}: experience {s[v]['experience_s'] * 1e3:.1f} ms, exposed {s[v]['exposed_s'] * 1e3:.1f} ms, "
              f"iteration {s[v]['iteration_s']:.2f} s, cpu {s[v]['cpu_s']:.2f} s  [{parts} ms]")
    for v in rows:
        if v == "native":
            continue
        ch = s[v]["change"]
        print(f"{v} vs native: experience {ch['experience_s']:+.0%}, exposed {ch['exposed_s']:+.0%}, "
              f"iteration {ch['iteration_s']:+.0%}, cpu {ch['cpu_s']:+.0%}")
    out = args.out or Path(__file__).resolve().parents[1] / "results" / f"rllib_breakdown_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"workload": name, "args": vars(args) | {"out": str(out)}, "summary": s,
                               "rows": {k: [r.to_dict() for r in v] for k, v in rows.items()}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
