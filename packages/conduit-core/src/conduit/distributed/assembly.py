"""Delivered rows put together: rows read from several shards, written into one batch in draw order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.schema import ExperienceSchema, same_width_integer

__all__ = ["Assembly", "concat"]


class Assembly:
    """Rows arriving from several shards, written into one batch in draw order."""

    def __init__(self, schema: ExperienceSchema, k: int, out: Mapping[str, torch.Tensor] | None = None) -> None:
        self.schema, self.k = schema, k
        self.fixed = {n: (out[n][:k] if out is not None else torch.empty((k, *schema[n].shape), dtype=schema[n].dtype))
                      for n in schema.fixed}
        self.ragged: list[tuple[np.ndarray, ExperienceBatch]] = []

    def put(self, dest: np.ndarray, part: ExperienceBatch) -> None:
        d = torch.from_numpy(dest)
        for n in self.schema.fixed:
            _bits(self.fixed[n]).index_copy_(0, d, _bits(part.tensor(n)))
        if self.schema.ragged:
            self.ragged.append((dest, ExperienceBatch({n: part[n] for n in self.schema.ragged}, part.batch_size)))

    def batch(self, keep: np.ndarray | None = None) -> ExperienceBatch:
        """The assembled rows (only positions ``keep``, in order, when given)."""
        cols: dict[str, torch.Tensor | Ragged] = dict(self.fixed)
        if self.schema.ragged:
            dests = np.concatenate([d for d, _ in self.ragged]) if self.ragged else np.zeros(0, np.int64)
            where = np.empty(self.k, dtype=np.int64)
            where[dests] = np.arange(dests.shape[0])
            for n in self.schema.ragged:
                parts = cast("list[Ragged]", [p[n] for _, p in self.ragged])
                vals = torch.cat([p.values for p in parts]) if parts else torch.empty(
                    (0, *self.schema[n].shape), dtype=self.schema[n].dtype)
                lens = torch.cat([p.lengths for p in parts]) if parts else torch.zeros(0, dtype=torch.int64)
                cols[n] = Ragged(vals, lens)
            tmp = ExperienceBatch({n: cols[n] for n in self.schema.ragged}, int(dests.shape[0]))
            order = where if keep is None else where[keep]
            tmp = tmp.select(torch.from_numpy(order))
            cols.update({n: tmp[n] for n in self.schema.ragged})
        n_out = self.k
        if keep is not None:
            kt = torch.from_numpy(keep)
            for n in self.schema.fixed:
                cols[n] = self.fixed[n].index_select(0, kt)
            n_out = int(keep.shape[0])
        return ExperienceBatch({n: cols[n] for n in self.schema}, n_out)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size, as core's storage copies rows
    (:func:`conduit.schema.same_width_integer`: exact for every dtype, and torch has no ``index_copy_`` for some,
    e.g. the float8 dtypes); ``t`` itself when no integer is that wide (e.g. complex128)."""
    b = same_width_integer(t.dtype)
    return t if b is None or t.dtype == b else t.view(b)


def concat(schema: ExperienceSchema, parts: list[ExperienceBatch], fixed: Mapping[str, torch.Tensor] | None
            ) -> ExperienceBatch:
    """Batches back to back; fixed fields are already back to back in ``fixed`` when given."""
    n = sum(p.batch_size for p in parts)
    cols: dict[str, torch.Tensor | Ragged] = {}
    for name in schema:
        if schema[name].ragged:
            rs = cast("list[Ragged]", [p[name] for p in parts])
            cols[name] = Ragged(torch.cat([r.values for r in rs]), torch.cat([r.lengths for r in rs]))
        elif fixed is not None:
            cols[name] = fixed[name][:n]
        else:
            cols[name] = torch.cat([p.tensor(name) for p in parts])
    return ExperienceBatch(cols, n)
