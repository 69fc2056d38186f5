"""Batches as NumPy columns for Ray's object store, and back.

Ray stores NumPy arrays in its shared-memory object store and hands readers a read-only
view without copying (on the same node; across nodes after one transfer). So columns
travel as NumPy: fixed fields as ``[n, *shape]`` arrays, ragged fields as a
``(values, lengths)`` pair. Dtypes NumPy lacks (``bfloat16``, float8) travel as their
bytes (``uint8``) and are viewed back with the schema's dtype.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.schema import ExperienceSchema

__all__ = ["Wire", "to_wire", "from_wire", "wire_rows", "wire_nbytes"]

#: name -> array (fixed field) or (values, lengths) (ragged field)
Wire = dict[str, Any]

_NUMPY_OK: dict[torch.dtype, bool] = {}


def _numpy_ok(dtype: torch.dtype) -> bool:
    ok = _NUMPY_OK.get(dtype)
    if ok is None:
        try:
            torch.empty(1, dtype=dtype).numpy()
            ok = True
        except (TypeError, RuntimeError):
            ok = False
        _NUMPY_OK[dtype] = ok
    return ok


def _array(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if not _numpy_ok(t.dtype):
        t = t.view(torch.uint8)
    return t.numpy()


def _tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():  # object-store arrays are read-only; we only ever read them
        warnings.filterwarnings("ignore", message=".*not writable.*")
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.as_tensor(a)
    return t if t.dtype == dtype else t.view(dtype)


def to_wire(batch: ExperienceBatch, schema: ExperienceSchema) -> Wire:
    """The batch as NumPy columns (host tensors are shared, not copied)."""
    out: Wire = {}
    for name in schema:
        c = batch[name]
        out[name] = (_array(c.values), _array(c.lengths)) if isinstance(c, Ragged) else _array(c)
    return out


def from_wire(cols: Wire, schema: ExperienceSchema) -> ExperienceBatch:
    """A batch viewing the NumPy columns (no copy)."""
    out: dict[str, torch.Tensor | Ragged] = {}
    n = 0
    for name, f in schema.items():
        c = cols[name]
        if f.ragged:
            r = Ragged(_tensor(c[0], f.dtype), _tensor(c[1], torch.int64))
            out[name], n = r, len(r)
        else:
            t = _tensor(c, f.dtype)
            out[name], n = t, int(t.shape[0])
    return ExperienceBatch(out, n)


def wire_rows(cols: Wire, start: int, count: int, schema: ExperienceSchema) -> ExperienceBatch:
    """Rows ``[start, start + count)`` of wire columns, as a batch (views for fixed fields)."""
    b = from_wire(cols, schema)
    if start == 0 and count == b.batch_size:
        return b
    return b.select(slice(start, start + count))


def wire_nbytes(cols: Wire) -> int:
    """Bytes the columns carry."""
    total = 0
    for c in cols.values():
        total += (c[0].nbytes + c[1].nbytes) if isinstance(c, tuple) else c.nbytes
    return total
