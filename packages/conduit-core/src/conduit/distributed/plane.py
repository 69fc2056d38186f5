"""The multi-node Experience Data Plane: one buffer whose shards live in Ray actors on several nodes.

Division of labour:

* **semantics** run here, in the learner's process, on a global index of handles
  (:class:`~conduit.distributed.index.ShardIndex`), with core's own roles: uniform
  sampling over the union of the shards, prioritized sampling from one global sum tree,
  on-policy M x E minibatches over the whole rollout (exactly once per epoch, across shards);
* **payload** lives in shard servers (:mod:`conduit.distributed.server`) pinned to nodes;
  ingestion goes to the shard the :class:`~conduit.distributed.plan.ShardPlan` picks (the
  producer's node when the measured costs allow), delivery reads rows from the shards
  through Ray's object store (NumPy columns, read without a copy) straight into the batch.

Faults: every remote call has a ``timeout``. A shard whose actor or node dies, or that does
not answer within ``timeout``, is *lost* (a call Ray answers with ``ActorUnavailableError``,
which proves no death, counts only once a health probe confirms it within ``timeout``; a copy
or write whose outcome stays unknown is discarded should it run late, so no shard keeps rows
the index does not name): it is fenced (killed, never restarted), its items
are either recovered from replicas (``replication=2``) or reported lost exactly, by handle,
in a :class:`~conduit.distributed.faults.LossReport`; the buffer keeps serving from the
other shards. A shard whose pings answer but whose data thread has run nothing for
``stuck_after`` seconds (a data call that never returns) is lost too: the monitor finds it by a
no-op it sends down that thread with each check. A health monitor thread pings the shards every
``health_period`` seconds, so a loss is detected within ``health_period + timeout`` seconds of Ray
reporting it (or of the shard hanging; ``stuck_after + health_period + timeout`` of its data thread
sticking), even when nobody calls the buffer, provided no call holds the buffer's lock
meanwhile: the monitor records a loss under that lock, so it waits for a call that holds it.
A delivery or write waiting on a shard holds it up to ``2 * timeout`` (its remote call, then
the health probe of a shard that did not answer; one waiting on the lost shard finds the loss
itself), which makes the bound ``health_period + 3 * timeout``. A call that meets several
failures holds it longer: ``2 * timeout`` more for each replica it reads or copy round it
sends after fencing a shard (re-replication with ``replication=2``).

Re-replication is not moved off the caller's path: it runs in the thread that found the loss (the call that
met the failure, ``check_health``, or the monitor thread), under the buffer's lock, so every call of the
training loop waits for it. For one lost shard it is at most
:data:`~conduit.distributed.recovery.COPY_ROUNDS` (3) rounds of copies, each waiting at most ``timeout``,
and a probe of at most ``timeout`` after each round whose copies did not all answer (after the last only
without a monitor): ``6 * timeout`` at most (``5 * timeout`` with the monitor), plus as much for each shard
found lost while copying. Then it gives up: segments left short stay readable from their remaining copy and
are counted in ``under_replicated`` (not in the report's ``re_replicated``); nothing copies them later.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import numpy as np
import torch

from conduit.batch import ExperienceBatch, Ragged, host_array
from conduit.checks import is_int
from conduit.distributed import checkpoint, recovery
from conduit.distributed._ray import (
    Outcome,
    check_seconds,
    current_node_id,
    positive_finite,
    ray_is_up,
    ray_module,
    wait_all,
    without_auto_init,
)
from conduit.distributed.assembly import Assembly, concat
from conduit.distributed.callbacks import LossCallbacks, PlaneLock
from conduit.distributed.errors import (
    ClusterError,
    DistributedError,
    RemoteTimeoutError,
    ShardLostError,
    TransferError,
)
from conduit.distributed.experience import ExperienceRef
from conduit.distributed.faults import LossReport
from conduit.distributed.index import ShardIndex
from conduit.distributed.links import LinkProfile
from conduit.distributed.plan import Chunk, ShardPlan, pools_needed
from conduit.distributed.servers import ShardServers
from conduit.distributed.transport import OBJECT_STORE, TORCH, TRANSPORTS, TorchGroup
from conduit.distributed.wire import from_wire, packed_nbytes, to_wire, unpack_rows
from conduit.edp import check_roles
from conduit.errors import CapacityError, ConduitError, ConfigurationError, EmptyBufferError
from conduit.scheduling.base import Scheduler, Synchronous, lock_held
from conduit.schema import ExperienceSchema
from conduit.semantics.base import SampleInfo, Selection, Semantics, check_unshared, claim, select_many
from conduit.semantics.onpolicy import OnPolicy, check_version
from conduit.semantics.replay import PrioritizedSampler, Replay, UniformSampler
from conduit.storage.base import AppendResult
from conduit.storage.columnar import pool_elements
from conduit.telemetry import Telemetry

__all__ = ["DistributedDataPlane"]

T = TypeVar("T")

log = logging.getLogger("conduit.distributed")

#: redraw rounds for replay draws that hit lost items before giving up
_MAX_REDRAWS = 256


#: the column a batch handed to a scheduler carries: each row's producer node (an index into the buffer's list of
#: producers). A column, not an attribute, so it survives whatever the scheduler does to the rows: copy them
#: (``copy_on_ingest``) or coalesce several hand-overs into one write (``g_ing > 1``).
_PRODUCER = "conduit.distributed/producer"


class DistributedDataPlane:
    """An experience buffer sharded over Ray nodes, with core's replay or on-policy semantics.

    The same calls as :class:`conduit.ExperienceDataPlane` (``ingest``, ``deliver``,
    ``update_priorities``, ``seal``, ``set_policy_version``, ``state_dict``...), plus
    :meth:`ingest` of an :class:`~conduit.distributed.ExperienceRef` staged on a producer's
    node, and fault reports (:attr:`losses`). Delivered batches own their memory (with the
    default :class:`~conduit.scheduling.Synchronous` scheduler).

    Core's schedulers drive it as they drive :class:`~conduit.ExperienceDataPlane`: with
    ``scheduler=Overlapped(...)`` ``ingest`` hands the batch to a bounded queue and returns
    (a full queue blocks: backpressure) while a worker thread stores it in the shards, and
    the next batches are read from the shards while the learner updates on this one, with
    the scheduler's bounds (prioritized: a draw precedes at most ``priority_staleness``
    priority updates; on-policy: prefetch never crosses a rollout or a policy version).
    Batches delivered by a prefetching scheduler are its reused buffers, valid for
    ``scheduler.output_depth`` deliveries. An :class:`ExperienceRef` is stored in the call
    (after what is queued before it); so is everything with the synchronous scheduler.

    After :meth:`close` the buffer takes no more work, as :class:`~conduit.ExperienceDataPlane`:
    ingesting, delivering, the scheduler primitives (``*_now``), sealing, setting the policy
    version, updating priorities and ``load_state_dict`` raise :class:`~conduit.ConfigurationError`
    ("closed"); build a new buffer. ``close()`` again is harmless. Unlike a single-node buffer,
    :meth:`state_dict` and :meth:`read` are refused too (close dropped the shards' partitions):
    take the checkpoint before ``close()``.

    Args:
        schema: the fields of one item.

    Keyword Args:
        capacity: global item slots (FIFO eviction is global: the oldest items go first,
            whichever shard holds them).
        semantics: ``Replay(...)`` (default: uniform) or ``OnPolicy(...)``; one object (and sampler) per buffer: one
            that another open buffer holds is refused (:class:`ConfigurationError`).
        servers: a :class:`ShardServers` group to use (shared, left running on close), or
            node ids to start one server on each (owned), or None for every alive node. A buffer whose process
            dies (e.g. a learner actor whose node died) cannot close its partitions on shared servers: each server
            drops them itself a few seconds after Ray reports that process dead (a restarted learner's new buffer
            does not sit beside its dead predecessor's items). A lost shard is never used again, and no server is
            added to a buffer: a node that comes back, or a new one, serves only buffers built on servers started
            there (take a :meth:`state_dict`, build a buffer on ``ShardServers`` that include the new nodes, load it).
        replication: copies of each item, on distinct nodes (1 or more).
        shard_capacity: item slots per shard (default ``capacity``: any shard can take
            everything, so routing never runs out of room). Below it, the shards that survive a loss
            may not hold ``capacity`` items: a replay ingestion then evicts the oldest items (FIFO)
            until they have room, so the buffer goes on holding fewer.
        ragged_capacity: elements per ragged field's pool per shard (default ``64 * shard_capacity``). A replay
            ingestion whose items no shard's pool has room for evicts the oldest items (FIFO over the union of the
            shards, as a single-node buffer evicts for pool room) until a shard can take them; copies go where the
            pools leave room. On-policy never evicts: such an ingestion is refused (:class:`ClusterError`), as is,
            before anything changes, a replay batch with an item longer than one pool or items that need more pools
            than are live however they are placed (more elements than the live pools hold together, or e.g. items of
            3, 6 and 6 elements into two pools of 8: see :func:`~conduit.distributed.plan.pools_needed`). A shard
            whose pool has the room for rows in total but split compacts it first. A replay batch that fits the
            emptied pools only grouped otherwise than the plan sends its rows (by free slots and producer, blind to
            how elements pack) can still be refused after evicting the oldest items (the write never evicts its own
            rows).
        reuse: expected deliveries per item, for the plan (default: 1 for replay, the
            number of epochs on-policy).
        measure: measure the links between nodes for the plan (once per server group);
            False ranks shards by locality only.
        links: declared links instead of measured ones (a :class:`~conduit.distributed.LinkProfile`, e.g. one
            measured before, or the figures of a known network): the plan and the transport choice use them, and
            nothing is measured (``measure`` is then ignored). It must name every directed link between the
            servers' nodes and the learner's node.
        learner_node: the node delivered batches go to (default: this process's node): the id of an alive
            node of this Ray cluster (``ray.get_runtime_context().get_node_id()`` in the learner's process, or
            one of :func:`~conduit.distributed.alive_nodes`); anything else (a host name, an address, a shortened
            or dead node's id) is refused with :class:`~conduit.ConfigurationError` before any server starts.
            Deliveries are priced from the links to this node: measured links reach it only where it holds one of
            the servers or is this process's node, so with ``measure`` (and no ``links``) another node is refused
            the same way (declare ``links`` to it, or ``measure=False`` to rank shards by locality). The torch
            transport delivers into this process, not to another node: with a ``learner_node`` other than this
            process's, ``transport="torch"`` is refused and ``"auto"`` delivers through the object store (see
            ``transport``).
        device: the torch device delivered batches land on (default: host memory).
        timeout: seconds any remote call may take; a shard that does not answer in time is lost.
        health_period: seconds between health checks of the monitor thread (None: no thread;
            losses are then found by the calls that hit them, which probe a shard that did not answer
            themselves, re-replication copies included, or by :meth:`check_health`).
        stuck_after: seconds a shard's data thread may run nothing while its pings answer before the shard is
            lost (default ``max(4 * timeout, 60)``): checked by the health checks (the monitor thread's, or
            :meth:`check_health`), each of which sends a no-op down every shard's data thread unless the previous
            one is still waiting. A call that takes longer than ``timeout`` already fails its caller
            (:class:`RemoteTimeoutError` / :class:`TransferError`); this ends a hang that would fail every later call.
        on_loss: called with each :class:`LossReport`, exactly once, in the order of :attr:`losses`, never
            under the buffer's lock (it may call the buffer, from any thread): by the thread that detected
            the loss once its call into the buffer let go of the lock (or by a thread already running an
            earlier report's callback, which takes it next; callbacks never run concurrently), and never
            under the scheduler's delivery lock: a loss found during ``deliver`` is handed over once the
            scheduler returned; one found by a prefetch job (``gather_now``/``prepare_now``) at the end of
            the next call into the buffer that holds no lock (any thread). One found by a background ingestion
            worker's write (``Overlapped``) is handed over on that worker, inside its write: a call there that
            would wait for that write (``flush()`` and the calls that flush first, ``ingest()`` into a full
            queue) raises :class:`~conduit.ConfigurationError`, changing nothing. What it
            raises is logged, never raised into the call that found the loss (that call goes on). No loss
            is recorded once :meth:`close` ran, and no callback runs once it returned (see :meth:`close`).
        scheduler: when ingestion and delivery work runs (default: ``Synchronous()``, in the
            caller); e.g. ``Overlapped(g_ing=..., g_del=...)`` from :mod:`conduit.scheduling`.
        transport: how shards deliver rows to the learner: ``"object_store"`` (Ray's object
            store), ``"torch"`` (a torch.distributed group of this process and the servers,
            formed on first use by :meth:`ShardServers.torch_group`, formed anew when the
            servers' group was retired; gloo on CPU), or
            ``"auto"`` (default): the torch group where this process already has one with
            these servers, per shard where its measured link is faster than the object
            store's (unmeasured: for shards on other nodes), else the object store. A torch
            transfer that fails between live peers retires the group for this buffer, which
            goes on through the object store. The group's receiving end (rank 0) is this process, and its
            links are measured to this process's node, so it is used only when ``learner_node`` is this
            process's node: with another one ``"torch"`` is refused (:class:`~conduit.ConfigurationError`,
            before any server starts or any group forms; build the buffer in the learner's process on that
            node, which forms its own group with the servers, or use ``"object_store"``), and ``"auto"``
            delivers every shard through the object store (choosing and pricing the torch path by links to
            ``learner_node`` would route a shard on this process's node over loopback TCP and price the
            shards as if the bytes went to ``learner_node``).

    Raises:
        ClusterError: Ray is not initialised, servers cannot be started or reached, or the ``servers`` group was
            shut down.
        ConfigurationError: arguments that cannot work together.
    """

    def __init__(self, schema: ExperienceSchema, *, capacity: int, semantics: Semantics | None = None,
                 servers: ShardServers | Sequence[str] | None = None, replication: int = 1,
                 shard_capacity: int | None = None, ragged_capacity: int | None = None, reuse: float | None = None,
                 measure: bool = True, links: LinkProfile | None = None, learner_node: str | None = None,
                 device: torch.device | str | None = None,
                 timeout: float = 30.0, health_period: float | None = 1.0, stuck_after: float | None = None,
                 on_loss: Callable[[LossReport], None] | None = None, transport: str = "auto",
                 scheduler: Scheduler | None = None) -> None:
        if not isinstance(schema, ExperienceSchema):
            raise ConfigurationError("schema must be a conduit.ExperienceSchema.")
        if not is_int(replication) or replication < 1:  # (True is no count of copies; NumPy's 2 is)
            raise ConfigurationError(f"replication must be an int >= 1, got {replication!r}.")
        replication = int(replication)
        # checked before any server starts (a refusal afterwards would leave the servers it started running)
        check_seconds("timeout", timeout)
        check_seconds("health_period", health_period, none_means="no monitor thread")
        check_seconds("stuck_after", stuck_after, none_means="max(4 * timeout, 60)")
        if shard_capacity is not None and not (is_int(shard_capacity) and shard_capacity > 0):
            raise ConfigurationError(f"shard_capacity must be a positive int or None, got {shard_capacity!r}.")
        if ragged_capacity is not None and not (is_int(ragged_capacity) and ragged_capacity > 0):
            if schema.ragged or not (is_int(ragged_capacity) and ragged_capacity == 0):
                raise ConfigurationError(f"ragged_capacity must be a positive int or None, got {ragged_capacity!r}.")
        if reuse is not None and not (positive_finite(reuse) or (not isinstance(reuse, bool) and reuse == 0)):
            raise ConfigurationError(f"reuse must be a number >= 0 (expected deliveries per item), got {reuse!r}.")
        if transport not in TRANSPORTS:
            raise ConfigurationError(f"transport must be one of {TRANSPORTS}, got {transport!r}.")
        if links is not None and not isinstance(links, LinkProfile):
            raise ConfigurationError(f"links must be a conduit.distributed.LinkProfile or None (measure them), got "
                                     f"{type(links).__name__}.")
        if _PRODUCER in schema:
            raise ConfigurationError(f"The field name {_PRODUCER!r} is reserved by DistributedDataPlane; rename it.")
        device = check_roles(semantics=semantics, scheduler=scheduler, device=device) or torch.device("cpu")
        if semantics is not None:  # (before anything is built: a buffer open with them would lose them)
            check_unshared(semantics)
        ray_module()
        if learner_node is not None:
            _check_learner_node(learner_node, servers)
            if transport == TORCH:
                _check_torch_learner_node(learner_node)
            if links is None and measure:
                _check_learner_measurable(learner_node, servers)
        self.schema = schema
        self.semantics: Semantics = semantics if semantics is not None else Replay()
        self._replay = isinstance(self.semantics, Replay)
        self.index = ShardIndex(schema, capacity, replication)
        self.replication = replication
        self.timeout = float(timeout)
        self.stuck_after = float(stuck_after) if stuck_after is not None else max(4 * self.timeout, 60.0)
        #: the health checks' no-op on each shard's data thread still waiting: shard -> (ObjectRef, sent when)
        self._ticks: dict[int, tuple[Any, float]] = {}
        self.device = device
        self.telemetry = Telemetry()
        self._callbacks = LossCallbacks(on_loss)
        self.losses: list[LossReport] = []
        self._losses_seen = 0  # len(losses) at the last deliver(): batches prepared before a loss are dropped
        #: items left with fewer than ``replication`` copies when stored or re-replicated after a loss (no room on
        #: another node, or every copy failed, retries included: see _replicate), counted each time: a running
        #: total over the buffer's life, like :attr:`lost_items`, that never goes down (also once such items are
        #: evicted or copied later)
        self.under_replicated = 0
        self._lock = PlaneLock(self._callbacks)
        self._closed = False
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.learner_node = learner_node or current_node_id()
        #: producer nodes of the batches handed to the scheduler (the rows' producer column indexes this list)
        self._producers: list[str] = [self.learner_node]
        self._producer_index = {self.learner_node: 0}
        self._producers_lock = threading.Lock()

        self._owns_servers = not isinstance(servers, ShardServers)
        self.servers = servers if isinstance(servers, ShardServers) else ShardServers(servers)
        self.servers.check_running()  # (a group shut down: its servers are gone)
        nodes = self.servers.nodes
        if replication > len(set(nodes)):
            if self._owns_servers:
                self.servers.shutdown()
            raise ConfigurationError(f"replication={replication} needs servers on at least {replication} distinct "
                                     f"nodes; these servers span {len(set(nodes))}.")
        self.shard_capacity = int(shard_capacity if shard_capacity is not None else capacity)
        self._ragged_capacity = ragged_capacity
        if self.shard_capacity * len(nodes) < capacity * replication:
            if self._owns_servers:
                self.servers.shutdown()
            raise ConfigurationError(f"{len(nodes)} shards of {self.shard_capacity} slots cannot hold {capacity} "
                                     f"items x {replication} replicas; raise shard_capacity or add servers.")
        if reuse is None:
            reuse = float(self.semantics.num_epochs) if isinstance(self.semantics, OnPolicy) else 1.0
        self._alive = [True] * len(nodes)
        self._local_next = [0] * len(nodes)
        #: while a write is under way, each shard's next local handle when it began: rows from there on are
        #: stored but not yet in the index, and no append may release them
        self._pinned: dict[int, int] = {}
        #: while a write is under way, where its window starts once it is stored (the oldest items it evicts are
        #: not re-replicated for a shard lost during it), and the segments left short for that reason (copied
        #: should the write fail and evict nothing)
        self._evicting: int | None = None
        #: where the last write's window starts (see _store)
        self._stored_oldest = 0
        self._short_evicted: list[int] = []
        #: while a write is under way, live shards with an append whose outcome is unknown (it timed out, or Ray
        #: reported the shard unavailable): it may still run, releasing what the write evicts (see _undo_store)
        self._doubtful: set[int] = set()
        #: reports recorded during a write, held back from on_loss until it ends: (index in ``losses``, handles of
        #: the lost shard's items the write evicts, and (segment row, items) of those it evicts that had a replica
        #: elsewhere; both left out of the report, its ``lost`` and ``recovered``, unless the write evicts nothing)
        self._held_losses: list[tuple[int, np.ndarray, list[tuple[int, int]]]] = []
        self.transport = transport
        self._torch: TorchGroup | None = None
        self._recv_pool: futures.ThreadPoolExecutor | None = None
        #: the receive pool once started (the finalizer's view of it: it must not hold the plane)
        self._pools: list[futures.ThreadPoolExecutor] = []
        try:  # what fails from here on stops the servers this buffer started
            # (probes bounded by this buffer's timeout, as every remote call it makes)
            self.links: LinkProfile | None = links
            if links is not None:
                _check_links(links, [*nodes, self.learner_node])
            elif measure:
                self.links = self.servers.links(timeout=self.timeout)
            self.plan = ShardPlan(nodes, self.learner_node, links=self.links, reuse=reuse)
            if transport == TORCH:
                # a retired group (closed, or broken by another buffer's transfer) is renewed once: a buffer built
                # at the same time gets the same new group
                self._torch = self.servers.torch_group(timeout=self.timeout, replace_broken=True)
            elif transport == "auto":
                g = self.servers.torch_group(create=False)
                # (a group delivers to its rank 0, this process: only where that is the learner's node)
                usable = g is not None and g.broken is None and g.learner_node == self.learner_node
                self._torch = g if usable else None
        except BaseException:
            if self._owns_servers:
                self.servers.shutdown()
            raise
        #: node ids known to be of this cluster (producer nodes are checked against it, see _check_node)
        self._known_nodes = {*nodes, self.learner_node}
        self._via_torch = [self._choose_torch(s) for s in range(len(nodes))]
        self._read_cost = np.array([self._deliver_seconds(s) for s in range(len(nodes))], dtype=np.float64)
        self.buffer_id = uuid.uuid4().hex
        #: what the garbage collector runs for a plane dropped without close(): stop the threads, drop the
        #: partitions, stop the servers this plane started (close() does it itself and detaches this)
        self._release = weakref.finalize(self, _release_dropped, self._stop, self.servers, self._owns_servers,
                                         self.buffer_id, self._alive, self._pools)
        self._release.atexit = False  # at exit Ray stops this process's actors itself, and may be gone already
        #: this process's owner token, given to every partition (see :mod:`~conduit.distributed.server`): once this
        #: process died, the next buffer opened on a server drops this buffer's partition there
        self._owner = [ray_module().put(b"")]
        opened = wait_all({s: info.actor.open.remote(self.buffer_id, schema.to_dict(), self.shard_capacity,
                                                     ragged_capacity, self._owner)
                           for s, info in enumerate(self.servers.servers)},
                          self.timeout)
        bad = {s: o for s, o in opened.items() if not o.ok}
        if bad:
            self.close()
            s, o = next(iter(bad.items()))
            raise ClusterError(f"Shard {s} on node {nodes[s][:8]} could not open its partition ({o.error}); "
                               f"check that node, or build the buffer on other servers.") from o.error
        self.semantics.bind(self.index)
        self.scheduler: Scheduler = scheduler if scheduler is not None else Synchronous()
        try:
            self.scheduler.attach(self)  # type: ignore[arg-type]
        except BaseException:  # e.g. a scheduler that refuses these semantics: drop the partitions opened above
            self._closed = True
            self._close_shards()
            raise
        claim(self.semantics, self)  # (once built: a build that failed claims nothing)
        if health_period is not None:
            # (it holds the plane weakly: a dropped plane is freed, and its finalizer stops the thread)
            self._monitor = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, float(health_period)),
                                             daemon=True, name=f"conduit-health-{self.buffer_id[:6]}")
            self._monitor.start()

    # -- properties -------------------------------------------------------------------------------
    @property
    def on_loss(self) -> Callable[[LossReport], None] | None:
        """The callback given each :class:`LossReport` (see the class docstring); may be replaced any time."""
        return self._callbacks.fn

    @on_loss.setter
    def on_loss(self, fn: Callable[[LossReport], None] | None) -> None:
        self._callbacks.fn = fn

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (as ``ExperienceDataPlane.closed``: the scheduler may serve another buffer)."""
        return self._closed

    @property
    def capacity(self) -> int:
        return self.index.capacity

    @property
    def storage(self) -> ShardIndex:
        """The global index: the payload-free :class:`~conduit.storage.Storage` the semantics and schedulers see."""
        return self.index

    @property
    def num_shards(self) -> int:
        return len(self._alive)

    @property
    def alive_shards(self) -> list[int]:
        """Shards not lost."""
        return [s for s, a in enumerate(self._alive) if a]

    @property
    def lost_items(self) -> int:
        """Items lost over the buffer's life (the sum over :attr:`losses`)."""
        return sum(r.num_lost for r in self.losses)

    def shard_node(self, shard: int) -> str:
        return self.plan.shard_nodes[shard]

    def __len__(self) -> int:
        with self._lock:
            return len(self.index)

    def __repr__(self) -> str:
        return (f"DistributedDataPlane({self.schema!r}, capacity={self.capacity}, shards={self.num_shards} on "
                f"{len(set(self.plan.shard_nodes))} nodes, replication={self.replication}, "
                f"semantics={type(self.semantics).__name__})")

    @property
    def transports(self) -> list[str]:
        """The delivery path of each shard now (``"torch"`` or ``"object_store"``)."""
        return [TORCH if self._uses_torch(s) else OBJECT_STORE for s in range(self.num_shards)]

    def _uses_torch(self, shard: int) -> bool:
        return self._via_torch[shard] and self._torch is not None and self._torch.broken is None

    def _choose_torch(self, shard: int) -> bool:
        if self._torch is None:
            return False
        if self.transport == TORCH:
            return True
        node = self.shard_node(shard)
        tl = self._torch.links
        if self.links is None or tl is None or (node, self.learner_node) not in tl.links:
            return node != self.learner_node
        mib = float(1 << 20)
        return tl.seconds(node, self.learner_node, mib) < self.links.seconds(node, self.learner_node, mib)

    def _deliver_seconds(self, shard: int) -> float:
        if self.links is None:
            return float(self.shard_node(shard) != self.learner_node)
        node = self.shard_node(shard)
        tl = self._torch.links if self._torch is not None else None
        if self._via_torch[shard] and tl is not None and (node, self.learner_node) in tl.links:
            return tl.link(node, self.learner_node).seconds(1 << 20) - tl.link(node, self.learner_node).overhead_s
        return self.plan.transfer_seconds(node, self.learner_node, 1 << 20)

    def _check_open(self) -> None:
        """:class:`ConfigurationError` once :meth:`close` ran (it dropped the shards' partitions: nothing is left to
        read or change)."""
        if self._closed:
            raise ConfigurationError("This DistributedDataPlane is closed (its shards dropped their partitions); build "
                                     "a new one (load a state_dict() taken before close() into it to keep the "
                                     "contents).")

    # -- ingestion --------------------------------------------------------------------------------
    def ingest(self, batch: Mapping[str, Any] | ExperienceBatch | ExperienceRef, *, version: int | None = None,
               priorities: torch.Tensor | None = None, node: str | None = None) -> torch.Tensor | None:
        """Store a batch in the shards the plan picks.

        Args:
            batch: one row per item for every schema field, or an :class:`ExperienceRef`
                staged on a producer's node.

        Keyword Args:
            version: the producing policy version (required on-policy; replay semantics keep no versions and
                ignore it, so that one producer can feed either kind of buffer).
            priorities: initial priorities (prioritized replay only).
            node: the producer's node id (default: the ref's node, or this process's node), one of
                this Ray cluster's (alive or dead).

        Returns:
            The items' global handles (int64), or None when the scheduler stores the batch later.

        Raises:
            SchemaError, CapacityError, PriorityError, ConfigurationError: bad input, e.g. a ``node``
                that is no node id of the cluster (nothing stored).
            TransferError: a staged batch could not be read (its producer or node died).
            ClusterError: no live shard can take the items.
        """
        self._check_open()
        self._check_node(node)
        t0 = time.perf_counter()
        sync = isinstance(self.scheduler, Synchronous)
        try:
            if isinstance(batch, ExperienceRef) or sync:
                if not sync:
                    self.scheduler.flush()  # what was queued before it is stored before it
                out = self._ingest(batch, version, priorities, node, validated=False)
                n = int(out.shape[0])
            else:
                b = ExperienceBatch.checked(batch, self.schema)
                n = b.batch_size
                self.index.evictions_for(n)  # raises CapacityError for a batch larger than the capacity
                self.semantics.check_ingest(n, version=version, priorities=priorities)
                tagged = ExperienceBatch({**{name: b[name] for name in b},
                                          _PRODUCER: torch.full((n,), self._producer_id(node), dtype=torch.int32)}, n)
                out = self.scheduler.ingest(tagged, version=version, priorities=priorities)  # type: ignore[assignment]
        except BaseException:  # the caller waited for the call all the same (e.g. for a shard, or for room in a queue)
            self.telemetry.record("ingest_wait", 0, 0, t0, time.perf_counter())  # (no items: none accepted)
            raise
        self.telemetry.record("ingest_wait", n, 0, t0, time.perf_counter())  # the caller's whole call
        return out

    def _check_node(self, node: Any) -> None:
        """Refuse a producer ``node`` that is no node id of this Ray cluster (a host name, an address, a shortened
        id): the batch would be routed as if produced on an unknown far node, and its locality silently lost.

        Raises:
            ConfigurationError: ``node`` is not None and not the id of a node of the cluster (alive or dead).
        """
        if node is None or (isinstance(node, str) and node in self._known_nodes):
            return
        if isinstance(node, str) and node:
            # (nodes that died count: a batch made there before it died is still here to store)
            ids = {str(n.get("NodeID")) for n in ray_module().nodes()}
            if node in ids:
                self._known_nodes.add(node)
                return
        raise ConfigurationError(f"node={node!r} is not a node id of this Ray cluster; pass the producer's node id "
                                 f"(ray.get_runtime_context().get_node_id() where the batch was made), or leave "
                                 f"node out for this process's node.")

    def _producer_id(self, node: str | None) -> int:
        """The index of ``node`` (None: the learner's node) in the list the producer column refers to."""
        node = node or self.learner_node
        with self._producers_lock:
            i = self._producer_index.get(node)
            if i is None:
                i = self._producer_index[node] = len(self._producers)
                self._producers.append(node)
            return i

    def ingest_now(self, batch: ExperienceBatch, *, version: int | None = None,
                   priorities: torch.Tensor | None = None,
                   on_stored: Callable[[], None] | None = None) -> torch.Tensor:
        """Store an already validated batch now (the scheduler's primitive); ``on_stored`` as
        ``ExperienceDataPlane.ingest_now``'s (called under the lock, in the hold that stored the batch).

        Rows that carry a producer column (what :meth:`ingest` hands to the scheduler) are
        routed by each row's producer node, so one write that coalesces batches of several
        producers still places each batch as the plan wants it for its producer; rows
        without one count as produced on the learner's node.

        A call that raises records its ``ingest`` span all the same, with no items (as
        ``ExperienceDataPlane.ingest_now``'s: a failed write on a scheduler's worker is that worker's time).
        """
        t0 = time.perf_counter()
        try:
            return self._ingest(batch, version, priorities, None, validated=True, on_stored=on_stored)
        except BaseException:
            self.telemetry.record("ingest", 0, 0, t0, time.perf_counter())  # (no items: none stored)
            raise

    def _ingest(self, batch: Mapping[str, Any] | ExperienceBatch | ExperienceRef, version: int | None,
                priorities: torch.Tensor | None, node: str | None, *, validated: bool,
                on_stored: Callable[[], None] | None = None) -> torch.Tensor:
        t0 = time.perf_counter()
        if isinstance(batch, ExperienceRef):
            if ExperienceSchema.from_dict(batch.schema) != self.schema:
                raise ConfigurationError("This ExperienceRef was staged with another schema; stage it with the "
                                         "buffer's schema.")
            n, nbytes, payload = batch.batch_size, batch.nbytes, batch.ref
            runs = [(0, n, node or batch.node_id)]
            copies = None
        else:
            b = cast(ExperienceBatch, batch) if validated else ExperienceBatch.checked(batch, self.schema)
            # each producer's rows in runs that fit one shard's ragged pools (a shard refuses an append whole)
            producers = self._producer_runs(b, node)
            runs = [(r, k, prod) for a, c, prod in producers for r, k in self._pool_runs(b, a, a + c)]
            # rows too large for one pool: the plan places copies by item slots, blind to the pools, so the copies
            # of the first runs would take the room later runs need. Every row is stored once, then copied below
            # where the pools leave room (as a checkpoint load does); a batch that fits one pool keeps its copies
            copies = 1 if len(runs) > len(producers) else None
            if _PRODUCER in b:
                b = ExperienceBatch({name: b[name] for name in self.schema}, b.batch_size)
            n, nbytes, payload = b.batch_size, b.nbytes(), None
            if self._replay:
                self._check_pools_fit(b)
        self.index.evictions_for(n)  # raises CapacityError for a batch larger than the capacity
        self.semantics.check_ingest(n, version=version, priorities=priorities)
        with self._lock:
            self._check_open()
            if not self._replay and version is not None:
                # checked above before the lock: another producer's newer version may have been stored since
                cast(OnPolicy, self.semantics).check_version_order(version)
            k = self.index.evictions_for(n)
            if k and not self._replay:
                raise CapacityError(f"Storing {n} more items needs {k} live items evicted, and this buffer may not "
                                    f"evict (on-policy data not yet consumed). Consume first or raise capacity.")
            new_oldest = self.index.oldest + k
            if n and self._replay and not all(self._alive):  # (with every shard up, the capacity has room)
                new_oldest = self._oldest_with_room(n, new_oldest)
            if n:
                if payload is None:
                    payload = ray_module().put(to_wire(b, self.schema))
                before = list(self._local_next)
                try:
                    try:
                        placed = self._store(payload, runs, nbytes / n, new_oldest, copies,
                                             evict_for_room=self._replay)
                    finally:
                        new_oldest = max(new_oldest, self._stored_oldest)  # (later: it evicted for pool room)
                except BaseException as e:
                    evicted = False  # (should the undo itself fail: the items stay reported lost)
                    try:
                        evicted = self._undo_store(before, new_oldest, e)
                    finally:
                        self._release_losses(evicted=evicted)
                    raise
                self._release_losses(evicted=True)
            else:
                placed = []
            ev_from = self.index.oldest
            self.index.release(new_oldest)  # (beyond the ``k`` the reservation evicts: see _oldest_with_room)
            res = self.index.reserve(n, evict=self._replay)
            res = AppendResult(res.first, res.count, ev_from, res.evicted_to)
            for start, count, reps in placed:
                self.index.add_segment(res.first + start, count, reps)
            # row numbers once every segment is in (adding one may compact the index's arrays)
            live = list(self.index.live_rows())
            rows = live[len(live) - len(placed):]
            self.semantics.on_append(res, version=version, priorities=priorities)
            if on_stored is not None:
                on_stored()
            short = [r for r, (_, _, reps) in zip(rows, placed, strict=True) if len(reps) < self.replication]
            if short:
                self._replicate(short)
        self.telemetry.record("ingest", n, nbytes, t0, time.perf_counter())
        return torch.arange(res.first, res.first + n, dtype=torch.int64)

    def _producer_runs(self, batch: ExperienceBatch, node: str | None) -> list[tuple[int, int, str]]:
        """(start, count, producer node) of each run of consecutive rows with one producer, in row order."""
        n = batch.batch_size
        if _PRODUCER not in batch or n == 0:
            return [(0, n, node or self.learner_node)]
        ids = batch.tensor(_PRODUCER).cpu().numpy()
        starts = [0, *(np.nonzero(ids[1:] != ids[:-1])[0] + 1).tolist()]
        ends = [*starts[1:], n]
        with self._producers_lock:
            return [(a, e - a, self._producers[int(ids[a])]) for a, e in zip(starts, ends, strict=True)]

    def _pool_runs(self, batch: ExperienceBatch, a: int, b: int) -> list[tuple[int, int]]:
        """Rows ``[a, b)`` of ``batch`` as (start, count) runs whose ragged elements each fit one shard's pool.

        A run goes to a shard as one append, which that shard refuses whole when its pool cannot hold the run
        (and then gets no more of this write): rows that fit the live pools only spread over several shards would
        be refused. Greedy from ``a``, each run as long as every ragged field's pool allows (at least one row: a
        row larger than a pool is refused by every shard).
        """
        if not self.schema.ragged or b <= a:
            return [(a, b - a)]
        pool = pool_elements(self._ragged_capacity, self.shard_capacity)
        # per field, elements before each row of [a, b] (cumulative, from a)
        ends = [np.concatenate([[0], np.cumsum(cast(Ragged, batch[n]).lengths[a:b].cpu().numpy())])
                for n in self.schema.ragged]
        runs, i = [], 0
        while i < b - a:
            j = min(int(np.searchsorted(e, e[i] + pool, side="right")) - 1 for e in ends)
            j = max(j, i + 1)
            runs.append((a + i, j - i))
            i = j
        return runs

    def _check_pools_fit(self, batch: ExperienceBatch) -> None:
        """Refuse, before anything changes, a replay batch that cannot fit the live shards' pools even once they
        are empty: an item with more elements than one pool, or items that need more pools than there are live
        shards however they are placed (:func:`~conduit.distributed.plan.pools_needed`, a lower bound: at least the
        elements over one pool's; an item is never split between shards). A replay write evicts the oldest items
        for pool room, and a batch refused after that would leave them evicted."""
        if not self.schema.ragged or not batch.batch_size:
            return
        pool = pool_elements(self._ragged_capacity, self.shard_capacity)
        live = len(self.alive_shards)
        for name in self.schema.ragged:
            lengths = cast(Ragged, batch[name]).lengths.cpu().numpy()
            longest, total = int(lengths.max()), int(lengths.sum())
            need = pools_needed(lengths, pool) if longest <= pool else live + 1
            if need > live:
                raise ClusterError(f"Ragged field {name!r} brings {total} elements (up to {longest} in one item), "
                                   f"whose items need at least {need} of the shards' pools of {pool} elements even "
                                   f"empty (an item is never split between shards), and {live} shards are live: "
                                   f"split the batch, add shard servers, or raise ragged_capacity.")

    def _release_for_room(self, payload: Any, row: int, shards: Sequence[int], oldest: int) -> int | None:
        """Where the window must start (after ``oldest``) for one of ``shards``, which refused row ``row`` of
        ``payload`` for room in its ragged pool, to take it: the earliest such start, so the oldest items go first
        whichever shard holds them (FIFO over the union, as a single-node buffer evicts for pool room). None when
        none of them can take it however many items go (the row fills a pool alone, or only rows this write stored
        hold the room)."""
        calls = {s: self.servers[s].actor.release_needed.remote(self.buffer_id, payload, row, 1,
                                                                 self._room(s, oldest)[1]) for s in shards}
        outs = wait_all(calls, self.timeout)
        self._settle({s: o for s, o in outs.items() if o.lost})
        best: int | None = None
        for s, o in outs.items():
            if not (o.ok and self._alive[s]) or o.value is None:
                continue
            need = int(o.value)

            def fits(start: int, s: int = s, need: int = need) -> bool:
                room, upto = self._room(s, start)
                return room >= 1 and upto >= need

            lo, hi = oldest + 1, self.index.next_handle
            if hi < lo or not fits(hi):
                continue
            while lo < hi:  # (the room and the release point only grow as the window starts later)
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid + 1
            best = lo if best is None else min(best, lo)
        return best

    def _oldest_with_room(self, n: int, oldest: int) -> int:
        """Where the window must start for the live shards to have room for one copy of ``n`` more items: ``oldest``
        (the start the capacity asks for), or later when the shards lost since took their room with them.

        The live shards can hold fewer than ``capacity`` items once a shard is lost (``shard_capacity`` below the
        capacity): a replay ingestion then evicts further oldest items (FIFO), rather than being refused for ever
        while the survivors keep their items. Unchanged when even an empty window has no room (the write raises).
        """
        def room(start: int) -> int:
            return sum(max(0, self._room(s, start)[0]) for s in self.alive_shards)

        lo, hi = oldest, self.index.next_handle
        if room(lo) >= n or room(hi) < n:
            return oldest
        while lo < hi:  # (the room only grows as the window starts later)
            mid = (lo + hi) // 2
            if room(mid) >= n:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _room(self, shard: int, oldest: int) -> tuple[int, int]:
        """(free slots, release point) of ``shard`` once the window starts at ``oldest``."""
        need = self.index.needed_from(shard, oldest)
        upto = self._local_next[shard] if need is None else need
        upto = min(upto, self._pinned.get(shard, upto))  # rows this write stored in an earlier round stay
        return self.shard_capacity - (self._local_next[shard] - upto), upto

    def _store(self, payload: Any, runs: Sequence[tuple[int, int, str]], row_bytes: float, oldest: int,
               copies: int | None = None, *, evict_for_room: bool = False, targets: Mapping[int, int] | None = None
               ) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """Write rows of ``payload`` to shards; returns (start, count, replicas) runs in row order.

        ``runs`` are (start, count, producer node): each run is placed by the plan for its
        producer, and every run's writes go out in one round of parallel calls. Each row gets
        ``copies`` replicas where there is room (default ``replication``).

        A run of several rows that every shard it was sent to refused for room (a ragged pool that earlier items
        partly fill: the runs are sized to empty pools) is halved and sent again, each row once from then on; a shard
        counts as full only once it refuses a single row.

        With ``evict_for_room`` (replay ingestion), once the shards that refused rows for room in their ragged pools
        leave too few free slots for the rows still to store, the window starts later: the oldest items go (FIFO over
        the union of the shards, whichever shard holds them) until a shard can take the first of those rows, as a
        single-node replay buffer evicts for pool room, and every shard is tried again. :attr:`_stored_oldest` is
        then where the window starts (also should the write fail: the shards may have released the items).

        ``targets`` maps a run's first row to the shard it goes to while that shard is live and not full (a checkpoint
        load places items as its packing into the ragged pools says); the plan places the other runs.
        """
        self._pinned = dict(enumerate(self._local_next))
        self._evicting, self._short_evicted, self._doubtful = oldest, [], set()
        self._stored_oldest = oldest
        try:
            return self._store_rounds(payload, runs, row_bytes, oldest, self.replication if copies is None else copies,
                                      evict_for_room, dict(targets or {}))
        finally:
            self._pinned = {}
            self._stored_oldest = cast(int, self._evicting)
            self._evicting = None

    def _store_rounds(self, payload: Any, runs: Sequence[tuple[int, int, str]], row_bytes: float, oldest: int,
                      copies: int, evict_for_room: bool, targets: dict[int, int]
                      ) -> list[tuple[int, int, list[tuple[int, int]]]]:
        placed: list[tuple[int, int, list[tuple[int, int]], str]] = []
        pending = list(runs)
        full: set[int] = set()
        # (each round places, halves or refuses every pending run: a run halves at most its bit length times on
        # each shard before that shard counts as full)
        bits = max((c for _, c, _ in runs), default=0).bit_length()
        # (evicting for pool room: each retry starts the window at least one item later)
        evictable = self.index.next_handle - oldest if evict_for_room else 0
        for _ in range((self.num_shards + 1) * (bits + 2) + evictable):
            if not pending:
                break
            live = [s for s in self.alive_shards if s not in full]
            if evict_for_room and full and sum(max(0, self._room(s, oldest)[0]) for s in live) < sum(
                    c for _, c, _ in pending):
                # the shards with free slots refused rows for pool room: evict the oldest items (whichever shards
                # hold them) until a shard can take the first row left, and try every shard again
                later = self._release_for_room(payload, min(pending)[0], self.alive_shards, oldest)
                if later is not None:
                    oldest = self._evicting = later
                    full.clear()
                    live = self.alive_shards
            if not live:
                raise ClusterError("No live shard can take the items: every shard is lost or full. Add shard "
                                   "servers, or raise shard_capacity / ragged_capacity.")
            rooms, release = {}, {}
            for s in live:
                rooms[s], release[s] = self._room(s, oldest)
            calls: dict[tuple[int, int], Any] = {}
            plan: list[tuple[Chunk, str]] = []
            for p_start, p_count, producer in pending:
                t = targets.get(p_start)
                try:
                    chunks, _ = self.plan.split(p_count, producer, row_bytes * p_count,
                                                {t: rooms[t]} if t in rooms else rooms, copies)
                except ClusterError as e:
                    if not full:
                        raise
                    raise ClusterError(f"{e} (Shards {sorted(full)} have free slots but refused the items for room "
                                       f"in their ragged pools: raise ragged_capacity.)") from e
                for ch in chunks:
                    ch.start += p_start
                    plan.append((ch, producer))
                    for s in ch.shards:
                        rooms[s] -= ch.count  # the next run sees what this one took
                        calls[(len(plan) - 1, s)] = self.servers[s].actor.append.remote(
                            self.buffer_id, payload, ch.start, ch.count, release[s])
            outs = wait_all(calls, self.timeout)
            for (_, s), o in outs.items():
                if o.ok:
                    self._local_next[s] = max(self._local_next[s], int(o.value[2]))
            stuck = self._settle({s: o for (_, s), o in outs.items() if o.lost})
            if stuck:
                self._doubtful |= stuck  # (their appends may still run: _undo_store discards what they store)
                raise TransferError(f"Shards {sorted(stuck)} answer health checks but could not store the batch "
                                    f"within {self.timeout:g} s: the batch is unreadable (if it was staged on "
                                    f"another node, its producer or node died) or the shards are overloaded. Produce "
                                    f"it again, or raise timeout.")
            pending = []
            # a shard lost in this round may hold rows it stored earlier in this call: keep no replica on it
            # (the index must never name a fenced shard), store rows left with none again
            kept = []
            for p_start, p_count, p_reps, producer in placed:
                p_reps = [(s, lf) for s, lf in p_reps if self._alive[s]]
                if p_reps:
                    kept.append((p_start, p_count, p_reps, producer))
                else:
                    pending.append((p_start, p_count, producer))
            placed = kept
            for ci, (ch, producer) in enumerate(plan):
                reps, refused = [], []
                for s in ch.shards:
                    o = outs[(ci, s)]
                    if o.ok:
                        if self._alive[s]:  # (a later call of this round may have found it lost)
                            reps.append((s, int(o.value[0])))
                    elif o.lost:
                        pass  # settled above: the shard is lost
                    elif isinstance(o.error, CapacityError):
                        refused.append(s)
                    elif isinstance(o.error, ConduitError):
                        raise o.error
                    else:
                        raise TransferError(f"The batch could not be read by shard {s} ({o.error}); if it was "
                                            f"staged on another node, its producer or node died before ingestion: "
                                            f"produce it again.") from o.error
                if ch.count == 1:
                    full.update(refused)
                if reps:
                    placed.append((ch.start, ch.count, reps, producer))
                elif refused and ch.count > 1:
                    # refused for pool room that a smaller run may find: each half again, once (copies of the
                    # first halves would take the room later ones need; _replicate copies where room is left)
                    half = ch.count // 2
                    pending += [(ch.start, half, producer), (ch.start + half, ch.count - half, producer)]
                    if ch.start in targets:
                        targets[ch.start + half] = targets[ch.start]
                    copies = 1
                else:
                    pending.append((ch.start, ch.count, producer))
        if pending:
            raise ClusterError(f"{sum(c for _, c, _ in pending)} items could not be stored after retries on every "
                               f"live shard; check the cluster's health.")
        placed.sort(key=lambda p: p[0])
        return [(a, c, reps) for a, c, reps, _ in placed]

    def _release_losses(self, *, evicted: bool) -> None:
        """End a write's hold on the loss reports recorded during it (under the lock), and queue them for ``on_loss``.

        Items of a lost shard that the write evicts are evicted, neither lost nor recovered: its report leaves them
        out. When the write failed and ``evicted`` nothing, they stay in the window: the report names those with
        no replica left lost, and counts those that still have one recovered, after all.
        """
        held, self._held_losses = self._held_losses, []
        for i, gone, spared in held:
            if not evicted:
                # (a segment whose other replica was lost since is in that loss's ``gone``: counted there, once)
                back = sum(items for row, items in spared if self.index.segment(row)[2])
                if gone.size or back:
                    r = self.losses[i]
                    self.losses[i] = dataclasses.replace(r, lost=np.union1d(gone, r.lost), recovered=r.recovered + back)
            self._callbacks.add(self.losses[i])

    def _undo_store(self, before: list[int], oldest: int, error: BaseException) -> bool:
        """Undo an ingestion that failed after some shards stored their rows (under the lock).

        Those shards forget the rows again (the index never named them), so no shard holds a
        row the index does not know; rows the index names there (a copy made for a shard lost
        during the write) are kept, with whatever of the batch was stored before them. A shard
        that stored rows had first released the items the ingestion evicts, and the rows may
        have overwritten them: those evictions stand, and the index evicts the same oldest items
        (FIFO order kept). ``error`` gets a note saying so. A shard with an append of this write
        whose outcome is unknown (it may still run, releasing and storing) counts as such a shard:
        its truncate queues behind that append, so it runs after it (it is not waited for). A truncate that
        does not answer in time on a shard that answers a probe still runs before any later call there: the
        shard's room is counted as the truncate leaves it (else the room it frees would stay counted as used).

        Returns:
            Whether the items the write was to evict are evicted.
        """
        doubtful = {s for s in self._doubtful if self._alive[s]}  # (their appends may still run)
        touched = [s for s, nxt in enumerate(self._local_next) if nxt > before[s] or s in doubtful]
        if not touched:
            # no shard released or stored anything: the buffer is unchanged, so the items this write would have
            # evicted stay, and those a shard lost during it left short get their copy now
            short, self._short_evicted = self._short_evicted, []
            if short:
                self._replicate(short)
            return False
        upto = {s: max(before[s], self.index.held_end(s)) for s in touched if self._alive[s]}
        truncates = {s: self.servers[s].actor.truncate.remote(self.buffer_id, u) for s, u in upto.items()}
        # (a doubtful shard's truncate queues behind its stuck append: it runs after it, not waited for)
        outs = wait_all({s: ref for s, ref in truncates.items() if s not in doubtful}, self.timeout)
        for s, u in upto.items():
            # what its truncate leaves: also where it did not answer in time (stuck, or unreachable for a moment),
            # as a shard runs data calls in order, so the truncate runs before any later call there
            o = outs.get(s)
            self._local_next[s] = int(o.value) if o is not None and o.ok else u
        self._evicting = oldest  # a shard lost now: its items below ``oldest`` are evicted below, not lost
        try:
            self._settle({s: o for s, o in outs.items() if o.lost})  # (a stuck shard's truncate runs later)
        finally:
            self._evicting = None
        ev_from = self.index.oldest
        if oldest > ev_from:
            self.index.release(oldest)
            self.semantics.on_append(AppendResult(self.index.next_handle, 0, ev_from, self.index.oldest),
                                     version=None, priorities=None)
            note = (f"Conduit stored none of this batch; the {oldest - ev_from} oldest items it evicted to make room "
                    f"stay evicted (shards had already reused their space).")
            if hasattr(error, "add_note"):  # (Python 3.11+; on 3.10 the log line below is all there is)
                error.add_note(note)
            log.warning("%s", note)
        return True

    # -- delivery ---------------------------------------------------------------------------------
    def deliver(self, n: int | None = None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        """The next batch for the learner (replay: ``n`` draws; on-policy: the next minibatch).

        Replay draws never return a lost item (a draw that lands on one is redrawn, so draws
        stay uniform, or proportional to priority, over the items that survive; a prioritized
        batch's probabilities and weights are then all computed over the survivors). An
        on-policy minibatch leaves out the items lost since its rollout was ingested
        (each survivor is still delivered exactly once per epoch); a minibatch whose items
        were all lost is skipped (the next one is delivered in its place; the lost items
        are in :attr:`losses`), except the rollout's last, which then comes back empty with
        ``info.last`` set, so the learner still sees the rollout end. The same holds under a
        prefetching scheduler. An on-policy delivery whose read fails (e.g. :class:`RemoteTimeoutError`)
        has consumed its minibatch (it is not delivered again), and releases it as a delivered one.

        Raises:
            EmptyBufferError: nothing to deliver.
            CapacityError: a draw without replacement larger than the live contents.
            StaleExperienceError: on-policy data too stale and ``on_stale="raise"``.
        """
        self._check_open()
        t0 = time.perf_counter()
        if len(self.losses) != self._losses_seen:
            # a prefetching scheduler may hold batches read before the loss, with items now reported lost
            # (LossReport.lost: never delivered again): drop them, so they are drawn and read again
            self._losses_seen = len(self.losses)
            with self._lock.scheduler_call():
                self.scheduler.invalidate("contents")
        try:
            with self._lock.scheduler_call():  # (on_loss runs after it: not under the scheduler's delivery lock)
                batch, info = self.scheduler.deliver(n, **kwargs)
        except BaseException:  # the caller waited for the call all the same (e.g. for a shard until the timeout)
            self.telemetry.record("deliver_wait", 0, 0, t0, time.perf_counter())  # (no items: none delivered)
            raise
        self.telemetry.record("deliver_wait", batch.batch_size, 0, t0, time.perf_counter())  # the caller's whole call
        return batch, info

    def deliver_now(self, n: int | None = None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        """Select and read now (the scheduler's primitive). A call that raises records its ``deliver`` span all the
        same, with no items (see :meth:`ingest_now`)."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._check_open()
                if self._replay:
                    batch, info = self._deliver_replay(n, **kwargs)
                else:
                    batch, info = self._deliver_on_policy(n, **kwargs)
            if self.device.type != "cpu":
                batch = batch.to(self.device, non_blocking=True)
        except BaseException:
            self.telemetry.record("deliver", 0, 0, t0, time.perf_counter())  # (no items: none delivered)
            raise
        self.telemetry.record("deliver", batch.batch_size, batch.nbytes(), t0, time.perf_counter())
        return batch, info

    # -- primitives for prefetching schedulers (as ExperienceDataPlane's) ----------------------------
    def select_now(self, sizes: Sequence[int | None], *, peek: bool = False, when: Callable[[], bool] | None = None,
                   **kwargs: Any) -> list[Selection] | None:
        """Select ``len(sizes)`` deliveries in order, as that many deliveries would (nothing read or released).

        ``peek`` restores the semantics' state afterwards; ``when`` is checked under the same
        lock first (None is returned, nothing selected, when it is false).
        """
        with self._lock:
            self._check_open()
            if when is not None and not when():
                return None
            return select_many(self.semantics, sizes, peek=peek, **kwargs)

    def read_locked(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` under the buffer's lock and return its result (as ``ExperienceDataPlane.read_locked``).

        It is the lock ``ingest_now``, ``deliver_now`` and ``select_now`` hold while they change the index and
        the semantics: ``fn`` sees them between two such steps, never part way through one. The lock is
        re-entrant; keep ``fn`` short (it holds up ingestion and delivery).

        Raises:
            ConfigurationError: the buffer is closed (as ``select_now`` is refused then); ``fn`` did not run.
        """
        with self._lock:
            self._check_open()
            return fn()

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The plane's re-entrant lock, as a context manager (as :attr:`conduit.ExperienceDataPlane.lock`)."""
        return self._lock

    def holds_lock(self) -> bool:
        """Whether the calling thread holds the buffer's lock (as ``ExperienceDataPlane.holds_lock``: a scheduler
        refuses a call there that would wait for its worker thread, which needs this lock)."""
        return lock_held(self._lock)

    def gather_now(self, selections: Sequence[Selection],
                   out: Mapping[str, torch.Tensor] | Callable[[int], Mapping[str, torch.Tensor]] | None = None,
                   *, replace: bool = True, beta: float | None = None, skip_lost: bool = True) -> ExperienceBatch:
        """Read the rows of ``selections`` from the shards, back to back (fixed fields into ``out``).

        Replay selections are read together: each shard gets one request for all of their rows
        on it, however many selections (a prefetch chunk, or several learners' batches) there are.

        A selection is updated in place to what was read: replay draws that landed on lost
        items are redrawn (``replace``, ``beta`` as drawn); an on-policy selection loses its
        lost items, and with ``skip_lost`` (the selections are real, not a prefetch's
        prediction) the last selection, when its items were all lost, becomes the
        semantics' next minibatch, as :meth:`deliver` skips it.

        A call that raises records its ``deliver`` span all the same, with no items (see :meth:`ingest_now`).
        """
        t0 = time.perf_counter()
        try:
            batch = self._gather_now(selections, out, replace, beta, skip_lost)
        except BaseException:
            self.telemetry.record("deliver", 0, 0, t0, time.perf_counter())  # (no items: none read)
            raise
        self.telemetry.record("deliver", batch.batch_size, batch.nbytes(), t0, time.perf_counter())
        return batch

    def _gather_now(self, selections: Sequence[Selection],
                    out: Mapping[str, torch.Tensor] | Callable[[int], Mapping[str, torch.Tensor]] | None,
                    replace: bool, beta: float | None, skip_lost: bool) -> ExperienceBatch:
        """:meth:`gather_now`'s read, without its telemetry."""
        with self._callbacks.deferring(), self._lock:  # (a scheduler's primitive: see LossCallbacks.deferring)
            self._check_open()
            total = sum(int(s.slots.shape[0]) for s in selections)
            bufs = out(total) if callable(out) else out
            row, took, grown = 0, 0, False

            def view(k: int) -> Mapping[str, torch.Tensor] | None:
                """Rows ``[row, row + k)`` of the buffers (the selection being read takes ``k`` rows)."""
                nonlocal bufs, took, grown
                took = k
                fixed = self.schema.fixed
                if bufs is not None and callable(out) and any(bufs[n].shape[0] < row + k for n in fixed):
                    bufs, grown = out(row + k), True  # a skipped minibatch was followed by a larger one
                if bufs is None or any(bufs[n].shape[0] < row + k for n in fixed):
                    return None
                return {n: bufs[n][row:row + k] for n in fixed}

            if self._replay:  # every selection's rows in one read: one request per shard, not per selection
                batch = self._read_replay(list(selections), replace, beta, view(total))
            else:
                parts = []
                for i, sel in enumerate(selections):  # only the latest may be replaced by the semantics' next one
                    parts.append(self._read_on_policy(sel, view, skip_lost=skip_lost and i == len(selections) - 1))
                    row += took
                shrunk = grown or any(p.batch_size != int(s.slots.shape[0])
                                      for p, s in zip(parts, selections, strict=True))
                batch = parts[0] if len(parts) == 1 else concat(self.schema, parts, None if shrunk else bufs)
        return batch

    def prepare_now(self, sizes: Sequence[int | None],
                    out: Mapping[str, torch.Tensor] | Callable[[int], Mapping[str, torch.Tensor]] | None = None, *,
                    peek: bool = False, when: Callable[[], bool] | None = None,
                    **kwargs: Any) -> tuple[ExperienceBatch, list[Selection]] | None:
        """:meth:`select_now` and :meth:`gather_now` under one lock hold (no ingestion in between). A call that
        raises records its ``deliver`` span all the same, with no items (see :meth:`ingest_now`)."""
        t0 = time.perf_counter()
        with self._callbacks.deferring(), self._lock:  # (a scheduler's primitive: see LossCallbacks.deferring)
            try:
                sels = self.select_now(sizes, peek=peek, when=when, **kwargs)
            except BaseException:  # (a failed read records its span in gather_now)
                self.telemetry.record("deliver", 0, 0, t0, time.perf_counter())  # (no items: none selected)
                raise
            if sels is None:
                return None
            return self.gather_now(sels, out, replace=kwargs.get("replace", True), beta=kwargs.get("beta"),
                                   skip_lost=not peek), sels

    def release_now(self, selection: Selection, *, when: Callable[[], object] | None = None) -> None:
        """Tell the semantics a selection was handed over (on-policy frees a finished rollout here, and storage
        held back for the selection). ``when`` runs first, under the plane's lock (see
        :meth:`conduit.ExperienceDataPlane.release_now`)."""
        with self._lock:
            if when is not None:
                when()
            self._check_open()
            self.semantics.after_gather(selection)

    def _read_on_policy(self, sel: Selection, out: Callable[[int], Mapping[str, torch.Tensor] | None], *,
                        skip_lost: bool) -> ExperienceBatch:
        """Read an on-policy selection, leaving out its lost items (``sel`` is updated to what was read).

        ``out(k)`` gives the buffers for ``k`` rows (None: new memory). With ``skip_lost`` a
        minibatch whose items were all lost is skipped: it is released and the semantics'
        next minibatch takes its place in ``sel``, until one has a survivor or is the
        rollout's last (which then comes back empty, with ``info.last``, to end the rollout).
        """
        while True:
            handles = sel.info.handles.numpy().copy()
            k = handles.shape[0]
            asm = Assembly(self.schema, k, out(k))
            dropped = self.index.lost_mask(handles)
            dropped[self._fetch(handles, np.nonzero(~dropped)[0], asm)] = True
            if not skip_lost or not dropped.all() or sel.info.last or k == 0:
                break
            nxt = self.semantics.select(None)  # first: should it fail, ``sel`` is still the caller's to hand over
            self.semantics.after_gather(sel)
            sel.slots, sel.info = nxt.slots, nxt.info
        if not dropped.any():
            return asm.batch()
        keep = np.nonzero(~dropped)[0]
        sel.slots = sel.slots[torch.from_numpy(keep)]
        sel.info = dataclasses.replace(sel.info, handles=torch.from_numpy(handles[keep]))
        return asm.batch(keep)

    def _deliver_replay(self, n: int | None, *, replace: bool = True, beta: float | None = None, **kw: Any
                        ) -> tuple[ExperienceBatch, SampleInfo]:
        sel = self.semantics.select(n, replace=replace, beta=beta, **kw)
        batch = self._read_replay([sel], replace, beta, None)
        return batch, sel.info

    def _read_replay(self, sels: list[Selection], replace: bool, beta: float | None,
                     out: Mapping[str, torch.Tensor] | None) -> ExperienceBatch:
        """Read replay selections' rows back to back, redrawing draws that land on lost items (each selection
        is updated to what was read). All selections are read together: one request per shard."""
        sizes = np.array([int(s.slots.shape[0]) for s in sels], dtype=np.int64)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        handles = np.concatenate([s.info.handles.numpy() for s in sels]) if sels else np.zeros(0, np.int64)
        asm = Assembly(self.schema, int(handles.shape[0]), out)
        todo = np.arange(handles.shape[0])
        losses, redrawn = len(self.losses), False
        for _ in range(_MAX_REDRAWS):
            lost = todo[self.index.lost_mask(handles[todo])]
            if lost.size:  # redrawn within each selection (a draw without replacement stays distinct there)
                redrawn = True
                for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
                    mine = lost[(lost >= a) & (lost < b)]
                    if mine.size:
                        sels[i], handles[a:b] = self._redraw(sels[i], handles[a:b], mine - a, replace, beta)
                continue
            todo = self._fetch(handles, todo, asm)
            if not todo.size:
                break
        else:
            raise DistributedError(f"Draws kept landing on lost items after {_MAX_REDRAWS} redraws; the buffer has "
                                   f"lost nearly everything ({len(self.index)} items left).")
        for s, a, b in zip(sels, starts.tolist(), ends.tolist(), strict=True):
            s.info = dataclasses.replace(s.info, handles=torch.from_numpy(handles[a:b].copy()))
        if redrawn or len(self.losses) != losses:
            self._reweigh(sels, beta)
        return asm.batch()

    def _reweigh(self, sels: list[Selection], beta: float | None) -> None:
        """Probabilities and importance weights of prioritized draws, against the priorities of now.

        A draw made before a loss was accounted had them computed with the lost items' priorities in the
        total; the draws that replaced its lost ones have them without. Every draw of a batch is a draw from
        the survivors, so all of them get the survivors' values (as one draw after the loss would).
        """
        sampler = getattr(self.semantics, "sampler", None)
        if not isinstance(sampler, PrioritizedSampler):
            return
        for sel in sels:
            info = sel.info
            if info.probabilities is None or info.weights is None or not sel.slots.numel():
                continue
            leaf = sampler.priorities(sel.slots.numpy().astype(np.int64))
            live = torch.from_numpy(leaf > 0)  # (a priority set to 0 since the draw keeps its values)
            if not live.any():
                continue
            probs, weights = sampler.weigh(np.where(leaf > 0, leaf, 1.0), beta)
            info.probabilities[live] = torch.from_numpy(probs).to(info.probabilities.dtype)[live]
            info.weights[live] = torch.from_numpy(weights).to(info.weights.dtype)[live]

    def _redraw(self, sel: Selection, handles: np.ndarray, pos: np.ndarray, replace: bool, beta: float | None
                ) -> tuple[Selection, np.ndarray]:
        """Replace the draws at ``pos`` by fresh draws (the items they named are lost)."""
        if len(self.index) == 0:
            raise EmptyBufferError("Every item of the buffer was lost with its shards; ingest experience again.")
        assert isinstance(self.semantics, Replay)
        sampler = self.semantics.sampler
        window = self.index.next_handle - self.index.oldest
        if replace and isinstance(sampler, UniformSampler) and 4 * len(self.index) < window:
            # fewer than a quarter of the window survive: redrawing over the window would keep landing on
            # lost items (and give up after _MAX_REDRAWS), so draw uniformly among the survivors directly
            # (with the sampler's generator: its draw state still covers every draw)
            live = self.index.live_handles()
            pick = live[torch.randint(0, live.shape[0], (int(pos.shape[0]),), generator=sampler._gen).numpy()]
            new = Selection(torch.from_numpy(pick % self.capacity), SampleInfo(handles=torch.from_numpy(pick)))
        elif replace:
            new = self.semantics.select(int(pos.shape[0]), replace=True, beta=beta)
        else:
            live = self.index.live_handles()
            fresh = np.setdiff1d(live, handles, assume_unique=False)
            if fresh.shape[0] < pos.shape[0]:
                raise CapacityError(f"Cannot draw {handles.shape[0]} distinct items: only {live.shape[0]} survive "
                                    f"the loss of shards.")
            # the sampler's generator, not one seeded by the draw: a redraw that depends on the handles drawn
            # favours some survivors (the draws would not be uniform over the items that survive)
            gen = sampler._gen if isinstance(sampler, UniformSampler) else \
                torch.Generator().manual_seed(int(handles.sum()) & 0x7FFFFFFF)
            pick = fresh[torch.randperm(fresh.shape[0], generator=gen)[:pos.shape[0]].numpy()]
            new = Selection(torch.from_numpy(pick % self.capacity), SampleInfo(handles=torch.from_numpy(pick)))
        handles = handles.copy()
        handles[pos] = new.info.handles.numpy()
        info = sel.info
        t = torch.from_numpy(pos)
        if info.weights is not None and new.info.weights is not None:
            info.weights[t] = new.info.weights
        if info.probabilities is not None and new.info.probabilities is not None:
            info.probabilities[t] = new.info.probabilities
        sel.slots[t] = new.slots
        return sel, handles

    def _deliver_on_policy(self, n: int | None, **kw: Any) -> tuple[ExperienceBatch, SampleInfo]:
        sel = self.semantics.select(n, **kw)
        try:
            batch = self._read_on_policy(sel, lambda k: None, skip_lost=True)
        finally:
            # handed over exactly once, also when the read failed (the minibatch is consumed then): an
            # outstanding selection would hold back the storage of every later rollout for ever
            self.semantics.after_gather(sel)
        return batch, sel.info

    def _fetch(self, handles: np.ndarray, pos: np.ndarray, asm: Assembly) -> np.ndarray:
        """Read the items at positions ``pos`` of ``handles`` into ``asm``; returns positions not read.

        A shard that fails is lost (and its replicas elsewhere are read instead); positions
        returned are those whose items have no live replica left.

        Raises:
            DistributedError: reads kept failing on shards already fenced (the index names a
                lost shard for some items): a bound, so that such a state never loops forever.
        """
        for _ in range(self.num_shards + 1):  # every round that fails fences a shard: more rounds cannot help
            if not pos.size:
                return pos
            h = handles[pos]
            lost = self.index.lost_mask(h)
            if lost.any():
                return pos[lost] if lost.all() else np.concatenate([pos[lost], self._fetch(handles, pos[~lost], asm)])
            rows = self.index.segments_of(h)
            shard, local = self.index.replicas(rows, h)
            cost = np.where(shard >= 0, self._read_cost[np.maximum(shard, 0)], np.inf)
            col = np.argmin(cost, axis=1)
            pick = shard[np.arange(h.shape[0]), col]
            loc = local[np.arange(h.shape[0]), col]
            calls: dict[int, Any] = {}
            by_torch: dict[int, np.ndarray] = {}
            groups: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            for s in np.unique(pick).tolist():
                sel = np.nonzero(pick == s)[0]
                uniq, inv = np.unique(loc[sel], return_inverse=True)
                groups[s] = (sel, inv)
                if self._uses_torch(s):
                    by_torch[s] = uniq
                else:
                    calls[s] = self.servers[s].actor.gather.remote(self.buffer_id, uniq)
            outs = self._torch_reads(by_torch) if by_torch else {}
            outs.update(wait_all(calls, self.timeout))
            stuck = self._settle({s: o for s, o in outs.items() if o.lost})
            if stuck:
                raise RemoteTimeoutError(f"Shards {sorted(stuck)} answer health checks but did not deliver within "
                                         f"{self.timeout:g} s (overloaded, or unreachable for a moment). "
                                         f"Deliver smaller batches or raise timeout.")
            failed = []
            for s, o in outs.items():
                sel, inv = groups[s]
                if o.ok:
                    part = o.value if isinstance(o.value, ExperienceBatch) else from_wire(o.value, self.schema)
                    if part.batch_size == sel.shape[0]:  # no repeats: write rows straight to their positions
                        dest = np.empty_like(sel)
                        dest[inv] = pos[sel]
                        asm.put(dest, part)
                    else:
                        asm.put(pos[sel], part.select(torch.from_numpy(inv.astype(np.int64))))
                elif o.lost:
                    failed.append(sel)
                else:
                    if isinstance(o.error, ConduitError):
                        raise o.error
                    raise DistributedError(f"Shard {s} failed to read items: {o.error}") from o.error
            pos = pos[np.concatenate(failed)] if failed else pos[:0]
        if not pos.size:
            return pos
        raise DistributedError(f"{pos.size} items could not be read: their shards failed after being fenced, so the "
                               f"buffer's index names a lost shard for them. Report this as a bug; rebuild the buffer "
                               f"from a checkpoint to continue.")

    def _torch_reads(self, reads: dict[int, np.ndarray]) -> dict[int, Outcome]:
        """Read rows from shards over the torch group: ``reads`` maps shard -> sorted local handles.

        Returns shard -> :class:`Outcome` holding the rows as an :class:`ExperienceBatch`,
        or the failure of the shard's call (a dead or hung peer: ``lost``). A receive that
        fails while the shard's call succeeded means the group broke between live peers:
        the group is retired and those shards are read through the object store.

        Rows that arrived whole are delivered without waiting for the shard's call to answer: both
        messages received mean its sends completed, so nothing of that transfer is left in flight, and a
        reply that comes late (a loaded cluster) neither fails the delivery nor retires the group. Only
        the calls of shards whose rows did not arrive are waited for (what is left of ``timeout``, at
        least 0.5 s), to tell a dead or hung peer from a transport failure.
        """
        g = self._torch
        assert g is not None
        deadline = time.monotonic() + self.timeout
        tags = {s: g.tags() for s in reads}
        refs = {s: self.servers[s].actor.gather_send.remote(self.buffer_id, uniq, g.group_id, tags[s])
                for s, uniq in reads.items()}
        # one waiter per shard: a peer that hangs must not hold up the others (their sends wait for
        # our receives and would time out on their side)
        pool = self._receivers()
        futs = {s: pool.submit(self._receive, g, s, int(uniq.shape[0]), tags[s]) for s, uniq in reads.items()}
        futures.wait(list(futs.values()), timeout=max(0.0, deadline - time.monotonic()))
        got: dict[int, ExperienceBatch] = {}
        failed: dict[int, BaseException] = {}
        for s, f in futs.items():
            if not f.done():
                failed[s] = TimeoutError(f"no rows from shard {s} within {self.timeout:.1f} s")
            elif f.exception() is not None:
                failed[s] = f.exception()  # type: ignore[assignment]
            else:
                got[s] = f.result()
        # (a shard's rows in hand prove its sends completed: its call's answer adds nothing, and waiting for a late
        # one turned delivered rows into a RemoteTimeoutError and retired a working group)
        outs: dict[int, Outcome] = {s: Outcome(b) for s, b in got.items()}
        pending = {s: ref for s, ref in refs.items() if s not in got}
        done = wait_all(pending, max(0.5, deadline - time.monotonic())) if pending else {}
        retry: dict[int, Any] = {}
        for s, o in done.items():
            # gloo closes every pair of a group after a timeout, and a peer's reset may leave the group
            # half-open: any failed transfer retires the group (ShardServers.torch_group(refresh=True)
            # forms a new one)
            why = failed.get(s) or o.error
            if g.broken is None:
                g.broken = f"a transfer from shard {s} failed: {why}"
                log.warning("conduit: torch.distributed transport retired (%s); delivering through the object "
                            "store", g.broken)
            if o.lost or isinstance(o.error, ConduitError):
                outs[s] = o  # the peer died, hung, or refused: settled like any failed call
            else:  # the shard is fine, the transport failed: read its rows through the object store
                retry[s] = self.servers[s].actor.gather.remote(self.buffer_id, reads[s])
        if retry:
            outs.update(wait_all(retry, self.timeout))
        return outs

    def _receivers(self) -> futures.ThreadPoolExecutor:
        if self._recv_pool is None:
            self._recv_pool = futures.ThreadPoolExecutor(2 * self.num_shards, thread_name_prefix="conduit-recv")
            self._pools.append(self._recv_pool)
        return self._recv_pool

    def _receive(self, g: TorchGroup, shard: int, n: int, tag: int) -> ExperienceBatch:
        """Receive one shard's rows (ragged lengths first, then the packed columns); raises what gloo raises."""
        lengths = None
        if self.schema.ragged:
            lengths = g.empty((n, len(self.schema.ragged)), torch.int64)
            g.recv(lengths, shard, tag).wait()
            lengths = lengths.cpu()
        payload = g.empty((packed_nbytes(n, lengths, self.schema),), torch.uint8)
        g.recv(payload, shard, tag + 1).wait()
        return unpack_rows(payload.cpu(), n, lengths, self.schema)

    def read(self, handles: torch.Tensor | np.ndarray | Sequence[int]) -> ExperienceBatch:
        """The items named by ``handles``, in that order (for checkpoints and inspection).

        Raises:
            ConfigurationError: the handles are not integers.
            CapacityError: a handle is evicted or not yet assigned.
            ShardLostError: an item was lost with its shards.
        """
        raw = np.asarray(host_array(handles) if isinstance(handles, torch.Tensor) else handles)
        if raw.size and raw.dtype.kind not in "iu":  # a float handle must not be truncated to another item's
            raise ConfigurationError(f"Handles must be integers (the int64 handles ingest returned), got dtype "
                                     f"{raw.dtype}.")
        h = raw.astype(np.int64, copy=False).reshape(-1)
        with self._lock:
            self._check_open()
            bad = (h < self.index.oldest) | (h >= self.index.next_handle)
            if bad.any():
                raise CapacityError(f"{int(bad.sum())} handles are not live (live: [{self.index.oldest}, "
                                    f"{self.index.next_handle})); read only live handles.")
            asm = Assembly(self.schema, h.shape[0])
            missing = self._fetch(h, np.arange(h.shape[0]), asm)
            if missing.size:
                gone = h[missing]  # the report that names these items (none: lost in a load that stopped)
                report = next((r for r in reversed(self.losses) if np.isin(gone, r.lost).any()), None)
                raise ShardLostError(f"{missing.size} of the requested items were lost with their shards "
                                     f"(see .losses); read live_handles() instead.", report)
            return asm.batch()

    def live_handles(self) -> np.ndarray:
        """Handles of every item that can still be delivered, oldest first."""
        with self._lock:
            return self.index.live_handles()

    # -- priorities and on-policy control ---------------------------------------------------------
    def update_priorities(self, handles: torch.Tensor, priorities: torch.Tensor) -> int:
        """New priorities for delivered items, by handle; updates for evicted or lost items are ignored.

        Returns:
            How many handles were live and applied.

        Raises:
            PriorityError: NaN, infinite or negative priorities, or a length mismatch.
            ConfigurationError: the buffer is not prioritized.
        """
        if not isinstance(self.semantics, Replay):
            raise ConfigurationError("update_priorities needs Replay semantics with a PrioritizedSampler.")
        # (contiguous copies where the caller's arrays run backwards: torch takes no negative strides)
        h = torch.from_numpy(np.ascontiguousarray(PrioritizedSampler.check_handles(handles)))
        p = torch.from_numpy(np.ascontiguousarray(PrioritizedSampler.check(priorities)))  # typed PriorityError
        with self._lock:
            self._check_open()
            if self.index.lost_in_window() and h.shape[0] == p.shape[0]:
                live = (h >= self.index.oldest) & (h < self.index.next_handle)
                keep = torch.ones_like(h, dtype=torch.bool)
                if live.any():
                    lost = torch.from_numpy(self.index.lost_mask(h[live].numpy()))
                    keep[live.nonzero().reshape(-1)[lost]] = False
                h, p = h[keep], p[keep]
            applied = self.semantics.update_priorities(h, p)
        self.scheduler.invalidate("priorities")
        return applied

    def _on_policy(self) -> OnPolicy:
        if not isinstance(self.semantics, OnPolicy):
            raise ConfigurationError("This call needs OnPolicy semantics.")
        return self.semantics

    def seal(self) -> None:
        """Close the open on-policy rollout so it can be delivered."""
        sem = self._on_policy()
        self._check_open()
        self.scheduler.flush()
        with self._lock:
            self._check_open()
            sem.seal()

    def set_policy_version(self, version: int) -> None:
        """The learner's policy version (on-policy staleness is measured against it).

        Raises:
            ConfigurationError: ``version`` is not an integer (a NumPy or 0-d tensor integer is fine);
                the version is then unchanged.
        """
        sem = self._on_policy()
        v = check_version(version)
        with self._lock:
            self._check_open()
            sem.policy_version = v
        self.scheduler.invalidate("policy")

    def flush(self) -> None:
        """Block until every batch handed to ``ingest`` is in the shards (the scheduler's queue drained)."""
        t0 = time.perf_counter()
        try:
            self.scheduler.flush()
        finally:  # the caller's wait for the background writes (exposed time: see conduit.exposure)
            self.telemetry.record("flush_wait", 0, 0, t0, time.perf_counter())

    # -- faults (conduit.distributed.recovery) ----------------------------------------------------
    def check_health(self) -> list[LossReport]:
        """Ping every live shard once (at most ``timeout`` seconds) and probe its data thread; returns the losses
        this found (the shards that did not answer, those whose data thread has run nothing for ``stuck_after``
        seconds, and any that the re-replication of their items then found lost), in the order they were
        recorded in :attr:`losses`."""
        return recovery.check_health(self)

    def _settle(self, failed: dict[int, Outcome]) -> set[int]:
        """Decide which shards whose call failed are lost; returns those found alive (see :func:`recovery.settle`)."""
        return recovery.settle(self, failed)

    def _lose(self, shard: int, reason: str, *, found: list[LossReport] | None = None) -> LossReport | None:
        """Declare ``shard`` lost: fence it, account its items, restore replication (see :func:`recovery.lose`)."""
        return recovery.lose(self, shard, reason, found=found)

    def _replicate(self, rows: list[int]) -> int:
        """Give under-replicated segments the copies they lack; returns items copied (see
        :func:`recovery.replicate`)."""
        return recovery.replicate(self, rows)

    # -- checkpoint (conduit.distributed.checkpoint) ----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Live contents (read from the shards), handles, lost ranges and semantics state (RNG included).

        A shard lost while its items are read is fenced and its items are lost, as anywhere else: the
        checkpoint leaves them out (they are in :attr:`losses`).

        A ``"scheduler"`` entry is added when the scheduler has state to keep, as in
        :meth:`ExperienceDataPlane.state_dict` (e.g. :class:`~conduit.scheduling.Automatic`'s calibrated
        decision): a buffer whose scheduler is of the same kind goes on with it after :meth:`load_state_dict`.

        Raises:
            ConfigurationError: the buffer is closed (its partitions are gone): take the checkpoint before close().
        """
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (items go to the live shards; lost items stay lost).

        Its ``"scheduler"`` entry (absent in checkpoints of schedulers with nothing to keep) is applied, as by
        :meth:`ExperienceDataPlane.load_state_dict`, only when this buffer's scheduler is of the kind that saved
        it (e.g. a new ``Automatic`` takes the saved decision instead of calibrating); with another kind it is
        ignored. A load that stopped part way (``ClusterError``) does not apply it: load again.

        Raises:
            ConfigurationError: not a checkpoint of this buffer's kind, schema and capacity, or a damaged one
                (a damaged ``"scheduler"`` entry too; the buffer is unchanged).
            CapacityError: the checkpoint holds more items than the live shards can (the buffer is unchanged).
            ClusterError: loading stopped part way (the rest of the checkpoint is marked lost).
        """
        checkpoint.load_state_dict(self, state)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the monitor, drop this buffer's partitions, and stop the servers this buffer started.

        A call under way on another thread ends first (within its ``timeout`` bounds; it does not find the
        shards stopped under it, so no loss is reported for them). A health check under way (the monitor's, or
        :meth:`check_health` on another thread) records no loss once ``close()`` marked the buffer closed, and
        no ``on_loss`` callback runs once ``close()`` returned: it hands the reports recorded before it to
        ``on_loss`` and waits for a callback running on another thread (at most ``timeout + 5`` seconds, as for
        the monitor). Called under :meth:`read_locked`, it leaves those to the end of that hold (the callback
        may need the lock), as any call does. Closing again does nothing (but that wait); every other
        call that reads or changes the buffer is then refused (see the class docstring). A close that raised
        leaves the buffer open, as a single-node buffer's: the scheduler could not store what was handed over
        (its error is raised), so the monitor, the partitions and the servers are kept (nothing is dropped)
        and ``close()`` again retries. A buffer dropped without ``close()`` releases the same when it is
        garbage-collected (its threads end, its partitions are dropped and the servers it started are killed,
        without waiting for the servers' answers); what its scheduler still had queued is dropped.
        """
        if self._closed:
            self._settle_callbacks()
            return
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()  # stores what was handed over first; raises with the buffer still open
        # under the lock: a call under way on another thread (each of its remote calls bounded by ``timeout``)
        # ends before the shards stop, so it never finds them stopped under it and reports them lost; the calls
        # after it are refused as closed, and a health check under way records no loss (see _lose)
        with self._lock:
            closing = not self._closed
            self._closed = True
        if closing:
            self._stop.set()
            self._close_shards()
        self._settle_callbacks()

    def _settle_callbacks(self) -> None:
        """Hand the queued loss reports to ``on_loss`` and wait for a callback running on another thread (close()'s
        last step: no callback runs once it returned). Not when this thread holds the buffer's lock or is in a
        scheduler call: the callback may need those (the reports go when that hold ends, as for any call)."""
        if self._lock._is_owned() or self._callbacks.depth():
            return
        if not self._callbacks.wait_idle(self.timeout + 5):
            log.warning("conduit: close() returned while an on_loss callback still runs on another thread (it took "
                        "more than %.0f s)", self.timeout + 5)

    def _close_shards(self) -> None:
        # close() may run on the monitor thread itself (an on_loss callback that closes the buffer): that
        # thread stops on its own once this returns (_stop is set), and cannot be joined from inside
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=self.timeout + 5)
        if self._release.detach() is None:
            return  # the finalizer already released everything (it was run by hand)
        for pool in self._pools:
            pool.shutdown(wait=False)
        if self._owns_servers:
            self.servers.shutdown()
        elif ray_is_up():  # (after ray.shutdown() the servers, and this buffer's partitions, are gone already)
            try:
                with without_auto_init():
                    wait_all({s: self.servers[s].actor.close.remote(self.buffer_id) for s in self.alive_shards},
                             min(self.timeout, 10.0))
            except Exception:
                if ray_is_up():
                    raise
                # Ray was shut down while the partitions were being closed: they went with it

    def __enter__(self) -> DistributedDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _watch(ref: weakref.ref[DistributedDataPlane], stop: threading.Event, period: float) -> None:
    """The health monitor: check the plane's shards every ``period`` seconds until it is closed or dropped.

    It holds the plane only during a check, so a plane dropped without ``close()`` is freed
    (its finalizer sets ``stop``; a monitor that wakes to a freed plane ends too).
    """
    while not stop.wait(period):
        plane = ref()
        if plane is None or not ray_is_up():
            return  # dropped, or Ray was shut down (a ping now would start a new local Ray)
        try:
            with without_auto_init():  # (a ray.shutdown() on another thread may land during the check)
                plane.check_health()
        except Exception:  # noqa: BLE001 - the monitor must outlive transient errors
            if not ray_is_up():
                return  # Ray was shut down during the check: what failed was the call into it
            log.exception("conduit health check failed")
        finally:
            plane = None  # not held while waiting


def _release_dropped(stop: threading.Event, servers: ShardServers, owned: bool, buffer_id: str, alive: list[bool],
                     pools: list[futures.ThreadPoolExecutor]) -> None:
    """Release what a plane dropped without ``close()`` held (its finalizer; it must not hold the plane).

    Stops the monitor thread (at its next wake-up) and the receive threads, kills the servers the
    plane started, or asks shared servers to drop its partitions without waiting for the answer.
    It runs in the garbage collector, on whatever thread freed the plane: it never waits for a
    remote call and never raises (a server already gone, or Ray shut down, leaves nothing to release).
    """
    stop.set()
    for pool in pools:
        pool.shutdown(wait=False)
    if not ray_is_up():  # Ray was shut down: its actors went with it, and a call now would start a new Ray
        return
    try:
        with without_auto_init():  # (nor one after a ray.shutdown() on another thread that lands meanwhile)
            if owned:
                servers.shutdown()
            else:
                for s, up in enumerate(alive):
                    if up:
                        servers[s].actor.close.remote(buffer_id)
    except Exception:  # noqa: BLE001 - see above
        log.debug("conduit: releasing a dropped plane's shards failed", exc_info=True)


def _check_links(links: LinkProfile, nodes: Sequence[str]) -> None:
    """Refuse declared ``links`` that leave out a directed link between two of ``nodes``.

    Raises:
        ConfigurationError: a link is missing (named in the message).
    """
    missing = [(a, b) for a in dict.fromkeys(nodes) for b in dict.fromkeys(nodes) if (a, b) not in links.links]
    if missing:
        a, b = missing[0]
        raise ConfigurationError(f"The declared links name no link {a[:8]} -> {b[:8]} ({len(missing)} links "
                                 f"missing); declare every directed link between the servers' nodes and the "
                                 f"learner's node (same-node ones too), or leave links out to measure them.")


def _check_learner_measurable(node: str, servers: ShardServers | Sequence[str] | None) -> None:
    """Refuse to measure links for a ``learner_node`` that neither holds one of the servers nor is this process's
    node: :func:`~conduit.distributed.links.measure_links` probes only between those nodes, so no link to it would
    be measured and deliveries would be priced from other nodes' links. (``servers=None`` puts a server on every
    alive node, the learner's included.)

    Raises:
        ConfigurationError: no link to ``node`` can be measured (says what to pass instead).
    """
    if servers is None or isinstance(servers, (str, bytes)) or node == current_node_id():
        return
    nodes = servers.nodes if isinstance(servers, ShardServers) else list(servers)
    if node not in nodes:
        raise ConfigurationError(f"learner_node={node[:8]}... holds no shard server and is not this process's node, "
                                 f"so no link to it can be measured (links are probed between the servers' nodes and "
                                 f"this process's); deliveries would be priced from other nodes' links. Declare the "
                                 f"links to it (links=LinkProfile(...), e.g. measured by a process on that node), "
                                 f"put a server on it, or pass measure=False to rank shards by locality.")


def _check_torch_learner_node(node: str) -> None:
    """Refuse ``transport="torch"`` for a ``learner_node`` other than this process's node: the torch group delivers
    into this process (its rank 0), and its links are measured to this node, so the buffer would choose and price
    the torch path by links to a node the bytes never go to (a shard on this process's node priced as remote, one
    on ``learner_node`` as local, while its rows cross to this process).

    Raises:
        ConfigurationError: ``node`` is not this process's node (says what to do instead).
    """
    here = current_node_id()
    if node != here:
        raise ConfigurationError(f"transport='torch' delivers into this process (rank 0 of the torch.distributed "
                                 f"group, on node {here[:8]}...), not to learner_node={node[:8]}...; build the "
                                 f"buffer in the learner's process on that node (it forms its own group with the "
                                 f"servers), leave learner_node out, or use transport='object_store'.")


def _check_learner_node(node: Any, servers: ShardServers | Sequence[str] | None) -> None:
    """Refuse a ``learner_node`` that is no alive node id of this Ray cluster (a host name, an address, a shortened
    or dead node's id): the plan and the transport choice would price every shard as on another node, and the
    batches' locality would be silently lost. The node of a given server group is taken as it is.

    Raises:
        ConfigurationError: ``node`` is not the id of an alive node of the cluster.
    """
    if isinstance(servers, ShardServers) and isinstance(node, str) and node in servers.nodes:
        return
    if isinstance(node, str) and node:
        if node in {str(n.get("NodeID")) for n in ray_module().nodes() if n.get("Alive")}:
            return
    raise ConfigurationError(f"learner_node={node!r} is not the id of an alive node of this Ray cluster; pass the "
                             f"learner's node id (ray.get_runtime_context().get_node_id() in the learner's process, "
                             f"or one of conduit.distributed.alive_nodes()), or leave learner_node out for this "
                             f"process's node.")



