"""SRL samples <-> Conduit items.

An SRL sample is a record of named fields (arrays, ``None``, or nested records) laid out time
first: ``[T, ...]`` from an actor, ``[T, B, ...]`` once batched. Conduit stores one *item* per
trajectory segment, so a field of per-step shape ``s`` becomes a Conduit field of shape
``(T, *s)`` under its dotted path (``obs.image``). A :class:`RecordLayout` is inferred from the
first sample and then checks every later one, splits puts into items, and rebuilds ``[T, B, ...]``
records of the same classes on delivery.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from conduit import ConfigurationError, ExperienceSchema, Field, SchemaError
from conduit.batch import host_array, native

__all__ = ["RecordLayout", "Leaf", "as_array", "torch_dtype"]


def torch_dtype(dtype: np.dtype, path: str) -> torch.dtype:
    """The torch dtype that stores ``dtype`` exactly, or a SchemaError naming the field (also for a dtype torch
    has but Conduit's storage cannot gather, such as ``uint64``)."""
    try:
        out = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        Field((1,), out)  # (refuses dtypes the storage cannot gather rows of)
    except (TypeError, ConfigurationError) as e:
        why = f" ({e})" if isinstance(e, ConfigurationError) else ""
        raise SchemaError(f"Field {path!r} has dtype {dtype}, which Conduit cannot store{why}; convert it to a "
                          f"storable numeric dtype, or list it in buffer_args['drop_fields'] to deliver it as "
                          f"None.") from None
    return out


def as_array(value: Any, path: str) -> np.ndarray:
    """``value`` (a NumPy array, a torch tensor, or nested lists of numbers) as host NumPy in native byte order.

    NumPy arrays and CPU tensors are shared where possible. A tensor is detached, brought to the host
    and has its conjugate / negative view bits resolved (e.g. ``z.conj().imag``); an array in
    non-native byte order (e.g. ``'>f4'``) is converted to the same dtype in native order (the
    values are unchanged; deliveries are native). Anything else is read with ``np.asarray``.

    Raises:
        SchemaError: the value cannot be read as one array (naming the field and what to send), also a
            mapping (``dict``): nested fields are records, as the sample itself is.
    """
    if isinstance(value, Mapping):  # (np.asarray would read it as a 0-d object array: "shape ()")
        raise SchemaError(f"Field {path!r} is a {type(value).__name__}, which is not an array; nested fields are "
                          f"records of named [T, ...] fields, like the sample itself (e.g. a NamedArray): send its "
                          f"entries as such a record, or as fields of their own, or list the field in "
                          f"buffer_args['drop_fields'] to deliver it as None.")
    try:
        if isinstance(value, torch.Tensor):
            arr = host_array(value)
        else:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except Exception as e:  # noqa: BLE001 - whatever a foreign __array__ / tensor raises: refused, typed
        raise SchemaError(f"Field {path!r} cannot be read as one array ({type(value).__name__}: "
                          f"{type(e).__name__}: {e}); send a NumPy "
                          f"array or tensor [T, ...] of a numeric or bool dtype (NumPy has no bfloat16: convert "
                          f"such tensors to float32), or list the field in buffer_args['drop_fields'].") from None
    return native(arr)


@dataclass(frozen=True)
class Leaf:
    """One stored field: its dotted path, NumPy dtype and per-step shape."""

    path: str
    dtype: np.dtype
    step_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Node:
    cls: type
    #: (name, child) where child is a _Node, a Leaf, or None (a field that is always None)
    children: tuple[tuple[str, Any], ...]


class RecordLayout:
    """The structure of the samples one buffer holds: classes, fields, time length ``T``.

    Args:
        sample: the first sample.

    Fields may be NumPy arrays, torch tensors or nested lists (see :func:`as_array`); a field's
    dtype is fixed up to byte order (``'>f4'`` and ``'<f4'`` are the same float32 field, stored
    and delivered in native order).

    Keyword Args:
        batched: the sample is ``[T, B, ...]`` (otherwise ``[T, ...]``).
        drop_fields: dotted paths delivered as ``None`` and never stored.
    """

    def __init__(self, sample: Any, *, batched: bool, drop_fields: Collection[str] = ()) -> None:
        self.drop_fields = frozenset(drop_fields)
        self.leaves: list[Leaf] = []
        self.time_steps = -1
        self._root = self._infer(sample, "", batched)
        if not self.leaves:
            raise SchemaError("The sample has no array fields to store; an SRL sample needs at least one [T, ...] "
                              "array.")
        self.paths = tuple(leaf.path for leaf in self.leaves)

    # -- inference -------------------------------------------------------------------------
    def _infer(self, rec: Any, prefix: str, batched: bool) -> _Node:
        if not hasattr(rec, "items"):
            raise SchemaError(f"Expected a record with named fields (items()), got {type(rec).__name__}.")
        children: list[tuple[str, Any]] = []
        for name, value in rec.items():
            path = f"{prefix}{name}"
            if value is None or path in self.drop_fields:
                children.append((name, None))
            elif hasattr(value, "items") and not isinstance(value, (np.ndarray, Mapping)):
                children.append((name, self._infer(value, path + ".", batched)))
            else:
                arr = as_array(value, path)
                lead = 2 if batched else 1
                if arr.ndim < lead:
                    layout = "[T, B, ...]" if batched else "[T, ...]"
                    raise SchemaError(f"Field {path!r} has shape {arr.shape}; SRL samples are {layout} (list a "
                                      f"field without a time axis in buffer_args['drop_fields'] to deliver it as "
                                      f"None).")
                if self.time_steps < 0:
                    self.time_steps = int(arr.shape[0])
                elif arr.shape[0] != self.time_steps:
                    raise SchemaError(f"Field {path!r} has {arr.shape[0]} time steps, other fields have "
                                      f"{self.time_steps}; every field of a sample shares its first axis T.")
                torch_dtype(arr.dtype, path)
                leaf = Leaf(path, arr.dtype, tuple(int(s) for s in arr.shape[lead:]))
                if arr.shape[0] == 0 or 0 in leaf.step_shape:
                    raise SchemaError(f"Field {path!r} has shape {arr.shape}, with an empty time or per-step axis; "
                                      f"every stored field needs T >= 1 and per-step sizes >= 1 (list an empty "
                                      f"field in drop_fields).")
                self.leaves.append(leaf)
                children.append((name, leaf))
        return _Node(type(rec), tuple(children))

    def schema(self) -> ExperienceSchema:
        """The Conduit schema: one field of shape ``(T, *step_shape)`` per stored leaf."""
        return ExperienceSchema({leaf.path: Field((self.time_steps, *leaf.step_shape), torch_dtype(leaf.dtype,
                                                                                                     leaf.path))
                                 for leaf in self.leaves})

    # -- put -------------------------------------------------------------------------------
    def split(self, sample: Any, *, batched: bool) -> tuple[dict[str, np.ndarray], int]:
        """Item-major arrays ``{path: [n, T, *step_shape]}`` (views where possible) and ``n``.

        Raises:
            SchemaError: the sample does not match the layout (field set, dtype, shape, T), before
                anything is stored.
        """
        out: dict[str, np.ndarray] = {}
        n = self._split(self._root, sample, "", batched, out, [-1])
        return out, n

    def _split(self, node: _Node, rec: Any, prefix: str, batched: bool, out: dict[str, np.ndarray],
               n: list[int]) -> int:
        if not hasattr(rec, "items"):
            raise SchemaError(f"Field {prefix[:-1] or 'sample'!r} should be a {node.cls.__name__} record, got "
                              f"{type(rec).__name__}.")
        cls: type = type(rec)
        if cls is not node.cls:  # (delivered as the first sample's class: another one would come back changed)
            raise SchemaError(f"{'Field ' + repr(prefix[:-1]) if prefix else 'The sample'} is a "
                              f"{cls.__qualname__} record, the first sample's was a {node.cls.__qualname__}; "
                              f"every sample of one buffer has the same record classes (deliveries are built "
                              f"with the first sample's).")
        got = dict(rec.items())
        names = [name for name, _ in node.children]
        if set(got) != set(names):
            missing = sorted(set(names) - set(got))
            extra = sorted(set(got) - set(names))
            raise SchemaError(f"Sample fields differ from the first sample's at {prefix or 'top level'}: missing "
                              f"{missing}, unexpected {extra}. Every sample of one buffer has the same fields.")
        for name, child in node.children:
            path = f"{prefix}{name}"
            value = got[name]
            if child is None:
                if value is not None and path not in self.drop_fields:
                    raise SchemaError(f"Field {path!r} was None in the first sample and is not now; a field is "
                                      f"either always None or always an array (or list it in drop_fields).")
                continue
            if isinstance(child, _Node):
                if value is None:
                    raise SchemaError(f"Field {path!r} is None, but was a record in the first sample.")
                self._split(child, value, path + ".", batched, out, n)
                continue
            if value is None:
                raise SchemaError(f"Field {path!r} is None, but was an array in the first sample.")
            arr = as_array(value, path)
            if arr.dtype != child.dtype:
                raise SchemaError(f"Field {path!r} has dtype {arr.dtype}, the first sample had {child.dtype}; "
                                  f"send one dtype per field.")
            t = self.time_steps
            if batched:
                if arr.ndim != len(child.step_shape) + 2 or arr.shape[0] != t or arr.shape[2:] != child.step_shape:
                    raise SchemaError(f"Field {path!r} has shape {arr.shape}; expected [T={t}, B, "
                                      f"*{list(child.step_shape)}].")
                b = int(arr.shape[1])
                item_major = np.swapaxes(arr, 0, 1)
            else:
                if arr.shape != (t, *child.step_shape):
                    raise SchemaError(f"Field {path!r} has shape {arr.shape}; expected [T={t}, "
                                      f"*{list(child.step_shape)}] (a batched [T, B, ...] sample goes to "
                                      f"put_batch, or set batched_puts=True).")
                b = 1
                item_major = arr[None]
            if n[0] < 0:
                n[0] = b
            elif b != n[0]:
                raise SchemaError(f"Field {path!r} has batch size {b}, other fields have {n[0]}.")
            out[path] = item_major
        return n[0]

    # -- get -------------------------------------------------------------------------------
    def build(self, arrays: Mapping[str, np.ndarray]) -> Any:
        """A record of the first sample's classes holding ``arrays`` (``{path: [T, B, ...]}``)."""
        return self._build(self._root, "", arrays)

    def _build(self, node: _Node, prefix: str, arrays: Mapping[str, np.ndarray]) -> Any:
        kwargs: dict[str, Any] = {}
        for name, child in node.children:
            path = f"{prefix}{name}"
            if child is None:
                kwargs[name] = None
            elif isinstance(child, _Node):
                kwargs[name] = self._build(child, path + ".", arrays)
            else:
                kwargs[name] = arrays[path]
        return node.cls(**kwargs)

    def leaf(self, path: str) -> Leaf | None:
        """The stored leaf at ``path``, if any."""
        return next((leaf for leaf in self.leaves if leaf.path == path), None)
