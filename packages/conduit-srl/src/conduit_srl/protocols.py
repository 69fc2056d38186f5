"""The SRL interfaces the adapter meets, as structural types (no SRL import).

These are written from the call sites of SRL (openpsi-project/srl at 636c5da): what a trainer or
buffer worker calls on a buffer, what an actor calls on a sample producer, and what a consumer
calls on a buffer. Only the members those call sites use are listed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["RecordLike", "ReplayEntryLike", "BufferLike", "SampleProducerLike", "SampleConsumerLike"]


@runtime_checkable
class RecordLike(Protocol):
    """A sample: named fields holding arrays (``[T, ...]`` or ``[T, B, ...]``), ``None`` or nested records.

    The class is rebuilt with ``type(record)(**fields)``, which is how SRL's own slicing builds one.
    """

    def items(self) -> Iterator[tuple[str, Any]]: ...

    def length(self, dim: int = 0) -> int: ...

    def min_of(self, field: str, ignore_negative: bool = True) -> Any: ...

    def average_of(self, field: str, ignore_negative: bool = True) -> Any: ...


class ReplayEntryLike(Protocol):
    """What ``buffer.get()`` returns: the trainer reads ``sample``, ``reuses`` and ``sampling_indices``."""

    sample: Any
    reuses: float
    sampling_indices: np.ndarray | None


@runtime_checkable
class BufferLike(Protocol):
    """The trainer-side buffer: ``put`` on the consuming thread, ``empty``/``get``/``qsize`` on the training one."""

    def put(self, x: Any) -> Any: ...

    def get(self) -> Any: ...

    def empty(self) -> bool: ...

    def qsize(self) -> int: ...


@runtime_checkable
class SampleProducerLike(Protocol):
    """Actor side: ``post`` is thread-safe; ``flush`` is called by one thread, every poll."""

    def post(self, sample: Any) -> None: ...

    def flush(self) -> None: ...


@runtime_checkable
class SampleConsumerLike(Protocol):
    """Trainer side: ``consume_to`` moves what has arrived into a buffer without blocking; returns the count."""

    def consume_to(self, buffer: Any, max_iter: int) -> int: ...
