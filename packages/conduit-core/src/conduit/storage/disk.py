"""The disk tier: columns in memory-mapped files, for buffers larger than memory.

Each column is one file mapped with ``torch.from_file(shared=True)``: writes go to the page
cache and reach the disk in the background, reads fault pages in on demand, so the buffer
may be far larger than RAM. The ring logic is :class:`ColumnarStorage`'s, unchanged.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch

from conduit.batch import ExperienceBatch
from conduit.checks import is_int
from conduit.errors import ConfigurationError, PlacementError
from conduit.schema import ExperienceSchema
from conduit.storage.base import AppendResult
from conduit.storage.columnar import Allocator, ColumnarStorage, pool_elements

__all__ = ["DiskStorage", "memmap_allocator"]


def _size(nbytes: int) -> str:
    """``nbytes`` for a message, in the largest binary unit that keeps it at least 1 (``"600.0 KiB"``)."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def memmap_allocator(directory: str | Path) -> Allocator:
    """An allocator that maps each column to a file ``<directory>/<name>.bin`` (created, zero-filled).

    The field name is percent-encoded in the file name (``obs/rgb`` maps to ``obs%2Frgb.bin``), so
    that every field name, a ``/`` in it included, names one file directly in ``directory``.

    The file's blocks are reserved when it is made (``posix_fallocate``), so that a volume that
    fills up later cannot leave a mapped page without a block (a write there would kill the
    process with SIGBUS). A file system (or OS) that cannot reserve blocks keeps the file sparse.

    Every column gets a new file: one that already exists (another storage's live column, which
    a write here would overwrite, or a leftover) is refused, not mapped. Give each storage its own
    directory.

    Raises:
        PlacementError: the volume has no room left for the file's blocks (the file is removed again).
        ConfigurationError: the column's file already exists in ``directory``.
    """
    root = Path(directory)
    reserve = getattr(os, "posix_fallocate", None)

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= int(s)
        path = root / f"{quote(str(name), safe='')}.bin"
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            # O_EXCL: an existing file may be another storage's mapped column; sharing it would mix their items
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigurationError(f"The column file {path} already exists (another storage's column, or one left "
                                     f"behind); give each storage an empty directory of its own.") from None
        try:
            if reserve is not None:  # (macOS has no posix_fallocate: the file stays sparse there)
                reserve(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                os.close(fd)
                fd = -1
                path.unlink(missing_ok=True)  # the refused column leaves no file behind
                raise PlacementError(f"The disk tier cannot reserve {_size(nbytes)} for field {name!r} in "
                                     f"{root} (the volume is full); free space there, pass "
                                     f"DiskPlacement(directory=...) on a larger volume or lower the capacity.") from e
            # EOPNOTSUPP/EINVAL: this file system cannot reserve blocks; the file stays sparse
        finally:
            if fd >= 0:
                os.close(fd)
        return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)

    return allocate


class DiskStorage(ColumnarStorage):
    """A :class:`ColumnarStorage` whose columns are memory-mapped files.

    Args:
        schema: the fields.
        capacity: number of item slots.

    Keyword Args:
        directory: where to put the files (a fresh subdirectory is created inside it and
            removed when the storage is closed or garbage-collected); default: the system temp dir.
            A relative path is taken relative to the working directory at construction.
        ragged_capacity: elements in each ragged field's pool (default ``capacity * 64``).

    Raises:
        ConfigurationError: a capacity or ragged_capacity that is no positive int, a directory that is no path.
        PlacementError: the directory lacks the free space the columns need (their blocks are
            reserved at construction), cannot be made or used (a path that is a file, or not
            writable), or a column's file cannot be made there.
    """

    def __init__(self, schema: ExperienceSchema, capacity: int, *, directory: str | Path | None = None,
                 ragged_capacity: int | None = None) -> None:
        if not is_int(capacity) or capacity <= 0:  # (NumPy's 8 is a count, as everywhere in core; True is none)
            raise ConfigurationError(f"capacity must be a positive int, got {capacity!r}.")
        capacity = int(capacity)
        # absolute: the files are deleted by path on close() or collection, perhaps after the process changed its
        # working directory (a relative path would then name another directory, and the files would stay behind)
        try:
            parent = (Path(directory) if directory is not None else Path(tempfile.gettempdir())).absolute()
        except TypeError:  # (pathlib takes str and os.PathLike only: not an int, nor bytes)
            raise ConfigurationError(f"directory must be a path (a str or os.PathLike such as pathlib.Path), got "
                                     f"{directory!r}.") from None
        pool = pool_elements(ragged_capacity, capacity)
        if schema.ragged and pool <= 0:  # refused before a directory is made
            raise ConfigurationError("ragged_capacity must be positive for a schema with ragged fields.")
        need = capacity * schema.fixed_item_bytes + sum(pool * schema[n].element_bytes for n in schema.ragged)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(parent).free
            if need > free:
                raise PlacementError(f"The disk tier needs {_size(need)} in {parent} but only {_size(free)} is "
                                     f"free; pass DiskPlacement(directory=...) on a larger volume or lower the "
                                     f"capacity.")
            directory_made = Path(tempfile.mkdtemp(prefix="conduit-disk-", dir=parent))
        except OSError as e:  # the path is a file, lies under one, or is not writable
            raise PlacementError(f"The disk tier cannot use {parent} ({e}); pass DiskPlacement(directory=...) "
                                 f"naming a writable directory.") from e
        self._closed = False
        self.directory = directory_made
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

    def __getstate__(self) -> dict[str, Any]:
        """Refused: a copy could not share the files (they are deleted with this storage) and would hold the whole
        buffer in memory."""
        raise ConfigurationError("A disk storage cannot be copied or pickled (its columns are memory-mapped files "
                                 "owned by this object); save its state_dict() and load it into a new storage.")

    def close(self) -> None:
        """Unmap and delete the files now (the storage is unusable afterwards: appends, reads and
        checkpoint loads raise :class:`~conduit.ConfigurationError`)."""
        self._closed = True
        self._cols.clear()
        self._np_cols.clear()
        self._raw_cols.clear()  # their addresses point into the unmapped files
        self._plan = None
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
