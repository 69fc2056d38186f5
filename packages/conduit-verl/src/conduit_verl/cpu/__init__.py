"""CPU support for tests and demos: a verl platform and a small rollout backend.

verl 0.9.1 has neither a CPU platform nor a CPU rollout, so ``python -m
verl.trainer.main_ppo`` cannot run on a host without an accelerator. Registered through
verl's own registries (``PlatformRegistry``, ``RolloutReplicaRegistry``, the worker-side
rollout registry); they are chosen only where no accelerator exists.
"""

from __future__ import annotations

__all__ = ["maybe_register"]


def _load_hf_replica() -> type:
    from conduit_verl.cpu.rollout import HFReplica

    return HFReplica


def maybe_register() -> None:
    """Register the ``cpu`` platform (picked only when no accelerator is present) and the ``hf`` rollout."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from conduit_verl.cpu import platform  # noqa: F401  (PlatformRegistry.register("cpu"))

    RolloutReplicaRegistry.register("hf", _load_hf_replica)
    base._ROLLOUT_REGISTRY.setdefault(("hf", "async"), "conduit_verl.cpu.rollout.HFServerAdapter")
