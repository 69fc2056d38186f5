"""The hydra overrides that make verl's trainer config run on a CPU (tests and demos)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["cpu_overrides", "main_ppo_overrides", "reference_overrides", "compose"]


def cpu_overrides(model_path: str, *, n: int = 4, mini_batch: int = 1, micro_batch: int = 4, epochs: int = 1,
                  shuffle: bool = False) -> list[str]:
    """verl 0.9.1 trainer overrides for FSDP2 on gloo with a small fp32 model.

    FSDP1 (verl's default ``fsdp``) needs its parameters on a GPU; flash-attention is not
    installed on a CPU host; bf16 autocast and ``torch.compile`` are slow or missing there.
    """
    actor = "actor_rollout_ref.actor"
    return [
        f"actor_rollout_ref.model.path={model_path}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"{actor}.strategy=fsdp2",
        f"{actor}.fsdp_config.model_dtype=fp32",
        f"+{actor}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{actor}.fsdp_config.use_torch_compile=False",
        f"{actor}.use_torch_compile=False",
        f"{actor}.use_dynamic_bsz=False",
        f"{actor}.ppo_mini_batch_size={mini_batch}",
        f"{actor}.ppo_micro_batch_size_per_gpu={micro_batch}",
        f"{actor}.ppo_epochs={epochs}",
        f"{actor}.shuffle={shuffle}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=False",
        "trainer.device=cpu",
    ]


def reference_overrides(*, micro_batch: int = 4) -> list[str]:
    """What verl's reference model (``use_kl_loss`` or ``use_kl_in_reward``) needs on a CPU beside
    :func:`cpu_overrides`: its FSDP config is its own, so the actor's fp32, no-``torch.compile``
    settings and a log-prob micro-batch size are given to it again."""
    ref = "actor_rollout_ref.ref"
    return [
        f"{ref}.log_prob_micro_batch_size_per_gpu={micro_batch}",
        f"{ref}.fsdp_config.model_dtype=fp32",
        f"+{ref}.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{ref}.fsdp_config.use_torch_compile=False",
    ]


def main_ppo_overrides(root: str, *, steps: int = 2) -> list[str]:
    """Everything ``python -m verl.trainer.main_ppo`` needs for a few GRPO steps on a CPU with Conduit.

    ``root`` is what ``python -m conduit_verl.tiny ROOT`` wrote. The README shows the same list.
    """
    return [
        f"data.train_files={root}/data/train.parquet",
        f"data.val_files={root}/data/val.parquet",
        "data.train_batch_size=2",
        "data.max_prompt_length=32",
        "data.max_response_length=8",
        "data.dataloader_num_workers=0",
        "algorithm.adv_estimator=grpo",
        *cpu_overrides(f"{root}/model", n=4, mini_batch=1, micro_batch=4),
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.custom_reward_function.path=pkg://conduit_verl.tiny",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "transfer_queue.backend.storage_backend=Conduit",
        "trainer.v1.sampler.custom_sampler.path=pkg://conduit_verl.replay",
        "trainer.v1.sampler.custom_sampler.name=ConduitReplayBuffer",
        "+ray_kwargs.ray_init.address=local",
        "ray_kwargs.ray_init.num_cpus=8",
        "+ray_kwargs.ray_init.num_gpus=1",
    ]


def compose(overrides: Sequence[str], config_name: str = "ppo_trainer") -> Any:
    """verl's own trainer config (``verl/trainer/config``) composed with ``overrides``."""
    import verl.trainer.config as vcfg
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=os.path.dirname(vcfg.__file__), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
