"""Bandwidth profiles: measured (or declared) cost of each data path, and the profiler.

A path's cost for one call is ``overhead + rows * per_row + bytes / bandwidth``: a fixed
per-call overhead, a per-row cost for gathers, and the bytes at the effective bandwidth
for a transfer of that size (small transfers reach less bandwidth than large ones; a
profile keeps a few measured points and interpolates in log-size between them; for row
gathers the points are keyed by the width of one row). See :class:`LinkCost`.

Path names (``BandwidthProfile.links`` keys):

* ``host_copy``: host memory -> host memory (ingestion into a host-tier buffer);
* ``host_gather``: random-row gather within host memory (delivery from a host buffer);
* ``host_gather_scalar`` / ``host_gather_scalar_cached``: the same for 1-D columns (one
  element per item) larger than / within the last-level cache;
* ``h2d_pinned``, ``h2d_pageable``: page-locked / pageable host -> GPU (``h2d_pinned:i``
  for GPU ``i``; unsuffixed: GPU 0 and the default); ``d2h_pinned``, ``d2h_pageable`` back;
* ``gpu_gather``: random-row gather within one GPU's memory (``gpu_gather:i``), timed as a
  delivery runs it: several columns' kernels queued back to back, one synchronisation per call;
* ``p2p``: GPU -> GPU copy (``p2p:i:j`` for the pair, ``p2p`` as the default);
* ``disk_read``: random-row gather from a memory-mapped file whose pages are not cached;
* ``disk_write``: writes into a memory-mapped file (page cache, written back later);
* ``edp_deliver``, ``edp_ingest``: the EDP's own per-call overhead (sampling or validation,
  locking, accounting).

:func:`profile_machine` measures these on the machine it runs on and caches the result
in the user cache directory, keyed by machine and its GPUs (and reused only for the directory its disk tier
was measured in); loading a profile measured on another machine raises
:class:`conduit.PlacementError`. That cache file holds only this machine's measurement: a
declared profile is neither saved there nor taken from there as one.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conduit.checks import is_real
from conduit.errors import ConfigurationError, PlacementError
from conduit.storage.columnar import empty_column, gather_into
from conduit.telemetry import write_atomically

__all__ = ["LinkCost", "BandwidthProfile", "profile_machine", "measure_host_paths", "load_profile", "machine_id",
           "machine_summary", "gpu_descriptions", "host_memory", "cache_dir", "profile_path", "PATHS"]

#: the version of the profile file layout or of what its paths measure (bumped when either changes;
#: older files are re-measured)
PROFILE_FORMAT = 5

#: every path name a profile may carry (per-device variants add ``:i`` / ``:i:j``)
PATHS = ("host_copy", "host_gather", "host_gather_scalar", "host_gather_scalar_cached", "h2d_pinned", "h2d_pageable",
         "d2h_pinned", "d2h_pageable", "gpu_gather", "p2p", "disk_read", "disk_write", "edp_deliver", "edp_ingest")


@dataclass(frozen=True)
class LinkCost:
    """The cost of one call on one data path.

    ``seconds(nbytes, rows) = overhead_s + rows * per_row_s + nbytes / bandwidth(nbytes)``:
    a fixed per-call overhead, a per-row cost for gathers (a random row costs a cache or
    TLB miss whatever its width; bulk copies have no rows), and the bytes at the effective
    bandwidth. ``points`` are ``(bytes, bytes_per_second)`` pairs sorted by size; the
    bandwidth for a size in between is interpolated linearly in ``log(bytes)`` (unlimited next
    to an unlimited point) and clamped to the nearest point outside the measured range, then
    capped so that a larger transfer never takes less time than a smaller one
    (:meth:`bandwidth`: ``seconds`` is non-decreasing in ``nbytes`` for any points, noisy
    measurements included). A path known by one figure has one point.
    """

    overhead_s: float
    points: tuple[tuple[float, float], ...] = ((1.0, math.inf),)
    per_row_s: float = 0.0
    #: for gathers: ``points`` are keyed by the bytes of one row, not of the whole call
    by_row: bool = False

    def __post_init__(self) -> None:
        pts = tuple(sorted((float(b), float(bw)) for b, bw in self.points))
        # (a point's size is finite: one at an infinite size, which a profile file's ``Infinity`` reads as, was
        # measured by no transfer; alone it priced every transfer at its figure)
        if (not pts or any(not (0 < b < math.inf and bw > 0) for b, bw in pts) or not 0 <= self.overhead_s < math.inf
                or not 0 <= self.per_row_s < math.inf):
            raise PlacementError(f"A link needs a finite overhead >= 0, a finite per-row cost >= 0 and positive "
                                 f"(bytes, bandwidth) points, the bytes finite, got overhead={self.overhead_s}, "
                                 f"per_row={self.per_row_s}, points={self.points}; re-run `conduit profile`.")
        object.__setattr__(self, "points", pts)

    @classmethod
    def constant(cls, gbps: float, overhead_us: float = 0.0, per_row_ns: float = 0.0) -> LinkCost:
        """A path with one bandwidth (GB/s, 1e9 bytes), a per-call overhead (us) and a per-row cost (ns)."""
        return cls(overhead_us * 1e-6, ((1.0, gbps * 1e9),), per_row_ns * 1e-9)

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]], overhead_s: float) -> LinkCost:
        """A bulk-copy path from measured ``(bytes, seconds)`` samples and a measured per-call overhead.

        Each sample's bandwidth is ``bytes / (seconds - overhead)``; a sample no slower than
        the overhead alone (noise) is dropped.
        """
        pts = []
        for b, t in samples:
            moving = t - overhead_s
            if b > 0 and moving > 0:
                pts.append((b, b / moving))
        if not pts:
            raise PlacementError("Every measurement was within the per-call overhead; the machine was too busy to "
                                 "measure. Re-run `conduit profile` when it is quieter.")
        return cls(max(0.0, overhead_s), tuple(pts))

    @classmethod
    def fit_or_bound(cls, samples: Sequence[tuple[float, float]], overhead_s: float) -> LinkCost:
        """:meth:`fit`, or where every sample was within the overhead (a busy machine), a conservative bound.

        The bound takes the smallest measured time as the per-call overhead and each sample's
        whole time as moving its bytes, so larger transfers still cost more (never an infinite
        bandwidth from a noisy measurement).

        Raises:
            PlacementError: no sample of a positive size took a positive time (a clock that did not tick, NaN
                timings): nothing bounds the link, and an unlimited one would cost nothing.
        """
        try:
            return cls.fit(samples, overhead_s)
        except PlacementError:
            timed = tuple((b, b / t) for b, t in samples if b > 0 and t > 0)
            if not timed:
                raise PlacementError(
                    f"No measurement of this link took any time (samples {list(samples)!r}): the clock did not "
                    f"resolve the transfers, so nothing bounds its bandwidth. Re-run the measurement with larger "
                    f"transfer sizes or more repeats.") from None
            floor = min([overhead_s, *(t for _, t in samples)])
            return cls(max(0.0, floor), timed)

    @classmethod
    def fit_rows(cls, samples: Iterable[tuple[float, float, float]], overhead_s: float) -> LinkCost:
        """A gather path from ``(rows, bytes, seconds)`` samples of several row widths and a 1-row overhead.

        Each sample gives the effective bandwidth for rows of its width,
        ``bytes / (seconds - overhead)``; a call of ``r`` rows of ``w`` bytes then costs
        ``overhead + r * w / bandwidth(w)``, the bandwidth interpolated between widths.
        """
        pts = []
        for rows, b, t in samples:
            moving = t - overhead_s
            if rows > 0 and b > 0 and moving > 0:
                pts.append((b / rows, b / moving))
        if not pts:
            raise PlacementError("Every gather was within the per-call overhead; the machine was too busy to "
                                 "measure. Re-run `conduit profile` when it is quieter.")
        return cls(max(0.0, overhead_s), tuple(pts), by_row=True)

    @classmethod
    def fit_gather(cls, samples: Iterable[tuple[float, float, float]], *, bytes_term: bool = True) -> LinkCost:
        """A gather path from measured ``(rows, bytes, seconds)`` samples, by a 3-term fit.

        Fits ``overhead + rows * per_row + bytes / bandwidth`` by least squares on the
        relative error (so small and large calls count alike); a coefficient that comes out
        negative is fixed at 0 and the rest refitted. ``bytes_term=False`` fits no bandwidth
        (for scalar columns, whose bytes are proportional to rows).
        """
        rows_, bytes_, secs = (list(x) for x in zip(*samples, strict=True))
        active = [0, 1, 2] if bytes_term else [0, 1]
        for _ in range(3):
            cols = [[1.0, r, b][j] for r, b in zip(rows_, bytes_, strict=True) for j in active]
            a = torch.tensor(cols, dtype=torch.float64).view(len(secs), len(active))
            t = torch.tensor(secs, dtype=torch.float64)
            coef = torch.linalg.lstsq(a / t[:, None], torch.ones_like(t)[:, None]).solution.view(-1)
            neg = [j for j, c in zip(active, coef.tolist(), strict=True) if c < 0]
            if not neg:
                break
            active = [j for j in active if j not in neg]
        full = dict.fromkeys(range(3), 0.0)
        full.update(zip(active, coef.tolist(), strict=True))
        inv_bw = full[2]
        bw = 1.0 / inv_bw if inv_bw > 0 else math.inf
        return cls(full[0], ((1.0, bw),), full[1])

    def bandwidth(self, nbytes: float) -> float:
        """Effective bytes per second for one transfer of ``nbytes``.

        The points interpolated (see the class), capped so that no transfer moves faster than the
        slowest measured point of its size or smaller: ``nbytes / bandwidth(nbytes)`` (and so
        :meth:`seconds`) never decreases as ``nbytes`` grows, whatever the points. Noisy samples (a
        small transfer measured slower than a larger one) or a bandwidth that the log-size
        interpolation raises almost as fast as the size would otherwise predict less time for more
        bytes. Points whose predictions already grow with size are not changed.

        Raises:
            ConfigurationError: ``nbytes`` is no real number, NaN, infinite or negative.
        """
        _check_size("nbytes", nbytes)
        bw = self._interpolated(nbytes)
        slowest = self._slowest(nbytes)
        if slowest > 0 and nbytes < bw * slowest:  # (nbytes / bw < slowest; bw may be infinite)
            return nbytes / slowest
        return bw

    def _slowest(self, nbytes: float) -> float:
        """The longest time a measured point of ``nbytes`` or fewer bytes takes to move its bytes (0 when
        there is none, or only unlimited ones)."""
        return max((b / w for b, w in self.points if b <= nbytes), default=0.0)

    def _interpolated(self, nbytes: float) -> float:
        """The points interpolated linearly in ``log(bytes)``, clamped outside them (see the class)."""
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1]
        x = math.log(nbytes)
        for (b0, w0), (b1, w1) in zip(pts, pts[1:], strict=False):
            if b0 <= nbytes <= b1:
                if nbytes == b0 or nbytes == b1:  # a measured point, as measured
                    return w0 if nbytes == b0 else w1
                if math.isinf(w0) or math.isinf(w1):  # next to an unlimited point: unlimited (inf - inf is NaN)
                    return math.inf
                f = (x - math.log(b0)) / (math.log(b1) - math.log(b0))
                return w0 + f * (w1 - w0)
        return pts[-1][1]  # pragma: no cover - unreachable, points are sorted

    def seconds(self, nbytes: float, rows: float = 0) -> float:
        """Predicted seconds for one call moving ``nbytes`` (in ``rows`` random rows, for a gather).

        A call that moves nothing costs nothing.

        Raises:
            ConfigurationError: ``nbytes`` or ``rows`` is no real number, NaN, infinite or negative (a NaN
                priced as NaN seconds, and a negative size as nothing, would compare silently wrong).
        """
        _check_size("nbytes", nbytes)
        _check_size("rows", rows)
        if nbytes <= 0:
            return 0.0
        per_row = self.by_row and rows > 0
        size = nbytes / rows if per_row else nbytes  # what the points are keyed by
        bw = self._interpolated(size)
        moving = 0.0 if math.isinf(bw) else nbytes / bw
        # never less than the slowest measured point of this size or smaller (see bandwidth), row by row for a
        # gather: a larger transfer never predicts less time
        moving = max(moving, (rows if per_row else 1) * self._slowest(size))
        return self.overhead_s + rows * self.per_row_s + moving

    @property
    def peak_bandwidth(self) -> float:
        return max(bw for _, bw in self.points)

    def to_dict(self) -> dict[str, Any]:
        """SI units: seconds, bytes, bytes per second (``None`` for an unlimited bandwidth)."""
        return {"overhead_s": self.overhead_s, "per_row_s": self.per_row_s, "by_row": self.by_row,
                "points": [[b, None if math.isinf(bw) else bw] for b, bw in self.points]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkCost:
        """Inverse of :meth:`to_dict`; also accepts the data-file form
        ``{"gbps": G, "overhead_us": U, "per_row_ns": R}`` (any of the three may be left out).

        Raises:
            ValueError, TypeError, KeyError: a malformed entry (e.g. ``by_row`` that is not a bool);
                :func:`load_profile` reports them as a :class:`PlacementError`.
        """
        if "overhead_s" in d:
            pts = tuple((_number("points", b), math.inf if bw is None else _number("points", bw))
                        for b, bw in d["points"])
            by_row = d.get("by_row", False)
            if not isinstance(by_row, bool):  # (bool("false") is True: the points would be read per row)
                raise ValueError(f"by_row must be true or false, got {by_row!r}")
            return cls(_number("overhead_s", d["overhead_s"]), pts, _number("per_row_s", d.get("per_row_s", 0.0)),
                       by_row)
        over = _number("overhead_us", d.get("overhead_us", 0.0))
        per_row = _number("per_row_ns", d.get("per_row_ns", 0.0))
        if "gbps" in d:
            return cls.constant(_number("gbps", d["gbps"]), over, per_row)
        return cls(over * 1e-6, per_row_s=per_row * 1e-9)  # a pure per-call (and per-row) cost


def _check_size(what: str, v: object) -> None:
    """Raise :class:`ConfigurationError` unless ``v`` is a finite real number >= 0 (a count of bytes or rows)."""
    if not is_real(v) or not 0 <= v < math.inf:
        raise ConfigurationError(f"{what} must be a finite number >= 0, got {v!r}; pass the bytes (or rows) the call "
                                 f"moves.")


def _number(what: str, v: Any) -> float:
    """A link figure of a file as a float. Raises TypeError: it is no real number (``float()`` would read the
    string ``"0.5"`` and ``true`` as figures)."""
    if not is_real(v):
        raise TypeError(f"{what} must be a number, got {v!r}")
    return float(v)


#: the paths priced per GPU (``name:i``); ``p2p`` is priced per pair (``p2p:i:j``)
PER_GPU_PATHS = frozenset({"h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "gpu_gather"})


def link_name_problem(key: str) -> str | None:
    """Why ``key`` is no link name (``None`` when it is one): a path of :data:`PATHS`, ``name:i`` for a path
    priced per GPU, ``p2p:i:j`` for two distinct GPUs (indices written as plain ints)."""
    kind, *indices = str(key).split(":")
    if kind not in PATHS:
        return (f"{key!r} names no data path Conduit prices; use one of {', '.join(PATHS)} (for one GPU 'name:i', "
                f"for a GPU pair 'p2p:i:j')")
    if not indices:
        return None
    want = 2 if kind == "p2p" else 1 if kind in PER_GPU_PATHS else 0
    if not want:
        return f"{key!r}: {kind} is not priced per GPU, so this entry would never be read; write {kind!r}"
    if len(indices) != want or any(not i.isdigit() or str(int(i)) != i for i in indices) or \
            (want == 2 and indices[0] == indices[1]):
        form = "p2p:i:j" if want == 2 else f"{kind}:i"
        return (f"{key!r} is no link name; write '{form}' with "
                f"{'two distinct GPU indices' if want == 2 else 'a GPU index'} (0, 1, ...), or '{kind}' for every GPU")
    return None


def _gpu_description(props: Any) -> str:
    """One GPU as ``"<name> pci=<domain:bus:device> uuid=<uuid>"`` from its ``torch.cuda.get_device_properties``
    (parts this torch does not report are left out)."""
    out = str(props.name)
    domain, bus, device = (getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if isinstance(domain, int) and isinstance(bus, int) and isinstance(device, int):
        out += f" pci={domain:04x}:{bus:02x}:{device:02x}.0"
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        out += f" uuid={uuid}"
    return out


def gpu_descriptions() -> list[str]:
    """This process's CUDA GPUs in device order, each by name, PCI location and UUID (``[]`` without CUDA): what
    tells one set of GPUs from another on the same host (a GPU replaced, added or moved, another
    ``CUDA_VISIBLE_DEVICES``)."""
    if not torch.cuda.is_available():
        return []
    return [_gpu_description(torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count())]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_memory() -> int:
    """This machine's physical memory in bytes (0 where the operating system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def machine_summary(gpus: Sequence[str] | None = None) -> dict[str, Any]:
    """What identifies this machine for profiling: host name, CPU, cores, memory, GPUs (``gpus``: their
    descriptions, default :func:`gpu_descriptions`; none on a machine without CUDA)."""
    return {"hostname": socket.gethostname(), "platform": platform.machine(), "cpu": _cpu_model(),
            "cpus": os.cpu_count() or 1, "host_memory": host_memory(),
            "gpus": gpu_descriptions() if gpus is None else list(gpus)}


def machine_id(gpus: Sequence[str] | None = None) -> str:
    """A short stable key of this machine (see :func:`machine_summary`; ``gpus`` as there). It changes with the
    GPUs (their names, count, order, PCI locations and UUIDs), so a profile measured before a GPU change is not
    this machine's; a machine without GPUs keeps its key."""
    blob = json.dumps(machine_summary(gpus), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_dir() -> Path:
    """Where profiles are cached: ``$CONDUIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/conduit``, else
    ``~/.cache/conduit``."""
    env = os.environ.get("CONDUIT_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "conduit"


def profile_path() -> Path:
    """The cache file for this machine's profile: it holds only this machine's measurement (see
    :meth:`BandwidthProfile.save` and :func:`load_profile`)."""
    return cache_dir() / f"profile-{machine_id()}.json"


def _is_cache_file(path: Path) -> bool:
    """Whether ``path`` names this machine's profile cache file (:func:`profile_path`), however it is spelt."""
    try:
        return path.resolve() == profile_path().resolve()
    except (OSError, RuntimeError):  # a symlink loop: not the cache file, which the cache never makes
        return False


@dataclass
class BandwidthProfile:
    """The cost of each data path on one machine (measured) or one declared topology.

    Args:
        links: path name -> :class:`LinkCost` (see the module docstring for names).
        source: ``"measured"`` or ``"declared"``.
        machine: :func:`machine_id` of the machine measured (``"declared:<topology>"`` otherwise).
        created: ISO time of the measurement.
        details: free-form facts (machine summary, sizes measured, notes).
    """

    links: dict[str, LinkCost]
    source: str = "measured"
    machine: str = ""
    created: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def has(self, kind: str) -> bool:
        """Whether the profile has a figure for path ``kind`` (as a default or for some device)."""
        return kind in self.links or any(k.startswith(kind + ":") for k in self.links)

    def link(self, kind: str, *devices: int) -> LinkCost:
        """The cost of path ``kind`` (for GPU ``i`` or the pair ``i, j`` when given).

        A per-device entry (``"p2p:0:3"``) wins over the path's default (``"p2p"``).

        Raises:
            PlacementError: the profile has no figure for this path.
        """
        if devices:
            key = ":".join([kind, *(str(d) for d in devices)])
            if key in self.links:
                return self.links[key]
        if kind in self.links:
            return self.links[kind]
        raise PlacementError(f"The {self.source} profile ({self.machine}) has no figure for path {kind!r}"
                             f"{' between ' + '/'.join(map(str, devices)) if devices else ''}; run `conduit profile` "
                             f"on a machine that has it, or add it to the topology's data file.")

    @property
    def measured_here(self) -> bool:
        """Whether this is a measurement of this machine (not a declared profile, nor one measured elsewhere)."""
        return self.source == "measured" and self.machine == machine_id()

    def check_machine(self) -> None:
        """Raise :class:`PlacementError` if this measured profile is from another machine."""
        if self.source == "measured" and self.machine != machine_id():
            here = machine_summary()
            there = self.details.get("machine", {})
            raise PlacementError(
                f"This bandwidth profile was measured on another machine ({self.machine}: "
                f"{there.get('hostname', '?')}, {there.get('cpu', '?')}, GPUs {there.get('gpus', '?')}); this machine "
                f"is {machine_id()} ({here['hostname']}, {here['cpu']}, GPUs {here['gpus']}). Run `conduit profile` "
                f"here to measure it, or plan with a declared topology (`conduit plan --topology NAME`).")

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, "source": self.source, "machine": self.machine, "created": self.created,
                "details": self.details, "links": {k: v.to_dict() for k, v in sorted(self.links.items())}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BandwidthProfile:
        if d.get("format") != PROFILE_FORMAT or "links" not in d:
            raise PlacementError(f"Not a Conduit bandwidth profile of format {PROFILE_FORMAT} (an older Conduit, or "
                                 f"another file); re-create it with `conduit profile`.")
        details = d.get("details", {})
        llc = details.get("llc_bytes", 0) if isinstance(details, dict) else None
        if (not isinstance(details, dict) or not isinstance(details.get("machine", {}), dict)
                or isinstance(llc, bool) or not isinstance(llc, int) or llc < 0):
            raise PlacementError(f"The bandwidth profile's details are malformed (a dict with 'machine' a dict and "
                                 f"'llc_bytes' an int >= 0, got {details!r}); re-create it with `conduit profile`.")
        source = d.get("source", "measured")
        if source not in ("measured", "declared"):  # (any other went unchecked for its machine, yet read as measured)
            raise PlacementError(f"The bandwidth profile's source is {source!r}, neither 'measured' nor 'declared'; "
                                 f"re-create it with `conduit profile`.")
        items = d["links"].items()  # (no dict: AttributeError, a malformed file to load_profile)
        for k, _ in items:  # (an entry under another name is one no lookup reads: the figure it meant is missing)
            problem = link_name_problem(k)
            if problem is not None:
                raise PlacementError(f"The bandwidth profile's link {problem}; re-create it with `conduit profile`.")
        return cls({k: LinkCost.from_dict(v) for k, v in items}, source=source,
                   machine=d.get("machine", ""), created=d.get("created", ""), details=details)

    def save(self, path: str | Path | None = None) -> Path:
        """Write as JSON (default: this machine's cache file); returns the path. The file keeps the
        provenance (``source``, ``machine``).

        The cache file (:func:`profile_path`) is what :func:`profile_machine` and :func:`load_profile`
        take as this machine's measurement: only a profile that is one (:attr:`measured_here`) may be
        written there.

        Raises:
            PlacementError: the file or its directory cannot be written (the message names it and what to do),
                or ``path`` is the cache file and this profile is declared or measured on another machine;
                nothing was written.
        """
        p = Path(path) if path is not None else profile_path()
        if not self.measured_here and _is_cache_file(p):
            raise PlacementError(
                f"This {self.source} profile ({self.machine}) is not this machine's measurement, and {p} is this "
                f"machine's measured-profile cache (what `conduit profile` and the local topology take as measured "
                f"here). Write it elsewhere with save(path), or run `conduit profile` to measure this machine.")
        text = json.dumps(self.to_dict(), indent=1)
        try:  # a failed write leaves the old file and no partial one; two processes saving never mix writes
            p.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(p, text)
        except OSError as e:
            what = "pass a writable path" if path is not None else "point CONDUIT_CACHE_DIR at a writable directory"
            raise PlacementError(f"Cannot write the bandwidth profile to {p} ({e}); {what}.") from e
        return p


def load_profile(path: str | Path | None = None) -> BandwidthProfile:
    """A cached profile (default: this machine's cache file), with its provenance (``source``, ``machine``).

    Raises:
        PlacementError: no profile there, it cannot be read (e.g. a directory), it is not a profile, it
            was measured on another machine, or it is a declared profile found in this machine's cache file
            (which holds only this machine's measurement: see :meth:`BandwidthProfile.save`).
    """
    p = Path(path) if path is not None else profile_path()
    if not p.exists():
        raise PlacementError(f"No bandwidth profile at {p}; run `conduit profile` to measure this machine.")
    try:
        text = p.read_text()
    except OSError as e:  # a directory, or a file this user may not read
        raise PlacementError(f"Cannot read the bandwidth profile at {p} ({e}); remove it (or point "
                             f"CONDUIT_CACHE_DIR elsewhere) and run `conduit profile`.") from e
    try:  # (OverflowError: a figure that is an integer too large for a float; RecursionError: nesting too deep)
        prof = BandwidthProfile.from_dict(json.loads(text))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
        raise PlacementError(f"{p} is not a readable bandwidth profile ({e}); delete it and run `conduit profile`.") \
            from e
    if prof.source != "measured" and _is_cache_file(p):
        raise PlacementError(f"{p}, this machine's measured-profile cache, holds a {prof.source} profile "
                             f"({prof.machine}), not a measurement of this machine; run `conduit profile` to measure "
                             f"it (that replaces the file), or keep the declared profile under another path.")
    prof.check_machine()
    return prof


# -- measurement ---------------------------------------------------------------------------
#: a clock returning seconds: ``time.perf_counter`` (wall) or ``time.thread_time`` (CPU time of this thread)
Clock = Callable[[], float]


def _median_seconds(fn: Callable[[], object], *, reps: int, warmup: int = 2,
                    sync: Callable[[], object] | None = None, before: Callable[[], object] | None = None,
                    clock: Clock = time.perf_counter, min_total: float = 0.02) -> float:
    """Median time of ``fn`` over ``reps`` runs after ``warmup`` runs (``before`` runs untimed).

    Short calls get more runs: as many as fit in ``min_total`` seconds (at most 8x ``reps``),
    so the median of a cheap call is as stable as that of an expensive one.
    """
    def timed() -> float:
        if before is not None:
            before()
        if sync is not None:
            sync()
        t0 = clock()
        fn()
        if sync is not None:
            sync()
        return clock() - t0

    for _ in range(warmup):
        timed()
    times = [timed() for _ in range(reps)]
    # (as many runs in all as fit in min_total, of which at most 7x reps more than the reps already run)
    extra = min(7 * reps, int(min_total / max(statistics.median(times), 1e-9)) - reps)
    times += [timed() for _ in range(max(0, extra))]
    return statistics.median(times)


def _measure_copy(src_dev: torch.device, dst_dev: torch.device, sizes: list[int], reps: int, *,
                  pin_src: bool = False, pin_dst: bool = False, clock: Clock = time.perf_counter) -> LinkCost:
    """Bulk copy ``src_dev`` -> ``dst_dev`` at several sizes, and the 4-byte per-call overhead (timed by ``clock``)."""
    cuda_devs = [d for d in (src_dev, dst_dev) if d.type == "cuda"]

    def sync_all() -> None:
        for d in cuda_devs:
            torch.cuda.synchronize(d)

    sync = sync_all if cuda_devs else None
    big = max(sizes)
    src = torch.empty(big // 4, dtype=torch.float32, device=src_dev, pin_memory=pin_src)
    dst = torch.empty(big // 4, dtype=torch.float32, device=dst_dev, pin_memory=pin_dst)
    src.fill_(1.0)
    dst.fill_(0.0)
    overhead = _median_seconds(lambda: dst[:1].copy_(src[:1]), reps=max(50, reps * 5), warmup=10, sync=sync,
                               clock=clock)
    samples = []
    for b in sizes:
        n = b // 4

        def copy_n(n: int = n) -> torch.Tensor:
            return dst[:n].copy_(src[:n])

        samples.append((float(b), _median_seconds(copy_n, reps=reps, sync=sync, clock=clock)))
    return LinkCost.fit(samples, overhead)


#: row widths (bytes) the gather paths are measured at; 0 means a 1-D column (scalar items). The two
#: widest are not powers of two: rows of 64 KiB and 128 KiB alias in the caches and gather up to 25%
#: slower than their neighbours, and interpolating through them mispredicted every width in between
#: (d = 20000 float32 rows, 80 kB: +30%). Every power of two from 1 to 16 KiB is measured: the bandwidth
#: peaks near the 4 KiB page (4000-byte rows gathered at 9.6 GB/s, 2 and 16 KiB rows at 5.7 and 8.2), so
#: interpolating from 2 KiB straight to 16 KiB predicted d = 1000 float32 rows up to 55% too slow.
_ROW_WIDTHS = (16, 256, 1024, 2048, 4096, 8192, 16384, 61440, 122880)
#: rows per measured gather
_GATHER_ROWS = 512


def _measure_gather(flat: torch.Tensor, widths: Iterable[int], reps: int, *, rows: int = _GATHER_ROWS,
                    before: Callable[[], object] | None = None, clock: Clock = time.perf_counter,
                    outputs: int = 2, columns: int = 1) -> LinkCost:
    """Gather ``rows`` random rows (fresh indices every call) of several widths from ``flat``.

    ``flat`` is split into ``columns`` equal columns, gathered one after another with the
    same rows (as a delivery gathers every field of a batch); the cost per column is the
    call's time divided by ``columns``. A width ``w`` views each column as rows of ``w``
    bytes (``w = 0``: the 1-D column itself). Outputs rotate over ``outputs`` buffers per
    column, as the EDP's delivery buffers do. The per-call overhead comes from 1-row gathers.
    """
    device = flat.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    esize = flat.element_size()
    part = flat.numel() // columns

    def timed(cols: list[torch.Tensor], k: int) -> float:
        outs = [[empty_column((k, *c.shape[1:]), flat.dtype, device) for _ in range(outputs)]
                for c in cols]
        state: dict[str, Any] = {"i": 0, "idx": torch.zeros(k, dtype=torch.int64, device=device)}

        def draw() -> None:
            state["i"] = (state["i"] + 1) % outputs
            state["idx"] = torch.randint(cols[0].shape[0], (k,), generator=gen).to(device)
            if before is not None:
                before()

        def gather() -> None:  # as a storage column gathers into a delivery buffer
            for c, o in zip(cols, outs, strict=True):
                gather_into(c, state["idx"], o[state["i"]])

        return _median_seconds(gather, reps=reps, sync=sync, before=draw, clock=clock) / len(cols)

    def view(width: int) -> list[torch.Tensor]:
        out = []
        for j in range(columns):
            col = flat[j * part:(j + 1) * part]
            if width:
                per = max(1, width // esize)
                col = col[: (col.numel() // per) * per].view(-1, per)
            out.append(col)
        return out

    ws = list(widths)
    overhead = timed(view(ws[0]), 1)
    samples = []
    for w in ws:
        cols = view(w)
        k = min(rows, cols[0].shape[0])
        row_bytes = (cols[0].shape[1] if cols[0].dim() > 1 else 1) * esize
        samples.append((float(k), float(k * row_bytes), timed(cols, k)))
    if ws == [0]:  # a 1-D column: elements are tiny, the cost is per row whatever the dtype
        k0, _, t = samples[0]
        return LinkCost(overhead, per_row_s=max(0.0, t - overhead) / k0)
    return LinkCost.fit_rows(samples, overhead)


def _measure_edp(reps: int, scalar_gather: LinkCost, host_copy: LinkCost,
                 clock: Clock = time.perf_counter) -> tuple[LinkCost, LinkCost]:
    """The EDP's own per-call overhead: a delivery/ingestion of 8-byte items minus the data movement."""
    from conduit.edp import ExperienceDataPlane
    from conduit.schema import ExperienceSchema, Field

    edp = ExperienceDataPlane(ExperienceSchema(x=Field((), torch.int64)), capacity=4096)
    edp.ingest({"x": torch.arange(4096)})
    rows = 512
    t_del = _median_seconds(lambda: edp.deliver(rows), reps=max(50, reps * 5), warmup=10, clock=clock)
    one = {"x": torch.zeros(1, dtype=torch.int64)}
    t_ing = _median_seconds(lambda: edp.ingest(one), reps=max(50, reps * 5), warmup=10, clock=clock)
    edp.close()
    deliver = LinkCost(max(0.0, t_del - scalar_gather.seconds(rows * 8, rows)))
    ingest = LinkCost(max(0.0, t_ing - host_copy.seconds(8)))
    return deliver, ingest


def _drop_page_cache(path: str) -> bool:
    """Ask the kernel to drop the file's cached pages (works on Linux for files we own)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def _measure_disk(directory: str | None, file_bytes: int, reps: int) -> tuple[LinkCost, LinkCost, bool]:
    """Writes into, and random-row reads (page cache dropped first) from, a memory-mapped file."""
    with tempfile.TemporaryDirectory(prefix="conduit-profile-", dir=directory) as d:
        path = os.path.join(d, "col.bin")
        mm = torch.from_file(path, shared=True, size=file_bytes // 4, dtype=torch.float32)
        host = torch.ones(file_bytes // 4, dtype=torch.float32)
        sizes = [b for b in (64 << 10, 1 << 20, 16 << 20) if b <= file_bytes]
        overhead = _median_seconds(lambda: mm[:1].copy_(host[:1]), reps=50, warmup=10)
        samples = []
        for b in sizes:
            n = b // 4

            def write_n(n: int = n) -> torch.Tensor:
                return mm[:n].copy_(host[:n])

            samples.append((float(b), _median_seconds(write_n, reps=reps)))
        write = LinkCost.fit(samples, overhead)
        mm.copy_(host)
        cold = _drop_page_cache(path)
        read = _measure_gather(mm, [4096, 65536], max(3, reps // 2), rows=32,
                               before=(lambda: _drop_page_cache(path)) if cold else None)
    return read, write, cold


def _llc_bytes() -> int:
    """The last-level cache size (32 MiB when the OS does not say)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    try:
        for idx in base.glob("index*"):
            txt = (idx / "size").read_text().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or (32 << 20)


def measure_host_paths(*, quick: bool = False, clock: Clock = time.perf_counter) -> dict[str, LinkCost]:
    """Measure the host-memory paths: bulk copy, row and scalar gathers, the EDP's per-call overheads.

    Keyword Args:
        quick: fewer repetitions and smaller (still twice the last-level cache) gather columns.
        clock: ``time.perf_counter`` (wall time, the default) or ``time.thread_time`` (CPU
            time of this thread: on a shared machine it leaves out the time other processes
            held the core; valid for host paths when torch runs single-threaded).
    """
    reps = 11 if quick else 21
    cpu = torch.device("cpu")
    llc = _llc_bytes()
    links: dict[str, LinkCost] = {}
    copy_sizes = [64 << 10, 1 << 20, 16 << 20] if quick else [64 << 10, 1 << 20, 16 << 20, 64 << 20]
    links["host_copy"] = _measure_copy(cpu, cpu, copy_sizes, reps, clock=clock)
    big = max(4 * llc, (128 << 20) if quick else (512 << 20))
    column = empty_column((big // 4,), torch.float32).fill_(1.0)  # allocated as storage columns are
    # two columns, each several times the last-level cache, gathered with the same rows; into one
    # output buffer per column, as a host-tier delivery reuses the batch its caller has let go of
    # (rotating two 40 MB outputs measured d = 20000 deliveries 25% slower than the EDP runs them)
    links["host_gather"] = _measure_gather(column, _ROW_WIDTHS, reps, clock=clock, columns=2, outputs=1)
    links["host_gather_scalar"] = _measure_gather(column, [0], reps, clock=clock, outputs=1)
    del column
    cached = empty_column((llc // 64,), torch.float32).fill_(1.0)
    links["host_gather_scalar_cached"] = _measure_gather(cached, [0], reps, clock=clock, outputs=1)
    links["edp_deliver"], links["edp_ingest"] = _measure_edp(reps, links["host_gather_scalar_cached"],
                                                             links["host_copy"], clock=clock)
    return links


def profile_machine(*, cache: bool = True, refresh: bool = False, quick: bool = False,
                    disk_directory: str | None = None) -> BandwidthProfile:
    """Measure this machine's data paths (or return the cached profile).

    Measures bulk host copies, random-row host gathers (rows of several widths from a
    column larger than the caches, and scalar columns in and out of cache), the EDP's own
    per-call overhead, memory-mapped file writes and cold reads (page cache dropped first
    where the OS allows), and, where CUDA exists, H2D/D2H pinned and pageable copies,
    on-GPU gathers and P2P copies for every GPU pair. Timings are medians after warm-up.

    Keyword Args:
        cache: read the cached profile if there is one, and write the new one to the cache (a cache
            that cannot be written is a ``RuntimeWarning``: the measured profile is still returned).
        refresh: measure even if a cached profile exists.
        quick: fewer repetitions and smaller buffers (a few seconds). A full measurement
            (``quick=False``) is not answered by a cached quick one: it measures, and caches its result.
        disk_directory: where to measure the disk tier (default: the temp dir). The cached profile is
            returned only when its disk tier was measured there (the volume decides ``disk_read`` and
            ``disk_write``); otherwise this one is measured, and cached in its place.

    A cached profile is likewise returned only when it was measured with the intra-op threads torch uses
    now (``torch.get_num_threads()``, its ``details["torch_threads"]``): host copies and gathers of large
    tensors run on that many threads, so figures measured with 16 would price a process that runs with 1
    (``OMP_NUM_THREADS=1``, a Ray worker) at several times its bandwidth. Otherwise it is measured again.
    """
    disk_dir = os.path.realpath(disk_directory or tempfile.gettempdir())
    if cache and not refresh:
        try:
            cached = load_profile()
        except PlacementError:
            pass
        else:
            if (cached.details.get("disk_directory") == disk_dir and (quick or cached.details.get("quick") is False)
                    and cached.details.get("torch_threads") == torch.get_num_threads()):
                return cached
    reps = 11 if quick else 21
    cpu = torch.device("cpu")
    llc = _llc_bytes()
    copy_sizes = [64 << 10, 1 << 20, 16 << 20] if quick else [64 << 10, 1 << 20, 16 << 20, 64 << 20]
    links = measure_host_paths(quick=quick)
    disk_read, disk_write, cold = _measure_disk(disk_dir, (16 << 20) if quick else (64 << 20), reps)
    links["disk_read"], links["disk_write"] = disk_read, disk_write
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(n_gpu):
        g = torch.device("cuda", i)
        with torch.cuda.device(g):
            sfx = "" if i == 0 else f":{i}"
            links["h2d_pinned" + sfx] = _measure_copy(cpu, g, copy_sizes, reps, pin_src=True)
            links["h2d_pageable" + sfx] = _measure_copy(cpu, g, copy_sizes, reps)
            links["d2h_pinned" + sfx] = _measure_copy(g, cpu, copy_sizes, reps, pin_dst=True)
            links["d2h_pageable" + sfx] = _measure_copy(g, cpu, copy_sizes, reps)
            links["gpu_gather" + sfx] = _measure_gather(torch.ones((1 << 30) // 4, device=g), _ROW_WIDTHS, reps,
                                                        columns=4)
    for i in range(n_gpu):
        for j in range(n_gpu):
            if i != j:
                links[f"p2p:{i}:{j}"] = _measure_copy(torch.device("cuda", i), torch.device("cuda", j),
                                                      [1 << 20, 16 << 20, 64 << 20], reps)
    if n_gpu > 1:
        links["p2p"] = links["p2p:0:1"]
    prof = BandwidthProfile(links, source="measured", machine=machine_id(),
                            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                            details={"machine": machine_summary(), "quick": quick, "torch": torch.__version__,
                                     "torch_threads": torch.get_num_threads(), "llc_bytes": llc,
                                     "disk_read_cold": cold, "disk_directory": disk_dir, "gpus": n_gpu})
    if cache:
        try:
            prof.save()
        except PlacementError as e:  # the measurement stands: only its reuse by later runs is lost
            warnings.warn(f"{e} This measurement is used, but not cached: the next run measures again.",
                          RuntimeWarning, stacklevel=2)
    return prof
