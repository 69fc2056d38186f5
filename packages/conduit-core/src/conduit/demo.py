"""The synthetic actor/learner loop: experience through the EDP, and where the time went."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from tqdm import tqdm

from conduit.edp import ExperienceDataPlane
from conduit.schema import ExperienceSchema, Field
from conduit.semantics import Replay

__all__ = ["run_synthetic"]


def run_synthetic(argv: Sequence[str] | None = None) -> int:
    """Run the loop and print per-iteration ingest, deliver, exposed and iteration time."""
    p = argparse.ArgumentParser(prog="conduit demo --synthetic")
    p.add_argument("--obs-dim", type=int, default=5000)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--rollout", type=int, default=256, help="transitions per actor rollout")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--updates", type=int, default=4, help="learner updates per iteration")
    p.add_argument("--capacity", type=int, default=20_000)
    args = p.parse_args(list(argv or []))
    torch.manual_seed(0)
    d = args.obs_dim
    schema = ExperienceSchema(obs=Field((d,)), action=Field((), torch.int64), reward=Field(()),
                              next_obs=Field((d,)), done=Field((), torch.bool))
    edp = ExperienceDataPlane(schema, capacity=args.capacity, semantics=Replay(seed=0))
    net = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    rows = []
    for _ in tqdm(range(args.iterations), desc=f"synthetic loop d={d}", unit="it"):
        t_it = time.perf_counter()
        t = time.perf_counter()
        rollout = {"obs": torch.randn(args.rollout, d), "action": torch.randint(4, (args.rollout,)),
                   "reward": torch.randn(args.rollout), "next_obs": torch.randn(args.rollout, d),
                   "done": torch.zeros(args.rollout, dtype=torch.bool)}
        t_roll = time.perf_counter() - t
        t = time.perf_counter()
        edp.ingest(rollout)
        t_ing = time.perf_counter() - t
        t_del = t_upd = 0.0
        for _ in range(args.updates):
            t = time.perf_counter()
            batch, _info = edp.deliver(args.batch)
            t_del += time.perf_counter() - t
            t = time.perf_counter()
            q = net(batch["obs"]).gather(1, batch["action"][:, None]).squeeze(1)
            loss = torch.nn.functional.mse_loss(q, batch["reward"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            t_upd += time.perf_counter() - t
        rows.append((t_roll, t_ing, t_del, t_upd, time.perf_counter() - t_it))
    n = len(rows)
    mean = [sum(r[i] for r in rows) / n * 1e3 for i in range(5)]
    exposed = mean[1] + mean[2]  # synchronous: the whole experience path is on the critical path
    print(f"\nper iteration (ms), d={d}, batch={args.batch}, {args.updates} updates, synchronous scheduling")
    print(f"  rollout {mean[0]:8.2f}   update {mean[3]:8.2f}")
    print(f"  ingest  {mean[1]:8.2f}   deliver {mean[2]:8.2f}   exposed experience path {exposed:8.2f}")
    print(f"  iteration {mean[4]:8.2f}   experience path share {exposed / mean[4]:.0%}")
    return 0
