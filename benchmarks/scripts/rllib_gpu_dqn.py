"""The d = 5000 DQN comparison with the learner on a GPU (prepared for a machine with CUDA; outside CI).

Part 1, the learner in the driver on ``--device`` (four variants, iterations interleaved, the same table
as ``rllib_breakdown.py``):

* ``native``: RLlib's replay buffer and learner connector;
* ``conduit``: Conduit, transitions in pinned host memory, delivered to the learner's device by Conduit;
* ``conduit-gpu``: Conduit with the buffer on the GPU tier (``DevicePlacement(device)``): ingestion copies
  each step to the GPU once, sampling gathers on the GPU;
* ``conduit-overlapped``: Conduit in host memory with core's ``Overlapped`` scheduler (``--overlap`` batches
  prefetched while the learner updates; prioritized draws at most that many updates stale).

Part 2, one remote learner (a Ray actor holding the GPU, ``num_learners=1``): ``native-remote``, then
``conduit-remote`` (the buffer in the driver, each sample shipped to the actor as its batch), the same
table; the experience path is then what runs in the driver (``conduit_rllib.profiling``).

A variant that fails is reported with its traceback and the others go on. ``--device cpu`` runs the same
code without a GPU (a dry run of the script, not a measurement).

    python3 benchmarks/scripts/rllib_gpu_dqn.py --iterations 6 --steps 200 --out rllib_gpu_dqn.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _build(name: str, make: Any, errors: dict[str, str]) -> Any:
    try:
        return make()
    except Exception:
        errors[name] = traceback.format_exc()
        print(f"{name}: build failed\n{errors[name]}", flush=True)
        return None


def run_variants(makers: dict[str, Any], iterations: int, errors: dict[str, str],
                 devices: dict[str, list[str]]) -> dict[str, list[Any]]:
    """Build every variant, run their iterations interleaved, close them: the rows of each that ran (a variant
    that fails is reported in ``errors`` and dropped; ``devices`` gets each one's learner devices)."""
    variants = {}
    for name, make in makers.items():
        v = _build(name, make, errors)
        if v is not None:
            v.name = name
            variants[name] = v
            devices[name] = [r.get() for r in v.algo.learner_group.foreach_learner(
                lambda learner: str(learner._device))]
    print({n: (type(v.algo.local_replay_buffer).__name__, type(v.algo.learner_group).__name__, devices[n])
           for n, v in variants.items()}, flush=True)
    for i in range(iterations):
        for name, v in list(variants.items()):
            try:
                r = v.iteration()
                print(f"{name:>15} it {i + 1}: iteration {r.iteration_s:.3f} s, exposed {r.exposed_s * 1e3:.1f} ms",
                      flush=True)
            except Exception:
                errors[name] = traceback.format_exc()
                print(f"{name}: iteration failed\n{errors[name]}", flush=True)
                v.close()
                del variants[name]
    rows = {n: v.rows for n, v in variants.items() if v.rows}
    for n, v in variants.items():
        for r in v.rows:
            r.variant = n
        v.close()
    return rows


def report(rows: dict[str, list[Any]], baseline: str) -> dict[str, Any]:
    """Print the per-iteration table and the medians against ``baseline``; the JSON-ready summary and rows."""
    from conduit_rllib.compare import summarize, table

    if not rows:
        return {}
    print(table(rows))
    base = baseline if baseline in rows else next(iter(rows))  # (the baseline's variant may have failed)
    s = summarize(rows, baseline=base)
    for name in rows:
        ch = s[name].get("change")
        tail = "" if ch is None else (f"  vs {base}: exposed {ch['exposed_s']:+.0%}, iteration "
                                      f"{ch['iteration_s']:+.0%}")
        print(f"{name:>15}: exposed {s[name]['exposed_s'] * 1e3:.1f} ms, iteration {s[name]['iteration_s']:.3f} s"
              + tail, flush=True)
    return {"summary": s, "rows": {k: [r.to_dict() for r in v] for k, v in rows.items()}}


def driver_learner(args: argparse.Namespace, config: Any, errors: dict[str, str],
                   devices: dict[str, list[str]]) -> dict[str, Any]:
    import conduit_rllib
    from conduit import DevicePlacement
    from conduit_rllib.compare import Variant

    makers = {"native": lambda: Variant("native", config(0)),
              "conduit": lambda: Variant("conduit", config(0)),
              "conduit-gpu": lambda: Variant("conduit", config(0), enable=lambda c: conduit_rllib.enable(
                  c, placement=DevicePlacement(args.device)))}
    if args.overlap:
        from conduit import Overlapped

        makers["conduit-overlapped"] = lambda: Variant("conduit", config(0), enable=lambda c: conduit_rllib.enable(
            c, scheduler=lambda: Overlapped(g_del=args.overlap, background_ingest=False)))
    return report(run_variants(makers, args.iterations, errors, devices), "native")


def remote_learner(args: argparse.Namespace, config: Any, errors: dict[str, str],
                   devices: dict[str, list[str]]) -> dict[str, Any]:
    from conduit_rllib.compare import Variant

    rows: dict[str, list[Any]] = {}
    for name, kind in (("native-remote", "native"), ("conduit-remote", "conduit")):
        # one after the other: each learner actor holds the whole GPU (num_gpus_per_learner=1)
        rows.update(run_variants({name: lambda k=kind: Variant(k, config(1))}, args.remote_iterations, errors,
                                 devices))
    return report(rows, "native-remote")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="the learner's device (cpu: a dry run of the script)")
    p.add_argument("--obs-dim", type=int, default=5000)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--remote-iterations", type=int, default=4, help="part 2's iterations (0: skip part 2)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--uniform", action="store_true")
    p.add_argument("--overlap", type=int, default=2, metavar="G_DEL",
                   help="also Conduit (host) with Overlapped(g_del=G_DEL) storing adds in the caller (0: not)")
    p.add_argument("--num-cpus", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" /
                   "rllib_gpu_dqn.json")
    args = p.parse_args()

    import ray
    import torch

    gpus = 0 if args.device == "cpu" else 1
    if gpus and not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU (the CPU comparison is rllib_breakdown.py; --device cpu "
              "dry-runs this one)")
        return 2
    from conduit_rllib.workloads import dqn_large_obs

    torch.set_num_threads(1)

    def config(num_learners: int) -> Any:
        return dqn_large_obs(args.obs_dim, steps=args.steps, batch=args.batch, prioritized=not args.uniform,
                             capacity=20_000).learners(num_learners=num_learners, num_gpus_per_learner=gpus)

    info = {"device": args.device, "torch": torch.__version__, "ray": ray.__version__,
            "gpu": torch.cuda.get_device_name(0) if gpus else None, "obs_dim": args.obs_dim,
            "steps": args.steps, "batch": args.batch, "prioritized": not args.uniform}
    print(info, flush=True)
    ray.init(address="local", num_cpus=args.num_cpus, num_gpus=gpus, include_dashboard=False,
             log_to_driver=False, logging_level=logging.ERROR)
    errors: dict[str, str] = {}
    devices: dict[str, list[str]] = {}
    result: dict[str, Any] = {"info": info, "errors": errors, "learner_devices": devices}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if args.iterations:
            result["driver_learner"] = driver_learner(args, config, errors, devices)
        args.out.write_text(json.dumps(result, indent=1))  # kept if part 2 is killed by a time limit
        if args.remote_iterations:
            result["remote_learner"] = remote_learner(args, config, errors, devices)
    finally:
        ray.shutdown()
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}; errors: {sorted(errors) or 'none'}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
