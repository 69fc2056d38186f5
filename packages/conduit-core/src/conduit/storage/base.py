"""The storage role: where the bytes of experience live, and how items map to slots.

Every storage is a FIFO ring of ``capacity`` slots. Items get consecutive *handles*
(int64 sequence numbers) in ingestion order; the live items are exactly the handles in
``[oldest, next_handle)``. A handle is stable: it names one item for its whole life and is
never reused, so it carries the slot's generation (``slot = handle % capacity``,
``generation = handle // capacity``). A handle below ``oldest`` names an evicted item.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from conduit.batch import ExperienceBatch, Ragged
from conduit.checks import is_int
from conduit.errors import CapacityError, ConfigurationError, SchemaError
from conduit.schema import ExperienceSchema

__all__ = ["Storage", "AppendResult", "ring_ordered", "MAX_HANDLE"]

#: the largest next handle a storage takes from a checkpoint: handles are int64 (torch.arange and the slot arithmetic)
MAX_HANDLE = 2**63 - 1


class AppendResult(NamedTuple):
    """What one append did: the handles it assigned and the handles it evicted."""

    #: first handle written; the batch got ``first .. first + n - 1``
    first: int
    #: number of items written
    count: int  # type: ignore[assignment]  # a field named like tuple.count, by design (public API)
    #: handles ``[evicted_from, evicted_to)`` were evicted to make room (empty range if none)
    evicted_from: int
    evicted_to: int


def handles_at(slots: torch.Tensor, oldest: int, capacity: int) -> torch.Tensor:
    """The handles of the items at ``slots`` of a ring of ``capacity`` whose oldest live handle is
    ``oldest``: for each slot the ``h`` with ``oldest <= h < oldest + capacity`` and ``h % capacity == slot``."""
    return oldest + torch.remainder(slots - oldest, capacity)


def ring_ordered(starts: torch.Tensor, lengths: torch.Tensor, head: int, pool: int) -> bool:
    """Whether items (in handle order) whose elements lie at ``starts`` with ``lengths`` in a ragged pool of ``pool``
    elements keep the ring invariant for the pool's ``head``: read circularly from the head, the items that hold
    elements come in handle order, apart, and none reaches over the head (what every append, release and truncate
    of a :class:`~conduit.storage.columnar.ColumnarStorage` keeps, and its eviction walk relies on)."""
    used = lengths > 0
    if not bool(used.any()):
        return True
    dist = torch.remainder(starts[used] - head, pool)  # how far past the head each item starts, going round
    ends = dist + lengths[used]
    return bool((dist[1:] >= ends[:-1]).all()) and int(ends[-1]) <= pool


class Storage(ABC):
    """Columnar FIFO ring storage on one tier.

    Contract for implementations:
      * ``append`` validates room before writing anything; on error the storage is unchanged.
      * ``append`` evicts the oldest items first (FIFO), and only when asked to (``evict=True``).
      * ``gather`` writes rows for ``slots`` into ``out`` (reused buffers) and never allocates
        for fixed fields; ragged fields come back as :class:`conduit.Ragged`.
      * ``state_dict``/``load_state_dict`` round-trip contents and handles exactly.
    """

    schema: ExperienceSchema
    capacity: int
    #: the torch device holding the columns (for sharded storage, the device of shard 0)
    device: torch.device
    #: a short tier name for reports: "host", "pinned", "gpu", "sharded", "disk", "remote"
    tier: str = "host"
    #: how many times :meth:`load_state_dict` replaced the contents: a copy of live items made before this count
    #: changed may not match the items the same handles name now (an online migration starts over then)
    rewrites: int = 0

    @property
    @abstractmethod
    def oldest(self) -> int:
        """Handle of the oldest live item (== ``next_handle`` when empty)."""

    @property
    @abstractmethod
    def next_handle(self) -> int:
        """Handle the next ingested item will get."""

    def __len__(self) -> int:
        return self.next_handle - self.oldest

    @abstractmethod
    def append(self, batch: ExperienceBatch, *, evict: bool = True) -> AppendResult:
        """Write ``batch`` after the newest item, evicting the oldest ones if needed and allowed.

        Raises:
            CapacityError: the batch cannot fit (even after eviction, or eviction is off).
        """

    def append_rows(self, columns: dict[str, Any]) -> AppendResult | None:
        """:meth:`append` (evicting as needed) of a batch still given as a dict of tensors, where this storage has
        a path that checks and stores it in one step; None, with nothing changed, where it has none or the batch
        does not fit it (the default): then validate the batch and :meth:`append` it."""
        return None

    @abstractmethod
    def gather(self, slots: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> ExperienceBatch:
        """Rows ``slots`` of every field, into ``out`` when given (shapes must match).

        Ragged fields come back in newly allocated tensors: the caller owns them.
        """

    def handles_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The handle of the live item at each slot (int64; slots must hold live items).

        Live handles are the consecutive range ``[oldest, next_handle)``, at most ``capacity``
        long, so the handle is computed, not looked up: no random memory access.
        """
        return handles_at(slots, self.oldest, self.capacity)

    @abstractmethod
    def release(self, upto: int) -> None:
        """Evict every live item with a handle below ``upto`` (consumed on-policy data)."""

    def state_dict(self) -> dict[str, Any]:
        """The live items in handle order, as host tensors, with the handle range."""
        slots = torch.remainder(torch.arange(self.oldest, self.next_handle, dtype=torch.int64), self.capacity)
        batch = self.gather(slots)
        data: dict[str, Any] = {}
        for name in self.schema:
            c = batch[name]
            data[name] = (c.values.cpu().clone(), c.lengths.clone()) if isinstance(c, Ragged) else c.cpu().clone()
        out = {"schema": self.schema.to_dict(), "capacity": self.capacity, "oldest": self.oldest,
               "next": self.next_handle, "data": data}
        layout = self.ragged_layout()
        if layout is not None:
            out["ragged_layout"] = layout
        return out

    def ragged_layout(self) -> dict[str, Any] | None:
        """Where the live items' ragged elements lie in their pools, for :meth:`state_dict` (None: no ragged pools).

        ``{"pool": elements per pool, "starts": {field: int64 start of each live item, in handle order},
        "heads": {field: where the next batch's elements go}}``. Which items a later append evicts to make
        room in a pool depends on this layout, so a checkpoint restores it (a packed pool would evict later,
        or not at all, where the saved buffer evicts: the contents, and so the draws, would part ways).
        """
        return None

    def checkpoint_layout(self, state: dict[str, Any], batch: ExperienceBatch) -> dict[str, Any] | None:
        """The ``"ragged_layout"`` of checkpoint ``state`` whose live items are ``batch``, checked; None when there is
        none (an older checkpoint, or no ragged fields), it was saved for a pool of another size (this storage's
        ``ragged_capacity`` differs) or its items do not keep the ring invariant (:func:`ring_ordered`; a
        checkpoint written before that was kept after a truncate): the items are then packed from the pool's start.

        Raises:
            ConfigurationError: the layout is damaged (not what :meth:`ragged_layout` returns, starts outside the
                pool, or items whose elements overlap).
        """
        layout = state.get("ragged_layout") if isinstance(state, Mapping) else None
        pool = getattr(self, "ragged_capacity", None)
        if layout is None or pool is None or not self.schema.ragged:
            return None
        if not (isinstance(layout, Mapping) and is_int(layout.get("pool")) and isinstance(layout.get("starts"), Mapping)
                and isinstance(layout.get("heads"), Mapping)):
            raise ConfigurationError("This checkpoint's ragged_layout is damaged (expected {'pool': int, 'starts': "
                                     "{field: tensor}, 'heads': {field: int}}); load an undamaged state_dict().")
        if layout.get("pool") != pool:
            return None
        starts: dict[str, torch.Tensor] = {}
        heads: dict[str, int] = {}
        ring = True
        for name in self.schema.ragged:
            st, head = layout["starts"].get(name), layout["heads"].get(name)
            ok = (isinstance(st, torch.Tensor) and st.dtype == torch.int64 and tuple(st.shape) == (batch.batch_size,)
                  and isinstance(head, int) and not isinstance(head, bool) and 0 <= head <= pool)
            if ok and batch.batch_size:
                col = batch[name]
                assert isinstance(st, torch.Tensor) and isinstance(col, Ragged)
                st = st.cpu()
                lens = col.lengths.cpu()
                ends = st + lens
                used = lens > 0
                order = torch.argsort(st[used])
                s_used, e_used = st[used][order], ends[used][order]
                ok = (bool((st >= 0).all()) and bool((ends <= pool).all())
                      and bool((s_used[1:] >= e_used[:-1]).all()))
                ring = ring and (not ok or ring_ordered(st, lens, int(head), pool))
            if not ok:
                raise ConfigurationError(f"This checkpoint's ragged_layout of field {name!r} is damaged (starts "
                                         f"must be {batch.batch_size} int64 positions whose items lie apart inside "
                                         f"the pool of {pool} elements, the head an int in [0, {pool}]); load an "
                                         f"undamaged state_dict().")
            assert isinstance(st, torch.Tensor) and isinstance(head, int)
            starts[name], heads[name] = st, head
        if not ring:  # sound, but a later eviction walk would miss items: packed instead
            return None
        return {"pool": pool, "starts": starts, "heads": heads}

    def check_ragged_fits(self, batch: ExperienceBatch) -> None:
        """:class:`CapacityError` when a ragged field of ``batch`` brings more elements than this storage's
        pool: such a batch can never be stored, whatever is evicted."""
        pool = getattr(self, "ragged_capacity", None)
        if pool is None:
            return
        for name in self.schema.ragged:
            col = batch[name]
            assert isinstance(col, Ragged)
            total = int(col.values.shape[0])
            if total > pool:
                raise CapacityError(f"Ragged field {name!r} brings {total} elements, more than its pool ({pool}); "
                                    f"split the batch or raise ragged_capacity.")

    def checkpoint_batch(self, state: dict[str, Any]) -> tuple[int, ExperienceBatch]:
        """Check that ``state`` (from :meth:`state_dict`) fits this storage; its oldest handle and live items
        (:meth:`checkpoint_contents` without the layout).

        Raises:
            ConfigurationError, CapacityError: as :meth:`checkpoint_contents`.
        """
        oldest, batch, _ = self.checkpoint_contents(state)
        return oldest, batch

    def checkpoint_contents(self, state: dict[str, Any]) -> tuple[int, ExperienceBatch, dict[str, Any] | None]:
        """Check that ``state`` (from :meth:`state_dict`) fits this storage; its oldest handle, live items and
        checked ragged layout (:meth:`checkpoint_layout`), each checked once: what :meth:`load_state_dict` uses.

        Everything is checked before anything is changed: a refused checkpoint leaves the storage as it was.

        Raises:
            ConfigurationError: the checkpoint has another schema or capacity, or is damaged (missing
                entries, a handle range that does not fit the capacity or lies beyond int64, items that do not match
                its schema, a damaged ragged layout).
            CapacityError: a ragged field's live elements exceed this storage's ragged pool.
        """
        try:
            fits = state["capacity"] == self.capacity and ExperienceSchema.from_dict(state["schema"]) == self.schema
            # handles are integers: a float (a damaged checkpoint) must not be truncated to another item's
            oldest, nxt = operator.index(state["oldest"]), operator.index(state["next"])
            count, data = nxt - oldest, state["data"]
            items = list(data.items())
        # (ConfigurationError from the schema included; LookupError: a schema entry that is a tensor or a NumPy scalar,
        # indexed by key; RuntimeError: a capacity that is a tensor of several values, whose truth torch refuses)
        except (LookupError, TypeError, AttributeError, ValueError, RuntimeError, OverflowError) as e:
            raise ConfigurationError(f"This is not a storage checkpoint ({type(e).__name__}: {e}); load the "
                                     f"'storage' part of a state_dict() this storage type wrote.") from e
        if not fits:
            raise ConfigurationError("This checkpoint was written by a storage with another schema or capacity; "
                                     "build the buffer with the same schema and capacity before loading.")
        if nxt > MAX_HANDLE:  # handles are int64: the ring's handle and slot arithmetic would overflow
            raise ConfigurationError(f"This checkpoint's live handles [{oldest}, {nxt}) lie beyond int64 (the next "
                                     f"handle may be at most {MAX_HANDLE}); the checkpoint is damaged.")
        if oldest < 0 or not 0 <= count <= self.capacity:
            raise ConfigurationError(f"This checkpoint's live handles [{oldest}, {oldest + count}) do not fit a "
                                     f"capacity of {self.capacity}; the checkpoint is damaged.")
        pool = getattr(self, "ragged_capacity", None)
        cols: dict[str, torch.Tensor | Ragged] = {}
        for name, v in items:
            if not isinstance(v, tuple):
                cols[name] = v
                continue
            if len(v) != 2:
                raise ConfigurationError(f"This checkpoint's ragged field {name!r} is a {len(v)}-tuple, not a "
                                         f"(values, lengths) pair; the checkpoint is damaged.")
            cols[name] = Ragged(v[0], v[1])  # tensors or not: checked by validate below
            total = int(v[0].shape[0]) if isinstance(v[0], torch.Tensor) and v[0].dim() else 0
            if pool is not None and total > pool:
                raise CapacityError(f"This checkpoint holds {total} elements of ragged field "
                                    f"{name!r}, more than this storage's pool ({pool}); build the buffer with "
                                    f"a ragged_capacity of at least that before loading.")
        batch = ExperienceBatch(cols, count)
        if count:
            try:
                batch.validate(self.schema)
            except (SchemaError, AttributeError, TypeError, IndexError) as e:  # a column that is not a tensor
                raise ConfigurationError(f"This checkpoint's {count} items do not match its schema ({e}); the "
                                         f"checkpoint is damaged.") from e
        # (checked here: a damaged layout is refused before anything changes)
        return oldest, batch, self.checkpoint_layout(state, batch)

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (handles included)."""

    def nbytes(self) -> int:
        """Bytes reserved for the columns."""
        return 0
