"""The placement role: which tier (and devices) hold the experience state.

Tiers, all behind the one :class:`~conduit.storage.Storage` interface (so replay and
on-policy semantics are identical on each):

* :class:`HostPlacement`: host memory, pageable or page-locked (``pin_memory``, needs CUDA);
* :class:`DevicePlacement`: one accelerator (``cuda:i``), or any torch device;
* :class:`ShardedPlacement`: slots interleaved over several devices;
* :class:`DiskPlacement`: memory-mapped files, for buffers larger than memory.

A :class:`PlacementSpec` names a placement as plain data (``tier`` + ``devices``); it is
what the planner chooses and what ``conduit plan --json`` prints.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conduit.checks import is_real
from conduit.errors import ConfigurationError, PlacementError
from conduit.schema import ExperienceSchema
from conduit.storage.base import Storage
from conduit.storage.columnar import ColumnarStorage
from conduit.storage.disk import DiskStorage
from conduit.storage.sharded import ShardedStorage, as_devices

__all__ = ["Placement", "PlacementSpec", "HostPlacement", "DevicePlacement", "ShardedPlacement", "DiskPlacement",
           "TIERS"]

#: the tier names a :class:`PlacementSpec` may carry
TIERS = ("host", "pinned", "gpu", "sharded", "disk")


def ragged_pool(schema: ExperienceSchema, capacity: int, ragged_item_bytes: float) -> int:
    """Elements per ragged pool that ``capacity`` items of ``ragged_item_bytes`` bytes of ragged fields hold (every
    ragged field's pool has that many elements, so their bytes together are at most
    ``capacity * ragged_item_bytes``)."""
    per = sum(schema[n].element_bytes for n in schema.ragged)  # bytes of one element of every ragged field
    return int(capacity * ragged_item_bytes // per)


@dataclass(frozen=True)
class PlacementSpec:
    """A placement as data: the tier and the devices it uses.

    ``devices`` are torch device strings (``"cpu"``, ``"cuda:3"``); the disk tier lists
    ``"disk"``.

    Raises:
        PlacementError: an unknown tier, no devices, or ``devices`` that is one name instead of a sequence.
    """

    tier: str
    devices: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise PlacementError(f"Unknown tier {self.tier!r}; use one of {', '.join(TIERS)}.")
        if isinstance(self.devices, (str, bytes)):  # (a tuple of its characters otherwise: 'c', 'p', 'u')
            raise PlacementError(f"A placement's devices are a sequence of device names, got the one name "
                                 f"{self.devices!r}; write PlacementSpec({self.tier!r}, ({self.devices!r},)).")
        object.__setattr__(self, "devices", tuple(str(d) for d in self.devices))
        if not self.devices:
            raise PlacementError(f"A {self.tier!r} placement needs at least one device (e.g. ('cpu',), ('cuda:0',) "
                                 f"or ('disk',)).")

    def build(self, *, directory: str | Path | None = None, ragged_item_bytes: float | None = None) -> Placement:
        """The :class:`Placement` that realises this spec (``directory`` is for the disk tier).

        ``ragged_item_bytes`` sizes the ragged pools of the storage it builds when the buffer gives no
        ``ragged_capacity`` (see :attr:`Placement.ragged_item_bytes`; :meth:`Plan.build` passes the plan's).
        """
        if ragged_item_bytes is not None and (not is_real(ragged_item_bytes)
                                              or not 0 <= ragged_item_bytes < math.inf):
            raise ConfigurationError(f"ragged_item_bytes must be a finite number >= 0 (bytes per item of the ragged "
                                     f"fields) or None, got {ragged_item_bytes!r}.")
        placement: Placement
        if self.tier == "host":
            placement = HostPlacement()
        elif self.tier == "pinned":
            placement = HostPlacement(pin_memory=True)
        elif self.tier == "gpu":
            placement = DevicePlacement(self.devices[0])
        elif self.tier == "sharded":
            placement = ShardedPlacement(self.devices)
        else:
            placement = DiskPlacement(directory=directory)
        placement.ragged_item_bytes = ragged_item_bytes
        return placement

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "devices": list(self.devices)}

    def __str__(self) -> str:
        if self.tier in ("host", "pinned", "disk"):
            return self.tier
        return f"{self.tier}[{','.join(self.devices)}]"


class Placement(ABC):
    """Builds the storage for a buffer.

    Contract for implementations:
      * ``storage`` returns an empty storage able to hold ``capacity`` items of ``schema``;
      * it raises :class:`conduit.PlacementError` with a remedy when nothing fits.
    """

    #: bytes per item of all ragged fields together that the ragged pools are sized for when :meth:`storage`
    #: gets no ``ragged_capacity`` (the built-in tiers: see :meth:`planned_pool`); None: the storage's default,
    #: ``DEFAULT_POOL_PER_ITEM`` elements per item. :meth:`Plan.build` sets the plan's (its workload's ragged
    #: field bytes, i.e. at its mean ragged length), so the pools take the memory the plan checked.
    ragged_item_bytes: float | None = None

    @abstractmethod
    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        """An empty storage for ``capacity`` items of ``schema``."""

    def planned_pool(self, schema: ExperienceSchema, capacity: int, ragged_capacity: int | None) -> int | None:
        """The elements of each ragged pool for ``capacity`` items of ``schema``: ``ragged_capacity`` when given
        (or when ``schema`` has no ragged fields, or :attr:`ragged_item_bytes` is None); else as many as
        ``capacity`` items of :attr:`ragged_item_bytes` hold (every ragged field's pool has that many elements,
        so their bytes together are at most ``capacity * ragged_item_bytes``).

        Raises:
            PlacementError: the pools would be sized from a :attr:`ragged_item_bytes` of 0 (a plan of ragged
                fields at ``mean_ragged_length=0``, which checked no memory for them): pass ``ragged_capacity``.
        """
        if ragged_capacity is not None or not schema.ragged or self.ragged_item_bytes is None:
            return ragged_capacity
        pool = ragged_pool(schema, capacity, self.ragged_item_bytes)
        if pool <= 0:
            raise PlacementError(
                f"Ragged fields {', '.join(schema.ragged)}: this placement was planned for {self.ragged_item_bytes} "
                f"B of them per item, not one element of each for {capacity} items (a workload at "
                f"mean_ragged_length=0?), so the plan checked no memory for their pools. Plan with "
                f"Workload.from_schema(..., mean_ragged_length=N), or build the buffer with "
                f"ExperienceDataPlane(..., ragged_capacity=N).")
        return pool

    def storage_abandoned(self, storage: Storage) -> None:
        """``storage``, built by :meth:`storage`, will not be used (a migration into it failed): a storage
        that holds resources until it is collected (the disk tier's files) releases them now (``close``)."""
        release_storage(storage)

    def describe(self) -> str:
        return type(self).__name__

    @property
    def spec(self) -> PlacementSpec | None:
        """This placement as data, when it is one of the built-in tiers."""
        return None


def release_storage(storage: Storage) -> None:
    """Release now what ``storage`` holds until it is collected (the disk tier's files), through its ``close``, if
    it has one: for a storage no buffer uses any more (a failed migration's target, a committed one's source)."""
    close = getattr(storage, "close", None)
    if callable(close):
        close()


def _check_device(device: torch.device) -> None:
    """Raise :class:`PlacementError` for an accelerator this machine does not have."""
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        idx = device.index if device.index is not None else 0
        if idx >= n:
            raise PlacementError(f"{device} is not available here ({n} CUDA device(s)); pick an existing device, "
                                 f"or let `conduit plan --topology local` choose a placement.")
    elif device.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:
            raise PlacementError(f"{device} cannot be used here ({e}); pick another device.") from e


class HostPlacement(Placement):
    """Experience lives in host memory (page-locked when ``pin_memory`` and CUDA is present)."""

    def __init__(self, *, pin_memory: bool = False) -> None:
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        ragged_capacity = self.planned_pool(schema, capacity, ragged_capacity)
        return ColumnarStorage(schema, capacity, "cpu", ragged_capacity=ragged_capacity, pin_memory=self.pin_memory,
                               tier="pinned" if self.pin_memory else "host")

    def describe(self) -> str:
        return "host (pinned)" if self.pin_memory else "host"

    @property
    def spec(self) -> PlacementSpec:
        return PlacementSpec("pinned" if self.pin_memory else "host", ("cpu",))


class DevicePlacement(Placement):
    """Experience lives in one device's memory (``"cuda:i"``; any torch device works).

    Args:
        device: the device holding the columns.

    Raises:
        PlacementError: the device does not exist on this machine.
    """

    def __init__(self, device: torch.device | str = "cuda:0") -> None:
        (self.device,) = as_devices([device], PlacementError)  # (a name torch does not know: typed)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", 0)
        _check_device(self.device)

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        tier = "gpu" if self.device.type != "cpu" else "host"
        ragged_capacity = self.planned_pool(schema, capacity, ragged_capacity)
        return ColumnarStorage(schema, capacity, self.device, ragged_capacity=ragged_capacity, tier=tier)

    def describe(self) -> str:
        return f"device {self.device}"

    @property
    def spec(self) -> PlacementSpec:
        return PlacementSpec("gpu" if self.device.type != "cpu" else "host", (str(self.device),))


class ShardedPlacement(Placement):
    """Experience is sharded over ``devices`` (slot ``s`` on device ``s % K``).

    Several ``"cpu"`` entries are allowed: that exercises the sharding logic without a GPU.

    Args:
        devices: one device per shard, the first one also receives delivered batches.

    Raises:
        PlacementError: no devices, a device this machine does not have or torch does not know, or
            ``devices`` that is one name instead of a sequence.
    """

    def __init__(self, devices: Sequence[torch.device | str]) -> None:
        self.devices = tuple(as_devices(devices, PlacementError))
        if not self.devices:
            raise PlacementError("ShardedPlacement needs at least one device, e.g. ShardedPlacement(['cuda:0', "
                                 "'cuda:1']).")
        for d in self.devices:
            _check_device(d)

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        ragged_capacity = self.planned_pool(schema, capacity, ragged_capacity)
        return ShardedStorage(schema, capacity, self.devices, ragged_capacity=ragged_capacity)

    def describe(self) -> str:
        return f"sharded over {', '.join(str(d) for d in self.devices)}"

    @property
    def spec(self) -> PlacementSpec:
        return PlacementSpec("sharded", tuple(str(d) for d in self.devices))


class DiskPlacement(Placement):
    """Experience lives in memory-mapped files under ``directory`` (default: the temp dir).

    Keyword Args:
        directory: the volume to use; files go into a fresh subdirectory, removed with the storage.
    """

    def __init__(self, *, directory: str | Path | None = None) -> None:
        self.directory = directory

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        """Memory-mapped storage in a fresh subdirectory of :attr:`directory`.

        Raises:
            PlacementError: too little free space there, or the directory cannot be made or used
                (e.g. the path is a file, or not writable), or ragged pools planned at no length
                (:meth:`planned_pool`).
        """
        ragged_capacity = self.planned_pool(schema, capacity, ragged_capacity)
        try:
            return DiskStorage(schema, capacity, directory=self.directory, ragged_capacity=ragged_capacity)
        except OSError as e:  # the volume refused the directory (its column files are refused typed already)
            raise PlacementError(f"The disk tier cannot use {self.directory or 'the temp dir'} ({e}); pass "
                                 f"DiskPlacement(directory=...) naming a writable directory.") from e

    def describe(self) -> str:
        return "disk (memory-mapped)"

    @property
    def spec(self) -> PlacementSpec:
        return PlacementSpec("disk", ("disk",))
