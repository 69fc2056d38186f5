"""One TransferQueue field's samples in Conduit storage, and their online migration.

Each tensor field lives in an :class:`~conduit.ExperienceDataPlane` over a columnar storage
with two columns: ``values`` (``Field((), dtype, ragged=True)``: every sample's elements
packed end to end in one pool) and ``shape`` (the per-sample shape row, see
:class:`~conduit_verl.packing.PackedColumn`). It uses :class:`conduit.OnPolicy` semantics
only because they never evict: nothing leaves a TransferQueue field unless TransferQueue
clears it. TransferQueue names samples by *global index*; the store maps each to a handle.

TransferQueue clears samples in any order, while Conduit storage frees its oldest items
first. Cleared samples are therefore marked dead and their slots come back once every older
sample is dead too.

**Migration** when a put does not fit:

* *Sequences grew* (GRPO responses get longer during training) and the packed pool is
  full: the field moves online to a placement with a larger pool, through conduit-core's
  :meth:`ExperienceDataPlane.migrate <conduit.ExperienceDataPlane.migrate>` (every sample
  keeps its handle and slot; nothing is lost, reordered or re-profiled). The pool sizes come
  from a :class:`PoolLadder` (size -> placement; geometric rungs, each computed when first needed).
* *More samples than slots* (or slots held by samples cleared out of order): core's
  migration keeps the slot count by design, so here the adapter copies the live samples,
  packed, into a store with enough slots (twice the samples the put needs, in this rung
  or a larger one) and re-maps their handles.
* *Dead samples fill the pool* (a sample cleared late pins the ring, so the pool would have
  to hold everything put since): at least half the pool's elements belong to cleared samples,
  so the live ones are compacted the same way instead of the pool growing. A field's memory
  thus follows what it holds, not what was put since its oldest live sample.

Every move to a larger placement is recorded as a :class:`Migration` (a compaction within the
same rungs is not).

A put is two steps, so that a storage unit can store several fields all or nothing:
:meth:`FieldStore.append` makes room (migrating when needed) and appends the samples after the
newest, where nothing reads them yet; :meth:`FieldStore.settle` then makes them the samples of
their global indexes, or :meth:`FieldStore.rollback` forgets them (and a re-slotting the
append made), leaving the field as it was.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    HostPlacement,
    OnPolicy,
    Ragged,
    SchemaError,
    Storage,
)
from conduit.batch import ExperienceBatch
from conduit.schema import same_width_integer, storable
from conduit.storage import ColumnarStorage

from conduit_verl.packing import PackedColumn
from conduit_verl.unit_errors import missing_key

__all__ = ["Rung", "PoolLadder", "MIN_GROWTH", "PoolPlacement", "Migration", "FieldStore", "Appended",
           "check_indexes", "kind_error", "dtype_error", "rank_error", "storage_dtype"]


def check_indexes(name: str, gis: list[int], held: Collection[int], max_items: int | None,
                  reserved: Collection[int] = ()) -> None:
    """Refuse a put of ``gis`` to field ``name``, which holds the indexes ``held``, that names a global index
    twice (:class:`SchemaError`) or would hold more than ``max_items`` samples (:class:`CapacityError`).

    ``reserved``: the indexes of the field that puts in flight (prepared, not yet committed) will store; they
    count against ``max_items`` as if stored.
    """
    if len(set(gis)) != len(gis):
        raise SchemaError(f"Field {name!r}: a put names a global index twice.")
    new_items = sum(1 for g in gis if g not in held and g not in reserved)
    in_flight = sum(1 for g in reserved if g not in held)
    if max_items is not None and len(held) + in_flight + new_items > max_items:
        flight = f" + {in_flight} reserved by puts in flight" if in_flight else ""
        raise CapacityError(f"Field {name!r}: {len(held)} stored{flight} + {new_items} new samples exceed "
                            f"max_items={max_items}; clear consumed samples or raise max_items.")


def kind_error(name: str, held: str, brought: str, note: str = "") -> SchemaError:
    """A put brought field ``name`` as ``brought`` ("tensors" or "Python objects"); it is ``held`` the other way."""
    return SchemaError(f"Field {name!r} is stored as {held}{note}, a put brought {brought}; TransferQueue fields keep "
                       f"one kind (on every storage unit): put {name!r} as {held}, or the {brought} under another "
                       f"field name.")


def dtype_error(name: str, held: object, brought: object, note: str = "") -> SchemaError:
    """A put brought field ``name`` in dtype ``brought``; it is stored in ``held``."""
    return SchemaError(f"Field {name!r} is stored as {held}{note}, a put brought {brought}; TransferQueue fields keep "
                       f"one dtype (on every storage unit): cast the column to {held}, or put it under another field "
                       f"name.")


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a field of ``dtype`` keeps its packed values in: ``dtype`` itself, or for one conduit-core cannot
    gather rows of (uint16/uint32/uint64 on this torch) the signed integer dtype of the same width, whose bits the
    field views back as ``dtype`` on reads (TransferQueue's SimpleStorage holds such fields too).

    Raises:
        ConfigurationError: no same-width dtype can be stored either.
    """
    signed = None if storable(dtype) else same_width_integer(dtype)
    if signed is None:
        Field((), dtype)  # (a dtype no storage holds raises the ConfigurationError that says what to do)
        return dtype
    return signed


def rank_error(name: str, held_width: int, brought_width: int, note: str = "") -> SchemaError:
    """A put brought field ``name`` with shape rows of ``brought_width``, wider than the ``held_width`` it keeps."""
    return SchemaError(f"Field {name!r} holds samples of rank <= {held_width - 1}{note}, a put brought rank "
                       f"{brought_width - 1}; TransferQueue fields keep one rank (on every storage unit): put this "
                       f"column under another field name.")


@dataclass(frozen=True)
class Rung:
    """One placement of a field: its sample slots, its packed-pool elements and its tier."""

    items: int
    elements: int
    tier: str = "host"


@dataclass(frozen=True)
class Migration:
    """A move of a field's samples to a larger placement.

    ``kind`` is ``"pool"`` (conduit-core's online migration to a larger packed pool, handles
    kept) or ``"slots"`` (the adapter's re-slotting into more sample slots, handles re-mapped).
    """

    field: str
    kind: str
    source: Rung
    target: Rung
    moved_items: int
    moved_bytes: int
    seconds: float


@dataclass(frozen=True)
class _Layout:
    """What a :class:`FieldStore` is made of, as :meth:`FieldStore.append` found it (its rollback goes back to it)."""

    edp: ExperienceDataPlane
    next_handle: int
    alive: torch.Tensor
    elems: torch.Tensor
    handle: dict[int, int]
    slot_rung: int
    pool_rung: int
    migrations: int


@dataclass(frozen=True)
class Appended:
    """Samples :meth:`FieldStore.append` stored after the newest and nothing reads yet: :meth:`FieldStore.settle`
    makes them the samples ``gis``, :meth:`FieldStore.rollback` forgets them."""

    gis: list[int]
    handles: torch.Tensor
    lengths: torch.Tensor
    before: _Layout


#: the smallest :class:`PoolLadder` growth: from it on, every size below 2**63 is within 4,000 rungs of rung 0
MIN_GROWTH = 1.01


class PoolPlacement(HostPlacement):
    """Host placement (page-locked when CUDA is present) whose ragged pools hold ``elements`` each."""

    def __init__(self, elements: int, *, pin_memory: bool = False) -> None:
        super().__init__(pin_memory=pin_memory)
        self.elements = int(elements)

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        return ColumnarStorage(schema, capacity, "cpu", ragged_capacity=self.elements, pin_memory=self.pin_memory,
                               tier="pinned" if self.pin_memory else "host")

    def describe(self) -> str:
        return f"{super().describe()}, pool {self.elements}"


class PoolLadder:
    """The size -> placement map: rung ``k`` holds ``growth**k`` times rung 0 (at least one more slot and element
    than rung ``k - 1``). Rungs are computed as they are first needed, so every size has one, whatever ``growth``:
    only ``max_items`` limits the slots, nothing limits the pool.

    ``growth`` is at least :data:`MIN_GROWTH` (1.01): a growth closer to 1 makes rungs one element apart, so reaching
    a large pool would walk (and keep) millions of rungs. From 1.01 on, every size below 2**63 is within 4,000
    rungs of rung 0. A field asks for twice what it needs whenever it moves, so ``growth`` only sets how far past
    that a rung may overshoot: 1.01 to about 4 is the useful range (2.0, the default).

    Args:
        items: sample slots of rung 0.
        elements: packed-pool elements of rung 0.

    Keyword Args:
        growth: factor between rungs (a finite number >= :data:`MIN_GROWTH`).
        pin_memory: page-locked host pools (only when CUDA is present).
        max_items: no rung holds more samples than this (None: unbounded).

    Raises:
        ConfigurationError: ``items`` or ``elements`` not positive, ``growth`` not a finite number > 1 (infinity or
            NaN included) or below :data:`MIN_GROWTH`, or ``max_items`` below 1.
    """

    def __init__(self, items: int, elements: int, *, growth: float = 2.0, pin_memory: bool = False,
                 max_items: int | None = None) -> None:
        if items <= 0 or elements <= 0:
            raise ConfigurationError(f"PoolLadder needs positive items and elements, got {items}, {elements}.")
        if not 1 < growth < math.inf:  # (NaN fails too: int() of an infinite or NaN rung size raised untyped)
            raise ConfigurationError(f"PoolLadder growth must be > 1 and finite, got {growth}.")
        if growth < MIN_GROWTH:  # rungs one element apart: a large pool would take millions of them
            raise ConfigurationError(
                f"PoolLadder growth must be at least {MIN_GROWTH}, got {growth}: closer to 1, rungs grow by one "
                f"element, so a large pool takes millions of rungs. Use {MIN_GROWTH} to about 4 (the default is 2.0).")
        if max_items is not None and max_items < 1:
            raise ConfigurationError(f"max_items must be >= 1 or None, got {max_items}.")
        self.growth = float(growth)
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())
        self.max_items = max_items
        self.tier = "pinned" if self.pin_memory else "host"
        #: the rungs computed so far (:meth:`_grow` appends one)
        self.items: list[int] = []
        self.elements: list[int] = []
        self._next = (int(items), int(elements))  # the next rung's slots (before the max_items cap) and elements
        self._grow()

    def _grow(self) -> None:
        """Append the next rung."""
        it, el = self._next
        self.items.append(it if self.max_items is None else min(it, self.max_items))
        self.elements.append(el)
        self._next = (int(it * self.growth) + 1, int(el * self.growth) + 1)

    def _rung(self, k: int, key: list[int], need: int) -> int:
        """The smallest rung index ``>= k`` whose ``key`` entry is ``need`` or more (rungs are added as needed: each
        holds more than the one before, except slots capped at ``max_items``, which the caller checks)."""
        j = k
        while True:
            while j >= len(key):
                self._grow()
            if key[j] >= need:
                return j
            j += 1

    def slots(self, need: int, at_least: int = 0) -> int:
        """Index of the smallest slot rung (from ``at_least``) with ``need`` slots.

        Raises:
            CapacityError: ``need`` is above ``max_items``.
        """
        if self.max_items is not None and need > self.max_items:
            raise CapacityError(f"{need} samples exceed the storage limit (max_items={self.max_items}); clear "
                                f"consumed samples (tq.kv_clear) sooner or raise "
                                f"transfer_queue.backend.Conduit.max_items.")
        return self._rung(at_least, self.items, need)

    def pool(self, need: int, at_least: int = 0) -> int:
        """Index of the smallest pool rung (from ``at_least``) with ``need`` elements."""
        return self._rung(at_least, self.elements, need)

    def placement(self, pool_rung: int) -> PoolPlacement:
        return PoolPlacement(self.elements[pool_rung], pin_memory=self.pin_memory)


class FieldStore:
    """One tensor field of TransferQueue samples, packed in Conduit storage.

    Not thread-safe: a storage unit serialises the calls.
    """

    def __init__(self, name: str, dtype: torch.dtype, width: int, ladder: PoolLadder) -> None:
        self.name = name
        self.dtype = dtype
        #: the dtype the packed values are kept in (a same-width view of ``dtype``, see :func:`storage_dtype`)
        self.store_dtype = storage_dtype(dtype)
        self.width = width
        self.schema = ExperienceSchema(values=Field((), self.store_dtype, ragged=True),
                                       shape=Field((width,), torch.int64))
        self.ladder = ladder
        self.migrations: list[Migration] = []
        self._handle: dict[int, int] = {}
        self._build(0, 0)

    def _build(self, slot_rung: int, pool_rung: int) -> None:
        """An empty store of these rungs replaces the current one (which is left as it is); when allocating it fails,
        nothing is replaced."""
        cap = self.ladder.items[slot_rung]
        alive = torch.zeros(cap, dtype=torch.bool)
        elems = torch.zeros(cap, dtype=torch.int64)  # packed elements held, by slot
        edp = ExperienceDataPlane(self.schema, capacity=cap, semantics=OnPolicy(num_minibatches=1),
                                  placement=self.ladder.placement(pool_rung))
        self.edp, self._alive, self._elems = edp, alive, elems
        self.slot_rung, self.pool_rung = slot_rung, pool_rung

    @property
    def storage(self) -> Storage:
        return self.edp.storage

    @property
    def rung(self) -> Rung:
        return Rung(self.ladder.items[self.slot_rung], self.ladder.elements[self.pool_rung], self.ladder.tier)

    def __len__(self) -> int:
        return len(self._handle)

    def __contains__(self, gi: int) -> bool:
        return gi in self._handle

    def _range_slots(self) -> torch.Tensor:
        st = self.storage
        return torch.arange(st.oldest, st.next_handle, dtype=torch.int64) % st.capacity

    # -- write -----------------------------------------------------------------------------
    def check(self, gis: Sequence[int], col: PackedColumn, reserved: Collection[int] = ()) -> torch.Tensor:
        """Raise what :meth:`put` would raise for this input, changing nothing; the shape rows padded to the width.

        ``reserved``: global indexes puts in flight will store in this field (they count against ``max_items``).

        Raises:
            SchemaError: another dtype or shape rank than this field's.
            CapacityError: the storage limit would be exceeded.
        """
        gis = [int(g) for g in gis]
        n = len(gis)
        if len(col) != n:
            raise SchemaError(f"Field {self.name!r}: {len(col)} samples for {n} global indexes.")
        if col.dtype != self.dtype:
            raise dtype_error(self.name, self.dtype, col.dtype)
        shapes = col.shapes
        if shapes.shape[1] != self.width:
            if shapes.shape[1] > self.width:
                raise rank_error(self.name, self.width, shapes.shape[1])
            shapes = torch.nn.functional.pad(shapes, (0, self.width - shapes.shape[1]))
        if n:
            ExperienceBatch({"values": Ragged(col.values.view(self.store_dtype), col.lengths), "shape": shapes},
                            n).validate(self.schema)
        check_indexes(self.name, gis, self._handle, self.ladder.max_items, reserved)
        return shapes

    def put(self, gis: Sequence[int], col: PackedColumn) -> None:
        """Store ``col``'s samples under global indexes ``gis`` (a put of a stored index replaces it): :meth:`append`,
        then :meth:`settle`.

        Raises:
            SchemaError: another dtype or shape rank than this field's.
            CapacityError: the storage limit would be exceeded.
        """
        self.settle(self.append(gis, col))

    def _layout(self) -> _Layout:
        return _Layout(self.edp, self.storage.next_handle, self._alive, self._elems, self._handle, self.slot_rung,
                       self.pool_rung, len(self.migrations))

    def append(self, gis: Sequence[int], col: PackedColumn) -> Appended:
        """First step of a put: check ``col``, make room for it (migrating the field when it does not fit: every
        held sample is kept) and store its samples after the newest, where no read finds them. Pass the result to
        :meth:`settle` (the samples become those of ``gis``) or to :meth:`rollback` (they are forgotten) before any
        other call to this field (in between, a sample the put replaces may not be readable).

        On any error (a refused column, or memory running out while the field grows) the field holds what it held
        (a pool migration that finished stays: it holds the same samples, in a larger pool).

        Raises:
            SchemaError: another dtype or shape rank than this field's.
            CapacityError: the storage limit would be exceeded.
        """
        gis = [int(g) for g in gis]
        n = len(gis)
        shapes = self.check(gis, col)
        before = self._layout()
        if n == 0:
            return Appended(gis, torch.empty(0, dtype=torch.int64), col.lengths, before)
        batch = ExperienceBatch({"values": Ragged(col.values.view(self.store_dtype), col.lengths), "shape": shapes}, n)
        total = int(col.values.shape[0])
        try:
            try:
                handles = self.edp.ingest_now(batch, version=0)
            except CapacityError:
                self._make_room(n, total, [g for g in gis if g in self._handle])
                handles = self.edp.ingest_now(batch, version=0)
        except BaseException:
            self._restore(before)
            raise
        return Appended(gis, handles, col.lengths, before)

    def settle(self, appended: Appended) -> None:
        """Second step of a put: the samples :meth:`append` stored become those of their global indexes (replacing
        the samples held under them)."""
        if not appended.gis:
            return
        cap = self.storage.capacity
        replaced = [self._handle[g] for g in appended.gis if g in self._handle]  # after a migration: current handles
        if replaced:
            self._alive[torch.tensor(replaced, dtype=torch.int64) % cap] = False
        slots = appended.handles % cap
        self._alive[slots] = True
        self._elems[slots] = appended.lengths
        for g, h in zip(appended.gis, appended.handles.tolist(), strict=True):
            self._handle[g] = h
        self._release_dead_prefix()
        if appended.before.edp is not self.edp:  # re-slotted: no rollback goes back to the old store now
            appended.before.edp.close()

    def rollback(self, appended: Appended) -> None:
        """Forget what :meth:`append` stored (and a re-slotting it made): the field holds what it held before."""
        self._restore(appended.before)

    def _restore(self, before: _Layout) -> None:
        """Go back to the store ``before`` describes (:meth:`append` changed nothing of it but appending after its
        newest sample, or re-slotting into a new store)."""
        if self.edp is before.edp:  # the appended samples (if any) are the newest: forget them
            storage = self.storage
            assert isinstance(storage, ColumnarStorage)
            storage.truncate(before.next_handle)
            return
        self.edp.close()  # a re-slotting built this one; the old store is untouched
        self.edp, self._alive, self._elems, self._handle = before.edp, before.alive, before.elems, before.handle
        self.slot_rung, self.pool_rung = before.slot_rung, before.pool_rung
        del self.migrations[before.migrations:]

    def _release_dead_prefix(self) -> None:
        st = self.storage
        if st.oldest == st.next_handle:
            return
        alive = self._alive[self._range_slots()]
        first = int(alive.to(torch.int8).argmax()) if bool(alive.any()) else int(alive.shape[0])
        if first:
            st.release(st.oldest + first)

    def _make_room(self, n: int, elements: int, replacing: Sequence[int] = ()) -> None:
        """Migrate so that ``n`` more samples of ``elements`` packed elements fit (``replacing``: stored global
        indexes the put overwrites, not worth moving)."""
        range_slots = self._range_slots()
        in_range = int(range_slots.shape[0])
        alive = self._alive[range_slots]
        live = int(alive.sum())
        held = int(self._elems[range_slots].sum())  # the pool keeps the whole handle range, cleared samples too
        live_elems = int(self._elems[range_slots][alive].sum())
        if in_range + n > self.storage.capacity or 2 * live_elems <= held:  # out of slots, or at least half the
            # pool is dead (samples cleared behind an older live one): compact the live samples (a pinned ring
            # would otherwise grow the slots and pool with everything put since its oldest sample)
            self._reslot(live - len(replacing) + n, live_elems + elements, replacing)
            return
        need = held + elements
        k = self.ladder.pool(2 * need, at_least=self.pool_rung + 1)  # room to grow before the next move
        src = self.rung
        report = self.edp.migrate(self.ladder.placement(k))  # conduit-core: online, handles and slots kept
        self.pool_rung = k
        self.migrations.append(Migration(self.name, "pool", src, self.rung, report.items, report.nbytes,
                                         report.seconds))

    def _reslot(self, need_items: int, need_elems: int, replacing: Sequence[int] = ()) -> None:
        """Copy the live samples, packed, into a store with enough slots (of this rung, or a larger one) and pool;
        re-map their handles.

        The samples of ``replacing`` are not copied (the caller's put stores their new values right after). The old
        store is left as it is (:meth:`settle` closes it, :meth:`rollback` goes back to it).
        """
        t0 = time.perf_counter()
        src = self.rung
        range_slots = self._range_slots()
        live_slots = range_slots[self._alive[range_slots]]
        if replacing:
            gone = torch.tensor([self._handle[g] for g in replacing], dtype=torch.int64) % self.storage.capacity
            live_slots = live_slots[~torch.isin(live_slots, gone)]
        live = self.storage.gather(live_slots)
        vals = live["values"]
        assert isinstance(vals, Ragged)
        handles = self.storage.handles_of(live_slots).tolist()
        want = 2 * need_items  # room to grow before the next move
        if self.ladder.max_items is not None:  # max_items caps that headroom, not what must fit
            want = max(need_items, min(want, self.ladder.max_items))
        sk = self.ladder.slots(want, at_least=self.slot_rung)  # (the same rung when the copy leaves it room)
        pk = self.ladder.pool(2 * need_elems, at_least=self.pool_rung)
        self._build(sk, pk)
        remap: dict[int, int] = {}
        if live_slots.numel():
            moved = ExperienceBatch({"values": Ragged(vals.values.clone(), vals.lengths.clone()),
                                     "shape": live.tensor("shape").clone()}, int(live_slots.shape[0]))
            new_handles = self.edp.ingest_now(moved, version=0)
            slots = new_handles % self.storage.capacity
            self._alive[slots] = True
            self._elems[slots] = vals.lengths
            remap = dict(zip(handles, new_handles.tolist(), strict=True))
        self._handle = {g: remap[h] for g, h in self._handle.items() if h in remap}  # not: the replaced
        if self.rung == src:  # a compaction within the same rungs: no move to record
            return
        nbytes = vals.values.numel() * vals.values.element_size() + int(live_slots.shape[0]) * self.width * 8
        self.migrations.append(Migration(self.name, "slots", src, self.rung, int(live_slots.shape[0]), nbytes,
                                         time.perf_counter() - t0))

    # -- read ------------------------------------------------------------------------------
    def get(self, gis: Sequence[int]) -> PackedColumn:
        """The samples ``gis``, in that order, packed (fresh tensors).

        Raises:
            MissingKeyError: a global index this field does not hold (:func:`~conduit_verl.unit_errors.missing_key`:
                :mod:`conduit_verl.compat`'s class, or where compat is not imported, a stand-in that unpickles as it).
        """
        try:
            handles = torch.tensor([self._handle[int(g)] for g in gis], dtype=torch.int64)
        except KeyError as e:
            raise missing_key(f"Field {self.name!r} holds no sample with global index {e.args[0]}; it was never "
                              f"put, or was cleared.") from None
        b = self.storage.gather(handles % self.storage.capacity)
        vals = b["values"]
        assert isinstance(vals, Ragged)
        return PackedColumn(vals.values.view(self.dtype), vals.lengths, b.tensor("shape"))

    def clear(self, gis: Sequence[int]) -> int:
        """Forget the samples ``gis`` (unknown ones are ignored); returns how many were held."""
        hs = [self._handle.pop(int(g)) for g in gis if int(g) in self._handle]
        if hs:
            self._alive[torch.tensor(hs, dtype=torch.int64) % self.storage.capacity] = False
            self._release_dead_prefix()
        return len(hs)
