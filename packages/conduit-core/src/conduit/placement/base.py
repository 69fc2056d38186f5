"""The placement role: which tier (and devices) hold the experience state."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from conduit.schema import ExperienceSchema
from conduit.storage.base import Storage
from conduit.storage.columnar import ColumnarStorage

__all__ = ["Placement", "HostPlacement"]


class Placement(ABC):
    """Builds the storage for a buffer.

    Contract for implementations:
      * ``storage`` returns an empty storage able to hold ``capacity`` items of ``schema``;
      * it raises :class:`conduit.PlacementError` with a remedy when nothing fits.
    """

    @abstractmethod
    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        """An empty storage for ``capacity`` items of ``schema``."""

    def describe(self) -> str:
        return type(self).__name__


class HostPlacement(Placement):
    """Experience lives in host memory (page-locked when ``pin_memory`` and CUDA is present)."""

    def __init__(self, *, pin_memory: bool = False) -> None:
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        return ColumnarStorage(schema, capacity, "cpu", ragged_capacity=ragged_capacity, pin_memory=self.pin_memory,
                               tier="pinned" if self.pin_memory else "host")

    def describe(self) -> str:
        return "host (pinned)" if self.pin_memory else "host"
