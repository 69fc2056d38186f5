"""verl's real actor worker (FSDP2 on gloo, in this process) fed through Conduit's minibatch delivery.

The same rollout batch and seed must give the same per-step losses, gradient norms and
final weights as verl's own minibatch iterator: Conduit changes where and when the
minibatches are prepared, never which rows they hold.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def rollout_batch(tokenizer: Any, *, prompts: int, n: int, p_len: int = 8, r_len: int = 8, seed: int = 0) -> Any:
    """A GRPO-shaped DataProto as verl's trainer holds it after generation (left/right padded)."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    b = prompts * n
    pad = tokenizer.pad_token_id
    pl = torch.randint(3, p_len + 1, (b,), generator=g)
    rl = torch.randint(2, r_len + 1, (b,), generator=g)
    prompt = torch.full((b, p_len), pad)
    response = torch.full((b, r_len), pad)
    mask = torch.zeros(b, p_len + r_len, dtype=torch.int64)
    scores = torch.zeros(b, r_len)
    for i in range(b):
        prompt[i, p_len - pl[i]:] = torch.randint(3, 300, (int(pl[i]),), generator=g)
        response[i, :rl[i]] = torch.randint(3, 300, (int(rl[i]),), generator=g)
        mask[i, p_len - pl[i]:p_len + rl[i]] = 1
        scores[i, rl[i] - 1] = float(torch.rand(1, generator=g))
    input_ids = torch.cat([prompt, response], 1)
    position_ids = torch.clamp(torch.cumsum(mask, 1) - 1, min=0)
    return DataProto.from_dict(
        tensors=dict(prompts=prompt, responses=response, input_ids=input_ids, attention_mask=mask,
                     position_ids=position_ids, response_mask=mask[:, p_len:].clone(), token_level_scores=scores,
                     token_level_rewards=scores),
        non_tensors=dict(uid=np.array([f"p{i // n}" for i in range(b)], dtype=object)),
        meta_info={"global_token_num": mask.sum(1).tolist(), "temperature": 1.0})


def full_params(worker: Any) -> dict[str, torch.Tensor]:
    module = worker.actor.engine.module
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def run_update(cfg: Any, mode: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One GRPO actor update through verl's trainer helpers, with Conduit delivery in ``mode``."""
    from conduit_verl import delivery
    from transformers import AutoTokenizer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    trainer = SimpleNamespace(config=cfg, actor_rollout_wg=worker, distillation_config=None)
    tok = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    batch = rollout_batch(tok, prompts=2, n=cfg.actor_rollout_ref.rollout.n)
    old, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
    batch = compute_advantage(batch.union(old), adv_estimator="grpo", num_repeat=cfg.actor_rollout_ref.rollout.n)
    with delivery.forced(mode):  # type: ignore[arg-type]
        out = RayPPOTrainer._update_actor(trainer, batch)
    return out.meta_info["metrics"], full_params(worker)


def test_actor_update_through_conduit_matches_verl(tiny: dict[str, Path], gloo: None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Same losses, gradient norms and weights with Conduit's prefetching delivery as with verl's iterator.

    8 rows, minibatches of 4 (ppo_mini_batch_size=1 x n=4), 2 epochs, shuffled: M = 4 optimizer steps.
    """
    from conduit_verl.cpu.config import compose, cpu_overrides

    cfg = compose(cpu_overrides(str(tiny["model"]), n=4, mini_batch=1, micro_batch=2, epochs=2, shuffle=True))
    monkeypatch.setenv("CONDUIT_VERL_TRACE_DIR", str(tmp_path))
    ref_metrics, ref_params = run_update(cfg, "off")
    assert not list(tmp_path.iterdir()), "verl's own path must not go through Conduit"
    got_metrics, got_params = run_update(cfg, "prefetch")

    for key in ("actor/pg_loss", "actor/grad_norm", "actor/loss"):
        assert len(ref_metrics[key]) == 4, (key, ref_metrics[key])
        assert got_metrics[key] == ref_metrics[key], key
    assert ref_params.keys() == got_params.keys()
    for name, ref in ref_params.items():
        assert torch.equal(got_params[name], ref), name
    assert any(not torch.equal(p, q) for p, q in zip(ref_params.values(), full_params_initial(cfg).values(),
                                                       strict=True)), "the update changed nothing"

    (rec_file,) = tmp_path.glob("delivery-*.json")
    rec = json.loads(rec_file.read_text())
    assert rec["minibatches"] == 4 and rec["num_minibatches"] == 2 and rec["epochs"] == 2
    assert rec["g_del"] == pytest.approx(1 / 4)
    assert rec["staged"] == 3  # minibatch k+1 staged while k trained, never past the last one
    assert rec["telemetry"]["deliver"]["calls"] == 4


#: the KL loss on (verl's default type, named)
KL_LOSS = ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl"]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A (possibly jagged) tensor's values, one row after another, copied."""
    return (t.values() if t.is_nested else t.reshape(-1)).detach().clone()


def run_update_with_ref(cfg: Any, mode: str) -> tuple[dict[str, Any], list[torch.Tensor], Any]:
    """One GRPO actor update with the KL loss: verl's reference worker (its FSDP2 forward-only engine, on this CPU)
    computes ``ref_log_prob`` as verl's trainer does, the actor trains through Conduit delivery in ``mode``.

    Returns the update's metrics, the ``ref_log_prob`` of every micro-batch as the loss received it, and the batch."""
    from conduit_verl import delivery
    from transformers import AutoTokenizer
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.workers.engine_workers import ActorRolloutRefWorker

    cfg = copy.deepcopy(cfg)  # the ref worker's init_model rewrites its config section in place
    actor = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    actor.init_model()
    ref = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="ref")
    ref.init_model()
    seen: list[torch.Tensor] = []
    loss_fn = actor.loss_fn

    def recording_loss(model_output: Any, data: Any, dp_group: Any = None) -> Any:
        seen.append(_flat(data["ref_log_prob"]))
        return loss_fn(model_output=model_output, data=data, dp_group=dp_group)

    actor.set_loss_fn(recording_loss)
    trainer = SimpleNamespace(config=cfg, actor_rollout_wg=actor, ref_policy_wg=ref, ref_in_actor=False,
                              distillation_config=None)
    tok = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    batch = rollout_batch(tok, prompts=2, n=cfg.actor_rollout_ref.rollout.n)
    old, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
    batch = batch.union(old).union(RayPPOTrainer._compute_ref_log_prob(trainer, batch))
    batch = compute_advantage(batch, adv_estimator="grpo", num_repeat=cfg.actor_rollout_ref.rollout.n)
    with delivery.forced(mode):  # type: ignore[arg-type]
        out = RayPPOTrainer._update_actor(trainer, batch)
    return out.meta_info["metrics"], seen, batch


def test_kl_loss_update_through_conduit_matches_verl(tiny: dict[str, Path], gloo: None, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With the KL loss on, verl's reference model starts on this CPU (conduit-verl's CPU platform builds its
    offloaded FSDP2 engine unpinned) and Conduit hands the loss the same ``ref_log_prob``, bitwise, micro-batch by
    micro-batch, as verl's own iterator: same KL losses, same policy losses.

    8 rows, minibatches of 4, 2 shuffled epochs, micro-batches of 2: 4 optimizer steps, 8 loss calls."""
    from conduit_verl.cpu.config import compose, cpu_overrides, reference_overrides

    cfg = compose(cpu_overrides(str(tiny["model"]), n=4, mini_batch=1, micro_batch=2, epochs=2, shuffle=True)
                  + reference_overrides(micro_batch=2) + KL_LOSS
                  + ["actor_rollout_ref.actor.optim.lr=1e-2"])  # verl's 1e-6 moves no fp32 low_var_kl off 0
    monkeypatch.setenv("CONDUIT_VERL_TRACE_DIR", str(tmp_path))
    ref_metrics, ref_seen, batch = run_update_with_ref(cfg, "off")
    assert not list(tmp_path.iterdir()), "verl's own path must not go through Conduit"
    got_metrics, got_seen, _ = run_update_with_ref(cfg, "prefetch")
    assert len(list(tmp_path.glob("delivery-*.json"))) == 1  # the second update went through Conduit

    # the reference is the initial policy: its log-probs are the actor's before the update
    rlp, mask = batch.batch["ref_log_prob"], batch.batch["response_mask"].bool()
    assert torch.allclose(rlp[mask], batch.batch["old_log_probs"][mask], atol=1e-5)
    assert len(ref_seen) == len(got_seen) == 8
    for k, (want, got) in enumerate(zip(ref_seen, got_seen, strict=True)):
        assert got.dtype == want.dtype and torch.equal(got, want), k
    seen = torch.cat(ref_seen)
    seen = seen[seen != 0]  # the loss gets them padded with zeros; no token of this random model has log-prob 0
    assert torch.equal(torch.sort(seen).values,  # every response token's, twice (2 epochs), none else
                       torch.sort(torch.cat([rlp[mask]] * 2)).values)
    for key in ("actor/kl_loss", "actor/pg_loss", "actor/loss", "actor/grad_norm"):
        assert len(ref_metrics[key]) == 4, (key, ref_metrics[key])
        assert got_metrics[key] == ref_metrics[key], key
    kl = ref_metrics["actor/kl_loss"]
    assert kl[0] == 0.0 and all(math.isfinite(v) and v > 0 for v in kl[1:]), kl  # the policy moved off the ref


def full_params_initial(cfg: Any) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.actor_rollout_ref.model.path)
    return {n: p.detach() for n, p in model.named_parameters()}
