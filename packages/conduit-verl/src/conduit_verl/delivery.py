"""Delivery: verl's minibatch iteration, through Conduit.

In verl 0.9, ``TrainingWorker.train_mini_batch`` (actor and critic updates) receives its
data-parallel shard as one TensorDict and walks it with
``verl.utils.tensordict_utils.make_iterator``: ``epochs`` passes, each a DataLoader over the
row indices (shuffled with a generator seeded ``seed + dp_rank`` when the actor's
``shuffle`` is on), cut into minibatches of ``mini_batch_size``. One minibatch is one
optimizer step, so one rollout feeds ``M = ppo_epochs x train_batch / ppo_mini_batch``
updates.

:func:`conduit_make_iterator` takes that call's place (installed by the plugin, gated to
verl 0.9.x). It ingests the shard into an :class:`~conduit.ExperienceDataPlane` with
:class:`VerlOnPolicy` semantics (Conduit's on-policy freshness: every row once per epoch, M
minibatches per epoch, never across policy versions) whose per-epoch order is *exactly*
verl's, so the same data and seed give the same minibatches, hence the same losses and
gradients. Delivery granularity is one minibatch: ``g_del = 1/M``.

With ``prefetch`` (the default), :class:`MinibatchPrefetch` stages minibatch k+1 while
minibatch k trains: on a GPU the shard sits in page-locked host memory, dense columns are
gathered into page-locked buffers and every column is copied with ``non_blocking`` on a side
stream (jagged columns from the gather's fresh, pageable buffer), so ``forward_step``'s
``.to(device)`` finds them already there; on a CPU-only host the gather runs in a background
thread (no pinning, no streams).

When it is on: ``CONDUIT_VERL_DELIVERY`` = ``prefetch`` | ``sync`` | ``off`` decides when set;
otherwise it follows ``transfer_queue.backend.Conduit.delivery`` when this process's
TransferQueue backend is Conduit; otherwise verl's own iterator runs. A shard Conduit cannot
represent (a nested sub-TensorDict, a non-jagged nested tensor, a dtype it cannot gather rows of
such as ``uint16``) also goes to verl's own iterator, with one log line.
"""

from __future__ import annotations

import bisect
import inspect
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any, Literal, cast

import numpy as np
import torch
from conduit import (
    CapacityError,
    ConduitError,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    HostPlacement,
    OnPolicy,
    Ragged,
    SampleInfo,
    Scheduler,
    SchemaError,
)
from conduit.batch import ExperienceBatch
from conduit.scheduling.base import wait_refused
from conduit.scheduling.worker import Job, Worker
from conduit.schema import storable
from conduit.semantics.base import Selection, claim, release
from conduit.semantics.onpolicy import check_version
from conduit.storage import ColumnarStorage
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torch.utils.data import DataLoader, Dataset

from conduit_verl.packing import jagged

__all__ = [
    "VerlOnPolicy",
    "MinibatchPrefetch",
    "MinibatchDelivery",
    "conduit_make_iterator",
    "install",
    "uninstall",
    "delivery_mode",
    "forced",
    "ENV",
]

logger = logging.getLogger(__name__)

#: environment switch, read in every process: prefetch | sync | off
ENV = "CONDUIT_VERL_DELIVERY"
#: when set, every Conduit minibatch iteration writes a JSON record of itself there
TRACE_ENV = "CONDUIT_VERL_TRACE_DIR"
Mode = Literal["prefetch", "sync", "off"]
_MODES = ("prefetch", "sync", "off")


# -- semantics ---------------------------------------------------------------------------------
#: DataLoader arguments the per-rollout loader is built with (a ``dataloader_kwargs`` entry may not set them)
_LOADER_OWN = frozenset({"dataset", "batch_size", "generator", "collate_fn", "batch_sampler"})


class VerlOnPolicy(OnPolicy):
    """Conduit's on-policy semantics with verl's per-epoch row order.

    Each rollout gets a fresh ``torch.utils.data.DataLoader`` over its row indices, built as
    verl's ``make_iterator`` builds its own (a generator seeded with ``seed``, ``shuffle`` and
    the other ``dataloader_kwargs``); epoch ``e``'s order is that loader's ``e``-th pass, cut
    into M contiguous minibatches (sizes differ by at most one). When M divides the rollout
    size this reproduces verl's minibatches row for row.

    With ``seed=None`` the loader draws from torch's global RNG, as verl's does, and at the same
    moment: verl's loader starts epoch ``e`` (one global draw for the loader's base seed, one
    more when ``shuffle`` is on) when the consumer asks for that epoch's first minibatch, i.e.
    after the previous minibatch trained. So epochs after the first start on their first
    delivery, not when the previous epoch's last minibatch is selected
    (:attr:`starts_epochs_on_delivery`; :class:`MinibatchPrefetch` then stages nothing across
    an epoch boundary), and the same global RNG state gives the same order as verl's, and
    leaves the global RNG as verl's does, whatever the training in between draws. A prediction
    (``select_now(..., peek=True)``, which a multi-size real ``select_now`` makes before its
    selections) puts back the global RNG state its draws took, so each epoch's order is drawn
    from the global RNG once, by the real selection that starts it (the global RNG is the
    process's: a draw another thread makes during the prediction, which holds the buffer's lock,
    is undone with it). A delivery with ``n`` or options is refused (as :class:`~conduit.OnPolicy`
    refuses it) before an epoch waiting for its first delivery starts: it draws nothing.

    The loader runs the user's code (a ``sampler``, worker processes): a pass that raises is refused the same way, as
    a :class:`~conduit.ConfigurationError` chained to its error, and the retry draws that pass again.

    ``state_dict`` keeps how many of the current rollout's epoch orders were drawn and whether the
    next epoch waits for its first delivery; a load rebuilds a seeded loader and replays its passes
    to that point, so a checkpoint between epochs continues exactly. An unseeded loader draws each
    pass from the global RNG, as a fresh one does: its next pass is drawn from the RNG as it is then.

    ``dataloader_kwargs`` may not set what the loader is built with (``dataset``, ``batch_size``,
    ``generator``, ``collate_fn``, ``batch_sampler``), nor options torch's DataLoader refuses (an unknown one, or
    ones that do not work together): :class:`~conduit.ConfigurationError` at construction.
    """

    def __init__(self, *, num_minibatches: int, num_epochs: int = 1, max_staleness: int = 0,
                 on_stale: Literal["drop", "raise"] = "drop", seed: int | None = None,
                 dataloader_kwargs: dict[str, Any] | None = None) -> None:
        self._peeking = False
        self._peek_rng: torch.Tensor | None = None  # the global RNG state before a prediction's first draw (seed=None)
        super().__init__(num_minibatches=num_minibatches, num_epochs=num_epochs, max_staleness=max_staleness,
                         on_stale=on_stale, shuffle=False, seed=0 if seed is None else int(seed))
        kwargs = dict(dataloader_kwargs or {})
        own = sorted(k for k in kwargs if k in _LOADER_OWN)
        if own:  # DataLoader would raise a raw TypeError (or mis-cut the epoch) at the first minibatch
            raise ConfigurationError(f"dataloader_kwargs sets {own}, which the delivery sets itself (dataset, "
                                     f"batch_size from num_minibatches, generator from seed, collate_fn); pass the "
                                     f"others only (e.g. shuffle).")
        try:  # built as each rollout's loader is (building one draws nothing and starts no worker)
            DataLoader(cast("Dataset[torch.Tensor]", torch.arange(1)), batch_size=1, collate_fn=lambda x: x, **kwargs)
        except (TypeError, ValueError) as e:  # else a raw error at the first minibatch, maybe on the prefetch thread
            raise ConfigurationError(f"torch's DataLoader refuses dataloader_kwargs {kwargs!r}: {e}; pass only "
                                     f"DataLoader options that work together (e.g. shuffle).") from e
        self.loader_seed = seed
        self.dataloader_kwargs = kwargs
        self._orders: Generator[torch.Tensor, None, None] | None = None
        self._orders_drawn = 0  # passes drawn from the current rollout's loader
        self._deferred = False  # the next epoch starts on the next delivery (seed=None)

    @property
    def starts_epochs_on_delivery(self) -> bool:
        """True with ``seed=None``: an epoch after the first draws its order (from the global RNG) when its first
        minibatch is delivered, as verl's loader does, so nothing may select it ahead of that delivery."""
        return self.loader_seed is None

    def _start_epoch(self) -> None:
        if self.starts_epochs_on_delivery and self._epoch > 0 and not self._deferred:
            self._deferred = True  # started by the next select, when the consumer asks for the epoch
            return
        super()._start_epoch()

    @property
    def peeking(self) -> bool:
        """True while ``select_many`` predicts deliveries; when it ends, the global RNG draws the prediction made
        (``seed=None``) are given back, so the real selections draw those orders, once."""
        return self._peeking

    @peeking.setter
    def peeking(self, value: bool) -> None:
        if not value and self._peek_rng is not None:
            torch.set_rng_state(self._peek_rng)
            self._peek_rng = None
        self._peeking = bool(value)

    def select(self, n: int | None = None, **kwargs: Any) -> Selection:
        if n is not None or kwargs:  # refused below before anything changes: no deferred epoch starts (draws) for it
            return super().select(n, **kwargs)
        if self._deferred:
            if self._cur is not None and self.stale(self._cur.version):  # dropped (or refused) below: no order to draw
                if self.on_stale == "raise":
                    raise self.stale_error(self._cur.version)
                self._deferred = False
            else:
                super()._start_epoch()  # a refused order raises here and leaves the epoch deferred
                self._deferred = False
        return super().select(n, **kwargs)

    def drop_stale(self) -> int:
        """:meth:`OnPolicy.drop_stale`; a deferred epoch of a dropped rollout is not started."""
        cur = self._cur
        dropped = super().drop_stale()
        if cur is not None and self._cur is None:
            self._deferred = False
        return dropped

    def _epoch_orders(self, n: int) -> Generator[torch.Tensor, None, None]:
        gen = None
        if self.loader_seed is not None:
            gen = torch.Generator()
            gen.manual_seed(int(self.loader_seed))
        m = self.num_minibatches or 1
        size = n // m if n % m == 0 else -(-n // m)
        # a tensor is a map-style dataset at runtime (__getitem__/__len__), not in torch's stubs
        loader: DataLoader[torch.Tensor] = DataLoader(cast("Dataset[torch.Tensor]", torch.arange(n)),
                                                      batch_size=max(1, size), collate_fn=lambda x: x,
                                                      generator=gen, **self.dataloader_kwargs)
        while True:
            yield torch.cat([torch.stack(list(b)) if b else torch.empty(0, dtype=torch.int64) for b in loader])

    def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
        """The order verl's loader visits the rollout's items in epoch ``epoch`` (a fresh loader per rollout)."""
        if self._peeking and self.loader_seed is None and self._peek_rng is None:
            self._peek_rng = torch.get_rng_state()  # a prediction draws: given back when it ends (peeking setter)
        if epoch == 0 or self._orders is None:
            self._orders, self._orders_drawn = self._epoch_orders(n), 0
        self._orders_drawn += 1
        try:
            return next(self._orders)
        except ConduitError:
            raise
        except Exception as e:  # the user's loader (a sampler, a worker) failed: refused, so the pass is given back
            raise ConfigurationError(f"verl's DataLoader failed drawing epoch {epoch}'s order ({type(e).__name__}: "
                                     f"{e}); nothing was delivered: fix dataloader_kwargs (e.g. the sampler) or the "
                                     f"cause, then deliver again (the same order is drawn).") from e

    def release_loader(self) -> None:
        """End the current rollout's loader (and the worker processes ``num_workers`` with ``persistent_workers``
        keeps between passes), as verl's iterator ends its own when its iteration ends. The next rollout, or a
        :meth:`load_state_dict`, builds a fresh one; ``state_dict`` is unchanged."""
        orders, self._orders = self._orders, None
        if orders is not None:
            orders.close()  # the suspended pass lets its loader go now, not at a later collection

    def _start_epoch_checked(self) -> None:
        """Draw and cut the epoch; a refused order or cut (ConfigurationError) gives its loader pass back.

        The refused pass is undrawn: a seeded loader is rebuilt and replayed to the passes drawn before
        it, an unseeded one gets the global RNG state it drew from back, so the retry draws the very pass
        the refused start drew (what a buffer that was never refused draws) and ``orders_drawn`` is as
        it was.
        """
        orders, drawn = self._orders, self._orders_drawn
        rng = torch.get_rng_state() if self.loader_seed is None else None
        try:
            super()._start_epoch_checked()
        except ConfigurationError:
            if rng is not None:
                torch.set_rng_state(rng)
            # (a loader pass that raised ended its generator: a fresh one draws the next pass)
            ended = orders is not None and inspect.getgeneratorstate(orders) == inspect.GEN_CLOSED
            if orders is not None and orders is self._orders and self._cur is not None and (
                    self.loader_seed is not None or ended):
                orders = self._epoch_orders(self._cur.count)  # the loader in use drew the refused pass: replay it
                for _ in range(drawn if self.loader_seed is not None else 0):  # (unseeded: each pass draws anew)
                    next(orders)
            self._orders, self._orders_drawn = orders, drawn
            raise

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "orders_drawn": self._orders_drawn, "deferred": self._deferred}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        drawn, deferred = state.get("orders_drawn", 0), state.get("deferred", False)
        # the rollout being delivered has drawn one pass per epoch started (one more in a checkpoint of a version
        # where a refused start used one up): a larger count is damage, and replaying it would spin through that
        # many loader passes
        epoch = state.get("epoch")
        past = (state.get("cur") is not None and isinstance(drawn, int) and isinstance(epoch, int)
                and drawn > epoch + 2)
        if (isinstance(drawn, bool) or not isinstance(drawn, int) or drawn < 0 or not isinstance(deferred, bool)
                or past):
            raise ConfigurationError(f"This checkpoint's loader state (orders_drawn={drawn!r}, deferred={deferred!r}) "
                                     f"is damaged; load an undamaged state_dict().")
        super().load_state_dict(state)
        self._orders, self._orders_drawn, self._deferred = None, 0, deferred
        if self._cur is not None and drawn and self.loader_seed is not None:
            # the seeded loader's passes so far, replayed: its next pass is the one the saved buffer would draw
            self._orders = self._epoch_orders(self._cur.count)
            for _ in range(drawn):
                next(self._orders)
            self._orders_drawn = drawn


# -- scheduling --------------------------------------------------------------------------------
class _StageTicket:
    """One prefetch job's marks, read and set under the buffer's lock: whether a delivery cancelled it before it
    took that lock, and whether it took it."""

    __slots__ = ("cancelled", "entered")

    def __init__(self) -> None:
        self.cancelled = False
        self.entered = False


class MinibatchPrefetch(Scheduler):
    """Stages the next on-policy minibatch while the current one trains (or not, ``prefetch=False``).

    The staging of minibatch k+1 starts when minibatch k is handed out and never runs past
    the end of a rollout (nor past the end of an epoch when the semantics'
    ``starts_epochs_on_delivery`` is true), so nothing is selected that the learner will not
    receive, nor ahead of its time. On CUDA
    it runs on a side stream after the learner's stream has reached the hand-out point, its
    host-side wait keeps the page-locked gather buffers safe to reuse, and the learner's
    stream waits on it before use. Ingestion is synchronous. ``g_del`` is ``1/M`` of the
    rollout being delivered. The staging job draws under the buffer's lock: a delivery made while
    holding that lock (inside ``read_locked``) does not wait for a job still waiting for it, but
    cancels the job (which drew nothing) and draws the minibatch itself, the one the job would have.
    A delivery with ``n`` or options goes to the semantics as it is, past a pending job: on-policy
    semantics (the only ones whose deliveries it stages) refuse it, typed, before anything changes,
    so the staged minibatch stays the next one.
    """

    output_depth = 3

    def __init__(self, *, prefetch: bool = True) -> None:
        self.prefetch = prefetch
        # the staged minibatch takes a gather buffer of its own: one more keeps every handed-out
        # minibatch valid until the third one after it is handed out, as without prefetching
        self.output_depth = 4 if prefetch else 3
        self.g_ing = 1.0
        self.g_del = 1.0
        self._pool: Worker | None = None
        self._pending: Job[tuple[ExperienceBatch, SampleInfo, Any] | None] | None = None
        self._ticket = _StageTicket()  # the pending job's
        self._side: Any = None
        self.staged = 0

    def attach(self, edp: ExperienceDataPlane) -> None:
        super().attach(edp)
        self._cuda = edp.device.type == "cuda"
        if self._cuda:
            self._side = torch.cuda.Stream(device=edp.device)

    def ingest(self, batch: ExperienceBatch, *, version: int | None,
               priorities: torch.Tensor | None) -> torch.Tensor | None:
        return self.edp.ingest_now(batch, version=version, priorities=priorities)

    def _stage(self, after: Any, ticket: _StageTicket | None = None
               ) -> tuple[ExperienceBatch, SampleInfo, Any] | None:
        """Select and gather the next minibatch; as a prefetch job (``ticket``), under the buffer's lock, and
        nothing (None) when a delivery holding that lock cancelled it first (it drew the minibatch itself)."""
        with self.edp.lock:
            if ticket is not None:
                if ticket.cancelled:
                    return None
                ticket.entered = True
            if not self._cuda:
                batch, info = self.edp.deliver_now()
                return batch, info, None
            with torch.cuda.stream(self._side):
                if after is not None:
                    self._side.wait_event(after)
                batch, info = self.edp.deliver_now()
                done = torch.cuda.Event()
                done.record(self._side)
        done.synchronize()  # only this staging thread waits: the gather buffers are free again
        return batch, info, done

    def _job_waits_for_our_lock(self) -> bool:
        """Whether the pending prefetch job waits for the buffer's lock, which this thread holds (waiting for the
        job would never end)."""
        job = self._pending
        return job is not None and not job.done() and self.edp.holds_lock() and not self._ticket.entered

    def _cancel_waiting_job(self) -> None:
        """Cancel the pending prefetch job when it waits for the buffer's lock this thread holds (cancelled, it draws
        nothing)."""
        if self._job_waits_for_our_lock():
            self._ticket.cancelled = True
            self._pending = None

    def deliver(self, n: int | None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        if n is not None or kwargs:
            return self.edp.deliver_now(n, **kwargs)
        self._cancel_waiting_job()  # inside the buffer's lock (read_locked): drawn here, as a synchronous delivery
        if self._pending is not None:
            fut = self._pending
            try:
                # the job stays staged until it has ended: a wait interrupted here (Ctrl-C's KeyboardInterrupt) leaves
                # its minibatch (already selected) to the next delivery, instead of skipping it
                fut.wait()
                self._pending = None
                staged = fut.result()
            finally:
                del fut  # (a failed job holds its error, whose traceback holds this frame: no cycle through the job)
            assert staged is not None  # (only a cancelled job returns nothing, and it is no longer pending)
            batch, info, done = staged
        else:  # staged here (the first minibatch, or an epoch's first with seed=None): after the learner's work so far
            now = None
            if self._cuda:
                now = torch.cuda.Event()
                now.record(torch.cuda.current_stream(self.edp.device))
            staged_now = self._stage(now)
            assert staged_now is not None  # (no ticket: never cancelled)
            batch, info, done = staged_now
        if done is not None:
            cur = torch.cuda.current_stream(self.edp.device)
            cur.wait_event(done)
            for name in batch:
                col = batch[name]
                if isinstance(col, Ragged):  # allocated on the side stream, used on this one
                    col.values.record_stream(cur)
                    col.lengths.record_stream(cur)
        if info.num_minibatches:
            self.g_del = 1.0 / (info.num_minibatches * (getattr(self.edp.semantics, "num_epochs", 1) or 1))
        ends_epoch = info.num_minibatches is not None and info.minibatch == info.num_minibatches - 1
        if ends_epoch and getattr(self.edp.semantics, "starts_epochs_on_delivery", False):
            pass  # the next epoch's order is drawn on its first delivery, in the consumer's thread (seed=None)
        elif self.prefetch and not info.last:
            after = None
            if self._cuda:
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.edp.device))
            pool = self._pool  # (read once: a close() on another thread may drop it meanwhile)
            if pool is None:
                pool = self._pool = Worker("conduit-prefetch")
                weakref.finalize(self, pool.stop)  # dropped without close(): the thread ends
            self._ticket = _StageTicket()
            try:
                self._pending = pool.submit(self._stage, after, self._ticket)
            except ConfigurationError:
                pass  # the worker was stopped by a close() on another thread: nothing is staged; this minibatch
                # is handed over, and the next delivery is refused by the closed buffer
            else:
                self.staged += 1
        return batch, info

    def detach(self) -> None:
        """Forget the buffer once it is closed (a no-op while it is open). The buffer and its scheduler refer to each
        other, so without this a closed buffer (its copy of the rollout, page-locked on a GPU host, and its gather
        buffers) lived on after its owner let it go, until a garbage collection: one more per verl train step."""
        edp = getattr(self, "edp", None)
        if edp is not None and edp.closed:
            del self.edp

    def invalidate(self, reason: str = "contents") -> None:
        """A staged minibatch was selected before the change; it stays and is delivered next.

        (Policy changes are refused mid-rollout by :class:`MinibatchDelivery`, so a staged
        minibatch is never one the new policy would have dropped.)
        """

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Wait for the prefetch job, then stop its thread.

        Raises:
            ConfigurationError: called holding the buffer's lock (inside ``read_locked``) while the job waits for
                that lock (waiting would never end); nothing changes: close outside the lock.
        """
        if self._job_waits_for_our_lock():
            raise wait_refused("close()", "prefetch job (it draws the next minibatch)")
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception:  # surfaced to nobody: the iteration was abandoned
                pass
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


# -- TensorDict <-> ExperienceBatch ------------------------------------------------------------------
class _Codec:
    """How one verl shard maps onto a Conduit schema, and back."""

    def __init__(self, td: TensorDict) -> None:
        fields: dict[str, Field] = {}
        self.objects: list[str] = []
        self.consts: list[str] = []
        self.order: list[str] = []
        for key in td.keys():
            v = td.get(key)
            self.order.append(key)
            if isinstance(v, NonTensorData):
                self.consts.append(key)
            elif isinstance(v, NonTensorStack):
                self.objects.append(key)
            elif isinstance(v, torch.Tensor) and v.is_nested:
                fields[key] = Field(tuple(v.values().shape[1:]), v.dtype, ragged=True)
            elif isinstance(v, torch.Tensor):
                fields[key] = Field(tuple(v.shape[1:]), v.dtype)
        self.schema = ExperienceSchema(fields)

    @staticmethod
    def unsupported(td: TensorDict) -> str | None:
        """Why Conduit cannot carry this shard (None when it can)."""
        if len(td.batch_size) != 1:
            return f"batch_size {tuple(td.batch_size)} is not one-dimensional"
        has_tensor = False
        for key in td.keys():
            v = td.get(key)
            if isinstance(v, (NonTensorData, NonTensorStack)):
                continue
            if not isinstance(v, torch.Tensor):
                return f"field {key!r} is a {type(v).__name__}"
            has_tensor = True
            if not storable(v.dtype):
                return f"field {key!r} has dtype {v.dtype}, which Conduit storage cannot gather rows of"
            if v.is_nested:
                if v.layout != torch.jagged or cast(Any, v).lengths() is not None or getattr(v, "_ragged_idx", 1) != 1:
                    return f"field {key!r} is a nested tensor Conduit does not pack (layout/holes/ragged dim)"
                if any(d <= 0 for d in v.values().shape[1:]):
                    return f"field {key!r} has an empty trailing dimension"
            elif v.dim() == 0 or any(d <= 0 for d in v.shape[1:]):
                return f"field {key!r} has shape {tuple(v.shape)}"
        return None if has_tensor else "no tensor field"

    @staticmethod
    def _kind(v: Any) -> str:
        if isinstance(v, NonTensorData):
            return "constant"
        if isinstance(v, NonTensorStack):
            return "objects"
        return "jagged tensor" if isinstance(v, torch.Tensor) and v.is_nested else "tensor"

    def mismatch(self, td: TensorDict) -> str | None:
        """How ``td``'s columns differ from the first shard's (None when they match; dtypes and shapes are the
        schema's to check)."""
        kinds = {k: self._kind(td.get(k)) for k in td.keys()}
        want = {k: "constant" if k in self.consts else "objects" if k in self.objects else
                "jagged tensor" if self.schema[k].ragged else "tensor" for k in self.order}
        if kinds.keys() != want.keys():
            return (f"columns {sorted(kinds)}, the first shard's {sorted(want)} (missing "
                    f"{sorted(want.keys() - kinds.keys())}, extra {sorted(kinds.keys() - want.keys())})")
        bad = [f"{k!r} is {kinds[k]}, was {want[k]}" for k in self.order if kinds[k] != want[k]]
        return "; ".join(bad) if bad else None

    def encode(self, td: TensorDict) -> tuple[ExperienceBatch, dict[str, list[Any]], dict[str, Any]]:
        n = int(td.batch_size[0])
        cols: dict[str, torch.Tensor | Ragged] = {}
        for key, f in self.schema.items():
            v = td.get(key)
            if f.ragged:
                offsets = v.offsets()
                cols[key] = Ragged(v.values()[int(offsets[0]):int(offsets[-1])], offsets.diff().to(torch.int64))
            else:
                cols[key] = v
        objects = {k: td.get(k).tolist() for k in self.objects}
        consts = {k: td.get(k) for k in self.consts}
        return ExperienceBatch(cols, n), objects, consts

    def decode(self, batch: ExperienceBatch, objects: dict[str, list[Any]], consts: dict[str, Any]) -> TensorDict:
        out: dict[str, Any] = {}
        for key in self.order:
            if key in self.schema:
                c = batch[key]
                if isinstance(c, Ragged):  # built as verl's index_select builds it: samples of one dimension
                    # record their min/max lengths, samples with trailing dimensions do not (so to_padded_tensor
                    # pads those to the minibatch's total length, as it does verl's)
                    out[key] = jagged(c.values, c.lengths, seqlens=c.values.dim() == 1)
                else:
                    out[key] = c
            elif key in objects:
                out[key] = NonTensorStack(*objects[key])
            else:
                out[key] = consts[key]
        return TensorDict(out, batch_size=[batch.batch_size])


def _constant(v: Any) -> Any:
    """The value a constant column (``NonTensorData``) carries."""
    return v.data if isinstance(v, NonTensorData) else v


def _same_constant(a: Any, b: Any) -> bool:
    """Whether two constant columns carry the same value (tensors and arrays by dtype, shape and elements, also inside
    dicts, lists and tuples)."""
    x, y = _constant(a), _constant(b)
    if x is y:
        return True
    # (== would ask a tensor or array inside a container for a truth value)
    if isinstance(x, dict) and type(x) is type(y):
        return x.keys() == y.keys() and all(_same_constant(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and type(x) is type(y):
        return len(x) == len(y) and all(_same_constant(u, v) for u, v in zip(x, y, strict=True))
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and bool(torch.equal(x.cpu(), y.cpu())))
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                and bool(np.array_equal(x, y)))
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # a value without a truthful ==: only the same object is the same
        return False


# -- the verl-facing object ----------------------------------------------------------------------
class MinibatchDelivery:
    """verl TensorDicts in, verl minibatch TensorDicts out, through one Conduit EDP.

    ``ingest`` takes a shard (one row per sample) produced by policy ``version``; ``seal``
    closes the rollout; ``minibatches`` yields every minibatch of every epoch of the oldest
    sealed rollout, as TensorDicts shaped like verl's own (dense columns dense, jagged
    columns jagged, objects and constants carried along). Staleness is
    ``policy_version - rollout_version`` and is enforced at delivery (``max_staleness``,
    ``on_stale``), as :class:`conduit.OnPolicy` defines it. With ``on_stale="raise"`` the refused
    rollout stays waiting (nothing is dropped unasked), so every delivery raises again until
    :meth:`drop_stale` drops the stale rollouts (counted in ``semantics.dropped_items``).

    A yielded minibatch's dense columns are reused buffers: valid until the third one after it.

    Keyword Args:
        num_minibatches: M per epoch.
        epochs: passes over each rollout.
        seed: the DataLoader generator seed (verl: ``seed + dp_rank``); None: torch's global RNG, drawn when
            verl's own loader draws it (see :class:`VerlOnPolicy`).
        dataloader_kwargs: verl's loader options (``shuffle``).
        prefetch: stage minibatch k+1 while k trains.
        device: where minibatches land (default: the current CUDA device if any, else CPU).
        capacity: rows the buffer holds, a limit: a shard that does not fit next to the rows not yet delivered is
            refused (CapacityError, the buffer unchanged). Default: the first shard's size, grown (to at least twice
            as many rows, every live row and the rollouts' progress kept) when a later shard does not fit, as a larger
            rollout, one put as several shards, or the next rollout ingested while one waits needs.
        ragged_capacity: packed elements per jagged column, a limit (default: sized from the first shard, and grown
            online when a later shard's sequences do not fit, as GRPO responses grow).

    The buffer (its columns, capacity and jagged pools) is built from the first shard with rows: an empty shard
    before it stores nothing and fixes nothing.
    """

    def __init__(self, *, num_minibatches: int, epochs: int = 1, seed: int | None = None,
                 dataloader_kwargs: dict[str, Any] | None = None, max_staleness: int = 0,
                 on_stale: Literal["drop", "raise"] = "drop", prefetch: bool = True,
                 device: torch.device | str | None = None, capacity: int | None = None,
                 ragged_capacity: int | None = None) -> None:
        self.semantics = VerlOnPolicy(num_minibatches=num_minibatches, num_epochs=epochs, max_staleness=max_staleness,
                                      on_stale=on_stale, seed=seed, dataloader_kwargs=dataloader_kwargs)
        self.scheduler = MinibatchPrefetch(prefetch=prefetch)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.capacity = capacity
        self.ragged_capacity = ragged_capacity
        self.edp: ExperienceDataPlane | None = None
        self.codec: _Codec | None = None
        self._segments: list[tuple[int, dict[str, list[Any]], dict[str, Any]]] = []
        self._firsts: list[int] = []
        #: the constant columns of the open rollout's shards (None before its first shard): one value per rollout
        self._open_consts: dict[str, Any] | None = None
        self._mid_rollout = False
        self.delivered = 0
        self._closed = False

    def _build(self, td: TensorDict) -> None:
        self.codec = _Codec(td)
        n = int(td.batch_size[0])
        cap = self.capacity or max(n, 1)
        rag = self.ragged_capacity
        if rag is None:
            totals = [int(td.get(k).values().shape[0]) for k, f in self.codec.schema.items() if f.ragged]
            rag = max(1, -(-max(totals, default=1) * cap // max(n, 1)))
        self.edp = ExperienceDataPlane(self.codec.schema, capacity=cap, semantics=self.semantics,
                                       placement=self._placement(), scheduler=self.scheduler,
                                       device=self.device, ragged_capacity=rag)

    def _placement(self) -> HostPlacement:
        return HostPlacement(pin_memory=self.device.type == "cuda")

    def _ingest(self, batch: ExperienceBatch, version: int) -> torch.Tensor | None:
        """Ingest ``batch``, growing what is default-sized when it does not fit, then retrying: the rows
        (``capacity=None``: :meth:`_grow`) and the jagged pools (``ragged_capacity=None``: conduit-core's online
        migration). Every live row is kept either way. An explicit ``capacity`` the rows do not fit is refused
        (CapacityError, the buffer unchanged)."""
        for _ in range(3):  # (at most the rows, then the pools, grow)
            assert self.edp is not None
            try:
                return self.edp.ingest(batch, version=version)
            except CapacityError as e:
                st = self.edp.storage
                if not isinstance(st, ColumnarStorage):
                    raise
                live = st.next_handle - st.oldest
                if live + batch.batch_size > st.capacity:  # out of slots (no pool helps)
                    if self.capacity is not None:
                        raise CapacityError(
                            f"MinibatchDelivery(capacity={self.capacity}) holds at most {self.capacity} rows: this "
                            f"shard's {batch.batch_size} rows do not fit next to the {live} rows not yet delivered. "
                            f"Deliver the waiting rollouts first (minibatches()), or build the delivery with a larger "
                            f"capacity= (or capacity=None, which grows as rollouts do). The buffer is unchanged."
                        ) from e
                    self._grow(live + batch.batch_size)
                    continue
                brought = [int(cast(Ragged, batch[k]).values.shape[0]) for k in self.edp.schema.ragged]
                if self.ragged_capacity is not None or not brought:
                    raise
                pool = st.ragged_capacity
            self.edp.migrate(self._placement(), ragged_capacity=2 * (pool + max(brought)))  # room for what is held
        assert self.edp is not None
        return self.edp.ingest(batch, version=version)

    def _grow(self, rows: int) -> None:
        """Rebuild the buffer (default capacity) with room for ``rows`` rows: at least twice its capacity.

        conduit-core's :meth:`~conduit.ExperienceDataPlane.migrate` keeps the capacity (a sampler's state may be keyed
        by slot, ``handle % capacity``). :class:`VerlOnPolicy` keys its rollouts, epochs and orders by handle only, so
        here a new buffer of the larger capacity takes the live rows at their handles (the storage's checkpoint, which
        lists them in handle order), the same semantics (rebound to the new storage: nothing of the rollouts'
        progress changes) and a scheduler holding the minibatch already staged, if any: the next delivery is the one
        it would have been. Jagged pools grow in proportion unless ``ragged_capacity`` fixes them. A failure before the
        swap (e.g. out of memory) leaves the old buffer in use, unchanged.
        """
        old, sched = self.edp, self.scheduler
        assert old is not None and isinstance(old.storage, ColumnarStorage)
        sched._cancel_waiting_job()  # (inside read_locked: the job drew nothing; the next delivery draws it)
        pending = sched._pending
        if pending is not None:
            pending.wait()  # its minibatch was drawn from the old buffer: it stays staged, for the next delivery
        st = old.storage
        cap = max(2 * st.capacity, rows)
        pool = self.ragged_capacity
        if pool is None and old.schema.ragged:
            pool = -(-st.ragged_capacity * cap // st.capacity)
        state = {**st.state_dict(), "capacity": cap}
        scheduler = MinibatchPrefetch(prefetch=sched.prefetch)
        release(self.semantics)  # (handed over to the new buffer: the old one is closed once it is built)
        try:
            edp = ExperienceDataPlane(old.schema, capacity=cap, semantics=self.semantics, placement=self._placement(),
                                      scheduler=scheduler, device=self.device, ragged_capacity=pool)
            try:
                edp.storage.load_state_dict(state)
            except BaseException:
                edp.close()
                scheduler.detach()
                raise
        except BaseException:
            self.semantics.bind(st)
            claim(self.semantics, old)
            raise
        scheduler._pending, scheduler._ticket = sched._pending, sched._ticket
        scheduler.staged, scheduler.g_del = sched.staged, sched.g_del
        sched._pending = None
        edp.telemetry = old.telemetry
        self.edp, self.scheduler = edp, scheduler
        old.close()  # (its scheduler has nothing pending: it stops its thread)
        sched.detach()

    def ingest(self, td: TensorDict, *, version: int) -> None:
        """Add a shard produced by policy ``version`` to the open rollout.

        A refused shard changes nothing: a refused first shard does not fix the columns or the capacity. Nor does an
        empty shard before the first shard with rows (it has no rows to size the buffer by, and none to store; its
        version is checked).

        A minibatch carries one value of a constant column (``NonTensorData``, e.g. ``temperature``), and its rows may
        come from any shard of the rollout, so every shard of a rollout must carry the same constants. A shard of
        another ``version`` than the open rollout's opens a rollout of its own (on-policy semantics seal the open
        one), with constants of its own.

        Raises:
            SchemaError: the shard's columns differ from the first shard's, or a constant column's value differs
                from the open rollout's earlier shards (seal the rollout first, or put it as a per-row column).
            CapacityError: it does not fit next to the undelivered rollouts.
            ConfigurationError: a shard Conduit cannot carry, or called after :meth:`close`.
        """
        self._check_open()
        why = _Codec.unsupported(td)
        if why is not None:
            raise ConfigurationError(f"Conduit cannot carry this shard: {why}.")
        built = self.edp is None
        if built and int(td.batch_size[0]) == 0:
            self.semantics.check_ingest(0, version=version, priorities=None)
            return
        if built:
            self._build(td)
        assert self.edp is not None and self.codec is not None
        differs = self.codec.mismatch(td)
        if differs is not None:
            raise SchemaError(f"This shard's columns differ from the first shard's: {differs}; every shard carries "
                              f"the same columns, of the same kinds.")
        open_ = self.semantics.open_rollout
        try:  # whether the shard joins the open rollout (a shard of another version opens one of its own)
            joins = open_ is not None and open_[0] == check_version(version)
        except ConfigurationError:
            joins = False  # (refused by the ingest below)
        if joins and self._open_consts is not None:
            other = [k for k in self.codec.consts if not _same_constant(td.get(k), self._open_consts[k])]
            if other:
                raise SchemaError(
                    f"Constant column(s) {other} of this shard differ from the open rollout's earlier shards "
                    f"({', '.join(f'{k}={_constant(self._open_consts[k])!r}' for k in other)}); a minibatch carries "
                    f"one value of a constant and may mix the rollout's shards. seal() the rollout before a shard "
                    f"with other constants, or put the value as a per-row column (NonTensorStack).")
        try:
            batch, objects, consts = self.codec.encode(td)
            handles = self._ingest(batch, version)
        except BaseException:
            if built:  # the buffer was built for this shard: forget it, so the next first shard builds its own
                self.edp.close()
                self.scheduler.detach()
                self.edp, self.codec = None, None
            raise
        assert handles is not None
        first = int(handles[0]) if handles.numel() else self.edp.storage.next_handle
        self._firsts.append(first)
        self._segments.append((first, objects, consts))
        if not joins and handles.numel():  # this shard's rows opened a rollout (an empty shard opens none)
            self._open_consts = consts

    def seal(self) -> None:
        """Close the open rollout: it can be delivered (the next shard opens a rollout, with constants of its own)."""
        self._check_open()
        if self.edp is not None:
            self.edp.seal()
        self._open_consts = None

    def set_policy_version(self, version: int) -> None:
        """The learner's policy is now ``version`` (between rollouts only).

        Raises:
            ConfigurationError: called while a rollout is half delivered, or after :meth:`close`, or ``version`` is not
                an integer (a NumPy or 0-d tensor integer is fine), as :meth:`ExperienceDataPlane.set_policy_version
                <conduit.ExperienceDataPlane.set_policy_version>` refuses it; the version is then unchanged.
        """
        v = check_version(version)
        self._check_open()
        if self._mid_rollout:
            raise ConfigurationError("set_policy_version during a rollout's minibatches; finish the rollout first.")
        if self.edp is not None:
            self.edp.set_policy_version(v)
        else:  # (no buffer yet: the semantics it will be built with)
            self.semantics.policy_version = v

    def _rows(self, handles: torch.Tensor) -> tuple[dict[str, list[Any]], dict[str, Any]]:
        hs = handles.tolist()
        seg_i = [bisect.bisect_right(self._firsts, h) - 1 for h in hs]
        consts = self._segments[seg_i[0]][2] if hs else {}
        assert self.codec is not None
        objects = {k: [self._segments[s][1][k][h - self._segments[s][0]] for h, s in zip(hs, seg_i, strict=True)]
                   for k in self.codec.objects}
        return objects, consts

    def next_minibatch(self) -> tuple[TensorDict, SampleInfo]:
        """The next minibatch of the oldest sealed rollout.

        Raises:
            EmptyBufferError: no sealed rollout is waiting.
            StaleExperienceError: the rollout is too stale and ``on_stale="raise"``.
            ConfigurationError: called after :meth:`close`.
        """
        self._check_open()
        if self.edp is None:
            from conduit import EmptyBufferError

            raise EmptyBufferError("Nothing was ingested: ingest a shard and seal it.")
        assert self.codec is not None
        batch, info = self.edp.deliver()
        objects, consts = self._rows(info.handles)
        self._mid_rollout = not info.last
        self.delivered += 1
        if info.last:
            self._forget_before(self.edp.storage.oldest)
        return self.codec.decode(batch, objects, consts), info

    def drop_stale(self) -> int:
        """Drop the rollouts waiting for delivery that are too stale now (``max_staleness``), oldest first, as
        ``on_stale="drop"`` would: counted in ``semantics.dropped_items``, their rows freed. With ``on_stale="raise"``
        a refused delivery leaves the stale rollout waiting, so every delivery raises again: this is the way on.

        Returns:
            The rows dropped (0 when nothing is stale).

        Raises:
            ConfigurationError: called after :meth:`close`, or while a rollout is half delivered (it is fresh: the
                policy version changes only between rollouts).
        """
        self._check_open()
        if self._mid_rollout:
            raise ConfigurationError("drop_stale during a rollout's minibatches; finish the rollout first.")
        if self.edp is None:
            return 0
        dropped = self.edp.read_locked(self.semantics.drop_stale)
        self._forget_before(self.edp.storage.oldest)
        return dropped

    def _forget_before(self, handle: int) -> None:
        while len(self._segments) > 1 and self._segments[1][0] <= handle:
            self._segments.pop(0)
            self._firsts.pop(0)

    def minibatches(self) -> Iterator[tuple[TensorDict, SampleInfo]]:
        """Every minibatch of every epoch of the next rollout, in order."""
        while True:
            td, info = self.next_minibatch()
            yield td, info
            if info.last:
                return

    def _check_open(self) -> None:
        """:class:`~conduit.ConfigurationError` after :meth:`close` (also when no shard had built the buffer)."""
        if self._closed:
            raise ConfigurationError("This MinibatchDelivery is closed; build a new one.")

    def close(self) -> None:
        """Close the buffer (and stop the prefetch thread); every later call is refused (ConfigurationError)."""
        if self.edp is not None:
            self.edp.close()  # (a close refused inside read_locked leaves the delivery open)
            self.scheduler.detach()  # the closed buffer goes with this delivery, not at a later garbage collection
        self.semantics.release_loader()
        self._closed = True


# -- the hook ---------------------------------------------------------------------------------------
_ORIGINAL: Any = None
_FORCED: list[str] = []
_iterations = 0
_lock = threading.Lock()
_warned: set[str] = set()


def delivery_mode() -> Mode:
    """``prefetch``, ``sync`` or ``off`` for this process, right now (see the module docstring)."""
    if _FORCED:
        return _FORCED[-1]  # type: ignore[return-value]
    env = os.environ.get(ENV, "").strip().lower()
    if env:
        if env not in _MODES:
            raise ConfigurationError(f"{ENV}={env!r}; use one of {_MODES}.")
        return env  # type: ignore[return-value]
    try:
        import transfer_queue.interface as tqi

        from conduit_verl.tq_storage import ConduitStorageManager
    except ImportError:
        return "off"
    client = getattr(tqi, "_TQ_CLIENT", None)
    manager = getattr(client, "storage_manager", None)
    if isinstance(manager, ConduitStorageManager):
        mode = manager.delivery
        if mode not in _MODES:
            raise ConfigurationError(f"transfer_queue.backend.Conduit.delivery={mode!r}; use one of {_MODES}.")
        return mode  # type: ignore[return-value]
    return "off"


@contextmanager
def forced(mode: Mode) -> Iterator[None]:
    """Force the delivery mode in this process within the block (tests, in-process use)."""
    if mode not in _MODES:
        raise ConfigurationError(f"delivery mode {mode!r}; use one of {_MODES}.")
    _FORCED.append(mode)
    try:
        yield
    finally:
        _FORCED.pop()


def conduit_make_iterator(tensordict: TensorDict, mini_batch_size: int, epochs: int, seed: int | None = None,
                          dataloader_kwargs: dict[str, Any] | None = None) -> Iterator[TensorDict]:
    """Drop-in for ``verl.utils.tensordict_utils.make_iterator`` (same arguments, same minibatches).

    Unlike verl's, a minibatch's dense columns live in reused gather buffers: it stays as delivered while the next
    two minibatches are handed out, then a later one may overwrite it (jagged columns are fresh tensors). verl's
    one caller, ``TrainingWorker.train_mini_batch``, trains each minibatch before asking for the next; a caller that
    keeps minibatches longer must ``.clone()`` them.
    """
    mode = delivery_mode()
    why = None if mode == "off" else _Codec.unsupported(tensordict)
    empty = why is None and mode != "off" and int(tensordict.batch_size[0]) == 0
    if mode == "off" or why is not None or int(epochs) < 1 or empty:  # no epochs or rows: verl's yields nothing
        if why is not None and why not in _warned:
            _warned.add(why)
            logger.warning("Conduit delivery passes this shard to verl's iterator: %s.", why)
        return _verl_iterator()(tensordict, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs)
    n = int(tensordict.batch_size[0])
    if mini_batch_size <= 0 or n % mini_batch_size:
        raise ConfigurationError(f"{n} rows do not split into minibatches of {mini_batch_size}; verl needs "
                                 f"ppo_mini_batch_size x rollout.n divisible by the data-parallel size and dividing "
                                 f"the batch.")
    delivery = MinibatchDelivery(num_minibatches=n // mini_batch_size, epochs=int(epochs), seed=seed,
                                 dataloader_kwargs=dataloader_kwargs, prefetch=mode == "prefetch")
    delivery.ingest(tensordict, version=0)
    delivery.seal()
    return _iterate(delivery, mode)


def _verl_iterator() -> Any:
    if _ORIGINAL is not None:
        return _ORIGINAL
    import verl.utils.tensordict_utils as tu

    assert tu.make_iterator is not conduit_make_iterator
    return tu.make_iterator


def _iterate(delivery: MinibatchDelivery, mode: str) -> Iterator[TensorDict]:
    global _iterations
    t0 = time.perf_counter()
    count = 0
    try:
        for td, _info in delivery.minibatches():
            count += 1
            yield td
    finally:
        delivery.close()
        with _lock:
            _iterations += 1
            seq = _iterations
        trace_dir = os.environ.get(TRACE_ENV)
        if trace_dir and delivery.edp is not None:
            os.makedirs(trace_dir, exist_ok=True)
            rec = {"pid": os.getpid(), "seq": seq, "mode": mode, "minibatches": count,
                   "num_minibatches": delivery.semantics.num_minibatches, "epochs": delivery.semantics.num_epochs,
                   "g_del": delivery.scheduler.g_del, "staged": delivery.scheduler.staged,
                   "device": str(delivery.device), "seconds": time.perf_counter() - t0,
                   "telemetry": delivery.edp.telemetry.summary()}
            with open(os.path.join(trace_dir, f"delivery-{os.getpid()}-{seq}.json"), "w") as f:
                json.dump(rec, f)


def install() -> bool:
    """Route verl's minibatch iteration through :func:`conduit_make_iterator` (idempotent).

    Raises:
        UnsupportedVerlError: verl is not 0.9.x.
    """
    global _ORIGINAL
    from conduit_verl.compat import require_supported_verl

    require_supported_verl("conduit-verl's minibatch delivery")
    import verl.utils.tensordict_utils as tu

    if tu.make_iterator is conduit_make_iterator:
        return False
    _ORIGINAL = tu.make_iterator
    tu.make_iterator = conduit_make_iterator
    return True


def uninstall() -> None:
    """Give verl its own iterator back."""
    import verl.utils.tensordict_utils as tu

    if _ORIGINAL is not None and tu.make_iterator is conduit_make_iterator:
        tu.make_iterator = _ORIGINAL
