"""verl's V1 TransferQueue path with ``storage_backend=Conduit``, two data-parallel workers on Ray.

verl's own ``ActorRolloutRefWorker`` x 2 (FSDP2 on gloo, CPU-only Ray), driven by the V1
trainer's step methods (``_balance_batch``, ``_compute_old_log_prob``, ``_compute_advantage``,
``_update_actor``) over trajectories written the way ``AgentLoopWorkerTQ`` writes them. The
workers pull their shards from Conduit through verl's ``tqbridge``, iterate minibatches
through Conduit's delivery, and write log-probs back; two GRPO steps run, with the trainer's
``kv_clear`` in between. The same run on TransferQueue's SimpleStorage with verl's own
iterator must give the same losses, gradient norms and post-update log-probs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def put_trajectories(step: int, prompts: int, n: int) -> Any:
    """Finished rollouts as AgentLoopWorkerTQ puts them: one row per (prompt, session), with tags."""
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    g = torch.Generator().manual_seed(100 + step)
    keys, rows, tags = [], [], []
    for p in range(prompts):
        prompt = torch.randint(3, 300, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        for s in range(n):
            rl = int(torch.randint(2, 9, (1,), generator=g))
            resp = torch.randint(3, 300, (rl,), generator=g)
            ids = torch.cat([prompt, resp])
            score = torch.zeros(rl)
            score[-1] = float(torch.rand(1, generator=g))
            keys.append(f"s{step}p{p}_{s}_0")
            rows.append(dict(prompts=prompt, responses=resp, input_ids=ids, attention_mask=torch.ones_like(ids),
                             position_ids=torch.arange(len(ids)), response_mask=torch.ones(rl, dtype=torch.int64),
                             loss_mask=torch.ones(rl, dtype=torch.int64), rm_scores=score,
                             rollout_log_probs=-torch.rand(rl, generator=g), uid=f"s{step}p{p}"))
            tags.append(dict(status="success", prompt_len=len(prompt), response_len=rl, seq_len=len(ids),
                             global_steps=step))
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows), tags=tags)
    return KVBatchMeta(partition_id="train", keys=keys, tags=tags)


def run(start: Any, backend: str, model: str, **backend_cfg: Any) -> dict[str, Any]:
    import ray
    import transfer_queue as tq
    import verl  # noqa: F401  (loads conduit-verl's plugin)
    from conduit_verl.cpu.config import compose, cpu_overrides
    from transformers import AutoTokenizer
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cfg = compose(cpu_overrides(model, n=4, mini_batch=1, micro_batch=2, epochs=2, shuffle=True)
                  + ["data.train_batch_size=2", "algorithm.adv_estimator=grpo"])
    start(backend, **backend_cfg)
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(resource_pool=pool, device_name="cpu", ray_cls_with_init=RayClassWithInitArgs(
        cls=ray.remote(ActorRolloutRefWorker), config=cfg.actor_rollout_ref, role="actor"))
    out: dict[str, Any] = {"steps": []}
    try:
        wg.init_model()
        # the V1 trainer's step methods on a trainer holding just what they read
        trainer = PPOTrainerSync.__new__(PPOTrainerSync)
        trainer.config, trainer.actor_rollout_wg = cfg, wg
        trainer.tokenizer = AutoTokenizer.from_pretrained(model)
        trainer.use_critic, trainer.use_reference_policy, trainer.global_steps = False, False, 1
        for step in (1, 2):
            trainer.global_steps = step
            metrics: dict[str, Any] = {}
            batch = put_trajectories(step, prompts=2, n=4)
            batch.extra_info["temperature"] = 1.0
            batch = trainer._balance_batch(batch, metrics)
            batch = trainer._compute_old_log_prob(batch, metrics)
            batch = trainer._compute_advantage(batch, metrics)
            batch = trainer._update_actor(batch, metrics)
            after = tq.kv_batch_get(keys=sorted(batch.keys), partition_id="train",
                                    select_fields=["old_log_probs", "advantages"])
            out["steps"].append({k: metrics[k] for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy")}
                                | {"old_log_probs": [r.tolist() for r in after["old_log_probs"].unbind()],
                                   "advantages": [r.tolist() for r in after["advantages"].unbind()]})
            if backend == "Conduit":
                out["stats"] = tq.get_client().storage_manager.stats()
            tq.kv_clear(keys=batch.keys, partition_id="train")  # as PPOTrainer.fit does after each step
        # the post-update policy, seen through its log-probs on fresh data
        probe = put_trajectories(9, prompts=2, n=4)
        probe.extra_info.update({"calculate_entropy": False, "compute_loss": False, "temperature": 1.0})
        wg.compute_log_prob(probe)
        lp = tq.kv_batch_get(keys=probe.keys, partition_id="train", select_fields=["log_probs"])
        out["final_log_probs"] = [r.tolist() for r in lp["log_probs"].unbind()]
    finally:
        for w in wg.workers:
            ray.kill(w)
        tq.close()
    return out


def test_v1_path_on_conduit_matches_simple_storage(tiny: dict[str, Path], tq_session: Any, ray_local: Path) -> None:
    ref = run(tq_session, "SimpleStorage", str(tiny["model"]))
    assert not list(ray_local.glob("delivery-*.json")), "SimpleStorage must leave verl's iterator alone"
    got = run(tq_session, "Conduit", str(tiny["model"]))

    for r, g in zip(ref["steps"], got["steps"], strict=True):
        assert g == r  # losses, gradient norms, entropy, written-back old_log_probs and advantages
    assert got["final_log_probs"] == ref["final_log_probs"]  # same weights after two GRPO steps

    # results were written back into Conduit storage, and old rows were cleared
    (unit,) = got["stats"]
    assert {"old_log_probs", "advantages", "log_probs", "entropy"} <= set(unit["fields"])
    assert unit["fields"]["responses"]["samples"] == 8 and unit["telemetry"]["get"]["calls"] >= 6
    # both data-parallel workers iterated their minibatches through Conduit, 2 per epoch x 2 epochs, per step
    recs = [json.loads(p.read_text()) for p in ray_local.glob("delivery-*.json")]
    assert len({r["pid"] for r in recs}) == 2 and len(recs) == 4
    assert all(r["minibatches"] == 4 and r["g_del"] == pytest.approx(0.25) and r["mode"] == "prefetch" for r in recs)
