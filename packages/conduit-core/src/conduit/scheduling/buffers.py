"""Reused delivery buffers for prepared chunks (double/triple buffering), and the GPU hand-over.

A *chunk* is what one delivery call prepares: ``g_del`` batches gathered back to back.
:class:`ChunkRing` keeps a few chunk buffers and knows when each may be overwritten:
a delivered batch stays valid until ``output_depth`` further deliveries (the EDP's
contract), so a buffer is reusable only once every batch it handed out has expired.

With CUDA, a buffer is filled on a side stream (:meth:`ChunkRing.filling`): for a GPU
learner and host storage the host side is page-locked staging, gathered on the CPU and
copied to the device side with ``non_blocking`` copies; for GPU storage the gather
kernels themselves run on the side stream. Stream order is kept by events:

* every delivery call marks the learner's current stream as it starts; a buffer whose
  batches expired at call ``E`` is refilled only after the side stream waits on call
  ``E``'s mark, so no kernel the learner enqueued on those batches can see new data;
* hand-over makes the learner's stream wait on the event recorded after the fill, and
  calls ``record_stream`` on tensors allocated on the side stream (ragged columns) so the
  caching allocator does not reuse them under the learner;
* before the CPU overwrites a staging area, it waits for the previous copy out of it.

Storage on a GPU is written on the writing thread's current stream (an ingestion write
copies into the columns there; a host batch bound for a GPU shard even without blocking),
and a fill gathers from it on the side stream, which PyTorch creates non-blocking: it
does not wait for work on the default stream, nor that stream for it. So both are
ordered under the buffer's lock, in the hold that gathers (:meth:`ChunkRing.before_gather`,
:meth:`ChunkRing.after_gather`): per GPU the storage lives on, the stream the gather runs
on first waits for the device's default stream and for the stream that was current on the
filling thread before the fill, so every write stored before the gather has landed when it
reads; after the gather, those streams wait for it, so no write stored after it (an
eviction that overwrites the rows) runs before it has read. Writes are made under that
lock, so each one is on one side of a gather. That covers Conduit's own writers: its
ingestion worker writes on the default stream, and a thread that ingests in the caller
and delivers (``overlap=False``) writes and fills from the same current stream. A user
thread that stores with another stream current (``torch.cuda.stream(s)`` around an
in-caller ``ingest``, ``load_state_dict`` or ``migrate``) while a prefetch may gather on
another thread must make those writes on the default stream instead: let it wait for
``s`` (``torch.cuda.default_stream(d).wait_stream(s)``) and store inside
``torch.cuda.stream(torch.cuda.default_stream(d))`` (or use background ingestion, whose
worker writes on the default stream). A batch produced on a GPU must be ready on the
stream that stores it, as for any use of a tensor on another stream. The cost: a learner
that runs on the default stream of the storage's GPU has the gather ordered between its
kernels there, as a synchronous delivery's gather is (the selection, the host's share of
the work, still overlaps).

None of this runs without CUDA: there the host side is what the learner gets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.schema import ExperienceSchema
from conduit.storage.columnar import empty_column

__all__ = ["ChunkRing", "Fill", "buffers_needed", "storage_devices"]


def buffers_needed(g_del: int, output_depth: int) -> int:
    """Chunk buffers for full overlap: the chunk being filled, the one being read, and those
    still holding valid batches (``output_depth - 1`` earlier batches, ``g_del`` per chunk)."""
    return math.ceil(max(0, output_depth - 1) / max(1, g_del)) + 2


def storage_devices(storage: Any) -> list[torch.device]:
    """The devices ``storage`` holds its columns on (every shard's for sharded storage; ``cuda`` without an index
    read as ``cuda:0``, as a placement reads it)."""
    devices = getattr(storage, "devices", None)
    out = [torch.device(d) for d in (devices if devices else [storage.device])]
    return [torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d for d in out]


class Fill:
    """One fill of a buffer, on CUDA (see :meth:`ChunkRing.filling`): the stream current on the filling thread
    before the fill, and, between :meth:`ChunkRing.before_gather` and :meth:`ChunkRing.after_gather`, per GPU
    gathered from, the stream the gather runs on and the streams writes run on that it was ordered after."""

    __slots__ = ("outer", "gathers")

    def __init__(self, outer: Any) -> None:
        self.outer = outer
        self.gathers: list[tuple[Any, list[Any]]] = []


@dataclass
class _Slot:
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    dev: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: int = 0
    #: delivery count from which the buffer may be overwritten (its batches expired)
    expires: int = 0
    #: holds prepared, not yet delivered batches (or a job is filling it)
    busy: bool = False
    #: CUDA: the last fill of this buffer (its copy out of the host side) finished
    copied: Any = None


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
        self.cuda_device = device if device.type == "cuda" else storage_device
        if self.cuda:
            self.stream = torch.cuda.Stream(device=self.cuda_device)
        self.slots = [_Slot() for _ in range(count)]
        #: CUDA: delivery call index -> event on the learner's stream at the call's start
        self._calls: dict[int, Any] = {}

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

    def held_rows(self) -> int:
        """Rows the chunk buffers have memory for (host side; the device side mirrors it)."""
        return sum(s.rows for s in self.slots)

    def release(self, i: int) -> None:
        """Let go of buffer ``i``'s memory (it must hold nothing prepared). The batches it handed out keep
        that memory alive and stay valid, as nothing writes into it again, and the next fill of the buffer
        allocates afresh, so the buffer is free at once. CUDA memory is first marked as used by the
        learner's stream, so the allocator does not hand it out again before the work queued there on
        those batches is done."""
        s = self.slots[i]
        assert not s.busy, "a buffer holding prepared batches is never released"
        for t in (*s.host.values(), *s.dev.values()):
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
        s.host, s.dev, s.rows, s.expires = {}, {}, 0, 0

    def trim(self, max_rows: float, *, keep_rows: int, delivered: int) -> None:
        """Release idle buffers until they have memory for at most ``max_rows`` rows (or none is idle):
        first those sized for another chunk than ``keep_rows`` rows, then those whose batches expired
        (``delivered`` deliveries so far), larger ones first."""
        held = self.held_rows()
        order = sorted((i for i, s in enumerate(self.slots) if s.rows and not s.busy),
                       key=lambda i: (self.slots[i].rows == keep_rows, delivered < self.slots[i].expires,
                                      -self.slots[i].rows))
        for i in order:
            if held <= max_rows:
                break
            held -= self.slots[i].rows
            self.release(i)

    def delivered(self, i: int, index: int) -> None:
        """Batch number ``index`` (0-based delivery count) was handed out of buffer ``i``."""
        s = self.slots[i]
        s.expires = max(s.expires, index + self.output_depth)

    def call_started(self, index: int) -> None:
        """Delivery call ``index`` begins (CUDA: mark the learner's stream; batches expiring now were used before)."""
        if not self.cuda:
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.cuda_device))
        self._calls[index] = ev
        if len(self._calls) > 4 * len(self.slots) + 4 * self.output_depth + 64:
            for k in sorted(self._calls)[: len(self._calls) // 2]:
                if not any(s.expires == k for s in self.slots):
                    del self._calls[k]

    @contextmanager
    def filling(self, i: int) -> Iterator[Fill | None]:
        """Fill buffer ``i`` in the body: on CUDA, on the side stream, after the learner is done with it.

        Yields what :meth:`before_gather` and :meth:`after_gather` take (``None`` off CUDA)."""
        if not self.cuda:
            yield None
            return
        s = self.slots[i]
        fill = Fill(torch.cuda.current_stream(self.cuda_device))
        with torch.cuda.stream(self.stream):
            ev = self._calls.get(s.expires) if s.expires else None
            if ev is not None:
                self.stream.wait_event(ev)
            yield fill

    def before_gather(self, fill: Fill | None, devices: Sequence[torch.device]) -> None:
        """Under the buffer's lock, right before the gather of ``fill`` from storage on ``devices``: on each GPU
        among them, the stream the gather runs on (the side stream on this ring's device, else the thread's
        current one) waits for the writes enqueued so far, on the device's default stream and on the stream
        current before the fill (see the module docstring). Nothing off CUDA."""
        if fill is None:
            return
        fill.gathers = []
        for d in devices:
            if d.type != "cuda":
                continue
            gather = torch.cuda.current_stream(d)
            outer = fill.outer if fill.outer.device == gather.device else gather
            writers: list[Any] = []
            for w in (torch.cuda.default_stream(d), outer):
                if w != gather and w not in writers:
                    writers.append(w)
                    gather.wait_stream(w)
            if writers:
                fill.gathers.append((gather, writers))

    def after_gather(self, fill: Fill | None) -> None:
        """Under the buffer's lock, right after the gather of ``fill`` (also one that failed part way): the streams
        :meth:`before_gather` ordered it after wait for it, so that no write enqueued later on them (an eviction
        overwriting the rows read) runs before the gather has read. Nothing off CUDA."""
        if fill is None:
            return
        for gather, writers in fill.gathers:
            ev = gather.record_event()
            for w in writers:
                w.wait_event(ev)
        fill.gathers = []

    def filled(self, i: int) -> Any:
        """The event marking the end of buffer ``i``'s fill (``None`` off CUDA)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.slots[i].copied = ev
        return ev

    def host(self, i: int) -> Callable[[int], dict[str, torch.Tensor]]:
        """``rows -> buffers``: the host side of buffer ``i``, grown to ``rows`` when needed."""
        def get(rows: int) -> dict[str, torch.Tensor]:
            s = self.slots[i]
            if s.copied is not None and self.storage_device.type == "cpu":  # the last copy out of the staging
                s.copied.synchronize()
                s.copied = None
            if rows > s.rows:  # (rows set once both sides are: an allocation that fails leaves the buffer as it was)
                host = self._alloc(rows, self.storage_device, self.pin)
                s.dev = self._alloc(rows, self.device, False) if self.move else {}
                s.host, s.rows = host, rows
            return s.host
        return get

    def _alloc(self, rows: int, device: torch.device, pin: bool) -> dict[str, torch.Tensor]:
        # (normal tensors also when a delivery under torch.inference_mode() allocates them: see empty_column)
        return {n: empty_column((rows, *self.schema[n].shape), self.schema[n].dtype, device, pin_memory=pin)
                for n in self.schema.fixed}

    # -- the learner's device ----------------------------------------------------------------
    def to_device(self, i: int, parts: list[ExperienceBatch]) -> list[ExperienceBatch]:
        """Move the batches of a gathered chunk (back to back in buffer ``i``) to the learner's device.

        Call it inside :meth:`filling`: on CUDA the copies are ``non_blocking`` on the side stream.
        """
        if not self.move:
            return parts
        return self._copy(parts, self.slots[i], non_blocking=self.cuda)

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
        A learner on the host (storage on the GPU) has no stream to wait on: the CPU waits for
        the copies here (a ragged column's ``non_blocking`` copy to the host is asynchronous).
        """
        if event is None or not self.cuda:
            return
        if self.device.type != "cuda":
            event.synchronize()
            return
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        for name in self.schema.ragged:
            c = batch[name]
            if isinstance(c, Ragged) and c.values.is_cuda:
                c.values.record_stream(cur)
                c.lengths.record_stream(cur)
