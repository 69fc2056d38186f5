"""Reused delivery buffers for prepared chunks (double/triple buffering), and the GPU hand-over.

A *chunk* is what one delivery call prepares: ``g_del`` batches gathered back to back.
:class:`ChunkRing` keeps a few chunk buffers and knows when each may be overwritten:
a delivered batch stays valid until ``output_depth`` further deliveries (the EDP's
contract), so a buffer is reusable only once every batch it handed out has expired.

On a GPU learner with host storage, the host side of each buffer is page-locked (the
staging area) and a side CUDA stream copies it to the device side with ``non_blocking``
copies. Hand-over makes the learner's current stream wait on the copy's event; before a
buffer's device side is overwritten, the side stream waits on an event recorded on the
learner's stream when the buffer's last batch expired; before its host side is
overwritten, the worker waits for the previous copy out of it. None of this runs on a
machine without CUDA: there the host side is what the learner gets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.schema import ExperienceSchema

__all__ = ["ChunkRing", "buffers_needed"]


def buffers_needed(g_del: int, output_depth: int) -> int:
    """Chunk buffers for full overlap: the chunk being filled, the one being read, and those
    still holding valid batches (``output_depth - 1`` earlier batches, ``g_del`` per chunk)."""
    return math.ceil(max(0, output_depth - 1) / max(1, g_del)) + 2


@dataclass
class _Slot:
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    dev: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: int = 0
    #: delivery count from which the buffer may be overwritten (its batches expired)
    expires: int = 0
    #: holds prepared, not yet delivered batches (or a job is filling it)
    busy: bool = False
    #: CUDA: the last copy out of the host side finished
    copied: Any = None
    #: CUDA: the learner's stream finished with the device side
    released: Any = None


class ChunkRing:
    """Chunk buffers on the storage's device, mirrored on the learner's device when it differs.

    Args:
        schema: the fields (only fixed fields get buffers; ragged ones are copied per chunk).
        storage_device: where gathers happen.
        device: where the learner wants batches.
        count: initial number of buffers (more are added if ever needed).
        output_depth: deliveries a delivered batch stays valid for.
    """

    def __init__(self, schema: ExperienceSchema, storage_device: torch.device, device: torch.device, *,
                 count: int, output_depth: int) -> None:
        self.schema = schema
        self.storage_device = storage_device
        self.device = device
        self.output_depth = output_depth
        self.move = device != storage_device
        self.cuda = torch.cuda.is_available() and "cuda" in (device.type, storage_device.type)
        self.pin = self.cuda and storage_device.type == "cpu" and device.type == "cuda"
        self.stream: Any = None
        if self.cuda:
            dev = device if device.type == "cuda" else storage_device
            self.stream = torch.cuda.Stream(device=dev)
        self.slots = [_Slot() for _ in range(count)]

    # -- buffer life cycle -----------------------------------------------------------------
    def acquire(self, delivered: int, *, inside_call: bool) -> int:
        """A buffer whose batches all expired, marked busy (a new one if none is free).

        ``delivered`` is the number of deliveries completed. Inside a delivery call the
        learner has let go of the batch ``output_depth`` back; a background job may only
        reuse batches one further back.
        """
        margin = 0 if inside_call else 1
        for i, s in enumerate(self.slots):
            if not s.busy and delivered >= s.expires + margin:
                s.busy = True
                return i
        self.slots.append(_Slot(busy=True))
        return len(self.slots) - 1

    def free(self, i: int) -> None:
        """Buffer ``i`` holds nothing prepared any more (its batches were delivered or discarded)."""
        self.slots[i].busy = False

    def delivered(self, i: int, index: int) -> None:
        """Batch number ``index`` (0-based delivery count) was handed out of buffer ``i``."""
        s = self.slots[i]
        s.expires = max(s.expires, index + self.output_depth)
        if self.cuda and self.move:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            s.released = ev

    def host(self, i: int) -> Callable[[int], dict[str, torch.Tensor]]:
        """``rows -> buffers``: the host side of buffer ``i``, grown to ``rows`` when needed."""
        def get(rows: int) -> dict[str, torch.Tensor]:
            s = self.slots[i]
            if s.copied is not None:  # the previous copy out of this staging area must be done
                s.copied.synchronize()
                s.copied = None
            if rows > s.rows:
                s.rows = rows
                s.host = self._alloc(rows, self.storage_device, self.pin)
                s.dev = self._alloc(rows, self.device, False) if self.move else {}
            return s.host
        return get

    def _alloc(self, rows: int, device: torch.device, pin: bool) -> dict[str, torch.Tensor]:
        return {n: torch.empty((rows, *self.schema[n].shape), dtype=self.schema[n].dtype, device=device,
                               pin_memory=pin) for n in self.schema.fixed}

    # -- the learner's device ----------------------------------------------------------------
    def to_device(self, i: int, parts: list[ExperienceBatch]) -> tuple[list[ExperienceBatch], Any]:
        """Move the batches of a gathered chunk (back to back in buffer ``i``) to the learner's device.

        Returns the moved batches and the CUDA event of their copies (``None`` off CUDA).
        On CUDA the copies are ``non_blocking`` on the side stream, which first waits until
        the learner's stream is done with this buffer's previous contents.
        """
        if not self.move:
            return parts, None
        s = self.slots[i]
        if not self.cuda:  # a learner device that is neither the storage's nor CUDA: plain copies
            return self._copy(parts, s, non_blocking=False), None
        with torch.cuda.stream(self.stream):
            if s.released is not None:
                self.stream.wait_event(s.released)
            out = self._copy(parts, s, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        s.copied = ev
        return out, ev

    def _copy(self, parts: list[ExperienceBatch], s: _Slot, *, non_blocking: bool) -> list[ExperienceBatch]:
        out = []
        row = 0
        for b in parts:
            k = b.batch_size
            cols: dict[str, torch.Tensor | Ragged] = {}
            for name in self.schema:
                c = b[name]
                if isinstance(c, Ragged):
                    cols[name] = c.to(self.device, non_blocking=non_blocking)
                else:
                    cols[name] = s.dev[name][row:row + k].copy_(c, non_blocking=non_blocking)
            out.append(ExperienceBatch(cols, k))
            row += k
        return out

    def handover(self, batch: ExperienceBatch, event: Any) -> None:
        """Make the learner's current stream wait for the copy that produced ``batch``.

        Ragged columns were allocated on the side stream: ``record_stream`` keeps the
        caching allocator from reusing their memory while the learner's stream reads them.
        """
        if event is None or not self.cuda:
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        for name in self.schema.ragged:
            c = batch[name]
            if isinstance(c, Ragged) and c.values.is_cuda:
                c.values.record_stream(cur)
                c.lengths.record_stream(cur)
