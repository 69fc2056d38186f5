"""CPU support for tests and demos: a verl platform and a small rollout backend.

verl 0.9.1 has neither a CPU platform nor a CPU rollout, so ``python -m
verl.trainer.main_ppo`` cannot run on a host without an accelerator. Registered through
verl's own registries (``PlatformRegistry``, ``RolloutReplicaRegistry``, the worker-side
rollout registry); they are chosen only where no accelerator exists.
"""

from __future__ import annotations

__all__ = ["maybe_register"]


def maybe_register() -> None:
    """Register the ``cpu`` platform (verl picks it only when no accelerator is present)."""
    from conduit_verl.cpu import platform  # noqa: F401  (PlatformRegistry.register("cpu"))
