"""The experience schema: which fields an item has, their dtype and per-item shape.

A *fixed* field stores one tensor of shape ``shape`` per item. A *variable-length* field
(``Field(..., ragged=True)``) stores per item a sequence of ``L_i`` elements of shape
``shape``; the storage keeps those sequences packed end to end with an offset and a
length per item, so a token sequence costs its tokens and nothing more.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from conduit.errors import ConfigurationError

__all__ = ["Field", "ExperienceSchema"]


@dataclass(frozen=True)
class Field:
    """One named column of experience.

    Args:
        shape: the per-item shape (``()`` for a scalar). For a ragged field, the shape of
            one element of the sequence (``()`` for a token id).
        dtype: the torch dtype items are stored with; ingestion requires exactly this dtype.
        ragged: whether each item holds a variable-length sequence of elements.
    """

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    ragged: bool = False

    def __post_init__(self) -> None:
        try:
            shape = tuple(int(s) for s in self.shape)
        except (TypeError, ValueError):
            raise ConfigurationError(f"Field shape must be a tuple of sizes, got {self.shape!r}; write e.g. "
                                     f"Field((4,)) for 4 values per item, Field(()) for a scalar.") from None
        if any(s <= 0 for s in shape):
            raise ConfigurationError(f"Field shape {self.shape} has a non-positive dimension; give sizes >= 1.")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigurationError(f"Field dtype must be a torch.dtype, got {self.dtype!r}.")
        object.__setattr__(self, "shape", shape)

    @property
    def item_numel(self) -> int:
        """Elements per item (fixed field) or per sequence element (ragged field)."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def element_bytes(self) -> int:
        """Bytes of one item (fixed) or of one sequence element (ragged)."""
        return self.item_numel * torch.empty((), dtype=self.dtype).element_size()


class ExperienceSchema(Mapping[str, Field]):
    """An ordered, immutable mapping of field name to :class:`Field`.

    Examples:
        >>> import torch
        >>> s = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))
        >>> list(s), s.fixed_item_bytes
        (['obs', 'action'], 24)
    """

    def __init__(self, fields: Mapping[str, Field] | None = None, **kwargs: Field) -> None:
        merged: dict[str, Field] = dict(fields or {})
        merged.update(kwargs)
        if not merged:
            raise ConfigurationError("An ExperienceSchema needs at least one field.")
        for name, f in merged.items():
            if not isinstance(f, Field):
                raise ConfigurationError(f"Schema field {name!r} must be a conduit.Field, got {type(f).__name__}.")
        self._fields = merged
        self.fixed = tuple(n for n, f in merged.items() if not f.ragged)
        self.ragged = tuple(n for n, f in merged.items() if f.ragged)
        self._fixed_item_bytes = sum(merged[n].element_bytes for n in self.fixed)
        #: (name, dtype, per-item shape, column dims) of every fixed field: the checks a batch of tensors needs
        self.fixed_checks = tuple((n, f.dtype, torch.Size(f.shape), len(f.shape) + 1) for n, f in merged.items()
                                  if not f.ragged)

    def __getitem__(self, name: str) -> Field:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={f.dtype}{list(f.shape)}{'*' if f.ragged else ''}" for n, f in self._fields.items())
        return f"ExperienceSchema({inner})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExperienceSchema) and self._fields == other._fields

    def __hash__(self) -> int:
        return hash(tuple(self._fields.items()))

    @property
    def fixed_item_bytes(self) -> int:
        """Bytes one item takes in the fixed fields."""
        return self._fixed_item_bytes

    def item_bytes(self, mean_ragged_length: float = 0.0) -> float:
        """Bytes one item takes, counting ``mean_ragged_length`` elements per ragged field."""
        return self.fixed_item_bytes + mean_ragged_length * sum(self._fields[n].element_bytes for n in self.ragged)

    def to_dict(self) -> dict[str, Any]:
        """A plain, picklable description (dtype as its name)."""
        return {n: {"shape": list(f.shape), "dtype": str(f.dtype).removeprefix("torch."), "ragged": f.ragged}
                for n, f in self._fields.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Mapping[str, Any]]) -> ExperienceSchema:
        """Inverse of :meth:`to_dict`."""
        return cls({n: Field(tuple(v["shape"]), getattr(torch, v["dtype"]), bool(v.get("ragged", False)))
                    for n, v in d.items()})
