"""TransferQueue columns <-> packed variable-length form.

A TransferQueue field holds one value per sample: a tensor of any per-sample shape (dense
``[n, ...]`` columns and jagged nested tensors alike) or a Python object. Conduit keeps a
tensor field *packed*: every sample's elements flattened and laid end to end (a
:class:`conduit.Ragged` of element shape ``()``), plus each sample's shape. A response of
300 tokens costs 300 elements, whatever the longest response in the batch.

Reads rebuild the column exactly as TransferQueue's own SimpleStorage returns it: scalars
stacked densely, per-sample tensors as a jagged nested tensor (strided nested tensor, then
``NonTensorStack``, when the shapes do not allow a jagged one), objects as ``NonTensorStack``.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from conduit import SchemaError
from conduit.batch import ranges
from ray import cloudpickle

if TYPE_CHECKING:  # (imported where used: a storage unit's process, which builds none, need not import it)
    from tensordict import NonTensorStack

__all__ = ["PackedColumn", "pack_column", "unpack_column", "jagged", "select_rows", "concat_rows", "to_wire",
           "from_wire", "objects_to_wire", "objects_from_wire"]


@dataclass
class PackedColumn:
    """One tensor field of ``n`` samples, packed.

    ``values`` is 1-D; sample ``i`` owns ``lengths[i]`` consecutive elements of it and has
    shape ``shapes[i, 1:1 + shapes[i, 0]]`` (column 0 holds the per-sample ndim, so every row
    has the same width within a field).
    """

    values: torch.Tensor
    lengths: torch.Tensor
    shapes: torch.Tensor

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return int(self.shapes.shape[1]) - 1


def _shape_rows(shapes: list[tuple[int, ...]]) -> torch.Tensor:
    ndims = {len(s) for s in shapes}
    width = 1 + max(ndims) if ndims else 1
    rows = torch.zeros((len(shapes), width), dtype=torch.int64)
    for i, s in enumerate(shapes):
        rows[i, 0] = len(s)
        if s:
            rows[i, 1:1 + len(s)] = torch.tensor(s, dtype=torch.int64)
    return rows


def pack_column(value: Any, n: int, name: str = "column") -> PackedColumn | list[Any]:
    """Pack one TensorDict column (field ``name``) of ``n`` samples; non-tensor columns become a list of objects.

    Host tensors are shared where possible (a contiguous dense column or the values of a
    contiguous jagged tensor are not copied); device tensors are brought to the host. Tensors
    with a conjugate or negative view bit (``z.conj()``) are packed by value.

    A ``NonTensorData`` column is one value shared by every sample (tensordict's meaning, e.g. verl's
    ``meta_info``): each sample gets the whole value, also when it is a list or NumPy array of ``n`` items
    (TransferQueue's SimpleStorage indexes such a sequence per sample, and refuses a scalar). Per-sample
    objects are put as a ``NonTensorStack`` (``NonTensorStack(*items)``, as verl's ``DataProto.to_tensordict``
    does), or as a list.

    Raises:
        SchemaError: a tensor without dense values to pack (sparse, mkldnn, quantized or on the meta device), or
            a nested TensorDict.
    """
    if isinstance(value, torch.Tensor):
        _check_packable(name, value)
        t = value.detach()
        if not t.is_nested:  # by value: a lazy view bit cannot be stored or viewed as another dtype (copied only then)
            t = t.resolve_conj().resolve_neg()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_nested:
            return _pack_nested(t, n)
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(f"a column of {n} samples has shape {tuple(t.shape)}")
        per = tuple(t.shape[1:])
        numel = int(np.prod(per, dtype=np.int64)) if per else 1
        shapes = torch.tensor([len(per), *per], dtype=torch.int64).expand(n, -1).contiguous()
        return PackedColumn(t.reshape(-1), torch.full((n,), numel, dtype=torch.int64), shapes)
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    if isinstance(value, NonTensorData):
        return [value.data] * n
    if isinstance(value, NonTensorStack):
        items = value.tolist()
    elif isinstance(value, TensorDictBase):
        raise SchemaError(f"Field {name!r} is a nested {type(value).__name__}; a field holds one tensor or Python "
                          f"object per sample: put its entries as fields of their own (e.g. data.flatten_keys()).")
    else:
        items = list(value)
    if len(items) != n:
        raise ValueError(f"a column of {n} samples has {len(items)} items")
    return items


def _check_packable(name: str, t: torch.Tensor) -> None:
    """:class:`~conduit.SchemaError` unless ``t`` holds dense values that can be packed as they are."""
    if not t.is_nested and t.layout != torch.strided:
        raise SchemaError(f"Field {name!r} is a {str(t.layout).removeprefix('torch.')} tensor; put a dense one "
                          f"(e.g. .to_dense()).")
    if t.is_meta:
        raise SchemaError(f"Field {name!r} is on the meta device and holds no values; put a tensor with data.")
    if t.is_quantized:
        raise SchemaError(f"Field {name!r} is a quantized tensor ({t.dtype}), whose scale and zero point a field "
                          f"does not keep; put t.dequantize(), or t.int_repr() and its quantization parameters.")


def _pack_nested(t: torch.Tensor, n: int) -> PackedColumn:
    nt: Any = t  # a nested tensor: lengths()/offsets() are not in torch's Tensor stubs
    if t.layout == torch.jagged and nt.lengths() is None and getattr(t, "_ragged_idx", 1) == 1:
        vals = t.values()
        offsets = nt.offsets().to(torch.int64)
        if int(offsets.shape[0]) - 1 != n:
            raise ValueError(f"a nested column of {n} samples has {int(offsets.shape[0]) - 1} components")
        per_len = offsets.diff()
        trailing = tuple(vals.shape[1:])
        tnumel = int(np.prod(trailing, dtype=np.int64)) if trailing else 1
        if int(offsets[0]) != 0 or not vals.is_contiguous():
            vals = torch.cat([vals[int(offsets[i]):int(offsets[i + 1])] for i in range(n)]) if n else vals[:0]
        else:
            vals = vals[:int(offsets[-1])]
        shapes = torch.empty((n, 2 + len(trailing)), dtype=torch.int64)
        shapes[:, 0] = 1 + len(trailing)
        shapes[:, 1] = per_len
        if trailing:
            shapes[:, 2:] = torch.tensor(trailing, dtype=torch.int64)
        return PackedColumn(vals.reshape(-1), per_len * tnumel, shapes)
    # Any other nested layout: one sample at a time (rare: strided nested, holes, ragged_idx > 1).
    samples = t.unbind()
    if len(samples) != n:
        raise ValueError(f"a nested column of {n} samples has {len(samples)} components")
    flat = [s.contiguous().reshape(-1) for s in samples]
    values = torch.cat(flat) if flat else torch.empty(0, dtype=t.dtype)
    lengths = torch.tensor([f.shape[0] for f in flat], dtype=torch.int64)
    return PackedColumn(values, lengths, _shape_rows([tuple(s.shape) for s in samples]))


def select_rows(col: PackedColumn, rows: torch.Tensor) -> PackedColumn:
    """Samples ``rows`` of ``col``, in that order (a copy)."""
    offsets = torch.cumsum(col.lengths, 0) - col.lengths
    lens = col.lengths[rows]
    flat = ranges(offsets[rows], lens)
    return PackedColumn(col.values[flat], lens.clone(), col.shapes[rows])


def concat_rows(cols: list[PackedColumn]) -> PackedColumn:
    """The samples of ``cols`` one after the other (shape rows padded to a common width)."""
    width = max(c.shapes.shape[1] for c in cols)
    shapes = [torch.nn.functional.pad(c.shapes, (0, width - c.shapes.shape[1])) for c in cols]
    return PackedColumn(torch.cat([c.values for c in cols]), torch.cat([c.lengths for c in cols]), torch.cat(shapes))


def unpack_column(col: PackedColumn) -> torch.Tensor | NonTensorStack:
    """The column as TransferQueue's SimpleStorage returns it.

    Scalars (every sample of ndim 0) come back dense ``[n]``; samples of ndim >= 1 with equal
    trailing dimensions come back as one jagged nested tensor sharing ``values``; anything else
    as a jagged, else strided, nested tensor built sample by sample, else a ``NonTensorStack``.
    """
    n = len(col)
    ndims = col.shapes[:, 0]
    if n and bool((ndims == 0).all()):
        return col.values
    if n and bool((ndims == ndims[0]).all()):
        nd = int(ndims[0])
        trailing = col.shapes[:, 2:1 + nd]
        if trailing.shape[1] == 0 or bool((trailing == trailing[0]).all()):
            tr = tuple(int(x) for x in trailing[0]) if trailing.shape[1] else ()
            rows = col.shapes[:, 1]  # counted, not inferred: a zero-size trailing dimension leaves -1 ambiguous
            return jagged(col.values.view(int(rows.sum()), *tr), rows)
    return _unpack_slow(col)


def jagged(values: torch.Tensor, lengths: torch.Tensor, *, seqlens: bool = True) -> torch.Tensor:
    """A jagged nested tensor over ``values`` (shared) with rows of ``lengths``.

    With ``seqlens`` the min/max row lengths are recorded as ``as_nested_tensor`` records them; without
    them ``to_padded_tensor`` pads a column to its total length instead of its longest row (which is
    what verl's own minibatch iterator yields for samples with trailing dimensions).
    """
    n = int(lengths.shape[0])
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    if not seqlens:
        return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    host = lengths if lengths.device.type == "cpu" else lengths.cpu()
    lo, hi = (int(host.min()), int(host.max())) if n else (0, 0)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, min_seqlen=lo, max_seqlen=hi)


def _unpack_slow(col: PackedColumn) -> torch.Tensor | NonTensorStack:
    parts = torch.split(col.values, col.lengths.tolist())
    # (a tuple, not unpacked: a sample of ndim 0 beside higher-rank ones has the shape ())
    return nested_or_stack([p.view(tuple(int(d) for d in col.shapes[i, 1:1 + int(col.shapes[i, 0])]))
                            for i, p in enumerate(parts)])


def nested_or_stack(samples: list[torch.Tensor]) -> torch.Tensor | NonTensorStack:
    """Tensors of different shapes as one nested tensor (jagged, else strided), as TransferQueue's
    SimpleStorage returns them; a ``NonTensorStack`` when neither layout takes them."""
    for layout in (torch.jagged, torch.strided):
        try:
            return torch.nested.as_nested_tensor(samples, layout=layout)
        except (RuntimeError, TypeError, ValueError):
            continue
    from tensordict import NonTensorStack

    return NonTensorStack(*samples)


# -- wire format (what crosses a Ray call): raw bytes as NumPy, which Ray ships without pickling ------
def to_wire(col: PackedColumn) -> dict[str, Any]:
    """A Ray-friendly form of ``col``: bytes and int64 arrays (any dtype, bfloat16 included)."""
    vals = col.values.resolve_conj().resolve_neg().contiguous()  # a view bit cannot be reinterpreted as bytes
    raw = vals.view(torch.uint8) if vals.numel() else torch.empty(0, dtype=torch.uint8)
    return {"dtype": str(col.dtype).removeprefix("torch."), "values": raw.numpy(),
            "lengths": col.lengths.numpy(), "shapes": col.shapes.numpy()}


def objects_to_wire(columns: dict[str, Any]) -> dict[str, Any]:
    """``columns`` with each Python-object column (a list of values) pickled in band, as bytes; wire columns of
    tensors (dicts) as they are.

    Ray would hand NumPy arrays (and containers of them) to the receiver zero-copy, as read-only views of the call's
    object: a value kept (a unit keeps what it stores; a reader keeps what it read) would pin the whole call in
    Ray's object store and could not be written. Pickled in band, the receiver's values own their memory."""
    return {k: v if isinstance(v, dict) else cloudpickle.dumps(list(v), protocol=5) for k, v in columns.items()}


def objects_from_wire(columns: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`objects_to_wire`: each bytes column back to its list of values."""
    return {k: pickle.loads(v) if isinstance(v, bytes) else v for k, v in columns.items()}


def _tensor(a: np.ndarray, copy: bool) -> torch.Tensor:
    if copy:
        return torch.from_numpy(np.array(a, copy=True))
    if not a.flags.writeable:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only shared memory: we only read it
            return torch.from_numpy(a)
    return torch.from_numpy(a)


def from_wire(w: dict[str, Any], *, copy: bool = False) -> PackedColumn:
    """Inverse of :func:`to_wire`.

    With ``copy=False`` the tensors may view Ray's read-only shared memory: read them, never
    write them. ``copy=True`` gives tensors that own their memory.
    """
    dtype = getattr(torch, w["dtype"])
    raw = _tensor(w["values"], copy)
    values = raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)
    return PackedColumn(values, _tensor(w["lengths"], copy), _tensor(w["shapes"], copy))
