"""Bandwidth profiles: measured (or declared) cost of each data path, and the profiler.

A path's cost for one call moving ``b`` bytes is ``overhead + b / bandwidth(b)``: a fixed
per-call overhead plus the bytes at the effective bandwidth for transfers of that size
(small transfers reach less bandwidth than large ones; the profile keeps a few measured
points and interpolates in log-size between them).

Path names (``BandwidthProfile.links`` keys):

==================  =====================================================================
``host_copy``        host memory -> host memory (ingestion into a host-tier buffer)
``host_gather``      random-row gather within host memory (delivery from a host buffer)
``h2d_pinned``       page-locked host -> GPU (``h2d_pinned:i`` for GPU ``i``)
``h2d_pageable``     pageable host -> GPU (actors' tensors into a GPU buffer)
``d2h_pinned``       GPU -> page-locked host; ``d2h_pageable`` likewise
``gpu_gather``       random-row gather within one GPU's memory (``gpu_gather:i``)
``p2p``              GPU -> GPU copy (``p2p:i:j`` for the pair; ``p2p`` as the default)
``disk_read``        random-row gather from a memory-mapped file, pages not cached
``disk_write``       writes into a memory-mapped file (page cache, written back later)
``edp_deliver``      the EDP's own per-delivery overhead (sampling, locking, accounting)
``edp_ingest``       the EDP's own per-ingestion overhead (validation, locking, accounting)
==================  =====================================================================

:func:`profile_machine` measures these on the machine it runs on and caches the result
in the user cache directory, keyed by machine; loading a profile measured on another
machine raises :class:`conduit.PlacementError`.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from conduit.errors import PlacementError

__all__ = ["LinkCost", "BandwidthProfile", "profile_machine", "load_profile", "machine_id", "machine_summary",
           "cache_dir", "profile_path", "PATHS"]

#: every path name a profile may carry (per-device variants add ``:i`` / ``:i:j``)
PATHS = ("host_copy", "host_gather", "h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "gpu_gather",
         "p2p", "disk_read", "disk_write", "edp_deliver", "edp_ingest")


@dataclass(frozen=True)
class LinkCost:
    """The cost of one call on one data path: ``overhead_s + nbytes / bandwidth(nbytes)``.

    ``points`` are ``(bytes, bytes_per_second)`` pairs sorted by size; the bandwidth for a
    size in between is interpolated linearly in ``log(bytes)``, and clamped to the nearest
    point outside the measured range. A path known by one figure has one point.
    """

    overhead_s: float
    points: tuple[tuple[float, float], ...] = ((1.0, math.inf),)

    def __post_init__(self) -> None:
        pts = tuple(sorted((float(b), float(bw)) for b, bw in self.points))
        if not pts or any(b <= 0 or bw <= 0 for b, bw in pts) or self.overhead_s < 0:
            raise PlacementError(f"A link needs overhead >= 0 and positive (bytes, bandwidth) points, got "
                                 f"overhead={self.overhead_s}, points={self.points}; re-run `conduit profile`.")
        object.__setattr__(self, "points", pts)

    @classmethod
    def constant(cls, gbps: float, overhead_us: float = 0.0) -> LinkCost:
        """A path with one bandwidth (GB/s, 1e9 bytes) and a per-call overhead (microseconds)."""
        return cls(overhead_us * 1e-6, ((1.0, gbps * 1e9),))

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]], overhead_s: float) -> LinkCost:
        """From measured ``(bytes, seconds)`` samples and a measured per-call overhead.

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

    def bandwidth(self, nbytes: float) -> float:
        """Effective bytes per second for one transfer of ``nbytes``."""
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1]
        x = math.log(nbytes)
        for (b0, w0), (b1, w1) in zip(pts, pts[1:], strict=False):
            if b0 <= nbytes <= b1:
                f = (x - math.log(b0)) / (math.log(b1) - math.log(b0))
                return w0 + f * (w1 - w0)
        return pts[-1][1]  # pragma: no cover - unreachable, points are sorted

    def seconds(self, nbytes: float) -> float:
        """Predicted seconds for one call moving ``nbytes`` (0 bytes costs nothing)."""
        if nbytes <= 0:
            return 0.0
        bw = self.bandwidth(nbytes)
        return self.overhead_s + (0.0 if math.isinf(bw) else nbytes / bw)

    @property
    def peak_bandwidth(self) -> float:
        return max(bw for _, bw in self.points)

    def to_dict(self) -> dict[str, Any]:
        return {"overhead_us": self.overhead_s * 1e6,
                "points": [[b, None if math.isinf(bw) else bw / 1e9] for b, bw in self.points]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkCost:
        """Inverse of :meth:`to_dict`; also accepts the data-file form ``{"gbps": G, "overhead_us": U}``."""
        if "gbps" in d:
            return cls.constant(float(d["gbps"]), float(d.get("overhead_us", 0.0)))
        if "points" not in d:  # a pure per-call overhead
            return cls(float(d["overhead_us"]) * 1e-6)
        pts = tuple((float(b), math.inf if g is None else float(g) * 1e9) for b, g in d["points"])
        return cls(float(d["overhead_us"]) * 1e-6, pts)


def _gpu_names() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def machine_summary() -> dict[str, Any]:
    """What identifies this machine for profiling: host name, CPU, cores, memory, GPUs."""
    return {"hostname": socket.gethostname(), "platform": platform.machine(), "cpu": _cpu_model(),
            "cpus": os.cpu_count() or 1, "host_memory": _host_memory(), "gpus": _gpu_names()}


def machine_id() -> str:
    """A short stable key of this machine (see :func:`machine_summary`)."""
    blob = json.dumps(machine_summary(), sort_keys=True).encode()
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
    """The cache file for this machine's profile."""
    return cache_dir() / f"profile-{machine_id()}.json"


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
        return {"format": 1, "source": self.source, "machine": self.machine, "created": self.created,
                "details": self.details, "links": {k: v.to_dict() for k, v in sorted(self.links.items())}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BandwidthProfile:
        if d.get("format") != 1 or "links" not in d:
            raise PlacementError("Not a Conduit bandwidth profile (format 1); re-create it with `conduit profile`.")
        return cls({k: LinkCost.from_dict(v) for k, v in d["links"].items()}, source=d.get("source", "measured"),
                   machine=d.get("machine", ""), created=d.get("created", ""), details=d.get("details", {}))

    def save(self, path: str | Path | None = None) -> Path:
        """Write as JSON (default: this machine's cache file); returns the path."""
        p = Path(path) if path is not None else profile_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(p)
        return p


def load_profile(path: str | Path | None = None) -> BandwidthProfile:
    """A cached profile (default: this machine's cache file).

    Raises:
        PlacementError: no profile there, it is not a profile, or it was measured on another machine.
    """
    p = Path(path) if path is not None else profile_path()
    if not p.exists():
        raise PlacementError(f"No bandwidth profile at {p}; run `conduit profile` to measure this machine.")
    try:
        prof = BandwidthProfile.from_dict(json.loads(p.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise PlacementError(f"{p} is not a readable bandwidth profile ({e}); delete it and run `conduit profile`.") \
            from e
    prof.check_machine()
    return prof


# -- measurement ---------------------------------------------------------------------------
def _median_seconds(fn: Callable[[], object], *, reps: int, warmup: int = 2,
                    sync: Callable[[], None] | None = None, before: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after ``warmup`` runs (``before`` runs untimed)."""
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _measure_copy(src_dev: torch.device, dst_dev: torch.device, sizes: list[int], reps: int, *,
                  pin_src: bool = False, pin_dst: bool = False) -> LinkCost:
    """Bulk copy ``src_dev`` -> ``dst_dev`` at several sizes, and the 4-byte per-call overhead."""
    sync = torch.cuda.synchronize if "cuda" in (src_dev.type, dst_dev.type) else None
    big = max(sizes)
    src = torch.empty(big // 4, dtype=torch.float32, device=src_dev, pin_memory=pin_src)
    dst = torch.empty(big // 4, dtype=torch.float32, device=dst_dev, pin_memory=pin_dst)
    src.fill_(1.0)
    dst.fill_(0.0)
    overhead = _median_seconds(lambda: dst[:1].copy_(src[:1]), reps=max(50, reps * 5), warmup=10, sync=sync)
    samples = []
    for b in sizes:
        n = b // 4
        samples.append((float(b), _median_seconds(lambda n=n: dst[:n].copy_(src[:n]), reps=reps, sync=sync)))
    return LinkCost.fit(samples, overhead)


def _measure_gather(device: torch.device, source_bytes: int, row_bytes: list[int], rows: int, reps: int,
                    source: torch.Tensor | None = None, before: Callable[[], object] | None = None) -> LinkCost:
    """Gather ``rows`` random rows (fresh indices every call) of several widths from a large column."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    flat = source if source is not None else torch.ones(source_bytes // 4, dtype=torch.float32, device=device)
    gen = torch.Generator().manual_seed(0)

    def one(width: int, k: int) -> float:
        col = flat[: (flat.numel() // width) * width].view(-1, width)
        out = torch.empty((k, width), dtype=flat.dtype, device=device)
        idx: list[torch.Tensor] = []

        def draw() -> None:
            idx.clear()
            idx.append(torch.randint(col.shape[0], (k,), generator=gen).to(device))
            if before is not None:
                before()

        return _median_seconds(lambda: torch.index_select(col, 0, idx[0], out=out), reps=reps, sync=sync,
                               before=draw)

    overhead = one(1, 1)
    samples = [(float(rows * w), one(max(1, w // 4), rows)) for w in row_bytes]
    return LinkCost.fit(samples, overhead)


def _measure_edp(host_gather: LinkCost, host_copy: LinkCost, reps: int) -> tuple[LinkCost, LinkCost]:
    """The EDP's own per-call overhead: a delivery/ingestion of 8-byte items minus the data movement."""
    from conduit.edp import ExperienceDataPlane
    from conduit.schema import ExperienceSchema, Field

    edp = ExperienceDataPlane(ExperienceSchema(x=Field((), torch.int64)), capacity=4096)
    edp.ingest({"x": torch.arange(4096)})
    rows = 256
    t_del = _median_seconds(lambda: edp.deliver(rows), reps=max(50, reps * 5), warmup=10)
    one = {"x": torch.zeros(1, dtype=torch.int64)}
    t_ing = _median_seconds(lambda: edp.ingest(one), reps=max(50, reps * 5), warmup=10)
    edp.close()
    deliver = LinkCost(max(0.0, t_del - host_gather.seconds(rows * 8)))
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
    """Writes into and cold random-row reads from a memory-mapped file (the disk tier's paths)."""
    with tempfile.TemporaryDirectory(prefix="conduit-profile-", dir=directory) as d:
        path = os.path.join(d, "col.bin")
        mm = torch.from_file(path, shared=True, size=file_bytes // 4, dtype=torch.float32)
        host = torch.ones(file_bytes // 4, dtype=torch.float32)
        sizes = [b for b in (64 << 10, 1 << 20, 16 << 20) if b <= file_bytes]
        overhead = _median_seconds(lambda: mm[:1].copy_(host[:1]), reps=50, warmup=10)
        samples = []
        for b in sizes:
            n = b // 4
            samples.append((float(b), _median_seconds(lambda n=n: mm[:n].copy_(host[:n]), reps=reps)))
        write = LinkCost.fit(samples, overhead)
        mm[:].copy_(host)
        cold = _drop_page_cache(path)
        read = _measure_gather(torch.device("cpu"), file_bytes, [4096, 65536], 64, max(3, reps // 2), source=mm,
                               before=(lambda: _drop_page_cache(path)) if cold else None)
    return read, write, cold


def profile_machine(*, cache: bool = True, refresh: bool = False, quick: bool = False,
                    disk_directory: str | None = None) -> BandwidthProfile:
    """Measure this machine's data paths (or return the cached profile).

    Measures host copy and host gather bandwidth curves and per-call overheads, the EDP's
    own per-call overhead, memory-mapped file reads (page cache dropped first where the OS
    allows) and writes, and, where CUDA exists, H2D/D2H pinned and pageable copies,
    on-GPU gathers and P2P copies for every GPU pair.

    Keyword Args:
        cache: read the cached profile if there is one, and write the new one to the cache.
        refresh: measure even if a cached profile exists.
        quick: fewer repetitions and smaller buffers (seconds instead of tens of seconds).
        disk_directory: where to measure the disk tier (default: the temp dir).
    """
    if cache and not refresh:
        try:
            return load_profile()
        except PlacementError:
            pass
    reps = 5 if quick else 11
    cpu = torch.device("cpu")
    links: dict[str, LinkCost] = {}
    copy_sizes = [64 << 10, 1 << 20, 16 << 20] if quick else [64 << 10, 1 << 20, 16 << 20, 64 << 20]
    links["host_copy"] = _measure_copy(cpu, cpu, copy_sizes, reps)
    gather_source = (64 << 20) if quick else (256 << 20)
    links["host_gather"] = _measure_gather(cpu, gather_source, [16, 256, 4096, 65536, 262144], 256, reps)
    links["edp_deliver"], links["edp_ingest"] = _measure_edp(links["host_gather"], links["host_copy"], reps)
    disk_read, disk_write, cold = _measure_disk(disk_directory, (16 << 20) if quick else (64 << 20), reps)
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
            links["gpu_gather" + sfx] = _measure_gather(g, 256 << 20, [16, 256, 4096, 65536, 262144], 512, reps)
    for i in range(n_gpu):
        for j in range(n_gpu):
            if i != j:
                links[f"p2p:{i}:{j}"] = _measure_copy(torch.device("cuda", i), torch.device("cuda", j),
                                                      [1 << 20, 16 << 20, 64 << 20], reps)
    # unsuffixed defaults for GPU paths point at GPU 0's figures (already stored unsuffixed)
    if n_gpu > 1:
        links["p2p"] = links["p2p:0:1"]
    prof = BandwidthProfile(links, source="measured", machine=machine_id(),
                            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                            details={"machine": machine_summary(), "quick": quick, "torch": torch.__version__,
                                     "disk_read_cold": cold, "gpus": n_gpu})
    if cache:
        prof.save()
    return prof
