"""Learning curves, native RLlib vs Conduit: DQN on MountainCar-v0 and PPO on CartPole-v1, several seeds (outside CI).

Each (workload, variant, seed) trains for a budget of env steps and records
(env steps, wall seconds, mean return) per iteration into ``--out-dir/<workload>.json``;
``--plot`` draws mean +- min/max over seeds against env steps and against wall time.

    .venv/bin/python benchmarks/scripts/rllib_learning_curves.py ppo --seeds 0 1 2 --budget 60000 --plot
    .venv/bin/python benchmarks/scripts/rllib_learning_curves.py dqn-mountaincar --seeds 0 1 2 --budget 150000 --plot

Runs are sequential (one process, one local Ray); results are appended, so a run can be
split across invocations (``--variants`` / ``--seeds``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

OUT = Path(__file__).resolve().parents[1] / "results" / "learning_curves"


def dqn_mountaincar(seed: int) -> Any:
    """DQN settings that solve MountainCar-v0 in ~1e5 steps (double, dueling, 3-step, Huber, slow epsilon decay)."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    return (DQNConfig()
            .environment("MountainCar-v0")
            .env_runners(num_env_runners=0, rollout_fragment_length=4)
            .learners(num_learners=0)
            .training(lr=1e-3, train_batch_size=64, n_step=3, gamma=0.99, target_network_update_freq=1000,
                      training_intensity=16, num_steps_sampled_before_learning_starts=2000, double_q=True,
                      dueling=True, epsilon=[(0, 1.0), (40_000, 0.05)],
                      replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 100_000,
                                            "alpha": 0.6, "beta": 0.4})
            .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[128, 128], head_fcnet_hiddens=[128]))
            .reporting(min_sample_timesteps_per_iteration=2000, metrics_num_episodes_for_smoothing=10)
            .debugging(seed=seed, log_level="ERROR"))


def ppo(seed: int) -> Any:
    from conduit_rllib.workloads import ppo_cartpole

    return ppo_cartpole(seed=seed, batch=2000, minibatch=128, epochs=6)


WORKLOADS = {"dqn-mountaincar": dqn_mountaincar, "ppo": ppo}


def run(workload: str, variant: str, seed: int, budget: int) -> list[dict[str, float]]:
    import conduit_rllib

    config = WORKLOADS[workload](seed)
    if variant == "conduit":
        conduit_rllib.enable(config)
    algo = config.build_algo()
    curve: list[dict[str, float]] = []
    t0 = time.perf_counter()
    try:
        steps = 0
        while steps < budget:
            r = algo.train()["env_runners"]
            steps = int(r["num_env_steps_sampled_lifetime"])
            ret = r.get("episode_return_mean")
            curve.append({"steps": steps, "seconds": time.perf_counter() - t0,
                          "return": float("nan") if ret is None else float(ret)})
            print(f"{workload} {variant} seed={seed} steps={steps} t={curve[-1]['seconds']:.0f}s "
                  f"return={curve[-1]['return']:.1f}", flush=True)
    finally:
        algo.stop()
    return curve


def plot(workload: str, data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"native": "#7f7f7f", "conduit": "#1f77b4"}
    for variant, runs in data.items():
        for x_key, ax in (("steps", axes[0]), ("seconds", axes[1])):
            for i, curve in enumerate(runs.values()):
                ax.plot([p[x_key] for p in curve], [p["return"] for p in curve], color=colors[variant], alpha=0.8,
                        label=variant if i == 0 else None)
        n = min(len(c) for c in runs.values())
        if n:
            mean = np.nanmean([[p["return"] for p in c[:n]] for c in runs.values()], axis=0)
            axes[0].plot([p["steps"] for p in next(iter(runs.values()))[:n]], mean, color=colors[variant], lw=3,
                         alpha=0.4)
    axes[0].set(xlabel="env steps", ylabel="mean episode return", title=f"{workload}: return vs env steps")
    axes[1].set(xlabel="wall seconds", ylabel="mean episode return", title="return vs wall time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=["native", "conduit"], choices=["native", "conduit"])
    p.add_argument("--budget", type=int, default=60_000, help="env steps per run")
    p.add_argument("--out-dir", type=Path, default=OUT)
    p.add_argument("--plot", action="store_true")
    args = p.parse_args()

    import ray
    import torch

    torch.set_num_threads(1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{args.workload}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        for seed in args.seeds:
            for variant in args.variants:
                data.setdefault(variant, {})[str(seed)] = run(args.workload, variant, seed, args.budget)
                path.write_text(json.dumps(data, indent=1))
    finally:
        ray.shutdown()
    if args.plot:
        png = path.with_suffix(".png")
        plot(args.workload, data, png)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
