"""Where the time of one DQN replay sample goes: Conduit's prioritized RLlib buffer, profiled per call.

The d = 5000 DQN comparison on the H200 (``rllib.md``, GPU) found Conduit's ``sample`` at ~1.2 ms per call there
against ~0.7 ms on the 2-vCPU box. This script times the buffer alone, as DQN's training step calls it
(``sample(num_items=B, n_step=1, gamma, beta, **DQN_SAMPLE_KWARGS)``, then ``update_priorities``), for the
buffer's variants on ``--device`` (host storage delivering to the device; the GPU tier, ``DevicePlacement``),
and writes, per variant: the per-call medians (each call synchronised), a cProfile table of the Python side and
a ``torch.profiler`` table (CPU and, on a GPU, CUDA time per op).

    python benchmarks/scripts/gpu_sample_profile.py --device cuda:0 --out OUTDIR
    python benchmarks/scripts/gpu_sample_profile.py --device cpu --obs-dim 128 --capacity 2000 --out /tmp/p  # dry run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conduit_rllib.testing import DQN_SAMPLE_KWARGS


def episodes(obs_dim: int, n: int, length: int, seed: int) -> list[Any]:
    """``n`` numpy episodes of ``length`` steps with random float32 observations of ``obs_dim``."""
    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    rng = np.random.default_rng(seed)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32)
    out = []
    for k in range(n):
        out.append(SingleAgentEpisode(
            id_=f"ep-{seed}-{k}", observations=list(rng.standard_normal((length + 1, obs_dim), dtype=np.float32)),
            infos=[{}] * (length + 1), actions=list(rng.integers(0, 2, length)),
            rewards=list(rng.random(length, np.float32)),
            terminated=True, observation_space=obs_space, action_space=gym.spaces.Discrete(2),
            len_lookback_buffer=0))
    return out


def build(variant: str, args: argparse.Namespace) -> Any:
    from conduit import DevicePlacement
    from conduit_rllib.replay import ConduitPrioritizedEpisodeReplayBuffer

    placement = DevicePlacement(args.device) if variant == "gpu-tier" else None
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=args.capacity, alpha=0.6, seed=0, device=args.device,
                                                placement=placement)
    per = 100
    for start in range(0, args.capacity, per * 20):  # in adds of 20 episodes, as env runners hand them over
        buf.add(episodes(args.obs_dim, 20, per, seed=start))
    return buf


def one_step(buf: Any, args: argparse.Namespace, rng: np.random.Generator, sync: bool) -> tuple[float, float]:
    """One sample and one priority update as DQN's training step makes them; their seconds (synchronised)."""
    t0 = time.perf_counter()
    s = buf.sample(num_items=args.batch, n_step=1, gamma=0.99, beta=0.4, **DQN_SAMPLE_KWARGS)
    if sync:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    buf.update_priorities(rng.random(args.batch) + 1e-3)
    t2 = time.perf_counter()
    assert len(s) == args.batch
    return t1 - t0, t2 - t1


def profile_variant(variant: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    sync = torch.device(args.device).type == "cuda"
    t = time.perf_counter()
    buf = build(variant, args)
    built_s = time.perf_counter() - t
    rng = np.random.default_rng(1)
    for _ in range(args.warmup):
        one_step(buf, args, rng, sync)
    times = [one_step(buf, args, rng, sync) for _ in range(args.calls)]
    sample_ms = [a * 1e3 for a, _ in times]
    prio_ms = [b * 1e3 for _, b in times]

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.profiled):
        one_step(buf, args, rng, sync)
    prof.disable()
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    (out / f"cprofile_{variant}.txt").write_text(text.getvalue())

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if sync else [])
    with profile(activities=acts) as tp:
        for _ in range(args.profiled):
            one_step(buf, args, rng, sync)
    tables = [tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)]
    if sync:
        tables.append(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))
    (out / f"torch_profile_{variant}.txt").write_text("\n\n".join(tables))
    res = {"variant": variant, "built_s": round(built_s, 2), "calls": args.calls,
           "sample_ms": {"median": statistics.median(sample_ms), "p10": float(np.percentile(sample_ms, 10)),
                         "p90": float(np.percentile(sample_ms, 90))},
           "update_priorities_ms": {"median": statistics.median(prio_ms), "p90": float(np.percentile(prio_ms, 90))}}
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--obs-dim", type=int, default=5000)
    p.add_argument("--capacity", type=int, default=20000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--profiled", type=int, default=100)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the DQN run had OMP_NUM_THREADS=1)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    variants = ["host"] + (["gpu-tier"] if torch.device(args.device).type == "cuda" else [])
    info = {"device": args.device, "torch": torch.__version__, "threads": args.threads, "obs_dim": args.obs_dim,
            "capacity": args.capacity, "batch": args.batch,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    results = [profile_variant(v, args, args.out) for v in variants]
    (args.out / "sample_profile.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
