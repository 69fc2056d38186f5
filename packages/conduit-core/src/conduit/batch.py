"""The unit of data that crosses the EDP: a batch of items, column by column."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from conduit.checks import is_int
from conduit.errors import SchemaError
from conduit.schema import ExperienceSchema

__all__ = ["Ragged", "ExperienceBatch", "as_tensor", "host_array", "native", "ranges"]


# A read-only array (e.g. one Ray deserialised from the object store) is shared, not copied, by as_tensor: torch warns
# that writing to it would be undefined, but Conduit only reads what it is given (ingestion copies it into storage).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=r"conduit\.batch")


def as_tensor(x: object) -> torch.Tensor:
    """A torch view of ``x`` without copying where possible (NumPy arrays are shared; one in a foreign
    byte order, e.g. ``'>f4'`` on x86, which torch cannot share, is converted to native order by value).

    Raises:
        SchemaError: ``x`` is a NumPy masked array with masked entries (torch would read the values under the mask).
    """
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if isinstance(x, np.ma.MaskedArray) and np.ma.is_masked(x):
            raise SchemaError(f"A NumPy masked array with {int(np.ma.count_masked(x))} masked entries has no value "
                              f"to store there; fill them first (x.filled(value)) or leave those items out.")
        if not x.dtype.isnative:
            x = native(x)
        elif not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return torch.from_numpy(x)
    return torch.as_tensor(x)


def native(x: np.ndarray) -> np.ndarray:
    """``x`` in this machine's byte order: ``x`` itself when it already is, else a converted copy with the same
    values and dtype kind (e.g. ``'>f4'`` on x86 becomes ``'<f4'``), which torch can share."""
    return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))


def host_array(t: torch.Tensor) -> np.ndarray:
    """``t``'s values as a host NumPy array, shared where possible. A tensor with a conjugate or negative
    view bit (``z.conj()``, ``z.conj().imag``), which NumPy cannot share, is resolved into a copy first."""
    return t.detach().cpu().resolve_conj().resolve_neg().numpy()


@dataclass(frozen=True)
class Ragged:
    """Variable-length sequences packed end to end.

    ``values[offsets[i]:offsets[i] + lengths[i]]`` is item ``i``'s sequence, where
    ``offsets`` is the exclusive cumulative sum of ``lengths``.
    """

    values: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def from_sequences(cls, seqs: Sequence[object]) -> Ragged:
        """Pack a list of per-item sequences (tensors or arrays).

        Raises:
            SchemaError: an item is a scalar, or the sequences' elements differ in dtype or shape.
        """
        ts = [as_tensor(s) for s in seqs]
        if any(t.dim() == 0 for t in ts):
            raise SchemaError("A list of per-item sequences holds a scalar; give every item a sequence "
                              "(a list, array or 1-d tensor), or give a fixed field one scalar per item throughout.")
        lengths = torch.tensor([t.shape[0] for t in ts], dtype=torch.int64)
        # Zero-length sequences hold no elements: leave them out of the concatenation, so that
        # one given as an empty list (float32 to torch) cannot change the others' dtype.
        parts = [t for t in ts if t.shape[0]] or ts
        dtypes = {t.dtype for t in parts if t.shape[0]}
        if len(dtypes) > 1:  # torch.cat would promote them: int64 17 -> float32 16 is no value the caller gave
            raise SchemaError(f"The per-item sequences have different dtypes ({', '.join(sorted(map(str, dtypes)))}); "
                              f"give every sequence the field's dtype (e.g. 2.0, not 2, in a list for a float field).")
        # (an empty 1-D sequence, e.g. [], goes with any element shape, as torch.cat reads it; an empty one of more
        # dimensions has an element shape, which torch.cat checks as it checks the others)
        shapes = {tuple(t.shape[1:]) for t in parts if t.shape[0] or t.dim() > 1}
        if len(shapes) > 1:  # (torch.cat would raise a RuntimeError that names no field)
            raise SchemaError(f"The per-item sequences have elements of different shapes "
                              f"({', '.join(map(str, sorted(shapes)))}); give every element the field's element shape.")
        values = torch.cat(parts) if parts else torch.empty(0)
        return cls(values, lengths)

    @property
    def offsets(self) -> torch.Tensor:
        """Start of each item's sequence in ``values``."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.lengths[:i].sum())
        return self.values[start:start + int(self.lengths[i])]

    def padded(self, pad_value: float = 0) -> torch.Tensor:
        """A dense ``[n, max_len, *shape]`` copy, right-padded with ``pad_value``."""
        n = len(self)
        max_len = int(self.lengths.max()) if n else 0
        out = self.values.new_full((n, max_len, *self.values.shape[1:]), pad_value)
        mask = torch.arange(max_len, device=self.lengths.device)[None, :] < self.lengths[:, None]
        out[mask] = self.values
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Ragged:
        """The same sequences on ``device``."""
        return Ragged(self.values.to(device, non_blocking=non_blocking),
                      self.lengths.to(device, non_blocking=non_blocking))


class ExperienceBatch(Mapping[str, "torch.Tensor | Ragged"]):
    """A mapping of field name to a column with one shared leading batch size.

    Fixed fields are tensors ``[n, *shape]``; ragged fields are :class:`Ragged`.
    Construction is cheap and copies nothing; :meth:`from_mapping` converts NumPy
    arrays and lists of sequences without copying fixed fields.
    """

    __slots__ = ("_columns", "_valid_for", "batch_size")

    def __init__(self, columns: dict[str, torch.Tensor | Ragged], batch_size: int) -> None:
        self._columns = columns
        self.batch_size = batch_size
        #: the schema object this batch last passed :meth:`validate` against (columns are never replaced)
        self._valid_for: ExperienceSchema | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> ExperienceBatch:
        """Build a batch from tensors, NumPy arrays, :class:`Ragged` or lists of sequences.

        A list of per-item scalars that holds NumPy scalars or 0-d tensors keeps their dtype, which must
        be one: a list that mixes dtypes is refused, not promoted (promotion can change values, e.g. int64
        2**53 + 1). Python scalars in it take that dtype when they hold exactly such a value (``0`` among
        ``np.float64``); a list of Python scalars only is read by torch (floats as float32).

        Raises:
            SchemaError: ``data`` is not a mapping, the columns disagree on the batch size, or a list of
                per-item scalars mixes dtypes (or holds a Python scalar its NumPy scalars' dtype cannot hold).
        """
        if isinstance(data, ExperienceBatch):
            return data
        if not isinstance(data, Mapping):
            raise SchemaError(f"A batch is a mapping of field name to column (a dict or ExperienceBatch), got "
                              f"{type(data).__name__}; give {{field: tensor [n, ...]}} for every schema field.")
        if type(data) is dict and data:  # fast path: all fixed fields given as tensors of one length
            n = -1
            for v in data.values():
                if type(v) is not torch.Tensor or v.is_nested or not v.dim() or (n >= 0 and v.shape[0] != n):
                    break
                n = v.shape[0]
            else:
                return cls(dict(data), n)
        cols: dict[str, torch.Tensor | Ragged] = {}
        for k, v in data.items():
            if isinstance(v, Ragged):
                _check_ragged_parts(k, v)
                cols[k] = v
            elif isinstance(v, (list, tuple)) and v and not _is_scalar(v[0]):
                try:
                    cols[k] = Ragged.from_sequences(v)
                except (TypeError, ValueError, RuntimeError) as e:  # SchemaError included: name the field
                    raise SchemaError(f"Field {k!r}: its per-item sequences do not pack into one column ({e}); "
                                      f"give every item a sequence of elements of one shape and dtype.") from e
            elif isinstance(v, (list, tuple)) and v and (not isinstance(v[0], (int, float, complex, bool)) or any(
                    isinstance(x, (np.generic, np.ndarray, torch.Tensor)) for x in v)):
                # NumPy scalars and 0-d tensors keep their dtype, wherever they stand in the list (np.float64 is a
                # Python float too): torch would promote them with the rest (int64 2**53 + 1 -> float64 2**53)
                cols[k] = _scalar_rows(k, v)
            else:
                try:
                    t = as_tensor(v)
                except (TypeError, ValueError, RuntimeError) as e:
                    raise SchemaError(f"Field {k!r} cannot be made a tensor ({type(v).__name__}: {e}); give a "
                                      f"tensor or NumPy array [n, ...] of a numeric or bool dtype.") from e
                if t.is_nested:  # (it has no shape: torch raises an internal error on reading one)
                    raise SchemaError(_nested_error(k))
                if t.dim() == 0:
                    raise SchemaError(f"Field {k!r} is a scalar; give one row per item (shape [n, ...]).")
                cols[k] = t
        sizes = {k: (len(c) if isinstance(c, Ragged) else int(c.shape[0])) for k, c in cols.items()}
        if len(set(sizes.values())) > 1:
            raise SchemaError(f"Fields disagree on the batch size: {sizes}. Give every field one row per item.")
        return cls(cols, next(iter(sizes.values()), 0))

    @classmethod
    def checked(cls, data: Mapping[str, object], schema: ExperienceSchema) -> ExperienceBatch:
        """:meth:`from_mapping` then :meth:`validate` against ``schema``.

        A dict holding exactly the schema's fixed fields as tensors or NumPy arrays of the right dtype and
        per-item shape, all of one length, is checked in a single pass (an array becomes a tensor as
        :func:`as_tensor` makes it, the same one :meth:`from_mapping` makes). A ragged field whose
        sequences are all empty (no elements, so no dtype of their own) takes the schema's
        dtype and element shape; an empty list for a ragged field is a list of no sequences,
        for a fixed field a list of no per-item values (an empty batch either way).

        Raises:
            SchemaError: as :meth:`from_mapping` and :meth:`validate`.
        """
        if type(data) is dict:
            columns: Mapping[str, Any] | None = data
            n = _matching_rows(data, schema)
            if n < 0 and (columns := _arrays_as_tensors(data, schema)) is not None:
                n = _matching_rows(columns, schema)
            if n >= 0 and columns is not None:
                b = cls(dict(columns), n)  # (a new dict: the caller's stays theirs)
                b._valid_for = schema
                return b
        if isinstance(data, Mapping) and not isinstance(data, ExperienceBatch) and any(
                isinstance(data.get(name), (list, tuple)) and not data.get(name) for name in schema):
            # an empty list for a ragged field is a list of no sequences: an empty Ragged, not a fixed column; for a
            # fixed field a list of no per-item values: no rows of the field's dtype and shape (torch reads [] as
            # float32 of shape [0], which no int or shaped field takes)
            data = {k: ((Ragged(torch.empty((0, *schema[k].shape), dtype=schema[k].dtype),
                                torch.empty(0, dtype=torch.int64)) if schema[k].ragged
                         else torch.empty((0, *schema[k].shape), dtype=schema[k].dtype))
                        if k in schema and isinstance(v, (list, tuple)) and not v else v)
                    for k, v in data.items()}
        b = cls.from_mapping(data)
        for name in schema.ragged:  # sequences that are all empty (e.g. ``[[], []]``) carry no dtype of their own
            c = b._columns.get(name)
            f = schema[name]
            if isinstance(c, Ragged) and isinstance(c.values, torch.Tensor) and c.values.numel() == 0 and (
                    c.values.dim() == 1 and (c.values.dtype != f.dtype or f.shape)):
                cols = dict(b._columns)  # a new batch: the caller's stays as given
                cols[name] = Ragged(c.values.new_empty((0, *f.shape), dtype=f.dtype), c.lengths)
                b = cls(cols, b.batch_size)
        b.validate(schema)
        return b

    def __getitem__(self, name: str) -> torch.Tensor | Ragged:
        return self._columns[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    def __repr__(self) -> str:
        parts = []
        for k, c in self._columns.items():
            if isinstance(c, Ragged):
                parts.append(f"{k}=Ragged({c.values.dtype}, total={c.values.shape[0]})")
            else:
                parts.append(f"{k}={c.dtype}{list(c.shape)}")
        return f"ExperienceBatch(n={self.batch_size}, {', '.join(parts)})"

    def tensor(self, name: str) -> torch.Tensor:
        """The fixed field ``name`` as a tensor (a type-narrowing accessor)."""
        c = self._columns[name]
        if isinstance(c, Ragged):
            raise TypeError(f"Field {name!r} is ragged; use batch[{name!r}] to get its Ragged value.")
        return c

    def nbytes(self) -> int:
        """Bytes held by the columns."""
        total = 0
        for c in self._columns.values():
            if isinstance(c, Ragged):
                total += c.values.numel() * c.values.element_size() + c.lengths.numel() * 8
            else:
                total += c.numel() * c.element_size()
        return total

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ExperienceBatch:
        """The same batch on ``device``."""
        return ExperienceBatch({k: c.to(device, non_blocking=non_blocking) for k, c in self._columns.items()},
                               self.batch_size)

    def clone(self) -> ExperienceBatch:
        """A batch that owns its memory (use it to keep a delivered batch past its validity)."""
        return ExperienceBatch({k: (Ragged(c.values.clone(), c.lengths.clone()) if isinstance(c, Ragged)
                                    else c.clone()) for k, c in self._columns.items()}, self.batch_size)

    def select(self, index: torch.Tensor | slice | int) -> ExperienceBatch:
        """Rows ``index`` of every column (a copy for tensor indices and for slices with a negative step, a view for
        other slices of fixed fields); an integer (or a 0-d integer tensor) selects that one row, as a batch of one
        item."""
        if isinstance(index, slice) and index.step is not None and index.step < 0:
            # (torch slices take no negative step: the rows in that order, as Python's slicing gives them)
            index = torch.tensor(range(self.batch_size)[index], dtype=torch.int64)
        if is_int(index) or (isinstance(index, torch.Tensor) and index.dim() == 0 and index.dtype in _INDEX_DTYPES):
            # (indexing a column with it would drop the batch dimension: a row read as a batch of its elements)
            index = torch.tensor([int(index)], dtype=torch.int64)
        cols: dict[str, torch.Tensor | Ragged] = {}
        n = -1
        for k, c in self._columns.items():
            if isinstance(c, Ragged):
                idx = torch.arange(len(c))[index]
                starts, lens = c.offsets[idx], c.lengths[idx]
                flat = ranges(starts, lens)
                cols[k] = Ragged(c.values[flat], lens.clone())
                n = int(lens.shape[0])
            else:
                cols[k] = c[index]
                n = int(cols[k].shape[0])  # type: ignore[union-attr]
        return ExperienceBatch(cols, n if n >= 0 else 0)

    def numpy(self) -> dict[str, np.ndarray]:
        """Fixed fields as NumPy arrays sharing memory (host tensors only); ragged fields padded. A column that
        requires grad is read detached; one with a conjugate or negative view bit by value (:func:`host_array`).

        Raises:
            SchemaError: a field's dtype has no NumPy equivalent (bfloat16).
        """
        out: dict[str, np.ndarray] = {}
        for k, c in self._columns.items():
            t = c.padded() if isinstance(c, Ragged) else c
            try:
                out[k] = host_array(t)
            except TypeError as e:
                raise SchemaError(f"Field {k!r} ({t.dtype}) has no NumPy dtype ({e}); read it as tensors, or "
                                  f"convert it, e.g. batch[{k!r}].float().numpy().") from e
        return out

    def validate(self, schema: ExperienceSchema) -> None:
        """Check this batch against ``schema``. A batch that passed against this very schema object is not
        checked again (a batch stored after a migration is checked against the schema it was validated for).

        Raises:
            SchemaError: a missing or extra field, a wrong dtype, shape, or lengths.
        """
        if self._valid_for is schema:
            return
        if _matching_rows(self._columns, schema) == self.batch_size:  # fast path: tensors that all match
            self._valid_for = schema
            return
        missing = [n for n in schema if n not in self._columns]
        extra = [n for n in self._columns if n not in schema]
        if missing or extra:
            raise SchemaError(
                f"Batch fields do not match the schema: missing {missing}, unexpected {extra}. "
                f"The schema has {list(schema)}; give exactly those fields.")
        n = self.batch_size
        for name, f in schema.items():
            c = self._columns[name]
            if f.ragged:
                if not isinstance(c, Ragged):
                    raise SchemaError(f"Field {name!r} is ragged in the schema; give a conduit.Ragged or a "
                                      f"list of per-item sequences.")
                _check_ragged_parts(name, c)
                v, lens = c.values, c.lengths
                _check_has_values(name, v)
                _check_has_values(name, lens)
                if v.dim() == 0:
                    raise SchemaError(f"Field {name!r}: a Ragged's values are a 0-d tensor; give the packed "
                                      f"elements as a tensor [total, *shape].")
                if v.dtype != f.dtype:
                    raise SchemaError(f"Field {name!r} has dtype {v.dtype}, the schema says {f.dtype}; "
                                      f"convert it before ingesting.")
                if tuple(v.shape[1:]) != f.shape:
                    raise SchemaError(f"Field {name!r} has element shape {tuple(v.shape[1:])}, the schema "
                                      f"says {f.shape}.")
                if lens.dtype != torch.int64 or lens.dim() != 1 or lens.shape[0] != n:
                    raise SchemaError(f"Field {name!r} needs int64 lengths of shape [{n}].")
                # the running sums, not only the total: int64 lengths near 2**62 wrap around to any total, and
                # storage would then index far outside the packed values (a crash, not an error)
                ends = torch.cumsum(lens, 0)
                if (bool(((lens.min() < 0) | (ends.min() < 0) | (ends[-1] != v.shape[0])).item()) if n
                        else v.shape[0] != 0):
                    raise SchemaError(f"Field {name!r}: lengths must be >= 0 and sum to the number of "
                                      f"packed values ({v.shape[0]}).")
            else:
                if isinstance(c, Ragged):
                    raise SchemaError(f"Field {name!r} is fixed-size in the schema; give a tensor [n, *shape].")
                if not isinstance(c, torch.Tensor):  # an ExperienceBatch's columns are not converted
                    raise SchemaError(f"Field {name!r} is a {type(c).__name__}, not a tensor; build the batch from a "
                                      f"dict (or ExperienceBatch.from_mapping), which converts NumPy arrays.")
                _check_has_values(name, c)
                if c.dtype != f.dtype:
                    raise SchemaError(f"Field {name!r} has dtype {c.dtype}, the schema says {f.dtype}; "
                                      f"convert it before ingesting.")
                if tuple(c.shape[1:]) != f.shape:
                    raise SchemaError(f"Field {name!r} has per-item shape {tuple(c.shape[1:])}, the schema "
                                      f"says {f.shape}.")
                if c.dim() == 0 or c.shape[0] != n:
                    raise SchemaError(f"Field {name!r} has {c.shape[0] if c.dim() else 0} rows for a batch of {n} "
                                      f"items; give every field one row per item.")
        self._valid_for = schema


_STRIDED = torch.strided
#: integer dtypes a 0-d tensor that :meth:`ExperienceBatch.select` reads as one row's index may have
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _nested_error(name: str) -> str:
    """What a nested tensor given for field ``name`` is told."""
    return (f"Field {name!r} is a nested tensor; give a conduit.Ragged for a variable-length field (e.g. "
            f"Ragged.from_sequences(t.unbind())), or a dense tensor [n, *shape] for a fixed one.")


def _check_has_values(name: str, t: torch.Tensor) -> None:
    """:class:`SchemaError` unless ``t`` is a dense tensor with data (storage copies rows of strided memory)."""
    if t.is_nested:  # (a strided nested tensor reports the strided layout, and has no shape)
        raise SchemaError(_nested_error(name))
    if t.layout is not _STRIDED:
        raise SchemaError(f"Field {name!r} is a {str(t.layout).removeprefix('torch.')} tensor; give a dense one "
                          f"(e.g. .to_dense()).")
    if t.is_meta:
        raise SchemaError(f"Field {name!r} is on the meta device and holds no values; give a tensor with data.")


def _check_ragged_parts(name: str, r: Ragged) -> None:
    """:class:`SchemaError` unless ``r``'s values and lengths are tensors, the lengths one per item (the rest is
    checked by ``validate``)."""
    if not (isinstance(r.values, torch.Tensor) and isinstance(r.lengths, torch.Tensor)):
        raise SchemaError(f"Field {name!r}: a Ragged needs tensors for values and lengths, got "
                          f"{type(r.values).__name__} and {type(r.lengths).__name__}; use Ragged.from_sequences, or "
                          f"give a list of per-item sequences.")
    if r.lengths.dim() != 1:
        raise SchemaError(f"Field {name!r}: a Ragged's lengths must be a 1-d tensor (one length per item), got "
                          f"shape {tuple(r.lengths.shape)}.")


def _is_scalar(x: object) -> bool:
    """Whether ``x`` is one scalar (Python, NumPy, or a 0-d array or tensor), not a sequence."""
    return (isinstance(x, (int, float, complex, bool, np.generic))
            or (isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim == 0))


def _scalar_rows(name: str, rows: Sequence[object]) -> torch.Tensor:
    """A list of per-item NumPy scalars or 0-d tensors as one column, keeping their dtype, which must be one.

    A Python scalar among NumPy scalars takes their dtype when it holds exactly that value (``0`` among
    ``np.float64``), and is refused otherwise (``0.1`` among ``np.float32``, ``2**53 + 1`` among ``np.float64``).
    """
    try:
        tensors = [r for r in rows if isinstance(r, torch.Tensor)]
        if len(tensors) == len(rows):
            tdtypes = {t.dtype for t in tensors}
            if len(tdtypes) > 1:  # stacking would promote them (int64 2**24 + 1 -> float32 2**24)
                raise TypeError(f"their dtypes differ: {', '.join(sorted(map(str, tdtypes)))}")
            return torch.stack(tensors)
        if tensors:
            raise TypeError("it mixes 0-d tensors with other scalars")
        dtypes = {r.dtype for r in rows if isinstance(r, (np.ndarray, np.generic))}
        if len(dtypes) > 1:  # one array would promote them (int64 2**53 + 1 -> float64 2**53): no value the caller gave
            raise TypeError(f"their dtypes differ: {', '.join(sorted(map(str, dtypes)))}")
        arr = np.asarray(rows, dtype=next(iter(dtypes), None))
        for r, a in zip(rows, arr.tolist(), strict=True):
            if not isinstance(r, (np.ndarray, np.generic)) and not (a == r or (a != a and r != r)):  # (NaN is NaN)
                raise TypeError(f"{r!r} is no {arr.dtype} value (the dtype of the NumPy scalars listed with it)")
        return torch.from_numpy(native(arr))
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise SchemaError(f"Field {name!r} is a list of scalars that do not form one column ({e}); give one "
                          f"scalar of one dtype per item, or a tensor [n, ...].") from e


def _matching_rows(columns: Mapping[str, object], schema: ExperienceSchema) -> int:
    """The shared row count when ``columns`` are exactly the schema's fixed fields, each a tensor
    of the field's dtype and per-item shape, all of one length; -1 otherwise (then the full checks
    say what is wrong)."""
    checks = schema.fixed_checks
    if schema.ragged or not checks or len(columns) != len(checks):
        return -1
    n = -1
    for name, dtype, shape, dims in checks:
        c = columns.get(name)
        if (type(c) is not torch.Tensor or c.dtype is not dtype or c.layout is not _STRIDED or c.is_meta
                or c.is_nested):
            return -1
        s = c.shape
        if len(s) != dims or (dims > 1 and s[1:] != shape) or (n >= 0 and s[0] != n):
            return -1
        n = s[0]
    return n


def _arrays_as_tensors(columns: dict[str, object], schema: ExperienceSchema) -> dict[str, torch.Tensor | Ragged] | None:
    """``columns`` with each NumPy array (exactly ``np.ndarray``, of a numeric or bool dtype) made a tensor by
    :func:`as_tensor`, as :meth:`ExperienceBatch.from_mapping` makes it, for :func:`_matching_rows`; None when a column
    is neither a tensor nor such an array, none is an array, or the schema has ragged fields (the full checks then
    take the columns as given)."""
    if schema.ragged or len(columns) != len(schema.fixed_checks):
        return None
    out: dict[str, torch.Tensor | Ragged] = {}
    arrays = False
    for name, c in columns.items():
        if type(c) is np.ndarray:
            if c.dtype.kind not in "biufc":
                return None
            try:
                c = as_tensor(c)
            except (TypeError, RuntimeError):  # (a dtype this torch cannot share: the full checks say so)
                return None
            arrays = True
        elif type(c) is not torch.Tensor:
            return None
        out[name] = c
    return out if arrays else None


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of ``arange(s, s + l)`` for each (s, l), without a Python loop."""
    total = int(lengths.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=starts.device)
    rep_starts = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths,
                                         output_size=total)
    return torch.arange(total, dtype=torch.int64, device=rep_starts.device) + rep_starts
