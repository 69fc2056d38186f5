"""The shard server: a Ray actor pinned to one node that holds buffer partitions.

A server holds one *partition* per buffer that uses it (several buffers may share a
server). A partition is a core :class:`~conduit.storage.ColumnarStorage` ring on the
server's host memory with its own *local* handles; the driver-side index maps global
handles to (server, local handle). The server never decides what to evict: the driver
tells it, with each append, up to which local handle nothing is needed any more, and an
append that would need more room fails instead of overwriting live items.

Each partition may carry its buffer's *owner token*: a tiny Ray object the buffer's process put (and so owns).
A buffer whose process died (its node died, or the learner actor that built it crashed) can never close its
partitions; when another buffer opens a partition on the server, the server drops every partition whose token
Ray reports ``OwnerDiedError`` for (a process that died), so a learner that is restarted on shared servers does
not leave a dead predecessor's items in their memory. Ray reports such a death some seconds after it, so a
thread of the server looks at the tokens every :data:`OWNER_CHECK_PERIOD_S`, and the partitions it finds orphaned
are dropped on the data thread by the next ``open`` or health probe (:func:`tick`).

Data calls run one at a time in submission order; health checks (:func:`ping`) run in a
separate concurrency group, so a server whose data call waits for an unreadable argument
still answers them, and only a server that answers nothing is lost at once. The health monitor
also sends a no-op down the data thread (:func:`tick`): a server that answers pings while that
no-op waits for ``stuck_after`` seconds has a stuck data thread and is lost too.

This module imports no Ray at import time; :func:`server_class` wraps the class lazily.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import torch

from conduit.distributed.errors import DistributedError
from conduit.distributed.wire import Wire, pack_rows, ragged_lengths, to_wire, wire_rows
from conduit.errors import CapacityError
from conduit.schema import ExperienceSchema
from conduit.storage.columnar import ColumnarStorage

__all__ = ["ShardServer", "server_class", "ping", "tick", "AppendAck"]

#: what an append returns: (first local handle written, items written, next local handle)
AppendAck = tuple[int, int, int]

#: seconds between two looks at the owner tokens by the server's owner thread
OWNER_CHECK_PERIOD_S = 2.0
#: seconds the owner thread waits for one token (an owner that cannot be reached within it is taken as alive:
#: its partition stays, and is looked at again)
OWNER_CHECK_S = 10.0


class ShardServer:
    """Holds partitions of buffers on one node (the body of the Ray actor)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self._parts: dict[str, ColumnarStorage] = {}
        self._schemas: dict[str, ExperienceSchema] = {}
        #: the owner token (an ObjectRef the buffer's process owns) of each partition that was given one
        self._owners: dict[str, Any] = {}
        #: buffers whose owner the owner thread found dead (their partitions are dropped on the data thread)
        self._orphans: set[str] = set()
        self._owner_thread: threading.Thread | None = None
        #: torch.distributed groups joined: group id -> (process group, backend)
        self._groups: dict[str, tuple[Any, str]] = {}

    # -- identity and health ----------------------------------------------------------------
    def ready(self) -> tuple[str, int]:
        """(node id, process id): the server is up."""
        import ray

        return str(ray.get_runtime_context().get_node_id()), os.getpid()

    def ping(self) -> int:
        """Answer a health check (runs in the ``health`` concurrency group, so a data call stuck
        waiting for its argument does not hold it up); returns the number of partitions."""
        return len(self._parts)

    def tick(self) -> int:
        """Answer on the data thread (the default concurrency group), once the data calls queued before it
        have run: the health monitor's probe of that thread (:func:`tick`). Returns the number of partitions.

        It first drops the partitions of buffers whose process died (:meth:`drop_orphans`)."""
        self.drop_orphans()
        return len(self._parts)

    # -- partitions ---------------------------------------------------------------------------
    def open(self, buffer_id: str, schema: dict[str, Any], capacity: int, ragged_capacity: int | None,
             owner: list[Any] | None = None) -> None:
        """Create (or recreate, empty) the partition of ``buffer_id``; first drop the partitions of buffers whose
        process died (see :meth:`drop_orphans`).

        ``owner``: ``[token]``, an ObjectRef the buffer's process owns (in a list, so Ray passes the reference and
        does not resolve it); without it the partition is only ever dropped by :meth:`close`.
        """
        sch = ExperienceSchema.from_dict(schema)
        self.drop_orphans()
        self._parts[buffer_id] = ColumnarStorage(sch, capacity, "cpu", ragged_capacity=ragged_capacity,
                                                 tier="remote")
        self._schemas[buffer_id] = sch
        if owner and _is_ref(owner[0]):
            self._owners[buffer_id] = owner[0]
            self._orphans.discard(buffer_id)
            if self._owner_thread is None:
                self._owner_thread = threading.Thread(target=self._watch_owners, daemon=True,
                                                      name="conduit-owners")
                self._owner_thread.start()

    def close(self, buffer_id: str) -> None:
        self._parts.pop(buffer_id, None)
        self._schemas.pop(buffer_id, None)
        self._owners.pop(buffer_id, None)

    def drop_orphans(self) -> None:
        """Drop the partitions of buffers whose process died, as the owner thread found them (their owner token
        raised ``OwnerDiedError``: nothing will ever close them)."""
        for b in list(self._orphans):
            self._orphans.discard(b)
            if b in self._owners:
                self.close(b)

    def _watch_owners(self) -> None:
        """The owner thread: every :data:`OWNER_CHECK_PERIOD_S`, mark the buffers whose owner token Ray reports
        ``OwnerDiedError`` for (waiting at most :data:`OWNER_CHECK_S` for each; no answer in time proves no death).
        It only marks them: the partitions are dropped on the data thread (:meth:`drop_orphans`)."""
        import ray

        while True:
            time.sleep(OWNER_CHECK_PERIOD_S)
            for b, t in list(self._owners.items()):
                try:
                    ray.get(t, timeout=OWNER_CHECK_S)
                except ray.exceptions.OwnerDiedError:
                    if self._owners.get(b) is t:  # (not closed, nor reopened by a new owner, meanwhile)
                        self._orphans.add(b)
                except Exception:  # noqa: BLE001 - anything else proves no death: looked at again
                    pass

    def _part(self, buffer_id: str) -> ColumnarStorage:
        part = self._parts.get(buffer_id)
        if part is None:
            raise DistributedError(f"This shard server holds no partition of buffer {buffer_id!r} (it was closed "
                                   f"or the server restarted); rebuild the buffer.")
        return part

    def append(self, buffer_id: str, cols: Wire, start: int, count: int, release_upto: int) -> AppendAck:
        """Release local handles below ``release_upto``, then store rows ``[start, start + count)`` of ``cols``.

        A ragged pool whose free elements would hold the rows in total, but not in one block (the ring's free tail is
        too short and its start is taken), is compacted first (:meth:`ColumnarStorage.compact`): live items keep their
        handles and contents, and the driver never sees the layout.

        Raises:
            CapacityError: the rows do not fit without overwriting live items, even compacted (nothing changed).
        """
        part = self._part(buffer_id)
        before = part.oldest
        part.release(release_upto)
        try:
            batch = wire_rows(cols, start, count, self._schemas[buffer_id])
            try:
                res = part.append(batch, evict=False)
            except CapacityError:
                if not part.schema.ragged or part.evictions_if_compacted(batch):
                    raise
                # the pools have room in total, split (a free tail too short, the pool's start taken): compact
                # them, and the rows fit. The release stands from here (compacting may overwrite released elements)
                part.compact()
                before = part.oldest
                res = part.append(batch, evict=False)
        except BaseException:
            # a refused append changes nothing: the driver still indexes the items it would have released
            # (an append checks before it writes, so undoing the release restores the partition exactly)
            part.unrelease(before)
            raise
        return res.first, res.count, part.next_handle

    def release_needed(self, buffer_id: str, cols: Wire, start: int, count: int, release_upto: int) -> int | None:
        """The local handle below which items must be released for rows ``[start, start + count)`` of ``cols`` to
        fit once those below ``release_upto`` are (``release_upto`` or later), or None when they cannot fit even in
        an empty partition. Changes nothing: a replay driver asks this of a shard that refused the rows for pool room,
        to find how many oldest items to evict."""
        part = self._part(buffer_id)
        before = part.oldest
        part.release(release_upto)
        try:
            batch = wire_rows(cols, start, count, self._schemas[buffer_id])
            try:
                # an append compacts pools whose free elements are split (see append): what it must release
                k = part.evictions_if_compacted(batch)
            except CapacityError:
                return None
            return part.oldest + k
        finally:
            part.unrelease(before)

    def truncate(self, buffer_id: str, upto: int) -> int:
        """Forget local handles from ``upto`` on: undo appends of an ingestion the driver could not
        complete on every shard (it never indexed them). Returns the next local handle."""
        part = self._part(buffer_id)
        part.truncate(upto)
        return part.next_handle

    def gather(self, buffer_id: str, local: np.ndarray) -> Wire:
        """Rows of the given local handles, as NumPy columns (they go to the object store).

        Raises:
            DistributedError: a handle is not live here (the driver's index and this shard disagree).
        """
        return to_wire(self._gathered(buffer_id, local), self._schemas[buffer_id])

    def _gathered(self, buffer_id: str, local: np.ndarray) -> Any:
        part = self._part(buffer_id)
        h = np.asarray(local, dtype=np.int64)
        if h.size and (h.min() < part.oldest or h.max() >= part.next_handle):
            raise DistributedError(f"Local handles outside the live range [{part.oldest}, {part.next_handle}) "
                                   f"were requested; the buffer's index and this shard disagree. Rebuild the buffer.")
        return part.gather(torch.from_numpy(h % part.capacity))

    # -- the torch.distributed transport -------------------------------------------------------
    def join_group(self, group_id: str, host: str, port: int, rank: int, world: int, backend: str,
                   timeout: float) -> int:
        """Join a learner's torch.distributed group as ``rank`` (blocks until every rank joined)."""
        from conduit.distributed.transport import make_process_group

        self._groups[group_id] = (make_process_group(backend, group_id, host, port, rank, world, timeout), backend)
        return rank

    def leave_group(self, group_id: str) -> bool:
        """Leave torch.distributed group ``group_id`` (its connections close once nothing uses them); returns
        whether this server was in it."""
        return self._groups.pop(group_id, None) is not None

    def _group(self, group_id: str) -> tuple[Any, torch.device]:
        from conduit.distributed.transport import wire_device

        got = self._groups.get(group_id)
        if got is None:
            raise DistributedError(f"This shard server is not in torch.distributed group {group_id!r}; form the "
                                   f"group again (ShardServers.torch_group(refresh=True)).")
        return got[0], wire_device(got[1])

    def gather_send(self, buffer_id: str, local: np.ndarray, group_id: str, tag: int) -> int:
        """Send the rows of the given local handles to the learner (rank 0) over torch.distributed.

        Message ``tag`` carries the ragged lengths (only when the schema has ragged fields),
        message ``tag + 1`` every column's bytes (:func:`~conduit.distributed.wire.pack_rows`).
        Returns the bytes sent.
        """
        pg, dev = self._group(group_id)
        batch = self._gathered(buffer_id, local)  # (first: a closed partition is refused typed, see _part)
        sch = self._schemas[buffer_id]
        if sch.ragged:
            pg.send([ragged_lengths(batch, sch).to(dev)], 0, tag).wait()
        payload = pack_rows(batch, sch).to(dev)
        pg.send([payload], 0, tag + 1).wait()
        return int(payload.numel())

    def probe_send(self, group_id: str, nbytes: int, tag: int) -> int:
        """Send ``nbytes`` to the learner over torch.distributed (a link probe)."""
        pg, dev = self._group(group_id)
        pg.send([torch.ones(int(nbytes), dtype=torch.uint8, device=dev)], 0, tag).wait()
        return int(nbytes)

    def release(self, buffer_id: str, upto: int) -> int:
        part = self._part(buffer_id)
        part.release(upto)
        return part.oldest

    def span(self, buffer_id: str) -> tuple[int, int]:
        """(oldest, next) local handles of the partition."""
        part = self._part(buffer_id)
        return part.oldest, part.next_handle

    # -- link probes ----------------------------------------------------------------------------
    def probe(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of data made here (a link probe's payload)."""
        return np.ones(int(nbytes), dtype=np.uint8)

    def sink(self, data: np.ndarray) -> int:
        """Receive a probe's payload (Ray moves it to this node before the call runs)."""
        return int(data.nbytes)


def _is_ref(x: Any) -> bool:
    """Whether ``x`` is a Ray ObjectRef (an owner token; the tests' in-process servers get other stand-ins)."""
    try:
        import ray
    except ImportError:  # pragma: no cover - a server runs in Ray
        return False
    return isinstance(x, ray.ObjectRef)


_REMOTE: Any = None


def server_class() -> Any:
    """``ShardServer`` as a Ray actor class (built on first use)."""
    global _REMOTE
    if _REMOTE is None:
        from conduit.distributed._ray import ray_module

        _REMOTE = ray_module(initialized=False).remote(concurrency_groups={"health": 1})(ShardServer)
    return _REMOTE


def ping(actor: Any) -> Any:
    """ObjectRef of a health check of a server (its own thread: data calls cannot delay it)."""
    return actor.ping.options(concurrency_group="health").remote()


def tick(actor: Any) -> Any:
    """ObjectRef of a probe of a server's data thread: it answers once the data calls queued before it ran."""
    return actor.tick.remote()
