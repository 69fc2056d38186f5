"""A small record type with the array-of-fields behaviour SRL's code relies on (for tests and benchmarks).

Written from that behaviour, not from SRL's class: a record holds named fields (arrays, ``None``
or nested records), indexes every field at once, reports lengths and version statistics, and
carries metadata through pickling. SRL's samples behave this way, so a Conduit buffer that
works with this type works with theirs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = ["Record", "stack", "make_sample"]


class Record:
    """Named fields that are indexed together.

    * ``Record(obs=..., reward=..., state=Record(h=...))``; fields are kept in sorted order.
    * ``r.obs`` / ``r["obs"]`` read a field; ``r[2]``, ``r[:, 1]``, ``r[1:3]`` index every field
      (``None`` stays ``None``) and return a record of the same class.
    * ``length(dim)``: size of axis ``dim`` of the first array field that has it.
    * ``min_of`` / ``max_of`` / ``average_of(field, ignore_negative=True)``: statistics over all
      values of a field, skipping negative ones (SRL marks "no version" with -1).
    * ``metadata`` (read-only) with ``register_metadata`` / ``pop_metadata`` / ``clear_metadata``;
      it survives pickling.
    """

    # Set with ``object.__setattr__`` in ``__init__``; declared here for the type checker only.
    _fields: tuple[str, ...]
    _metadata: MappingProxyType[str, Any]

    def __init__(self, **fields: Any) -> None:
        object.__setattr__(self, "_fields", tuple(sorted(fields)))
        object.__setattr__(self, "_metadata", MappingProxyType({}))
        for k, v in fields.items():
            object.__setattr__(self, k, v)

    # -- fields ----------------------------------------------------------------------------
    def items(self) -> Iterator[tuple[str, Any]]:
        for k in self._fields:
            yield k, getattr(self, k)

    def keys(self) -> Iterator[str]:
        return iter(self._fields)

    def values(self) -> Iterator[Any]:
        for k in self._fields:
            yield getattr(self, k)

    def __iter__(self) -> Iterator[Any]:
        return self.values()

    def __len__(self) -> int:
        return len(self._fields)

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __getitem__(self, loc: Any) -> Any:
        if isinstance(loc, str):
            return getattr(self, loc)
        return type(self)(**{k: None if v is None else v[loc] for k, v in self.items()})

    def length(self, dim: int = 0) -> int:
        for _, v in self.items():
            if isinstance(v, np.ndarray) and v.ndim > dim:
                return int(v.shape[dim])
        raise IndexError(f"No field has an axis {dim}.")

    # -- statistics ------------------------------------------------------------------------
    def _values(self, name: str, ignore_negative: bool) -> np.ndarray:
        v = np.asarray(getattr(self, name), dtype=np.float64)
        return np.where(v >= 0, v, np.nan) if ignore_negative else v

    def min_of(self, name: str, ignore_negative: bool = True) -> float | None:
        v = self._values(name, ignore_negative)
        return None if v.size == 0 or np.isnan(v).all() else float(np.nanmin(v))

    def max_of(self, name: str, ignore_negative: bool = True) -> float | None:
        v = self._values(name, ignore_negative)
        return None if v.size == 0 or np.isnan(v).all() else float(np.nanmax(v))

    def average_of(self, name: str, ignore_negative: bool = True) -> float | None:
        v = self._values(name, ignore_negative)
        return None if v.size == 0 or np.isnan(v).all() else float(np.nanmean(v))

    # -- metadata --------------------------------------------------------------------------
    @property
    def metadata(self) -> MappingProxyType[str, Any]:
        return self._metadata

    def register_metadata(self, **kwargs: Any) -> None:
        clash = [k for k in kwargs if k in self._fields]
        if clash:
            raise KeyError(f"Metadata keys {clash} clash with field names.")
        object.__setattr__(self, "_metadata", MappingProxyType({**self._metadata, **kwargs}))

    def pop_metadata(self, key: str) -> Any:
        d = dict(self._metadata)
        value = d.pop(key)
        object.__setattr__(self, "_metadata", MappingProxyType(d))
        return value

    def clear_metadata(self) -> None:
        object.__setattr__(self, "_metadata", MappingProxyType({}))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), dict(self.items()), dict(self._metadata)))

    def __repr__(self) -> str:
        def show(v: Any) -> str:
            return f"{v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray) else repr(v)
        return f"{type(self).__name__}({', '.join(f'{k}={show(v)}' for k, v in self.items())})"


def _rebuild(cls: type[Record], fields: dict[str, Any], metadata: dict[str, Any]) -> Record:
    r = cls(**fields)
    r.register_metadata(**metadata)
    return r


def stack(records: Sequence[Any], axis: int = 1) -> Any:
    """Stack records field by field along ``axis`` (``None`` fields stay ``None``); keeps the first one's class."""
    first = records[0]
    if first is None:
        return None
    if isinstance(first, Record):
        return type(first)(**{k: stack([r[k] for r in records], axis) for k in first.keys()})
    return np.stack(records, axis=axis)


def make_sample(ids: Sequence[int] | np.ndarray, *, time_steps: int = 4, dim: int = 3, version: int = 0,
                batched: bool = False) -> Record:
    """A sample shaped like an actor's: ``[T, ...]`` (``batched``: ``[T, B, ...]`` with one column per id).

    Fields: ``obs`` ``[.., dim]`` float32 (each row equal to its id), ``id`` int64,
    ``policy_version_steps`` ``[.., 1]`` int64, ``reward`` ``[.., 1]`` float32, ``done`` bool,
    a nested ``policy_state`` record, and ``info = None``. With ``batched=False`` give one id.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if not batched and ids.shape[0] != 1:
        raise ValueError("an unbatched sample has one id")
    cols = ids if batched else ids[:1]
    t = time_steps
    base = np.broadcast_to(cols[None, :], (t, cols.shape[0])).copy()  # [T, B]
    obs = np.broadcast_to(base[..., None].astype(np.float32), (t, cols.shape[0], dim)).copy()
    steps = np.arange(t, dtype=np.float32)[:, None, None]
    sample = Record(
        obs=obs,
        id=base,
        policy_version_steps=np.full((t, cols.shape[0], 1), version, dtype=np.int64),
        reward=(base[..., None] + steps).astype(np.float32),
        done=np.zeros((t, cols.shape[0], 1), dtype=bool),
        policy_state=Record(hx=np.broadcast_to(base[..., None].astype(np.float32) * 2,
                                               (t, cols.shape[0], 2)).copy()),
        info=None,
    )
    return sample if batched else sample[:, 0]
