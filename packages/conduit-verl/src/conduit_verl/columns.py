"""One TransferQueue field's samples in Conduit storage, and their online migration.

Each tensor field lives in a :class:`conduit.ColumnarStorage` with two columns: ``values``
(``Field((), dtype, ragged=True)``: every sample's elements packed end to end in one pool)
and ``shape`` (the per-sample shape row, see :class:`~conduit_verl.packing.PackedColumn`).
TransferQueue names samples by *global index*; the store maps each to a Conduit handle.

TransferQueue clears samples in any order, while a Conduit storage frees its oldest items
first. Cleared samples are therefore marked dead and their slots come back once every
older sample is dead too.

**Migration.** When a put does not fit (more samples than slots, or longer sequences than
the packed pool holds: GRPO responses grow during training), the store moves its live
samples to the next placement of a :class:`PlacementMap` computed up front, then stores the
put. Nothing is lost, reordered or re-profiled; dead samples are dropped on the way, so a
migration also compacts. Each one is recorded as a :class:`Migration`.

Fallback note: conduit-core has no placement-map/migration API yet; this is the adapter's
own, limited to host tiers (``host``, or ``pinned`` when CUDA is present).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from conduit import CapacityError, ColumnarStorage, ConfigurationError, ExperienceSchema, Field, Ragged, SchemaError
from conduit.batch import ExperienceBatch

from conduit_verl.compat import MissingKeyError
from conduit_verl.packing import PackedColumn

__all__ = ["Rung", "PlacementMap", "Migration", "FieldStore"]


@dataclass(frozen=True)
class Rung:
    """One placement of a field: its sample slots, its packed-pool elements and its tier."""

    items: int
    elements: int
    tier: str = "host"


@dataclass(frozen=True)
class Migration:
    """A move of a field's live samples from one placement to a larger one."""

    field: str
    source: Rung
    target: Rung
    moved_items: int
    moved_bytes: int
    seconds: float


class PlacementMap:
    """The size -> placement map, computed once: rung ``k`` holds ``growth**k`` times rung 0.

    Args:
        items: sample slots of rung 0.
        elements: packed-pool elements of rung 0.

    Keyword Args:
        growth: factor between rungs (> 1).
        pin_memory: place pools in page-locked host memory (only when CUDA is present).
        max_items: no rung holds more samples than this (None: unbounded).
    """

    def __init__(self, items: int, elements: int, *, growth: float = 2.0, pin_memory: bool = False,
                 max_items: int | None = None) -> None:
        if items <= 0 or elements <= 0:
            raise ConfigurationError(f"PlacementMap needs positive items and elements, got {items}, {elements}.")
        if growth <= 1:
            raise ConfigurationError(f"PlacementMap growth must be > 1, got {growth}.")
        if max_items is not None and max_items < 1:
            raise ConfigurationError(f"max_items must be >= 1 or None, got {max_items}.")
        self.growth = float(growth)
        self.pin_memory = bool(pin_memory and torch.cuda.is_available())
        self.max_items = max_items
        tier = "pinned" if self.pin_memory else "host"
        self.rungs: list[Rung] = []
        it, el = items, elements
        for _ in range(48):  # 2**48 times rung 0 is beyond any host
            self.rungs.append(Rung(it if max_items is None else min(it, max_items), el, tier))
            it, el = int(it * self.growth) + 1, int(el * self.growth) + 1

    def place(self, items: int, elements: int, at_least: int = 0) -> int:
        """Index of the smallest rung (from ``at_least`` on) holding ``items`` samples and ``elements``.

        Raises:
            CapacityError: no rung is large enough (``max_items`` reached).
        """
        for k in range(at_least, len(self.rungs)):
            r = self.rungs[k]
            if r.items >= items and r.elements >= elements:
                return k
        raise CapacityError(f"{items} samples exceed the storage limit (max_items={self.max_items}); clear consumed "
                            f"samples (tq.kv_clear) sooner or raise transfer_queue.backend.Conduit.max_items.")

    def build(self, schema: ExperienceSchema, k: int) -> ColumnarStorage:
        r = self.rungs[k]
        return ColumnarStorage(schema, r.items, "cpu", ragged_capacity=r.elements, pin_memory=self.pin_memory,
                               tier=r.tier)


class FieldStore:
    """One tensor field of TransferQueue samples, packed in a Conduit storage.

    Not thread-safe: a storage unit serialises the calls.
    """

    def __init__(self, name: str, dtype: torch.dtype, width: int, pmap: PlacementMap) -> None:
        self.name = name
        self.dtype = dtype
        self.width = width
        self.schema = ExperienceSchema(values=Field((), dtype, ragged=True), shape=Field((width,), torch.int64))
        self.pmap = pmap
        self.rung = 0
        self.storage = pmap.build(self.schema, 0)
        self._alive = torch.zeros(self.storage.capacity, dtype=torch.bool)
        self._handle: dict[int, int] = {}
        self.migrations: list[Migration] = []

    def __len__(self) -> int:
        return len(self._handle)

    def __contains__(self, gi: int) -> bool:
        return gi in self._handle

    @property
    def live_elements(self) -> int:
        return int(self._live_batch_lengths().sum()) if self._handle else 0

    def _live_slots(self) -> torch.Tensor:
        st = self.storage
        slots = torch.arange(st.oldest, st.next_handle, dtype=torch.int64) % st.capacity
        return slots[self._alive[slots]]

    def _live_batch_lengths(self) -> torch.Tensor:
        return self.storage.gather(self._live_slots())["values"].lengths  # type: ignore[union-attr]

    # -- write -----------------------------------------------------------------------------
    def put(self, gis: Sequence[int], col: PackedColumn) -> None:
        """Store ``col``'s samples under global indexes ``gis`` (a put of a stored index replaces it).

        Raises:
            SchemaError: another dtype or shape rank than this field's.
            CapacityError: the storage limit would be exceeded.
        """
        gis = [int(g) for g in gis]
        n = len(gis)
        if len(col) != n:
            raise SchemaError(f"Field {self.name!r}: {len(col)} samples for {n} global indexes.")
        if len(set(gis)) != n:
            raise SchemaError(f"Field {self.name!r}: a put names a global index twice.")
        if col.dtype != self.dtype:
            raise SchemaError(f"Field {self.name!r} is stored as {self.dtype}, a put brought {col.dtype}; "
                              f"TransferQueue fields keep one dtype.")
        shapes = col.shapes
        if shapes.shape[1] != self.width:
            if shapes.shape[1] > self.width:
                raise SchemaError(f"Field {self.name!r} holds samples of rank <= {self.width - 1}, a put brought rank "
                                  f"{shapes.shape[1] - 1}; TransferQueue fields keep one rank.")
            shapes = torch.nn.functional.pad(shapes, (0, self.width - shapes.shape[1]))
        if n == 0:
            return
        batch = ExperienceBatch({"values": Ragged(col.values, col.lengths), "shape": shapes}, n)
        batch.validate(self.schema)
        new_items = sum(1 for g in gis if g not in self._handle)
        if self.pmap.max_items is not None and len(self._handle) + new_items > self.pmap.max_items:
            raise CapacityError(f"Field {self.name!r}: {len(self._handle)} stored + {new_items} new samples exceed "
                                f"max_items={self.pmap.max_items}; clear consumed samples or raise max_items.")
        try:
            res = self.storage.append(batch, evict=False)
        except CapacityError:
            self._migrate(n, int(col.values.shape[0]))
            res = self.storage.append(batch, evict=False)
        cap = self.storage.capacity
        replaced = [self._handle[g] for g in gis if g in self._handle]  # after a migration: the new handles
        if replaced:
            self._alive[torch.tensor(replaced, dtype=torch.int64) % cap] = False
        self._alive[torch.arange(res.first, res.first + n, dtype=torch.int64) % cap] = True
        for i, g in enumerate(gis):
            self._handle[int(g)] = res.first + i
        self._release_dead_prefix()

    def _release_dead_prefix(self) -> None:
        st = self.storage
        if st.oldest == st.next_handle:
            return
        slots = torch.arange(st.oldest, st.next_handle, dtype=torch.int64) % st.capacity
        alive = self._alive[slots]
        first = int(alive.to(torch.int8).argmax()) if bool(alive.any()) else int(slots.shape[0])
        if first:
            st.release(st.oldest + first)

    def _migrate(self, new_items: int, new_elements: int) -> None:
        """Move the live samples to the placement that also holds ``new_items``/``new_elements`` more."""
        t0 = time.perf_counter()
        src_rung = self.pmap.rungs[self.rung]
        slots = self._live_slots()
        live = self.storage.gather(slots)
        vals = live["values"]
        assert isinstance(vals, Ragged)
        need_items = int(slots.shape[0]) + new_items
        need_elems = int(vals.values.shape[0]) + new_elements
        k = self.pmap.place(need_items, need_elems, at_least=self.rung)
        r = self.pmap.rungs[k]
        if k == self.rung and (need_items * 4 > r.items * 3 or need_elems * 4 > r.elements * 3):
            k = self.pmap.place(need_items, need_elems, at_least=self.rung + 1)  # compaction alone would not last
        target = self.pmap.build(self.schema, k)
        handles = self.storage.handles_of(slots)
        if slots.numel():
            moved = ExperienceBatch({"values": Ragged(vals.values.clone(), vals.lengths.clone()),
                                     "shape": live.tensor("shape").clone()}, int(slots.shape[0]))
            res = target.append(moved, evict=False)
            remap = {int(h): res.first + i for i, h in enumerate(handles.tolist())}
        else:
            remap = {}
        alive = torch.zeros(target.capacity, dtype=torch.bool)
        alive[torch.arange(target.oldest, target.next_handle, dtype=torch.int64) % target.capacity] = True
        self._handle = {g: remap[h] for g, h in self._handle.items()}
        nbytes = vals.values.numel() * vals.values.element_size() + int(slots.shape[0]) * self.width * 8
        self.storage, self._alive, self.rung = target, alive, k
        self.migrations.append(Migration(self.name, src_rung, self.pmap.rungs[k], int(slots.shape[0]), nbytes,
                                         time.perf_counter() - t0))

    # -- read ------------------------------------------------------------------------------
    def get(self, gis: Sequence[int]) -> PackedColumn:
        """The samples ``gis``, in that order, packed (fresh tensors).

        Raises:
            MissingKeyError: a global index this field does not hold.
        """
        try:
            handles = torch.tensor([self._handle[int(g)] for g in gis], dtype=torch.int64)
        except KeyError as e:
            raise MissingKeyError(f"Field {self.name!r} holds no sample with global index {e.args[0]}; it was never "
                                  f"put, or was cleared.") from None
        slots = handles % self.storage.capacity
        b = self.storage.gather(slots)
        vals = b["values"]
        assert isinstance(vals, Ragged)
        return PackedColumn(vals.values, vals.lengths, b.tensor("shape"))

    def clear(self, gis: Sequence[int]) -> int:
        """Forget the samples ``gis`` (unknown ones are ignored); returns how many were held."""
        hs = [self._handle.pop(int(g)) for g in gis if int(g) in self._handle]
        if hs:
            self._alive[torch.tensor(hs, dtype=torch.int64) % self.storage.capacity] = False
            self._release_dead_prefix()
        return len(hs)
