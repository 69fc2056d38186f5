"""The placement map (item size -> placement, computed ahead) and the placement that follows it.

Experience can grow during training (longer responses, larger observations) until the
initial placement no longer fits or is no longer the fastest. The map is planned once,
over the whole size range, from the same profile; :class:`AdaptivePlacement` looks the
current size up and migrates the buffer online when it crosses a boundary, without
re-profiling. Sizes above the largest the map was planned for were never checked to fit:
looking them up is a :class:`~conduit.errors.PlacementError` (re-plan with a larger maximum).
Ragged fields were planned at a mean length, so the ragged pools are held to the plan too: their
bytes, with the fixed fields', may not exceed what the map checked for the placement, and a
migration sizes the new pools for the new item size.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conduit.checks import is_real
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement.base import Placement, PlacementSpec, ragged_pool
from conduit.placement.cost import Workload
from conduit.schema import ExperienceSchema
from conduit.storage.base import Storage
from conduit.storage.columnar import pool_elements

if TYPE_CHECKING:
    from conduit.batch import ExperienceBatch
    from conduit.edp import ExperienceDataPlane
    from conduit.placement.migration import MigrationReport
    from conduit.placement.planner import Planner

__all__ = ["MapRange", "PlacementMap", "AdaptivePlacement", "MAX_POINTS"]

#: the most geometric grid sizes :meth:`PlacementMap.build` plans (each is one planner run; the boundaries are
#: refined by bisection anyway, so more points only cost time). With a measured profile the grid also holds two
#: sizes per bend of a cost curve in the range (see ``_kinks``): at most 2 x the profile's distinct point sizes x
#: the call shapes priced (a row, an ingestion call, a batch, their share per shard count) x the growing fields'
#: distinct shares, in practice a few hundred; declared links have one point, so none. It also holds each
#: candidate's largest fitting size and the next where that lies in the range (two per candidate; found with
#: the cost model's memory check, about 25 estimates per candidate, not planner runs).
MAX_POINTS = 4096


@dataclass(frozen=True)
class MapRange:
    """Items of ``lo <= item_bytes < hi`` bytes go to ``spec`` (None: nothing fits)."""

    lo: float
    hi: float
    spec: PlacementSpec | None
    #: predicted experience-path seconds per iteration at ``lo`` (None when nothing fits)
    total_s: float | None = None

    @property
    def largest_whole(self) -> float:
        """The largest whole item size this range holds: ``ceil(hi) - 1`` (ranges are half-open, and sizes are
        located by the whole bytes they need, so ``hi`` itself lies in the next range); inf for an open range."""
        return float(math.ceil(self.hi) - 1) if math.isfinite(self.hi) else self.hi

    def to_dict(self) -> dict[str, Any]:
        return {"lo_bytes": self.lo, "hi_bytes": None if math.isinf(self.hi) else self.hi,
                "placement": None if self.spec is None else self.spec.to_dict(),
                "total_ms_at_lo": None if self.total_s is None else self.total_s * 1e3}


class PlacementMap:
    """Contiguous item-size ranges, each with the placement the planner chose for it.

    Args:
        ranges: sorted, contiguous ranges (the first starts at the smallest size covered).
        workload: the template the map was planned for (capacity, batch, learners).
        topology: the topology's name.

    Keyword Args:
        max_item_bytes: the largest item size the map was planned for (default: the last
            range's end, or its start when it is open).

    Raises:
        ConfigurationError: no ranges, an item that is not a :class:`MapRange`, a range that is
            empty or not a number, or whose placement is neither a :class:`PlacementSpec` nor None, ranges
            that are unsorted or leave gaps (``hi`` of one must be
            ``lo`` of the next), or a ``max_item_bytes`` that is no real number, NaN, negative, infinite or
            beyond the last range's end.
    """

    def __init__(self, ranges: list[MapRange], workload: Workload, topology: str, *,
                 max_item_bytes: float | None = None) -> None:
        if not ranges:
            raise ConfigurationError("A placement map needs at least one range.")
        for i, r in enumerate(ranges):
            if not isinstance(r, MapRange):
                raise ConfigurationError(f"Placement map range {i} is {type(r).__name__}, not a MapRange.")
            if any(not is_real(x) for x in (r.lo, r.hi)):
                raise ConfigurationError(f"Placement map range {i} ({r.lo!r} .. {r.hi!r}) must be numbers of bytes.")
            if not 0 <= r.lo < r.hi:  # (False for NaN)
                raise ConfigurationError(f"Placement map range {i} ({r.lo} .. {r.hi} B) must have 0 <= lo < hi.")
            if r.spec is not None and not isinstance(r.spec, PlacementSpec):  # (a lookup would hand it out)
                raise ConfigurationError(f"Placement map range {i} places its items on {r.spec!r}, not a "
                                         f"PlacementSpec; write e.g. PlacementSpec('host', ('cpu',)) (None: nothing "
                                         f"fits).")
            if i and ranges[i - 1].hi != r.lo:
                raise ConfigurationError(f"Placement map ranges must be sorted and contiguous: range {i - 1} ends at "
                                         f"{ranges[i - 1].hi} B, range {i} starts at {r.lo} B.")
        if max_item_bytes is not None and not (is_real(max_item_bytes) and 0 <= max_item_bytes < math.inf):
            raise ConfigurationError(f"max_item_bytes must be a finite number >= 0 (the largest item size the map was "
                                     f"planned for; or None: the last range's end), got {max_item_bytes!r}.")
        if max_item_bytes is not None and max_item_bytes > ranges[-1].hi:  # (sizes there are in no range)
            raise ConfigurationError(f"max_item_bytes ({max_item_bytes} B) lies beyond the last range, which ends at "
                                     f"{ranges[-1].hi} B: no range places the sizes in between. End the last range "
                                     f"there (or at math.inf), or lower max_item_bytes.")
        self.ranges = tuple(ranges)
        self.workload = workload
        self.topology = topology
        self._max_item_bytes = max_item_bytes

    @classmethod
    def build(cls, planner: Planner, workload: Workload, *, min_item_bytes: float, max_item_bytes: float,
              points: int = 48, resize: Callable[[float], Workload] | None = None) -> PlacementMap:
        """Plan over ``[min_item_bytes, max_item_bytes]`` (see :meth:`Planner.placement_map`).

        The map's :attr:`max_item_bytes` is the largest whole size planned (``floor(max_item_bytes)``, or
        ``ceil(min_item_bytes)`` for a range without a whole byte): sizes are planned in whole bytes, rounded up.

        The grid holds ``points`` sizes spaced geometrically and, with the default ``resize``, each side of every
        size where a measured cost curve bends (a profile point reached by a growing field in a priced call), so a
        placement that wins only between two geometric sizes because a measured link's time steps up there is
        planned; so is each candidate's largest fitting size (and the next), so a faster candidate that stops
        fitting between two geometric sizes is found. Between two neighbouring planned sizes that chose the same
        placement nothing more is planned, so a choice that changes and changes back in between for another reason
        (a curve bending between two of its points, the tie tolerance as below) is still not found; its fit is
        checked, so the map never names an unfit placement, only at worst a slower one.
        The planner's choice depends on the candidates' costs alone (costs equal up to float rounding go to the
        first proposed), but near a ``tie_tolerance`` boundary it can alternate over a few bytes: the default
        ``resize`` splits a size over equal growing fields unevenly every other byte, and a sharded ingestion's
        last DMA prices one field, so costs step rather than grow affinely with the size. There the map names
        the placement found on one side (both are within about the tolerance of each other).

        Raises:
            ConfigurationError: not ``0 < min_item_bytes <= max_item_bytes`` (both finite real numbers), or ``points``
                is not an int in ``[2, MAX_POINTS]``.
            PlacementError: the planner refuses the workload whatever its item size (e.g. more learners
                than GPUs): only sizes that fit nowhere (:class:`~conduit.placement.planner.NothingFitsError`)
                map to no placement.
        """
        from conduit.placement.planner import NothingFitsError

        if not (is_real(min_item_bytes) and is_real(max_item_bytes)
                and 0 < min_item_bytes <= max_item_bytes < math.inf):
            raise ConfigurationError(f"Need numbers 0 < min_item_bytes <= max_item_bytes, both finite, got "
                                     f"{min_item_bytes!r}, {max_item_bytes!r}.")
        if isinstance(points, bool) or not isinstance(points, int) or not 2 <= points <= MAX_POINTS:
            raise ConfigurationError(f"points must be an int >= 2 and at most {MAX_POINTS} (grid sizes planned before "
                                     f"the boundaries are refined by bisection), got {points!r}.")
        sized = resize or workload.resized
        cache: dict[int, tuple[PlacementSpec | None, float | None]] = {}

        def at(b: int) -> tuple[PlacementSpec | None, float | None]:
            if b not in cache:
                try:
                    plan = planner.plan(sized(b))
                    cache[b] = (plan.placement, plan.chosen.estimate.total_s)
                except NothingFitsError:  # (any other refusal is not about the size: it is raised)
                    cache[b] = (None, None)
            return cache[b]

        lo_b = int(math.ceil(min_item_bytes))
        hi_b = max(lo_b, int(math.floor(max_item_bytes)))  # a range without a whole byte in it: plan at lo_b
        n = points
        grid = sorted({int(round(lo_b * (hi_b / lo_b) ** (i / (n - 1)))) for i in range(n)} | {lo_b, hi_b}
                      | (_kinks(planner, workload, lo_b, hi_b) if resize is None else set())
                      | _fit_limits(planner, sized, lo_b, hi_b))
        starts = [grid[0]]

        def refine(a: int, b: int) -> None:
            """Add every boundary in ``(a, b]`` where the placement changes (``at(a) != at(b)``)."""
            sa = at(a)[0]
            while at(b)[0] != sa:
                lo, hi = a, b
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if at(mid)[0] == sa:
                        lo = mid
                    else:
                        hi = mid
                starts.append(hi)
                a, sa = hi, at(hi)[0]

        for a, b in zip(grid, grid[1:], strict=False):
            refine(a, b)
        ranges = []
        for i, s in enumerate(starts):
            hi = starts[i + 1] if i + 1 < len(starts) else math.inf
            spec, t = at(s)
            ranges.append(MapRange(float(s), float(hi), spec, t))
        # (the largest whole size planned, not a fractional maximum above it: sizes in between are located by
        # the whole bytes they need, hi_b + 1, which no plan checked; hi_b is ceil(min) when no whole byte lies in
        # the range, and that plan covers it)
        return cls(ranges, workload, planner.topology.name, max_item_bytes=float(hi_b))

    @property
    def boundaries(self) -> list[float]:
        """Item sizes (bytes) where the placement changes."""
        return [r.lo for r in self.ranges[1:]]

    @property
    def max_item_bytes(self) -> float:
        """The largest item size the map was planned for and places: the ``max_item_bytes`` given (default: the
        last range's end, or its start when it is open), but at most the largest whole size in a last range that
        ends at a finite ``hi`` (``ceil(hi) - 1``: ranges are half-open and sizes are located by the whole bytes
        they need, so ``hi`` itself lies in no range)."""
        last = self.ranges[-1]
        if self._max_item_bytes is not None:
            top = self._max_item_bytes
        else:
            top = last.lo if math.isinf(last.hi) else last.hi
        return min(top, last.largest_whole)

    def range_of(self, item_bytes: float) -> MapRange:
        """The range holding items of ``item_bytes`` (sizes below the map: its first range; above
        :attr:`max_item_bytes`: its last, which :meth:`lookup` refuses for them). A fractional size (a mean
        over ragged items) is located by the whole bytes it needs, rounded up: the map was planned at whole
        bytes, and the range below a boundary may not hold items even a fraction of a byte larger.

        Raises:
            ConfigurationError: ``item_bytes`` is no real number (a string, None, a bool), NaN or negative.
        """
        if not is_real(item_bytes) or not item_bytes >= 0:
            raise ConfigurationError(f"item_bytes must be a number >= 0, got {item_bytes!r}.")
        whole = math.ceil(item_bytes) if math.isfinite(item_bytes) else item_bytes
        i = bisect.bisect_right([r.lo for r in self.ranges], whole) - 1
        return self.ranges[max(0, i)]

    def lookup(self, item_bytes: float) -> PlacementSpec:
        """The placement for items of ``item_bytes`` (sizes below the map use its first range).

        Raises:
            PlacementError: nothing fits items of this size, or ``item_bytes`` exceeds
                :attr:`max_item_bytes` (nothing checked that the last range's placement holds
                such items: re-plan with a larger ``max_item_bytes``).
            ConfigurationError: ``item_bytes`` is no real number, NaN or negative.
        """
        r = self.range_of(item_bytes)
        size = f"{item_bytes:.0f}" if float(item_bytes).is_integer() else f"{item_bytes:.2f}"
        if r.spec is None:
            raise PlacementError(f"No placement on {self.topology!r} fits {self.workload.capacity} items of "
                                 f"{size} B; lower the capacity or shrink the items below {r.lo:.0f} B (whole "
                                 f"bytes, rounded up).")
        top = self.max_item_bytes
        if item_bytes > top:
            raise PlacementError(
                f"Items of {size} B exceed the range this placement map on {self.topology!r} was planned for (up "
                f"to {top:.0f} B per item): nothing checked that {r.spec} holds {self.workload.capacity} of them. "
                f"Re-plan with a larger maximum: planner.placement_map(..., max_item_bytes=N) with N at least the "
                f"largest item size expected (here {size} B).")
        return r.spec

    def to_dict(self) -> dict[str, Any]:
        return {"topology": self.topology, "workload": self.workload.to_dict(),
                "max_item_bytes": self.max_item_bytes, "ranges": [r.to_dict() for r in self.ranges]}

    def explain(self) -> str:
        lines = [f"placement map on {self.topology} (capacity {self.workload.capacity}, batch {self.workload.batch}, "
                 f"planned up to {self.max_item_bytes:.0f} B/item)"]
        for r in self.ranges:
            hi = "inf" if math.isinf(r.hi) else f"{r.hi:.0f}"
            lines.append(f"  {r.lo:>12.0f} .. {hi:>12} B/item -> {r.spec if r.spec else 'nothing fits'}")
        return "\n".join(lines)


def _fit_limits(planner: Planner, sized: Callable[[float], Workload], lo_b: int, hi_b: int) -> set[int]:
    """Each candidate's largest item size in ``[lo_b, hi_b]`` that fits, and the next (found by bisection on the
    cost model's memory check, which needs more memory for larger items), for every candidate that fits at
    ``lo_b`` but not at ``hi_b``: a faster candidate that stops fitting between two grid sizes is planned."""
    def fits(spec: PlacementSpec, b: int) -> bool:
        return planner.cost.estimate(spec, sized(b)).feasible

    out: set[int] = set()
    try:
        specs = [spec for spec, _ in planner.candidates(sized(lo_b))]
        for spec in specs:
            if not fits(spec, lo_b) or fits(spec, hi_b):
                continue
            lo, hi = lo_b, hi_b
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(spec, mid):
                    lo = mid
                else:
                    hi = mid
            out |= {lo, hi}
    except PlacementError:  # (a workload the planner refuses at every size: plan() says why)
        return set()
    return out


def _kinks(planner: Planner, workload: Workload, lo_b: int, hi_b: int) -> set[int]:
    """Item sizes in ``[lo_b, hi_b]`` (whole bytes, each side of the exact size) where a cost curve bends: where
    a growing field's bytes, in one of the calls the cost model prices (a row, an ingestion call's or a batch's
    rows, their share of a shard), reach a point of a multi-point link of the planner's profile, or a scalar
    column reaches half the last-level cache. Between two of these the links' figures change smoothly, so the
    grid plans each side of every step of a measured curve (declared links have one point: none there).
    Sizes as :meth:`Workload.resized` splits them over the growing fields."""
    points = {b for link in planner.profile.links.values() if len(link.points) > 1 for b, _ in link.points}
    llc = planner.profile.details.get("llc_bytes")
    grow = workload.growing if workload.growing is not None else tuple(range(len(workload.field_bytes)))
    if not points and not (isinstance(llc, int) and llc > 0 and set(grow) & set(workload.scalar)):
        return set()
    items, rows, cap = workload.ingest_call_items, workload.batch, workload.capacity
    try:  # (the shard counts the planner proposes: a sharded call's per-shard share)
        shards = sorted({len(spec.devices) for spec, _ in planner.candidates(workload)})
    except PlacementError:  # (a workload the planner refuses at every size: plan() says why)
        shards = []
    per_call = {1.0, float(items), float(rows), *(x / k for x in (items, rows) for k in shards if k > 1)}
    sizes = {(b, x) for b in points for x in per_call}
    if isinstance(llc, int) and llc > 0:  # a scalar column in or out of the cache (CostModel._gather)
        sizes |= {(llc // 2, float(x)) for x in (cap, rows, *(cap / k for k in shards if k > 1))}
    fixed = sum(b for i, b in enumerate(workload.field_bytes) if i not in grow)
    g_now = sum(workload.field_bytes[i] for i in grow)
    out: set[int] = set()
    for i in grow:
        share = workload.field_bytes[i] / g_now if g_now else 1.0 / len(grow)
        if share <= 0:
            continue
        for b, x in sizes:
            exact = fixed + b / x / share
            if lo_b - 1 <= exact <= hi_b + 1:
                out |= {min(hi_b, max(lo_b, int(math.floor(exact)) + d)) for d in (0, 1)}
    return out


def storage_spec(storage: Storage) -> PlacementSpec | None:
    """The :class:`PlacementSpec` of the tier and devices ``storage`` actually uses (None: a tier no spec
    names, e.g. a remote storage)."""
    tier = getattr(storage, "tier", None)
    if tier in ("host", "pinned"):
        return PlacementSpec(tier, ("cpu",))
    if tier == "gpu":
        return PlacementSpec("gpu", (str(storage.device),))
    if tier == "sharded":
        return PlacementSpec("sharded", tuple(str(d) for d in getattr(storage, "devices", (storage.device,))))
    if tier == "disk":
        return PlacementSpec("disk", ("disk",))
    return None


class AdaptivePlacement(Placement):
    """A placement that follows a :class:`PlacementMap` and migrates when the item size crosses a boundary.

    Args:
        placement_map: the precomputed map. Its workload's capacity bounds the buffers this placement
            builds storage for: the map checked that each placement holds that many items, so a buffer of
            more items is refused (:meth:`storage`, and :meth:`rebalance` of a buffer built by another
            placement); plan the map for the buffer's capacity. Its item sizes bound the ragged pools
            (``ragged_capacity`` elements per ragged field): the pools' bytes plus the fixed fields' may not
            exceed what the map checked for the placement (its capacity x the largest whole item size of the
            looked-up range: see :meth:`check_pool`).

    Keyword Args:
        directory: where the disk tier puts its files, if the map ever chooses it.
        mean_ragged_length: ragged elements per item assumed when the buffer is built (the map's
            ``Workload.from_schema(..., mean_ragged_length=...)``); the default pool holds ``capacity`` items
            of this length.
        window: recent ingestion calls averaged to observe the current item size (>= 1).

    Raises:
        ConfigurationError: ``window`` < 1, or a ``mean_ragged_length`` that is no real number, negative or
            non-finite.
    """

    def __init__(self, placement_map: PlacementMap, *, directory: str | Path | None = None,
                 mean_ragged_length: float = 0.0, window: int = 32) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigurationError(f"window must be an int >= 1 (ingestion calls averaged), got {window!r}.")
        if not (is_real(mean_ragged_length) and 0 <= mean_ragged_length < math.inf):
            raise ConfigurationError(f"mean_ragged_length must be a finite number >= 0, got {mean_ragged_length!r}.")
        self.map = placement_map
        self.directory = directory
        self.mean_ragged_length = mean_ragged_length
        self.window = window
        #: the spec currently in use (set when the storage is built; put back if a migration into it fails)
        self.current: PlacementSpec | None = None
        #: every migration this placement performed
        self.migrations: list[MigrationReport] = []
        #: (the storage built last, :attr:`current` before it): see :meth:`storage_abandoned`
        self._undo: tuple[weakref.ref[Storage], PlacementSpec | None] | None = None
        #: per buffer: (its schema changes seen, the time from which its ingestion has the current schema)
        self._schema_seen: weakref.WeakKeyDictionary[ExperienceDataPlane, tuple[int, float]] = \
            weakref.WeakKeyDictionary()
        #: held by :meth:`rebalance` from its decision to its bookkeeping: one migration at a time
        self._rebalancing = threading.RLock()

    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Storage:
        """Storage in the placement the map names for ``schema``'s items.

        Keyword Args:
            ragged_capacity: elements in each ragged field's pool (default: ``capacity`` items of
                ``mean_ragged_length`` elements, see :meth:`pool_for`; with a ``mean_ragged_length`` of 0
                there is no default: pass one).

        Raises:
            PlacementError: nothing fits them, they exceed the map's planned maximum, ``capacity``
                exceeds the capacity the map was planned for (nothing checked that its placements hold
                that many items), the ragged pools take more memory than the map checked (see
                :meth:`check_pool`), or their size is left to a ``mean_ragged_length`` of 0; nothing was built.
            ConfigurationError: ``ragged_capacity`` is not an int.
        """
        self._check_capacity(capacity)
        item_bytes = schema.item_bytes(self.mean_ragged_length)
        spec = self.map.lookup(item_bytes)
        if schema.ragged:
            if ragged_capacity is None:
                if not self.mean_ragged_length:  # the default pool would hold no sequence at all
                    raise PlacementError(
                        f"Ragged fields {', '.join(schema.ragged)}: this adaptive placement assumes no elements in "
                        f"them (mean_ragged_length=0), so the map checked no memory for their pools. Pass "
                        f"AdaptivePlacement(..., mean_ragged_length=N) with the N the map was planned for "
                        f"(Workload.from_schema(..., mean_ragged_length=N)), or the buffer's ragged_capacity.")
                ragged_capacity = self.pool_for(schema, capacity, item_bytes)
            self.check_pool(schema, capacity, ragged_capacity, item_bytes)
        st = spec.build(directory=self.directory).storage(schema, capacity, ragged_capacity=ragged_capacity)
        self._undo = (weakref.ref(st), self.current)
        self.current = spec
        return st

    def _check_capacity(self, capacity: int) -> None:
        """Refuse a buffer of more items than the map was planned for (nothing checked that its placements
        hold them).

        Raises:
            PlacementError: ``capacity`` exceeds the map's workload capacity.
        """
        planned = self.map.workload.capacity
        if capacity > planned:
            raise PlacementError(
                f"A buffer of {capacity} items exceeds the capacity this placement map on {self.map.topology!r} was "
                f"planned for ({planned} items): nothing checked that its placements hold {capacity} of them. Plan "
                f"the map for the buffer's capacity: planner.placement_map(Workload.from_schema(schema, "
                f"capacity={capacity}, ...), ...), or build the buffer with capacity <= {planned}.")

    @staticmethod
    def pool_for(schema: ExperienceSchema, capacity: int, item_bytes: float) -> int:
        """Elements per ragged pool that ``capacity`` items of ``item_bytes`` (counted as
        :meth:`ExperienceSchema.item_bytes` counts them) hold: ``capacity`` x their ragged length, at least 1."""
        return max(1, ragged_pool(schema, capacity, max(0.0, item_bytes - schema.fixed_item_bytes)))

    def check_pool(self, schema: ExperienceSchema, capacity: int, ragged_capacity: int, item_bytes: float) -> None:
        """Refuse ragged pools that, with the fixed fields of ``capacity`` items, take more bytes than the map
        checked that the placement for ``item_bytes`` holds: the map's capacity x the largest whole item size in
        that range (``ceil(hi) - 1`` for a range ``[lo, hi)``: ``hi`` is where the map found another placement,
        so items of ``hi`` bytes were never checked on this one; the map's maximum when that is smaller).

        Raises:
            PlacementError: the pools exceed it.
            ConfigurationError: ``ragged_capacity`` is not an int.
        """
        pool = pool_elements(ragged_capacity, capacity)
        r = self.map.range_of(item_bytes)
        top = min(r.largest_whole, self.map.max_item_bytes)
        checked = self.map.workload.capacity * top
        fixed = capacity * schema.fixed_item_bytes
        per = sum(schema[n].element_bytes for n in schema.ragged)
        if fixed + pool * per > checked:
            most = max(0, int((checked - fixed) // per))
            raise PlacementError(
                f"A ragged pool of {pool} elements per field takes {pool * per} B, with the fixed fields of {capacity} "
                f"items {fixed + pool * per} B: more than this placement map on {self.map.topology!r} checked that "
                f"{r.spec} holds ({self.map.workload.capacity} items of up to {top:.0f} B, {checked:.0f} B). Pass "
                f"ragged_capacity <= {most} (or None: sized for the planned items), or plan the map for longer "
                f"items (Workload.from_schema(..., mean_ragged_length=N) and a larger max_item_bytes).")

    def storage_abandoned(self, storage: Storage) -> None:
        """``storage``, built by :meth:`storage`, will not be used (a migration into this placement
        failed): :attr:`current` goes back to what it was before, the placement the buffer still uses,
        and a storage that holds resources until it is collected (the disk tier's files) releases
        them now, through its ``close``.

        Only the storage built last is undone (an older one's build was superseded already).
        """
        if self._undo is not None and self._undo[0]() is storage:
            self.current = self._undo[1]
            self._undo = None
        super().storage_abandoned(storage)

    @property
    def spec(self) -> PlacementSpec | None:
        return self.current

    def describe(self) -> str:
        return f"adaptive ({self.current})"

    def observed_item_bytes(self, edp: ExperienceDataPlane) -> float:
        """Mean payload bytes per item over the last ``window`` ingestion calls (with none:
        ``schema.item_bytes(mean_ragged_length)``).

        Counted as the map was planned (:meth:`ExperienceSchema.item_bytes`,
        :meth:`Workload.from_schema`): the fields' elements only, not the 8 B length per item
        and ragged field that the telemetry's byte counts include. So the same items give the
        same size, whether observed or assumed.

        Only ingestion since the buffer's schema last changed (a migration to a grown schema)
        counts: calls before it stored items of the old schema, a size the buffer no longer has.
        """
        recs = edp.telemetry.recent("ingest", self.window)
        since = self._current_schema_since(edp)
        recs = [r for r in recs if r.start >= since]
        items = sum(r.items for r in recs)
        if not items:
            return float(edp.schema.item_bytes(self.mean_ragged_length))
        return max(0.0, sum(r.nbytes for r in recs) / items - 8 * len(edp.schema.ragged))

    def _current_schema_since(self, edp: ExperienceDataPlane) -> float:
        """When ``edp``'s ingestion started storing items of its current schema (``-inf``: always has).

        A schema change is a migration: the end of the buffer's latest one when the change is first
        seen (a later placement-only migration seen together with it only drops a few calls more).
        """
        changes = len(edp._upgrades)
        seen = self._schema_seen.get(edp)
        if seen is not None and seen[0] == changes:
            return seen[1]
        since = -math.inf
        if changes:
            last = edp.telemetry.recent("migrate", 1)
            since = last[-1].end if last else time.perf_counter()
        self._schema_seen[edp] = (changes, since)
        return since

    def rebalance(self, edp: ExperienceDataPlane, *, item_bytes: float | None = None,
                  schema: ExperienceSchema | None = None,
                  transform: Callable[[ExperienceBatch], Any] | None = None) -> MigrationReport | None:
        """Migrate ``edp`` if the map places the current item size elsewhere than where its storage
        lives now (read from the storage, so a manual ``edp.migrate`` counts; no re-profiling).

        The size is ``item_bytes`` if given, else the new ``schema``'s (when the schema
        changes, e.g. a larger observation), else what recent ingestion observed.

        Returns:
            The migration's report, or None when the placement stays.

        Raises:
            PlacementError: nothing fits the size, or it exceeds the map's planned maximum
                (see :meth:`PlacementMap.lookup`), or the buffer holds more items than the map was
                planned for (a buffer built by another placement: see :meth:`storage`), or its ragged
                pools (after a move: the target's, see below) take more memory than the map checked
                for the placement (:meth:`check_pool`), or the migration failed; nothing was migrated
                and the buffer is unchanged.
            ConfigurationError: ``item_bytes`` is no real number, NaN or negative (the buffer is unchanged); or
                another rebalance of this placement runs and this thread holds the buffer's lock (see below;
                nothing changed: call it after the locked function returns).

        A move sizes the target's ragged pools for the new size (:meth:`pool_for`), never below the
        current pools (which hold the live items: none is lost).

        Calls run one at a time (one migration at a time): a call from another thread waits for the one
        running, then decides from where the storage lives by then, so the buffer stays on this placement and
        :attr:`current` names the placement its storage is in. A call that would wait holding the buffer's lock
        (inside ``edp.read_locked()``, or a callback the buffer runs under it) is refused instead: the running
        migration needs that lock.
        """
        if not self._rebalancing.acquire(blocking=not edp.holds_lock()):
            raise ConfigurationError(
                "This rebalance would wait for another rebalance of the placement, which runs a migration that "
                "needs the buffer's lock that this thread holds (inside read_locked(), or a callback the buffer "
                "runs under its lock): it would wait forever. Nothing was changed; call it after the locked "
                "function returns.")
        try:
            return self._rebalance(edp, item_bytes, schema, transform)
        finally:
            self._rebalancing.release()

    def _rebalance(self, edp: ExperienceDataPlane, item_bytes: float | None, schema: ExperienceSchema | None,
                   transform: Callable[[ExperienceBatch], Any] | None) -> MigrationReport | None:
        """:meth:`rebalance`, holding ``_rebalancing``."""
        # (a buffer built by another placement was never checked against the plan: neither a move nor a stay
        # on the map's placement says anything about it)
        self._check_capacity(edp.storage.capacity)
        if item_bytes is None:
            item_bytes = (schema.item_bytes(self.mean_ragged_length) if schema is not None
                          else self.observed_item_bytes(edp))
        spec = self.map.lookup(item_bytes)
        target = spec.build(directory=self.directory)
        cap, new_schema = edp.storage.capacity, schema if schema is not None else edp.schema
        pool = getattr(edp.storage, "ragged_capacity", None) if edp.schema.ragged else None
        # compared with where the storage lives now, not with where this placement last put it (:attr:`current`):
        # a manual ``edp.migrate``, or a buffer built by another placement, moved it without telling us
        if target.spec == storage_spec(edp.storage) and schema is None:
            if pool is not None:
                self.check_pool(new_schema, cap, pool, item_bytes)
            return None
        if new_schema.ragged:
            pool = max(pool or 0, self.pool_for(new_schema, cap, item_bytes))
            self.check_pool(new_schema, cap, pool, item_bytes)
        owner = edp.placement
        report = edp.migrate(target, schema=schema, transform=transform, ragged_capacity=pool)
        with edp.lock:  # (read together with the storage: a reader under the lock sees both or neither)
            if owner is self:  # the buffer keeps following the map
                edp.placement = self
            self.current = spec
            self.migrations.append(report)
        return report
