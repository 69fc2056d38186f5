"""The disk tier: columns in memory-mapped files, for buffers larger than memory.

Each column is one file mapped with ``torch.from_file(shared=True)``: writes go to the page
cache and reach the disk in the background, reads fault pages in on demand, so the buffer
may be far larger than RAM. The ring logic is :class:`ColumnarStorage`'s, unchanged.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch

from conduit.batch import ExperienceBatch
from conduit.errors import ConfigurationError, PlacementError
from conduit.schema import ExperienceSchema
from conduit.storage.base import AppendResult
from conduit.storage.columnar import Allocator, ColumnarStorage, pool_elements

__all__ = ["DiskStorage", "memmap_allocator"]


def memmap_allocator(directory: str | Path) -> Allocator:
    """An allocator that maps each column to a file ``<directory>/<name>.bin`` (created, zero-filled).

    The field name is percent-encoded in the file name (``obs/rgb`` maps to ``obs%2Frgb.bin``), so
    that every field name, a ``/`` in it included, names one file directly in ``directory``.
    """
    root = Path(directory)

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= int(s)
        path = root / f"{quote(str(name), safe='')}.bin"
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)

    return allocate


class DiskStorage(ColumnarStorage):
    """A :class:`ColumnarStorage` whose columns are memory-mapped files.

    Args:
        schema: the fields.
        capacity: number of item slots.

    Keyword Args:
        directory: where to put the files (a fresh subdirectory is created inside it and
            removed when the storage is garbage-collected); default: the system temp dir.
        ragged_capacity: elements in each ragged field's pool (default ``capacity * 64``).

    Raises:
        ConfigurationError: a capacity or ragged_capacity that is no positive int.
        PlacementError: the directory lacks the free space the columns need, or a column's file
            cannot be made there.
    """

    def __init__(self, schema: ExperienceSchema, capacity: int, *, directory: str | Path | None = None,
                 ragged_capacity: int | None = None) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ConfigurationError(f"capacity must be a positive int, got {capacity!r}.")
        parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        pool = pool_elements(ragged_capacity, capacity)
        if schema.ragged and pool <= 0:  # refused before a directory is made
            raise ConfigurationError("ragged_capacity must be positive for a schema with ragged fields.")
        need = capacity * schema.fixed_item_bytes + sum(pool * schema[n].element_bytes for n in schema.ragged)
        free = shutil.disk_usage(parent).free
        if need > free:
            raise PlacementError(f"The disk tier needs {need / 2**30:.2f} GiB in {parent} but only "
                                 f"{free / 2**30:.2f} GiB is free; pass DiskPlacement(directory=...) on a larger "
                                 f"volume or lower the capacity.")
        self._closed = False
        self.directory = Path(tempfile.mkdtemp(prefix="conduit-disk-", dir=parent))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        try:
            super().__init__(schema, capacity, "cpu", ragged_capacity=ragged_capacity,
                             allocator=memmap_allocator(self.directory), tier="disk")
        except BaseException as e:  # a refused storage leaves no directory behind
            self._finalizer()
            if isinstance(e, (RuntimeError, OSError)):  # the file system refused a column's file
                raise PlacementError(f"The disk tier cannot map its column files in {parent} ({e}); pass "
                                     f"DiskPlacement(directory=...) on a writable local volume.") from e
            raise

    def close(self) -> None:
        """Unmap and delete the files now (the storage is unusable afterwards: appends, reads and
        checkpoint loads raise :class:`~conduit.ConfigurationError`)."""
        self._closed = True
        self._cols.clear()
        self._np_cols.clear()
        self._raw_cols.clear()  # their addresses point into the unmapped files
        self._pools.clear()
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError(f"This disk storage was closed and its files in {self.directory} deleted; "
                                     f"build a new one.")

    def append(self, batch: ExperienceBatch, *, evict: bool = True) -> AppendResult:
        self._check_open()
        return super().append(batch, evict=evict)

    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> ExperienceBatch:
        self._check_open()
        return super().gather(slots, out)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_open()
        super().load_state_dict(state)
