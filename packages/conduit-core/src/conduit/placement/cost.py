"""The cost model: predicted ingestion and delivery latency, and memory, of a candidate placement.

Every prediction is built from the steps the implementation executes, each priced by a
:class:`~conduit.placement.LinkCost` (per-call overhead + bytes at the effective bandwidth
for that transfer size), and only those:

* **ingest** (actor -> buffer), per call (:meth:`CostModel.ingest_steps`): the EDP's per-call
  overhead plus, per field, the write into the tier from the actor's pageable host tensor.
  Host tiers: a host copy. One GPU (``ColumnarStorage.append``): a synchronous pageable
  host-to-device copy from the actor's tensor. Disk: a write into a memory-mapped file.
  GPU shards (``ShardedStorage.append``) are *staged*: per shard and field, the calling
  thread gathers the shard's rows into that shard's page-locked buffer (a host copy) and
  issues a ``non_blocking`` copy, a DMA at the *pinned* host-link rate that runs on the
  GPU's host link while the thread packs the next shard; so the shards' host links fill in
  parallel. GPUs behind one PCIe switch (the topology's ``host_link_groups``, e.g. DGX A100
  pairs 0/1, 2/3, 4/5, 6/7) share its uplink: their DMAs queue on it. A call lasts until
  its last DMA has landed (:attr:`IngestSteps.total_s`).
* **deliver** (buffer -> learner), per iteration and learner (:meth:`CostModel.delivery_steps`):
  the EDP's per-call overhead plus, per field, a random-row gather on the tier (host, GPU
  memory, shard by shard, or a memory-mapped file) and the move to the learner's device
  (pinned H2D from a host tier, P2P between GPUs). A sharded delivery
  (``ShardedStorage.gather``) also uploads, per GPU shard, its row indices to that GPU and,
  per field, the output positions to the gathering GPU (small pageable host-to-device
  copies on the calling thread): the more shards, the more uploads. Work on different GPUs
  overlaps: a sharded delivery costs its calls (issued one after another by one thread)
  plus the slowest shard's gather and move, plus the scatter of every shard's rows into the
  output on the gathering device.
* **ragged fields** of a sharded placement (``Workload.ragged``): ``ShardedStorage`` keeps their
  pools whole on its first device, so they are priced there and not split over the shards: ingested
  with one synchronous pageable copy into the pools before the shards' writes, delivered by one
  gather from the pools on the gathering device after the shards' scatter.

Learner ``l`` sits on ``cuda:l`` when the topology has GPUs, else on the host. Deliveries
to several learners are serialised (the EDP delivers one call at a time). Not priced: the
staging's event record/wait per shard (microseconds), the second write of a call that
wraps around the ring, ragged fields beyond their mean bytes, and what a scheduler adds
(a coalescing scheduler's grouped copy, overlap of ingestion with delivery).

Memory: the columns plus the delivery output buffers (``output_depth`` batches on the
gathering device and on each learner device), times ``1 + headroom``, must fit the
usable share of each device's memory. A sharded placement spreads the fixed fields' columns
over its shards and charges the ragged fields' pools (``Workload.ragged``) whole to its first
device, where ``ShardedStorage`` keeps them. Every tier also keeps, per ragged field, each item's
start and length in its pool (two int64) in host memory: charged to the host.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import torch

from conduit.checks import is_int, is_real
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement.base import PlacementSpec
from conduit.placement.profile import BandwidthProfile, LinkCost, _check_size
from conduit.placement.topology import Topology
from conduit.schema import ExperienceSchema, Field

__all__ = ["Workload", "Estimate", "CostModel", "IngestStep", "IngestSteps", "DeliverySteps", "transition_schema"]


def _exact(share: float) -> Fraction:
    """``share`` as the decimal it was written as (``0.29`` is 29/100, not the binary float just below it).

    Memory shares and headroom multiply byte counts; in floats ``100 * 0.29`` is
    ``28.999...`` and ``102000 * 1.1`` is ``112200.00000000001``, which would move a buffer
    that exactly fills a device across the boundary.
    """
    return Fraction(repr(float(share)))


def _amount(nbytes: float | Fraction) -> str:
    """``nbytes`` in GiB, or in the largest smaller unit where a tenth of a GiB would read as nothing."""
    b = float(nbytes)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size / 10:
            return f"{b / size:.1f} {unit}"
    return f"{math.ceil(b)} B"


def transition_schema(obs_dim: int, dtype: torch.dtype = torch.float32) -> ExperienceSchema:
    """The paper's synthetic transition: ``obs``, ``next_obs`` (``obs_dim`` each), action, reward, done."""
    return ExperienceSchema(obs=Field((obs_dim,), dtype), next_obs=Field((obs_dim,), dtype),
                            action=Field((), torch.int64), reward=Field((), torch.float32),
                            done=Field((), torch.bool))


def _field_indices(name: str, indices: object, fields: int) -> tuple[int, ...]:
    """``indices`` as a tuple of distinct field indices ``0 .. fields - 1``.

    Raises:
        ConfigurationError: not a collection of such ints (a bool, a negative or too large index, one twice).
    """
    out: tuple[object, ...] | None = None
    if isinstance(indices, Iterable) and not isinstance(indices, (str, bytes)):
        out = tuple(indices)
    if (out is None or any(not is_int(i) or not 0 <= int(i) < fields
                           for i in out)
            or len(set(out)) != len(out)):
        raise ConfigurationError(f"{name} must hold distinct indices of field_bytes (ints 0 .. {fields - 1}), got "
                                 f"{indices!r}.")
    return tuple(int(i) for i in out)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Workload:
    """What a buffer holds and how one training iteration uses it.

    Args:
        field_bytes: bytes per item of each column (ragged fields: at their mean length); a fractional
            size is rounded up to whole bytes, so memory checks count at least what the items take.
        capacity: item slots.
        batch: items per delivery, per learner.
        learners: learners, each taking one delivery per iteration.
        ingest_items: items per ingestion call (default ``batch * learners``: one call per iteration).
        growing: indices of the fields that grow with experience size (default: all);
            :meth:`resized` scales only these, so at least one, each named once.
        name: a label for reports.
        scalar: indices of the fields with one element per item (1-D columns, gathered
            by a different kernel than rows).
        ragged: indices of the ragged (variable-length) fields (:meth:`from_schema` sets them). A
            sharded storage keeps their pools whole on its first device, so the cost model prices
            them there: their memory, ingestion and delivery are not split over the shards.

    Raises:
        ConfigurationError: a count that is not a positive int, ``batch`` above ``capacity``, or
            ``growing`` / ``scalar`` / ``ragged`` holding something other than distinct indices of
            ``field_bytes`` (``growing`` also empty: :meth:`resized` could not reach any other size).
    """

    field_bytes: tuple[int, ...]
    capacity: int
    batch: int
    learners: int = 1
    ingest_items: int | None = None
    growing: tuple[int, ...] | None = None
    name: str = ""
    scalar: tuple[int, ...] = ()
    ragged: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (not self.field_bytes or any(not is_real(b) or not 0 <= b < math.inf
                                        for b in self.field_bytes)):
            raise ConfigurationError(f"field_bytes must be non-empty, each a finite number >= 0, got "
                                     f"{self.field_bytes}.")
        for nm in ("capacity", "batch", "learners"):
            v = getattr(self, nm)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigurationError(f"{nm} must be a positive int, got {v!r}.")
        items = self.ingest_items
        if items is not None and (isinstance(items, bool) or not isinstance(items, int) or items <= 0):
            raise ConfigurationError(f"ingest_items must be a positive int (or None), got {self.ingest_items!r}.")
        if self.batch > self.capacity:
            raise ConfigurationError(f"batch ({self.batch}) exceeds capacity ({self.capacity}).")
        # rounded up, as from_schema and resized round: a fractional size (a ragged field's mean bytes) truncated
        # would plan less memory than the items take
        object.__setattr__(self, "field_bytes", tuple(math.ceil(b) for b in self.field_bytes))
        if self.growing is not None:
            object.__setattr__(self, "growing", _field_indices("growing", self.growing, len(self.field_bytes)))
            if not self.growing:
                raise ConfigurationError("growing must name at least one field (or be None: all of them grow); "
                                         "with none, resized() could not reach any other item size.")
        object.__setattr__(self, "scalar", _field_indices("scalar", self.scalar, len(self.field_bytes)))
        object.__setattr__(self, "ragged", _field_indices("ragged", self.ragged, len(self.field_bytes)))

    @property
    def item_bytes(self) -> int:
        return sum(self.field_bytes)

    @property
    def calls_per_iteration(self) -> float:
        """Ingestion calls per iteration."""
        items = self.ingest_items or self.batch * self.learners
        return self.batch * self.learners / items

    @property
    def ingest_call_items(self) -> int:
        return self.ingest_items or self.batch * self.learners

    @classmethod
    def from_schema(cls, schema: ExperienceSchema, *, capacity: int, batch: int, learners: int = 1,
                    ingest_items: int | None = None, mean_ragged_length: float = 0.0, name: str = "") -> Workload:
        """The workload of ``schema`` items (ragged fields counted at ``mean_ragged_length`` elements, each
        field's bytes rounded up to a whole byte: the plan never counts less than the mean takes).

        Raises:
            ConfigurationError: ``mean_ragged_length`` is NaN, infinite or negative (or a count is invalid).
        """
        if (not is_real(mean_ragged_length)
                or not 0 <= mean_ragged_length < math.inf):
            raise ConfigurationError(f"mean_ragged_length must be a finite number >= 0, got {mean_ragged_length!r}.")
        fb = []
        for n in schema:
            f = schema[n]
            # (rounded up: a mean below half an element would plan no bytes, so no pool, and any rounding down
            # pools that hold fewer elements than capacity items at the mean take)
            fb.append(math.ceil(f.element_bytes * (mean_ragged_length if f.ragged else 1)))
        growing = tuple(i for i, n in enumerate(schema) if schema[n].ragged or schema[n].item_numel > 1) or None
        scalar = tuple(i for i, n in enumerate(schema) if not schema[n].ragged and schema[n].item_numel == 1)
        ragged = tuple(i for i, n in enumerate(schema) if schema[n].ragged)
        return cls(tuple(fb), capacity, batch, learners, ingest_items, growing, name, scalar, ragged)

    @classmethod
    def transitions(cls, obs_dim: int, *, capacity: int, batch: int, learners: int = 1,
                    ingest_items: int | None = None, dtype: torch.dtype = torch.float32) -> Workload:
        """The paper's synthetic workload: transitions of observation size ``obs_dim``."""
        if not isinstance(obs_dim, int) or obs_dim <= 0:
            raise ConfigurationError(f"obs_dim must be a positive int, got {obs_dim!r}.")
        return cls.from_schema(transition_schema(obs_dim, dtype), capacity=capacity, batch=batch, learners=learners,
                               ingest_items=ingest_items, name=f"transitions(d={obs_dim})")

    def resized(self, item_bytes: float) -> Workload:
        """The same workload (of the same class, every other field kept) with items of ``item_bytes``
        (only the growing fields change). A fractional size is rounded up to whole bytes: memory checks
        then count at least what the items hold.

        Raises:
            ConfigurationError: ``item_bytes`` is NaN, infinite or negative.
        """
        if not is_real(item_bytes) or not 0 <= item_bytes < math.inf:
            raise ConfigurationError(f"item_bytes must be a finite number >= 0, got {item_bytes!r}.")
        grow = self.growing if self.growing is not None else tuple(range(len(self.field_bytes)))
        fixed = sum(b for i, b in enumerate(self.field_bytes) if i not in grow)
        g_now = sum(self.field_bytes[i] for i in grow)
        target = max(0.0, float(item_bytes) - fixed)
        fb = list(self.field_bytes)
        exact = {i: target * (self.field_bytes[i] / g_now if g_now else 1.0 / len(grow)) for i in grow}
        for i in grow:
            fb[i] = int(math.floor(exact[i]))
        # hand the bytes lost to rounding down to the largest remainders: the item is item_bytes, rounded up
        short = int(math.ceil(target)) - sum(fb[i] for i in grow)
        for i in sorted(grow, key=lambda i: (-(exact[i] - fb[i]), i))[:max(0, short)]:
            fb[i] += 1
        # (replace: a subclass, e.g. the simulation's ReplayWorkload, keeps its own fields and kind)
        return replace(self, field_bytes=tuple(fb), name=self.name and f"{self.name}@{int(item_bytes)}B")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "item_bytes": self.item_bytes, "field_bytes": list(self.field_bytes),
                "capacity": self.capacity, "batch": self.batch, "learners": self.learners,
                "ingest_items": self.ingest_call_items}


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one placement and workload (seconds per iteration, bytes)."""

    spec: PlacementSpec
    ingest_s: float
    deliver_s: float
    #: device -> bytes the placement needs there (columns + output buffers, before headroom)
    memory: dict[str, int]
    #: device -> bytes usable there
    usable: dict[str, int]
    headroom: float
    #: named parts of the latency ("ingest: copy", "deliver: transfer", ...) in seconds
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        """Experience-path latency per iteration: ingestion plus delivery."""
        return self.ingest_s + self.deliver_s

    def shortfalls(self) -> list[str]:
        """One sentence per device the placement does not fit on (empty when feasible)."""
        out = []
        for dev, need in self.memory.items():
            want = need * (1 + _exact(self.headroom))  # exact: a buffer that exactly fills the device fits
            have = self.usable.get(dev, 0)
            if want > have:
                want_s, have_s = _amount(want), _amount(have)
                if want_s == have_s:  # a near miss: in bytes, so the message shows the difference
                    want_s, have_s = f"{math.ceil(want)} B", f"{have} B"
                out.append(f"needs {want_s} on {dev} (with {self.headroom:.0%} headroom), {have_s} usable")
        return out

    @property
    def feasible(self) -> bool:
        return not self.shortfalls()

    def to_dict(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "ingest_ms": self.ingest_s * 1e3, "deliver_ms": self.deliver_s * 1e3,
                "total_ms": self.total_s * 1e3, "memory_bytes": dict(self.memory), "usable_bytes": dict(self.usable),
                "feasible": self.feasible, "breakdown_ms": {k: v * 1e3 for k, v in self.breakdown.items()}}


@dataclass(frozen=True)
class IngestStep:
    """One step of an ingestion call (seconds).

    ``cpu_s`` runs on the calling thread: a copy it makes itself, or the packing and issue
    cost of an asynchronous one. When ``resource`` is set (``"hostlink:g"``: host link
    ``g``), ``link_s`` then runs there without holding the thread (a DMA), queued behind
    earlier steps on the same resource. ``shard`` is the shard whose page-locked staging
    buffer the step rewrites (``None``: none), which waits for that shard's previous copies.
    """

    cpu_s: float
    resource: str | None = None
    link_s: float = 0.0
    shard: int | None = None


@dataclass(frozen=True)
class IngestSteps:
    """One ingestion call as the steps it runs, in issue order.

    The calling thread runs ``calls_s`` (the EDP's call), then every step's ``cpu_s`` one
    after another; each step's asynchronous part starts when its thread part is done and
    its resource is free.
    """

    calls_s: float
    steps: tuple[IngestStep, ...]

    @property
    def thread_s(self) -> float:
        """The steps' time on the calling thread (without the EDP call)."""
        return sum(s.cpu_s for s in self.steps)

    @property
    def total_s(self) -> float:
        """Until the thread is done and every asynchronous copy it issued has landed."""
        t = self.calls_s
        free: dict[str, float] = {}
        for s in self.steps:
            t += s.cpu_s
            if s.resource is not None:
                free[s.resource] = max(t, free.get(s.resource, 0.0)) + s.link_s
        return max(t, *free.values()) if free else t


@dataclass(frozen=True)
class DeliverySteps:
    """One delivery to one learner, as the resources it occupies (seconds).

    ``calls_s`` (the EDP call, every gather, copy and index upload issued, one after
    another) runs on the calling thread; then every shard at once: ``(device, gather_s,
    move_s)``, the gather on that device, then its rows over the link to ``home``
    (``move_s`` 0 for the home shard); then ``scatter_s`` on ``home`` (the shards' rows into
    the output, and the ragged fields' gathers from their pools there), then ``transfer_s``
    from ``home`` to ``learner`` (0 when they are one device). ``home`` is ``"cpu"`` for host
    tiers and ``"disk"`` for the disk tier; an unsharded tier has one "shard" and no scatter.
    """

    calls_s: float
    shards: tuple[tuple[str, float, float], ...]
    home: str
    scatter_s: float
    transfer_s: float
    learner: str

    @property
    def total_s(self) -> float:
        slowest = max((g + m for _, g, m in self.shards), default=0.0)
        return self.calls_s + slowest + self.scatter_s + self.transfer_s


#: bytes of one row index or output position (int64) a sharded delivery uploads
_INDEX_BYTES = 8
#: host bytes per item and ragged field whatever the tier: its start and length in the pool (two int64s,
#: ``ColumnarStorage``'s ragged index)
_RAGGED_INDEX_BYTES = 16


def _check_disk_directory(topology: Topology, profile: BandwidthProfile) -> None:
    """Refuse a measured profile whose disk tier was measured on another directory than the one whose free space the
    discovered ``topology`` offers (``discover_topology(disk_directory=...)``): the volume decides ``disk_read`` and
    ``disk_write``, so its disk tier would be priced at another volume's speed. Said only where both name theirs.

    Raises:
        PlacementError: the two directories differ (compared as real paths).
    """
    measured, offered = profile.details.get("disk_directory"), topology.details.get("disk_directory")
    if profile.source != "measured" or not isinstance(measured, str) or not isinstance(offered, str):
        return
    if os.path.realpath(measured) != os.path.realpath(offered):
        raise PlacementError(
            f"This bandwidth profile measured the disk tier in {measured}, but topology {topology.name!r} offers the "
            f"disk tier in {offered}: its disk_read and disk_write are another volume's. Measure there, "
            f"profile_machine(disk_directory={offered!r}), or discover the topology with "
            f"discover_topology(disk_directory={measured!r}).")


def _cuda_index(device: str) -> int | None:
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else None


class CostModel:
    """Predicts latency and memory of placements on one topology from one bandwidth profile.

    Args:
        topology: the devices and their memory.
        profile: the path costs (default: the topology's declared figures; a discovered
            topology needs a measured profile, see :func:`~conduit.placement.profile_machine`).
            With a declared topology, the profile's figures replace the declared ones path by
            path and the declared ones fill the rest.

    Keyword Args:
        headroom: extra memory kept free beyond what the buffer needs (fraction of it).
        gpu_usable: share of each GPU's memory the buffer may use (the rest is the learner's).
        host_usable: share of host memory the buffer may use.
        disk_usable: share of the disk tier's free space the buffer may use.
        output_depth: delivery output buffers kept alive (the scheduler's ``output_depth``).

    Raises:
        PlacementError: no profile for this topology, or a measured profile from another machine, or (on a
            discovered topology) one whose disk tier was measured in another directory than the topology's.
    """

    def __init__(self, topology: Topology, profile: BandwidthProfile | None = None, *, headroom: float = 0.1,
                 gpu_usable: float = 0.9, host_usable: float = 0.75, disk_usable: float = 0.9,
                 output_depth: int = 2) -> None:
        prof = profile if profile is not None else topology.declared
        if prof is None:
            raise PlacementError(f"Topology {topology.name!r} declares no link figures; measure this machine with "
                                 f"conduit.placement.profile_machine() (or `conduit profile`) and pass the profile.")
        if topology.source == "discovered":
            prof.check_machine()
            _check_disk_directory(topology, prof)
        if profile is not None and topology.declared is not None and profile is not topology.declared:
            # measured figures where the profile has them, the declared ones for the rest
            # (declared_paths: the paths priced by the declared figures, which a plan's provenance names)
            prof = BandwidthProfile({**topology.declared.links, **profile.links}, source=profile.source,
                                    machine=profile.machine, created=profile.created,
                                    details={**profile.details, "declared_fallback": topology.name,
                                             "declared_paths": sorted(set(topology.declared.links)
                                                                      - set(profile.links))})
        for nm, v in (("headroom", headroom), ("gpu_usable", gpu_usable), ("host_usable", host_usable),
                      ("disk_usable", disk_usable)):
            most = 10 if nm == "headroom" else 1
            if not is_real(v) or not (0 <= v <= most):
                raise ConfigurationError(f"{nm} must be a number from 0 to {most} (a fraction), got {v!r}.")
        if isinstance(output_depth, bool) or not isinstance(output_depth, int) or output_depth < 1:
            raise ConfigurationError(f"output_depth must be an int >= 1 (the scheduler's output_depth), got "
                                     f"{output_depth!r}.")
        self.topology = topology
        self.profile = prof
        self.headroom = headroom
        self.gpu_usable = gpu_usable
        self.host_usable = host_usable
        self.disk_usable = disk_usable
        self.output_depth = output_depth

    # -- devices -----------------------------------------------------------------------------
    def learner_devices(self, workload: Workload) -> list[str]:
        """Where the learners sit: ``cuda:0 .. cuda:L-1`` with GPUs, else the host."""
        n = self.topology.num_gpus
        if not n:
            return ["cpu"] * workload.learners
        if workload.learners > n:
            raise PlacementError(f"{workload.learners} learners need {workload.learners} GPUs but topology "
                                 f"{self.topology.name!r} has {n}; use --learners {n} or fewer.")
        return [f"cuda:{i}" for i in range(workload.learners)]

    def usable_bytes(self, device: str) -> int:
        """Bytes of ``device`` the buffer may use: its memory times its usable share, rounded down (exactly)."""
        mem = self.topology.memory_of(device)
        share = self.host_usable if device == "cpu" else self.disk_usable if device == "disk" else self.gpu_usable
        return math.floor(mem * _exact(share))

    # -- memory ------------------------------------------------------------------------------
    def memory(self, spec: PlacementSpec, workload: Workload) -> dict[str, int]:
        """Bytes the placement needs per device: columns + delivery output buffers (+ on the host, the ragged
        pools' index: a start and a length per item and ragged field, and for GPU shards the page-locked staging
        each (shard, fixed field) keeps for one ingestion call's share of rows)."""
        item = workload.item_bytes
        out = self.output_depth * workload.batch * item
        need: dict[str, int] = {}

        def add(dev: str, b: int) -> None:
            need[dev] = need.get(dev, 0) + int(b)

        if spec.tier in ("host", "pinned"):
            add("cpu", workload.capacity * item)
            home = "cpu"
        elif spec.tier == "gpu":
            add(spec.devices[0], workload.capacity * item)
            home = spec.devices[0]
        elif spec.tier == "sharded":
            # fixed fields interleave over the shards; the ragged pools stay whole on the first device
            # (``ShardedStorage`` keeps them in one ``ColumnarStorage`` there)
            pools = sum(workload.field_bytes[i] for i in workload.ragged)
            k = len(spec.devices)
            for i, d in enumerate(spec.devices):
                add(d, ((workload.capacity - i + k - 1) // k) * (item - pools))
            add(spec.devices[0], workload.capacity * pools)
            if any(_cuda_index(d) is not None for d in spec.devices):  # (a call's rows go at most ceil(n / k) a shard)
                add("cpu", k * -(-min(workload.ingest_call_items, workload.capacity) // k) * (item - pools))
            home = spec.devices[0]
        else:
            add("disk", workload.capacity * item)
            home = "cpu"
        if workload.ragged:  # the pools' index of every item, in host memory on every tier
            add("cpu", workload.capacity * len(workload.ragged) * _RAGGED_INDEX_BYTES)
        add(home, out)
        for ld in sorted(set(self.learner_devices(workload))):
            if ld != home:
                add(ld, out)
        return need

    # -- latency -----------------------------------------------------------------------------
    def _gather(self, device: str, workload: Workload | None = None, field: int = -1,
                column_rows: float = 0) -> LinkCost:
        """The gather path on ``device`` for field ``field`` (a column of ``column_rows`` items).

        On the host, scalar columns use the 1-D gather figures, in or out of cache by the
        column's size against the last-level cache; wide rows use the row-gather figures.
        """
        if device == "disk":
            return self.profile.link("disk_read")
        i = _cuda_index(device)
        if i is not None:
            return self.profile.link("gpu_gather", i)
        if workload is not None and field in workload.scalar:
            column = column_rows * workload.field_bytes[field]
            llc = int(self.profile.details.get("llc_bytes", 0))
            kind = "host_gather_scalar_cached" if column <= llc // 2 else "host_gather_scalar"
            if kind in self.profile.links:
                return self.profile.links[kind]
        return self.profile.link("host_gather")

    def _move(self, src: str, dst: str, *, pinned: bool) -> LinkCost | None:
        """The path from ``src`` to ``dst`` (None when they are the same memory)."""
        si, di = _cuda_index(src), _cuda_index(dst)
        if si is None and di is None:
            return None
        if si is not None and di is not None:
            return None if si == di else self.profile.link("p2p", si, di)
        if si is None:
            assert di is not None
            return self.profile.link("h2d_pinned" if pinned else "h2d_pageable", di)
        assert si is not None
        return self.profile.link("d2h_pinned" if pinned else "d2h_pageable", si)

    def host_link_group(self, gpu: int) -> int:
        """The host link GPU ``gpu`` reaches host memory through.

        With ``host_link_groups`` in the topology (GPUs behind one PCIe switch share its
        uplink), the index of its group; otherwise its own link, numbered after the groups.
        """
        groups = self.topology.details.get("host_link_groups") or ()
        for g, members in enumerate(groups):
            if gpu in members:
                return g
        return len(groups) + gpu

    def ingest_steps(self, spec: PlacementSpec, workload: Workload) -> IngestSteps:
        """One ingestion call of ``workload.ingest_call_items`` items from actors' pageable host tensors,
        step by step, as the storage of ``spec``'s tier runs it (see the module docstring)."""
        items = workload.ingest_call_items
        edp = self.profile.link("edp_ingest").overhead_s
        fields = workload.field_bytes
        if spec.tier != "sharded":
            if spec.tier in ("host", "pinned"):
                link = self.profile.link("host_copy")
            elif spec.tier == "disk":
                link = self.profile.link("disk_write")
            else:  # ColumnarStorage on one GPU: a synchronous copy from the actor's pageable tensor
                link = self._move("cpu", spec.devices[0], pinned=False) or self.profile.link("host_copy")
            return IngestSteps(edp, tuple(IngestStep(link.seconds(fb * items)) for fb in fields))
        k = len(spec.devices)
        pack = self.profile.link("host_copy")
        # the ragged pools first (ShardedStorage.append writes them before the shards): a synchronous copy from the
        # actor's pageable tensor into the pools, whole, on the first device
        pool_link = self._move("cpu", spec.devices[0], pinned=False) or pack
        steps = [IngestStep(pool_link.seconds(fields[f] * items)) for f in workload.ragged]
        for s, d in enumerate(spec.devices):
            i = _cuda_index(d)
            for fb in (fb for f, fb in enumerate(fields) if f not in workload.ragged):
                b = fb * items / k
                if i is None:  # a host shard takes its rows directly
                    steps.append(IngestStep(pack.seconds(b)))
                    continue
                dma = self.profile.link("h2d_pinned", i)
                steps.append(IngestStep(pack.seconds(b) + dma.overhead_s, f"hostlink:{self.host_link_group(i)}",
                                        dma.seconds(b) - dma.overhead_s, s))
        return IngestSteps(edp, tuple(steps))

    def ingest(self, spec: PlacementSpec, workload: Workload) -> tuple[float, dict[str, float]]:
        """Seconds per iteration to ingest ``batch * learners`` items from actors' host tensors.

        Parts: ``ingest: edp`` (the call), ``ingest: copy`` (the copies on the calling thread;
        for GPU shards, the DMAs still running once it is done) and, for GPU shards,
        ``ingest: stage`` (packing each shard's rows into page-locked memory and issuing its DMAs).
        Calls of one iteration are priced one after another.
        """
        st = self.ingest_steps(spec, workload)
        thread = st.thread_s
        parts = {"ingest: edp": st.calls_s}
        if any(s.resource is not None for s in st.steps):
            parts["ingest: stage"] = thread
            parts["ingest: copy"] = max(0.0, st.total_s - st.calls_s - thread)
        else:
            parts["ingest: copy"] = thread
        scale = workload.calls_per_iteration
        parts = {k: v * scale for k, v in parts.items()}
        return sum(parts.values()), parts

    def delivery_steps(self, spec: PlacementSpec, workload: Workload, learner: str) -> DeliverySteps:
        """One delivery of ``workload.batch`` items to a learner on ``learner``, step by step."""
        rows = workload.batch
        fields = list(enumerate(workload.field_bytes))
        edp = self.profile.link("edp_deliver").overhead_s
        if spec.tier != "sharded":
            src = spec.devices[0] if spec.tier == "gpu" else "cpu"
            where = "disk" if spec.tier == "disk" else src
            gather = sum(self._gather(where, workload, f, workload.capacity).seconds(fb * rows, rows)
                         for f, fb in fields)
            calls = edp
            gi = _cuda_index(src)
            if gi is not None:  # one GPU: the drawn rows' indices go up once per gather
                calls += self.profile.link("h2d_pageable", gi).seconds(_INDEX_BYTES * rows)
            link = self._move(src, learner, pinned=src == "cpu")
            transfer = sum(link.seconds(fb * rows) for _, fb in fields) if link is not None else 0.0
            return DeliverySteps(calls, ((where, gather, 0.0),), where, 0.0, transfer, learner)
        k = len(spec.devices)
        home = spec.devices[0]
        hi = _cuda_index(home)
        share = rows / k
        calls = edp
        scatter = 0.0
        # the ragged fields are gathered from their pools, whole on the first device, after the shards
        for f, fb in fields:
            if f in workload.ragged:
                scatter += self._gather(home, workload, f, workload.capacity).seconds(fb * rows, rows)
        fields = [(f, fb) for f, fb in fields if f not in workload.ragged]
        for f, fb in fields:
            scatter += k * self._gather(home, workload, f, rows).seconds(fb * share, share)
        shards = []
        for d in spec.devices:
            i = _cuda_index(d)
            if i is not None:  # the shard's row indices, to its GPU
                calls += self.profile.link("h2d_pageable", i).seconds(_INDEX_BYTES * share)
            move = self._move(d, home, pinned=False)
            g_s = m_s = 0.0
            for f, fb in fields:
                if hi is not None:  # this field's output positions, to the gathering GPU
                    calls += self.profile.link("h2d_pageable", hi).seconds(_INDEX_BYTES * share)
                g = self._gather(d, workload, f, workload.capacity / k)
                calls += g.overhead_s
                g_s += g.seconds(fb * share, share) - g.overhead_s
                if move is not None:
                    calls += move.overhead_s
                    m_s += move.seconds(fb * share) - move.overhead_s
            shards.append((d, g_s, m_s))
        link = self._move(home, learner, pinned=False)
        transfer = sum(link.seconds(fb * rows) for _, fb in fields) if link is not None else 0.0
        return DeliverySteps(calls, tuple(shards), home, scatter, transfer, learner)

    def deliver_one(self, spec: PlacementSpec, workload: Workload, learner: str) -> dict[str, float]:
        """Latency parts of one delivery of ``batch`` items to a learner on ``learner``.

        ``deliver: gather`` and the shard part of ``deliver: transfer`` are the slowest
        shard's; ``deliver: calls`` holds the index uploads to GPUs (a sharded delivery's
        also every gather and copy issued), and a sharded delivery adds ``deliver: scatter``.
        """
        st = self.delivery_steps(spec, workload, learner)
        edp = self.profile.link("edp_deliver").overhead_s
        _, g, m = max(st.shards, key=lambda x: x[1] + x[2])
        parts = {"deliver: edp": edp, "deliver: gather": g, "deliver: transfer": m + st.transfer_s}
        if st.calls_s > edp:
            parts["deliver: calls"] = st.calls_s - edp
        if spec.tier == "sharded":
            parts["deliver: scatter"] = st.scatter_s
        return parts

    def deliver(self, spec: PlacementSpec, workload: Workload) -> tuple[float, dict[str, float]]:
        """Seconds per iteration to deliver one batch to every learner (deliveries are serialised)."""
        total: dict[str, float] = {}
        for ld in self.learner_devices(workload):
            for k, v in self.deliver_one(spec, workload, ld).items():
                total[k] = total.get(k, 0.0) + v
        return sum(total.values()), total

    def estimate(self, spec: PlacementSpec, workload: Workload) -> Estimate:
        """Latency and memory of ``spec`` for ``workload``."""
        for d in spec.devices:
            if d not in ("cpu", "disk"):
                self.topology.memory_of(d)  # raises for a device the topology lacks
        ti, pi = self.ingest(spec, workload)
        td, pd = self.deliver(spec, workload)
        need = self.memory(spec, workload)
        usable = {d: self.usable_bytes(d) for d in need}
        return Estimate(spec, ti, td, need, usable, self.headroom, {**pi, **pd})

    def move_seconds(self, nbytes: float, src: PlacementSpec, dst: PlacementSpec) -> float:
        """Predicted time to copy ``nbytes`` of live items from placement ``src`` to ``dst`` (a migration).

        The bytes are read with the source's gather path and written with the destination's
        ingestion path, spread over the destination's devices; GPU to GPU uses P2P.

        Raises:
            ConfigurationError: ``nbytes`` is no real number, NaN, infinite or negative.
        """
        _check_size("nbytes", nbytes)
        if nbytes <= 0:
            return 0.0
        chunk = 64 << 20
        calls = max(1, math.ceil(nbytes / chunk))
        per = nbytes / calls
        src_dev = src.devices[0] if src.tier in ("gpu", "sharded") else "cpu"
        read = self.profile.link("disk_read") if src.tier == "disk" else self._gather(src_dev)
        t = calls * read.seconds(per)
        dsts = dst.devices if dst.tier in ("gpu", "sharded") else ("cpu",)
        k = len(dsts)
        slowest = 0.0
        for d in dsts:
            link = self._move(src_dev, d, pinned=False)
            if dst.tier == "disk":
                link = self.profile.link("disk_write")
            if link is None:
                link = self.profile.link("host_copy") if d == "cpu" else self._gather(d)
            slowest = max(slowest, calls * link.seconds(per / k))
        return t + slowest
