"""GPU check: verl's in-process actor update with and without Conduit's prefetching delivery.

Run on a machine with one CUDA GPU (about a minute)::

    python packages/conduit-verl/scripts/gpu_actor_prefetch.py --out /tmp/gpu-actor.json

For each mode (verl's own iterator, Conduit ``sync``, Conduit ``prefetch``) it builds verl's
``ActorRolloutRefWorker`` (FSDP2, one rank, bf16 autocast off, SDPA), runs one GRPO actor
update over a long-sequence batch, and records with ``torch.profiler``:

* ``h2d_exposed_ms``: host-to-device copy time on the training (default) stream, i.e. the H2D
  the optimizer steps waited for (verl copies each micro-batch there in ``forward_step``);
* ``h2d_side_ms``: H2D time on other streams (Conduit's staging stream, overlapped);
* ``update_s``: wall time of ``update_actor``; ``losses``/``grad_norms`` to check equality.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def batch(tokenizer: Any, prompts: int, n: int, p_len: int, r_len: int) -> Any:
    import numpy as np
    from verl import DataProto

    g = torch.Generator().manual_seed(0)
    b = prompts * n
    rl = torch.randint(r_len // 2, r_len + 1, (b,), generator=g)
    prompt = torch.randint(3, len(tokenizer) - 1, (b, p_len), generator=g)
    response = torch.full((b, r_len), tokenizer.pad_token_id)
    mask = torch.zeros(b, p_len + r_len, dtype=torch.int64)
    mask[:, :p_len] = 1
    scores = torch.zeros(b, r_len)
    for i in range(b):
        response[i, :rl[i]] = torch.randint(3, len(tokenizer) - 1, (int(rl[i]),), generator=g)
        mask[i, p_len:p_len + rl[i]] = 1
        scores[i, rl[i] - 1] = float(torch.rand(1, generator=g))
    ids = torch.cat([prompt, response], 1)
    pos = torch.clamp(torch.cumsum(mask, 1) - 1, min=0)
    return DataProto.from_dict(
        tensors=dict(prompts=prompt, responses=response, input_ids=ids, attention_mask=mask, position_ids=pos,
                     response_mask=mask[:, p_len:].clone(), token_level_scores=scores, token_level_rewards=scores),
        non_tensors=dict(uid=np.array([f"p{i // n}" for i in range(b)], dtype=object)),
        meta_info={"global_token_num": mask.sum(1).tolist(), "temperature": 1.0})


def run(mode: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    from conduit_verl import delivery
    from conduit_verl.cpu.config import compose, cpu_overrides
    from transformers import AutoTokenizer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.workers.engine_workers import ActorRolloutRefWorker

    over = [o for o in cpu_overrides(model_dir, n=args.n, mini_batch=args.mini, micro_batch=args.micro, epochs=2,
                                     shuffle=True) if not o.startswith("trainer.device")]
    cfg = compose(over)
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    trainer = SimpleNamespace(config=cfg, actor_rollout_wg=worker, distillation_config=None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    data = batch(tok, args.prompts, args.n, args.p_len, args.r_len)
    old, _ = RayPPOTrainer._compute_old_log_prob(trainer, data)
    data = compute_advantage(data.union(old), adv_estimator="grpo", num_repeat=args.n)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with delivery.forced(mode), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # type: ignore[arg-type]
        t0 = time.perf_counter()
        out = RayPPOTrainer._update_actor(trainer, data)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    default_stream = torch.cuda.current_stream().cuda_stream
    exposed = side = 0.0
    for ev in prof.events():
        if "Memcpy HtoD" in ev.name and ev.device_type.name == "CUDA":
            dur = ev.device_time_total / 1e3
            if getattr(ev, "stream", None) in (None, 0, 7, default_stream):
                exposed += dur
            else:
                side += dur
    m = out.meta_info["metrics"]
    return {"mode": mode, "update_s": wall, "h2d_exposed_ms": exposed, "h2d_side_ms": side,
            "losses": m["actor/pg_loss"], "grad_norms": m["actor/grad_norm"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu-actor-prefetch.json")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--mini", type=int, default=2)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--p-len", type=int, default=256)
    p.add_argument("--r-len", type=int, default=2048)
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    import torch.distributed as dist
    from conduit_verl.tiny import build

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", HF_HUB_OFFLINE="1")
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    root = tempfile.mkdtemp(prefix="conduit-gpu-")
    model_dir = str(build(root, hidden=args.hidden, layers=args.layers)["model"])
    results = [run(mode, model_dir, args) for mode in ("off", "sync", "prefetch")]
    same = all(r["losses"] == results[0]["losses"] and r["grad_norms"] == results[0]["grad_norms"] for r in results)
    report = {"device": torch.cuda.get_device_name(), "args": vars(args), "same_losses_and_grads": same,
              "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
