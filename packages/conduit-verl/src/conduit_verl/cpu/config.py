"""The hydra overrides that make verl's trainer config run on a CPU (tests and demos)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["cpu_overrides", "compose"]


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


def compose(overrides: Sequence[str], config_name: str = "ppo_trainer") -> Any:
    """verl's own trainer config (``verl/trainer/config``) composed with ``overrides``."""
    import verl.trainer.config as vcfg
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=os.path.dirname(vcfg.__file__), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
