"""A verl platform for hosts without an accelerator (tests and demos only).

verl 0.9.1 ships platforms for NVIDIA, Ascend and ROCm only; on a CPU-only host it falls
back to ``nvidia`` and its first ``torch.cuda`` call fails. :class:`PlatformCPU` is
registered with verl's ``PlatformRegistry`` under ``cpu``. verl probes the registered
platforms in order, so on a host with an accelerator the built-in platform still wins;
``VERL_PLATFORM=cpu`` selects this one explicitly.

When verl picks it, :func:`activate` does the three things verl needs on a CPU that its registries
do not reach:

* registers verl's FSDP engines (actor and critic) for device ``cpu`` through
  ``EngineRegistry.register`` (verl declares them for ``cuda``/``npu`` only; the engines
  themselves are device-agnostic), as soon as verl has loaded them. The critic's refuses to
  start (:data:`CRITIC_ON_CPU`, a ``ConfigurationError``): verl 0.9.1 loads a value model with
  flash-attention hard-coded, which no CPU host runs;
* wraps ``verl.utils.distributed.initialize_global_process_group_ray``. verl builds the
  process-group backend as ``f"cpu:gloo,{device}:{backend}"``, which torch rejects when the
  device is ``cpu`` ("Duplicate device type cpu"); no registry reaches that string, so the
  wrapper passes ``backend="cpu:gloo"`` when the caller gave none;
* rebinds the name ``CPUOffloadPolicy`` in ``verl.workers.engine.fsdp.transformer_impl`` to
  :class:`UnpinnedCPUOffloadPolicy`, torch's policy with ``pin_memory`` always ``False``. verl
  builds a forward-only engine (the reference model) and any engine with
  ``fsdp_config.offload_policy=True`` with ``CPUOffloadPolicy(pin_memory=True)`` hard-coded
  (FSDP2), no config reaches that flag, and pinning host memory needs an accelerator, so on a
  CPU-only host the reference model's ``init_model`` failed ("Cannot access accelerator device
  when none is available"). Everything else about the offload policy stays verl's (parameters
  kept on the CPU, verl's offload-aware code paths); pinning only speeds host-to-device copies,
  and there is no device here. Done together with the engine registration, once verl has
  loaded that module, and only if the name is still torch's class.

The last two are conduit-verl's only changes to verl's module attributes (the wrapper is also
bound in the verl modules that had imported the original); both exist only where this platform
is chosen (a host without an accelerator), where what they replace cannot run.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from verl.plugin.platform import PlatformRegistry
from verl.plugin.platform.platform_base import PlatformBase

__all__ = ["CRITIC_ON_CPU", "PlatformCPU", "UnpinnedCPUOffloadPolicy", "activate", "cpu_device_module",
           "no_accelerator"]

logger = logging.getLogger(__name__)
_activated = False
_engines_registered = False


def no_accelerator() -> bool:
    """True when neither CUDA/ROCm nor an Ascend NPU is usable or visible on this host."""
    if torch.cuda.is_available():
        return False
    try:
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401

        return not torch.npu.is_available()  # type: ignore[attr-defined]
    except ImportError:
        pass
    return not any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/davinci0", "/dev/kfd"))


def _zero(*_: Any, **__: Any) -> int:
    return 0


def _none(*_: Any, **__: Any) -> None:
    return None


def cpu_device_module() -> SimpleNamespace:
    """What verl calls on ``get_torch_device()``, for the CPU: ``torch.cpu`` plus memory no-ops."""
    cpu = torch.cpu
    return SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: "cpu",
        set_device=_none,
        synchronize=_none,
        empty_cache=_none,
        ipc_collect=_none,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        memory_allocated=_zero,
        memory_reserved=_zero,
        max_memory_allocated=_zero,
        max_memory_reserved=_zero,
        reset_peak_memory_stats=_none,
        set_per_process_memory_fraction=_none,
        mem_get_info=lambda *a, **k: (0, 0),
        get_device_name=lambda *a, **k: "CPU",
        Stream=cpu.Stream,
        Event=cpu.Event,
        stream=cpu.stream,
        current_stream=cpu.current_stream,
    )


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's device interface answered by the host CPU (``gloo`` collectives, Ray ``CPU`` resources)."""

    @property
    def device_name(self) -> str:
        if not _engines_registered:
            _register_engines()  # verl asks for the device name right before it looks an engine up
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return cpu_device_module()

    def is_available(self) -> bool:
        ok = no_accelerator()
        if ok:
            activate()
        return ok

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return self.is_available()

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CONDUIT_VERL_VISIBLE_CPUS"

    @contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def activate() -> None:
    """Register verl's FSDP engines for ``cpu``, the gloo process-group default and the unpinned offload policy
    (idempotent)."""
    global _activated
    if _activated:
        return
    _activated = True
    import verl.utils.distributed as vdist

    original = vdist.initialize_global_process_group_ray
    if not getattr(original, "_conduit_cpu", False):
        def initialize_global_process_group_ray(timeout_second: Any = None, backend: Any = None) -> None:
            return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

        initialize_global_process_group_ray._conduit_cpu = True  # type: ignore[attr-defined]
        vdist.initialize_global_process_group_ray = initialize_global_process_group_ray
        import sys

        for modname in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
            mod: Any = sys.modules.get(modname)
            if mod is not None and getattr(mod, "initialize_global_process_group_ray", None) is original:
                mod.initialize_global_process_group_ray = initialize_global_process_group_ray
    _register_engines()


#: why a critic (verl's value-model engine) is refused on a CPU-only host, and what to do
CRITIC_ON_CPU = ("A critic cannot run on this CPU-only host: verl 0.9.1 loads the value model with "
                 "attn_implementation='flash_attention_2' hard-coded (verl.utils.model.load_valuehead_model; "
                 "model.override_config does not reach it, and installing trl does not help), and flash-attention "
                 "needs a GPU. Use a critic-free advantage estimator here (algorithm.adv_estimator=grpo, leaving "
                 "critic.enable unset), or run PPO with a critic (adv_estimator=gae) on a GPU host.")


def _refuse_critic(self: Any, *args: Any, **kwargs: Any) -> None:
    """The CPU critic engine's ``initialize`` (verl's first call to it, where it would load the model)."""
    from conduit import ConfigurationError

    raise ConfigurationError(CRITIC_ON_CPU)


@dataclass
class UnpinnedCPUOffloadPolicy(CPUOffloadPolicy):
    """torch's FSDP2 ``CPUOffloadPolicy`` whose ``pin_memory`` is ``False`` whatever the caller asked.

    Parameters, gradients and optimizer states stay on the CPU exactly as under the parent
    policy (FSDP2 checks ``isinstance(policy, CPUOffloadPolicy)``, which still holds); only the
    page-locking is left out, which needs an accelerator and only speeds copies to one.
    """

    def __post_init__(self) -> None:
        self.pin_memory = False


def _unpin_offload_policy(impl: Any) -> None:
    """Make verl's FSDP engine module build :class:`UnpinnedCPUOffloadPolicy` where it builds torch's policy."""
    if getattr(impl, "CPUOffloadPolicy", None) is CPUOffloadPolicy:
        impl.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy
    elif getattr(impl, "CPUOffloadPolicy", None) is not UnpinnedCPUOffloadPolicy:
        logger.warning("verl.workers.engine.fsdp.transformer_impl no longer names torch's CPUOffloadPolicy; a "
                       "reference model (forward-only engine) may fail to pin memory on this CPU-only host")


def _register_engines() -> None:
    """Register verl's FSDP engines for ``cpu`` (and unpin its offload policy) once their module has loaded.

    Never imports it: verl may be in the middle of importing it (it asks for the platform at
    import time); the engine lookup asks for the device name, which lands here again.
    """
    global _engines_registered
    import sys

    impl = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    base = sys.modules.get("verl.workers.engine.base")
    if impl is None or base is None or not hasattr(impl, "FSDPEngineWithValueHead"):
        return
    _engines_registered = True
    _unpin_offload_policy(impl)
    critic = type("CPUValueHeadEngine", (impl.FSDPEngineWithValueHead,), {"initialize": _refuse_critic,
                                                                            "__doc__": CRITIC_ON_CPU})
    engines = (("language_model", impl.FSDPEngineWithLMHead), ("value_model", critic))
    for model_type, cls in engines:
        try:
            base.EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(cls)
        except AssertionError:  # registered already (verl asserts on a duplicate key)
            pass
