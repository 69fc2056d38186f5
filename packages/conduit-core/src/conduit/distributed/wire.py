"""Batches as NumPy columns for Ray's object store, and back.

Ray stores NumPy arrays in its shared-memory object store and hands readers a read-only
view without copying (on the same node; across nodes after one transfer). So columns
travel as NumPy: fixed fields as ``[n, *shape]`` arrays, ragged fields as a
``(values, lengths)`` pair. Dtypes NumPy lacks (``bfloat16``, float8) travel as their
bytes (``uint8``) and are viewed back with the schema's dtype.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import numpy as np
import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.schema import ExperienceSchema

__all__ = ["Wire", "to_wire", "from_wire", "wire_rows", "wire_nbytes", "pack_rows", "unpack_rows", "ragged_lengths",
           "packed_nbytes"]

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
    # a conjugate or negative view bit (``z.conj()``, ``z.conj().imag``) is resolved: NumPy cannot share it
    t = t.detach().resolve_conj().resolve_neg()
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
    t = t if t.dtype == dtype else t.view(dtype)
    if t.data_ptr() % t.element_size():
        # Ray's object store places a column at a multiple of 8 bytes only, and torch's kernels read a dtype at
        # an address that is a multiple of its element size (complex128: 16) or crash the process: such a
        # column is copied, byte by byte, to memory torch allocated (the only case that is not a view)
        out = torch.empty(t.shape, dtype=t.dtype)
        out.view(torch.uint8).copy_(t.view(torch.uint8))  # (wire columns are C-contiguous)
        t = out
    return t


def to_wire(batch: ExperienceBatch, schema: ExperienceSchema) -> Wire:
    """The batch as NumPy columns (host tensors are shared, not copied)."""
    out: Wire = {}
    for name in schema:
        c = batch[name]
        out[name] = (_array(c.values), _array(c.lengths)) if isinstance(c, Ragged) else _array(c)
    return out


def from_wire(cols: Wire, schema: ExperienceSchema) -> ExperienceBatch:
    """A batch viewing the NumPy columns (no copy), except a column whose address is not a multiple of its
    element size (a ``complex128`` column Ray placed at an 8-byte boundary): it is copied, as torch cannot read it
    in place."""
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


# -- one byte buffer per transfer (the torch.distributed transport) -------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    # (values, not a view's bits: a tensor with a conjugate or negative view bit is resolved first)
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def ragged_lengths(batch: ExperienceBatch, schema: ExperienceSchema) -> torch.Tensor:
    """The lengths of every ragged field as one int64 ``[n, ragged fields]`` tensor (the first message)."""
    cols = [batch[name].lengths.to(torch.int64) for name in schema.ragged]  # type: ignore[union-attr]
    return torch.stack(cols, dim=1).contiguous() if cols else torch.zeros((batch.batch_size, 0), dtype=torch.int64)


#: every column starts at a multiple of this many bytes in a packed buffer, so each can be viewed in place as its
#: dtype: torch views bytes as a dtype only at an offset that is a multiple of its element size, and the widest
#: storable dtype (``complex128``) has 16-byte elements
_ALIGN = 16


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def pack_rows(batch: ExperienceBatch, schema: ExperienceSchema) -> torch.Tensor:
    """Every column of ``batch`` as the bytes of one ``uint8`` tensor: fixed fields in schema order,
    then the values of each ragged field (their lengths travel first, see :func:`ragged_lengths`);
    each column starts at a multiple of 16 bytes (the widest element size)."""
    cols = [batch.tensor(name) for name in schema.fixed] + [cast(Ragged, batch[name]).values
                                                            for name in schema.ragged]
    parts = []
    for c in cols:
        b = _bytes(c)
        parts.append(b)
        pad = _padded(b.numel()) - b.numel()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def packed_nbytes(n: int, lengths: torch.Tensor | None, schema: ExperienceSchema) -> int:
    """Bytes :func:`pack_rows` makes of ``n`` rows whose ragged lengths are ``lengths``."""
    total = sum(_padded(n * schema[name].element_bytes) for name in schema.fixed)
    for j, name in enumerate(schema.ragged):
        assert lengths is not None
        total += _padded(int(lengths[:, j].sum()) * schema[name].element_bytes)
    return total


def unpack_rows(payload: torch.Tensor, n: int, lengths: torch.Tensor | None, schema: ExperienceSchema
                ) -> ExperienceBatch:
    """The batch :func:`pack_rows` packed (views of ``payload``, no copy)."""
    out: dict[str, torch.Tensor | Ragged] = {}
    at = 0
    for name in schema.fixed:
        f = schema[name]
        size = n * f.element_bytes
        out[name] = payload[at:at + size].view(f.dtype).reshape(n, *f.shape)
        at += _padded(size)
    for j, name in enumerate(schema.ragged):
        f = schema[name]
        assert lengths is not None
        lens = lengths[:, j].contiguous()
        count = int(lens.sum())
        size = count * f.element_bytes
        out[name] = Ragged(payload[at:at + size].view(f.dtype).reshape(count, *f.shape), lens)
        at += _padded(size)
    return ExperienceBatch({name: out[name] for name in schema}, n)
