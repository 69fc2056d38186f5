"""The experience schema: which fields an item has, their dtype and per-item shape.

A *fixed* field stores one tensor of shape ``shape`` per item. A *variable-length* field
(``Field(..., ragged=True)``) stores per item a sequence of ``L_i`` elements of shape
``shape``; the storage keeps those sequences packed end to end with an offset and a
length per item, so a token sequence costs its tokens and nothing more.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from conduit.checks import is_bool
from conduit.errors import ConfigurationError

__all__ = ["Field", "ExperienceSchema", "storable", "same_width_integer"]


@functools.cache
def storable(dtype: torch.dtype) -> bool:
    """Whether a storage can hold ``dtype``: torch allocates it, copies it and gathers rows of it."""
    try:
        column = torch.empty(2, dtype=dtype)
        column.copy_(torch.index_select(column, 0, torch.zeros(2, dtype=torch.int64)))
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError (e.g. index_select for uint16)
        return False
    return True


#: the signed integer dtype of each element width
_SIGNED_BY_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_width_integer(dtype: torch.dtype) -> torch.dtype | None:
    """The signed integer dtype as wide as ``dtype`` (a ``view`` to it carries the bits of a dtype torch cannot
    gather or copy by index, e.g. uint16 or float8), or None for a width no integer has."""
    return _SIGNED_BY_WIDTH.get(dtype.itemsize)


@dataclass(frozen=True)
class Field:
    """One named column of experience.

    Args:
        shape: the per-item shape (``()`` for a scalar): integer sizes >= 1. For a ragged field,
            the shape of one element of the sequence (``()`` for a token id).
        dtype: the torch dtype items are stored with; ingestion requires exactly this dtype.
            It must be one torch can gather rows of (this rules out uint16/uint32/uint64 where
            torch lacks ``index_select`` for them).
        ragged: whether each item holds a variable-length sequence of elements (a bool).

    Raises:
        ConfigurationError: a shape, dtype or ragged flag outside the above.
    """

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    ragged: bool = False

    def __post_init__(self) -> None:
        try:
            if isinstance(self.shape, (str, bytes)) or any(isinstance(s, bool) for s in self.shape):
                raise TypeError
            shape = tuple(operator.index(s) for s in self.shape)  # sizes are integers: 2.5 or "4" is refused
        except TypeError:
            raise ConfigurationError(f"Field shape must be a tuple of sizes, got {self.shape!r}; write e.g. "
                                     f"Field((4,)) for 4 values per item, Field(()) for a scalar.") from None
        if any(s <= 0 for s in shape):
            raise ConfigurationError(f"Field shape {self.shape} has a non-positive dimension; give sizes >= 1.")
        if math.prod(shape) >= 2**63:
            raise ConfigurationError(f"Field shape {self.shape} has {math.prod(shape)} elements per item, more "
                                     f"than torch can index (2**63 - 1); give a smaller shape.")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigurationError(f"Field dtype must be a torch.dtype, got {self.dtype!r}.")
        if not is_bool(self.ragged):
            raise ConfigurationError(f"Field ragged must be True or False, got {self.ragged!r}.")
        if not storable(self.dtype):
            raise ConfigurationError(f"Field dtype {self.dtype} cannot be stored: this torch cannot gather rows of it "
                                     f"(index_select). Store it as a signed integer dtype of the same width "
                                     f"(e.g. torch.int16 for torch.uint16) and .view() it back after delivery.")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ragged", bool(self.ragged))

    @property
    def item_numel(self) -> int:
        """Elements per item (fixed field) or per sequence element (ragged field)."""
        return math.prod(self.shape)

    @property
    def element_bytes(self) -> int:
        """Bytes of one item (fixed) or of one sequence element (ragged)."""
        return self.item_numel * torch.empty((), dtype=self.dtype).element_size()


class ExperienceSchema(Mapping[str, Field]):
    """An ordered, immutable mapping of field name to :class:`Field`.

    Fields come from ``fields`` (a mapping), then from the keyword arguments, in that order.

    Raises:
        ConfigurationError: no field, a field that is no :class:`Field`, or a name given both in ``fields``
            and as a keyword (one would silently replace the other).

    Examples:
        >>> import torch
        >>> s = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))
        >>> list(s), s.fixed_item_bytes
        (['obs', 'action'], 24)
    """

    def __init__(self, fields: Mapping[str, Field] | None = None, **kwargs: Field) -> None:
        merged: dict[str, Field] = dict(fields or {})
        twice = [name for name in kwargs if name in merged]
        if twice:
            raise ConfigurationError(f"Schema field(s) {', '.join(map(repr, twice))} given both in fields and as a "
                                     f"keyword; give each field once.")
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
        """Inverse of :meth:`to_dict`.

        Raises:
            ConfigurationError: ``d`` is not such a description (a missing entry, an unknown dtype name, a
                ``ragged`` that is no bool).
        """
        try:
            # ragged as given: Field refuses what is no bool (bool("false") would make a fixed field ragged)
            fields = {n: Field(tuple(v["shape"]), getattr(torch, v["dtype"]), v.get("ragged", False))
                      for n, v in d.items()}
        except ConfigurationError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ConfigurationError(f"This is not a schema description ({type(e).__name__}: {e}); give what "
                                     f"ExperienceSchema.to_dict() returns: {{name: {{'shape': [...], 'dtype': "
                                     f"'float32', 'ragged': False}}}}.") from e
        return cls(fields)
