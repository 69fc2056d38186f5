"""Topology: the devices a buffer could live on, their memory, and the links between them.

A topology is either *declared* (a data file in ``conduit/placement/topologies/`` for a
machine we do not have, carrying nominal link figures) or *discovered* on this machine
(host memory, disk space, GPUs through torch and, when importable, NVML). A discovered
topology has no link figures of its own: the planner uses a measured
:class:`~conduit.placement.BandwidthProfile` for it.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

from conduit.checks import is_int, is_real
from conduit.errors import PlacementError
from conduit.placement.profile import PATHS, PER_GPU_PATHS, BandwidthProfile, LinkCost, host_memory, machine_id

__all__ = ["Gpu", "Topology", "load_topology", "discover_topology", "available_topologies"]

GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    """One accelerator: its index, model name and memory."""

    index: int
    name: str
    memory_bytes: int

    def __post_init__(self) -> None:
        """Raises PlacementError: ``index`` or ``memory_bytes`` is not an int >= 0 (a bool is no size)."""
        for what, v in (("index", self.index), ("memory_bytes", self.memory_bytes)):
            if not is_int(v) or v < 0:
                raise PlacementError(f"Gpu {what} must be an int >= 0, got {v!r}; give the GPU's {what} as an int.")

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


@dataclass(frozen=True)
class Topology:
    """The devices of one machine (or node) and, for declared machines, their link figures.

    Args:
        name: a data-file name (``"dgx-a100-80g"``) or ``"local"``.
        host_memory_bytes: host memory.
        gpus: the accelerators, in index order.
        disk_bytes: space available to the disk tier (0: no disk tier).
        declared: link figures from the data file (``None`` for a discovered topology).
        description: one line about the machine.
        source: ``"declared"`` or ``"discovered"``.
        details: everything else known (NVLink counts, peer access, notes; for declared
            machines ``host_link_groups``: the GPUs behind each PCIe switch, which share its
            uplink to the host, as the cost model prices staged ingestion).
    """

    name: str
    host_memory_bytes: int
    gpus: tuple[Gpu, ...] = ()
    disk_bytes: int = 0
    declared: BandwidthProfile | None = None
    description: str = ""
    source: str = "declared"
    details: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        """Raises PlacementError: a size is not an int >= 0 (a bool is no size), or a GPU is not a :class:`Gpu`."""
        for what, v in (("host_memory_bytes", self.host_memory_bytes), ("disk_bytes", self.disk_bytes)):
            if not is_int(v) or v < 0:
                raise PlacementError(f"Topology {self.name!r}: {what} must be an int >= 0, got {v!r}; give the "
                                     f"size in bytes as an int.")
        bad = [g for g in self.gpus if not isinstance(g, Gpu)]
        if bad:
            raise PlacementError(f"Topology {self.name!r}: gpus must be Gpu objects, got {bad[0]!r}.")

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def memory_of(self, device: str) -> int:
        """Bytes on ``device`` (``"cpu"``, ``"cuda:i"`` or ``"disk"``)."""
        if device == "cpu":
            return self.host_memory_bytes
        if device == "disk":
            return self.disk_bytes
        if device.startswith("cuda:") and device[5:].isdigit():
            i = int(device[5:])
            if 0 <= i < len(self.gpus):
                return self.gpus[i].memory_bytes
        raise PlacementError(f"Topology {self.name!r} has no device {device!r}; its devices are cpu, disk and "
                             f"{', '.join(g.device for g in self.gpus) or 'no GPUs'}.")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "description": self.description,
                "host_memory_bytes": self.host_memory_bytes, "disk_bytes": self.disk_bytes,
                "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes} for g in self.gpus],
                "details": self.details}

    @classmethod
    def from_file_dict(cls, d: dict[str, Any]) -> Topology:
        """A declared topology from its data-file form (see the files in ``topologies/``).

        ``links`` maps path names (:data:`~conduit.placement.profile.PATHS`, ``name:i`` for one GPU,
        ``p2p:i:j`` for a pair) to ``{"gbps": G, "overhead_us": U, "per_row_ns": R}`` (each optional;
        without ``gbps`` the bandwidth is unlimited) or to a profile's link form (:meth:`LinkCost.to_dict`).

        The file's top-level keys are :data:`_FILE_KEYS` (``nics`` is read by :mod:`conduit.simulation`),
        ``gpu``'s are :data:`_FILE_GPU_KEYS` and ``p2p``'s :data:`_FILE_P2P_KEYS`; any other key is refused (a
        misspelt ``disk_gib`` would silently leave the machine without a disk tier, a misspelt ``matrix_gbps``
        its GPUs with one uniform link). A GPU-to-GPU figure is declared once: in ``links`` (``p2p``,
        ``p2p:i:j``) or in the ``p2p`` block, not in both.

        Raises:
            PlacementError: the data is malformed or a figure is out of range; the message names what to fix
                (a top-level, ``gpu`` or ``p2p`` key the file form does not have, listing the accepted ones; a
                figure of a GPU pair declared both in ``links`` and in the ``p2p`` block; a ``p2p.matrix_gbps``
                diagonal entry that is not null or 0 (it is never read); a GPU index in
                ``host_link_groups`` that is no int of the topology (a bool is none); a ``p2p:i:j`` link without
                ``p2p:j:i`` and without a default ``p2p``; a link whose
                name is no path, that has a key a link does not have, or whose figure is not a finite number,
                > 0 for a bandwidth and >= 0 otherwise, is named with it).
        """
        try:
            name = str(d["name"])
            _known_keys(name, "", d, _FILE_KEYS)
            gpu = d.get("gpu") or {}
            if isinstance(gpu, dict):
                _known_keys(name, "gpu.", gpu, _FILE_GPU_KEYS)
            count = gpu.get("count", 0)
            if not is_real(count) or not math.isfinite(count) or float(count) != int(count):  # ("8": no count)
                raise PlacementError(f"Topology {name!r}: gpu.count must be a whole number of GPUs, got {count!r}.")
            n = int(float(count))
            gib = (_figure(name, "gpu.memory_gib", gpu["memory_gib"], positive=False) if n > 0 else 0.0)
            gpus = tuple(Gpu(i, str(gpu["name"]), int(gib * GIB)) for i in range(n))
            host = int(_figure(name, "host_memory_gib", d["host_memory_gib"], positive=False) * GIB)
            disk = int(_figure(name, "disk_gib", d.get("disk_gib", 0), positive=False) * GIB)
            if n < 0 or host < 0 or disk < 0 or any(g.memory_bytes < 0 for g in gpus):
                raise PlacementError(f"Topology {name!r}: gpu.count, host_memory_gib, disk_gib and gpu.memory_gib "
                                     f"must be >= 0.")
            links = {k: _declared_link(name, k, v, n) for k, v in d.get("links", {}).items()}
            p2p = d.get("p2p")
            if p2p:
                if isinstance(p2p, dict):
                    _known_keys(name, "p2p.", p2p, _FILE_P2P_KEYS)
                block: dict[str, LinkCost] = {}  # the p2p block's figures
                over = _figure(name, "p2p.overhead_us", p2p.get("overhead_us", 0.0), positive=False)
                if "matrix_gbps" in p2p:
                    mat = p2p["matrix_gbps"]
                    if len(mat) != n or any(len(r) != n for r in mat):
                        raise PlacementError(f"Topology {name!r}: p2p.matrix_gbps must be {n}x{n}.")
                    default = p2p.get("gbps")  # the figure for pairs the matrix leaves out (null or 0)
                    if default is not None:
                        block["p2p"] = LinkCost.constant(_figure(name, "p2p.gbps", default, positive=True), over)
                    for i in range(n):
                        for j in range(n):
                            v = mat[i][j]
                            if i == j:  # (a GPU's copy within itself is no P2P copy: gpu_gather prices it)
                                if v is None or (is_real(v) and v == 0):
                                    continue
                                raise PlacementError(
                                    f"Topology {name!r}: p2p.matrix_gbps[{i}][{j}] is {v!r}; the diagonal is not "
                                    f"read (a copy within one GPU is priced by links.gpu_gather): write null there.")
                            if (v is None or v == 0) and default is not None:
                                continue
                            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                                raise PlacementError(
                                    f"Topology {name!r}: p2p.matrix_gbps[{i}][{j}] is {v!r}; every pair of distinct "
                                    f"GPUs needs a finite bandwidth > 0 in GB/s (null only on the diagonal, or give "
                                    f"p2p.gbps as the figure for the pairs left out).")
                            block[f"p2p:{i}:{j}"] = LinkCost.constant(float(v), over)
                else:
                    block["p2p"] = LinkCost.constant(_figure(name, "p2p.gbps", p2p["gbps"], positive=True), over)
                twice = sorted(set(links) & set(block))  # two figures for one path: one would be dropped
                if twice:
                    where = "p2p.gbps" if twice[0] == "p2p" else "p2p.matrix_gbps"
                    raise PlacementError(
                        f"Topology {name!r}: links.{twice[0]} and {where} both declare the figure of {twice[0]!r} "
                        f"(one would be silently dropped); declare it once, in links or in the p2p block.")
                links.update(block)
            if "p2p" not in links:  # (without a default, a pair declared one way only fails every plan over it)
                pairs = {tuple(k.split(":")[1:]) for k in links if k.startswith("p2p:")}
                one_way = sorted((j, i) for i, j in pairs if (j, i) not in pairs)
                if one_way:
                    j, i = one_way[0]
                    raise PlacementError(
                        f"Topology {name!r}: links.p2p:{i}:{j} declares GPU {i} -> {j} but nothing declares "
                        f"p2p:{j}:{i} (the planner copies both ways between shards): add links.p2p:{j}:{i}, or a "
                        f"default links.p2p (or p2p.gbps) for the pairs left out.")
            prof = BandwidthProfile(links, source="declared", machine=f"declared:{name}",
                                    details={"source": d.get("source", "")})
            groups = d.get("host_link_groups")
            if groups is not None:
                flat = [i for g in groups for i in g] if isinstance(groups, list) and all(
                    isinstance(g, list) for g in groups) else None
                if flat is None or any(not is_int(i) or not 0 <= i < n for i in flat) or \
                        len(set(flat)) != len(flat):
                    raise PlacementError(f"Topology {name!r}: host_link_groups must be lists of GPU indices "
                                         f"(0..{n - 1}), each GPU in at most one group (the GPUs behind one PCIe "
                                         f"switch), got {groups!r}.")
            return cls(name, host, gpus, disk, prof, str(d.get("description", "")), "declared",
                       {"notes": d.get("notes", ""), "source": d.get("source", ""),
                        **({"host_link_groups": groups} if groups is not None else {})})
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise PlacementError(f"Malformed topology data ({e!r}); compare with the files in "
                                 f"conduit/placement/topologies/.") from e


#: the top-level keys of a topology data file (``nics``: the network cards :mod:`conduit.simulation` reads)
_FILE_KEYS = frozenset({"name", "description", "source", "notes", "host_memory_gib", "disk_gib", "gpu", "links",
                        "p2p", "host_link_groups", "nics"})
#: the keys of a data file's ``gpu`` object
_FILE_GPU_KEYS = frozenset({"count", "name", "memory_gib"})
#: the keys of a data file's ``p2p`` object
_FILE_P2P_KEYS = frozenset({"gbps", "overhead_us", "matrix_gbps"})


def _known_keys(topology: str, where: str, d: dict[str, Any], allowed: frozenset[str]) -> None:
    """Refuse the keys of ``d`` (the object at ``where`` in a data file) that are not in ``allowed``.

    Raises:
        PlacementError: naming the unknown key(s) and listing the accepted ones.
    """
    unknown = sorted(map(str, set(d) - allowed))
    if unknown:
        raise PlacementError(f"Topology {topology!r}: unknown key(s) {', '.join(where + k for k in unknown)}; "
                             f"{where.rstrip('.') if where else 'a topology data file'} takes "
                             f"{', '.join(where + k for k in sorted(allowed))} (compare with the files in "
                             f"conduit/placement/topologies/).")


#: the keys of one link in a data file: its own form (each optional: no ``gbps`` is an unlimited bandwidth, a
#: pure per-call cost), or a profile's (:meth:`LinkCost.to_dict`, as ``conduit profile --json`` prints it)
_FILE_LINK_KEYS = frozenset({"gbps", "overhead_us", "per_row_ns"})
_PROFILE_LINK_KEYS = frozenset({"overhead_s", "points", "per_row_s", "by_row"})


def _figure(topology: str, where: str, v: Any, *, positive: bool) -> float:
    """A link figure of a data file, as a float: a finite number, > 0 when ``positive`` (a bandwidth), else >= 0.

    Raises:
        PlacementError: it is not such a number (a bool, a string, NaN, infinite, or out of range); the
            message names the figure.
    """
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if positive
                                                                                        else v >= 0)
    if not ok:
        raise PlacementError(f"Topology {topology!r}: {where} is {v!r}; it must be a finite number "
                             f"{'> 0 (GB/s)' if positive else '>= 0'}.")
    return float(v)


#: the paths priced per GPU (``name:i``) in a data file's ``links``; ``p2p`` is priced per pair (``p2p:i:j``)
_PER_GPU_PATHS = PER_GPU_PATHS


def _declared_link(topology: str, key: str, entry: Any, num_gpus: int) -> LinkCost:
    """Link ``key`` of a topology's data file, on a machine of ``num_gpus`` GPUs.

    Raises:
        PlacementError: ``key`` names no path Conduit prices (a misspelt name would leave the path to the
            planner's refusal, or unpriced), or a GPU (``name:i``, ``p2p:i:j``) the topology does not have, or
            GPUs on a path that is not priced per GPU (an entry no lookup would read), ``entry`` is not an object,
            has keys a link does not have (a misspelt ``gbps`` would silently declare an unlimited bandwidth), or
            a figure that is not a finite number in range; the message names the link and what to write.
    """
    kind, *indices = str(key).split(":")
    if kind not in PATHS:
        raise PlacementError(f"Topology {topology!r}: links.{key} names no data path Conduit prices; use one of "
                             f"{', '.join(PATHS)} (for one GPU 'name:i', for a GPU pair 'p2p:i:j').")
    if indices:
        want = 2 if kind == "p2p" else 1 if kind in _PER_GPU_PATHS else 0
        if not want:
            raise PlacementError(f"Topology {topology!r}: links.{key}: {kind} is not priced per GPU, so this entry "
                                 f"would never be read; write links.{kind}.")
        form = "p2p:i:j" if want == 2 else f"{kind}:i"
        if len(indices) != want or any(not i.isdigit() or str(int(i)) != i for i in indices) or \
                (want == 2 and indices[0] == indices[1]):
            raise PlacementError(f"Topology {topology!r}: links.{key} is no link name; write '{form}' with "
                                 f"{'two distinct GPU indices' if want == 2 else 'a GPU index'} (0, 1, ...), or "
                                 f"'{kind}' for every GPU.")
        missing = [int(i) for i in indices if int(i) >= num_gpus]
        if missing:
            has = f"GPUs 0..{num_gpus - 1}" if num_gpus > 1 else "GPU 0" if num_gpus else "no GPUs"
            raise PlacementError(f"Topology {topology!r}: links.{key} names GPU {missing[0]}, which the topology "
                                 f"does not have (gpu.count {num_gpus}: {has}); fix the index or gpu.count.")
    if not isinstance(entry, dict):
        raise PlacementError(f"Malformed topology data: links.{key} of topology {topology!r} is {entry!r}, not an "
                             f"object such as {{\"gbps\": 12, \"overhead_us\": 5}}.")
    allowed = _PROFILE_LINK_KEYS if "overhead_s" in entry else _FILE_LINK_KEYS
    unknown = sorted(map(str, set(entry) - allowed))
    if unknown:
        raise PlacementError(f"Topology {topology!r}: links.{key} has unknown key(s) {', '.join(unknown)}; a link is "
                             f"{{\"gbps\": G, \"overhead_us\": U, \"per_row_ns\": R}} (each optional; without gbps "
                             f"the bandwidth is unlimited).")
    if allowed is _FILE_LINK_KEYS:
        for f in sorted(entry):
            _figure(topology, f"links.{key}.{f}", entry[f], positive=f == "gbps")
    return LinkCost.from_dict(entry)


def available_topologies() -> list[str]:
    """Names of the declared topologies shipped with Conduit (plus ``"local"``)."""
    root = resources.files("conduit.placement") / "topologies"
    names = sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))
    return [*names, "local"]


def load_topology(name: str) -> Topology:
    """A declared topology by name, or this machine's (``"local"``).

    Raises:
        PlacementError: no topology has that name (the message lists those that exist; a name is
            a data file's name, not a path), or its data file is not valid JSON or malformed.
    """
    if name == "local":
        return discover_topology()
    path = resources.files("conduit.placement") / "topologies" / f"{name}.json"
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name.startswith(".") \
            or not path.is_file():
        raise PlacementError(f"Unknown topology {name!r}; use one of {', '.join(available_topologies())} "
                             f"(\"local\" discovers this machine), or add a data file to "
                             f"conduit/placement/topologies/.")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: json.JSONDecodeError, UnicodeDecodeError
        raise PlacementError(f"The data file of topology {name!r} is not readable JSON ({e}); fix it (compare "
                             f"with the other files in conduit/placement/topologies/).") from e
    if not isinstance(data, dict):
        raise PlacementError(f"The data file of topology {name!r} holds {type(data).__name__}, not a JSON object; "
                             f"compare with the other files in conduit/placement/topologies/.")
    return Topology.from_file_dict(data)


def _nvml_details(n: int) -> dict[str, Any]:
    """NVLink counts per GPU and P2P status per pair through NVML, when it is importable and works."""
    try:
        import pynvml
    except ImportError:
        return {"nvml": "not importable (pip install nvidia-ml-py for NVLink discovery)"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound and friends: no driver here
        return {"nvml": f"unavailable ({type(e).__name__})"}
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        nvlinks = []
        for h in handles:
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active += int(pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED)
                except Exception:
                    break
            nvlinks.append(active)
        p2p = [[i == j or _nvml_p2p_ok(pynvml, handles[i], handles[j]) for j in range(n)] for i in range(n)]
        return {"nvml": "ok", "nvlinks_active": nvlinks, "nvml_p2p_read": p2p}
    finally:
        pynvml.nvmlShutdown()


def _nvml_p2p_ok(pynvml: Any, a: Any, b: Any) -> bool:
    try:
        return bool(pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_READ) == pynvml.NVML_P2P_STATUS_OK)
    except Exception:
        return False


def discover_topology(*, disk_directory: str | None = None) -> Topology:
    """This machine: host memory, disk space for the disk tier, GPUs (torch, and NVML when importable).

    Without a GPU the topology says so (``details["gpus"]``) and plans cover host and disk only.
    """
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        gpus.append(Gpu(i, p.name, int(p.total_memory)))
    details: dict[str, Any] = {"machine": machine_id()}
    if n:
        details["peer_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                                  for i in range(n)]
        details.update(_nvml_details(n))
        details["gpus"] = f"{n} CUDA device(s)"
    else:
        details["gpus"] = "no GPU found: planning over host memory and disk only"
    disk_dir = disk_directory or tempfile.gettempdir()
    disk = shutil.disk_usage(disk_dir).free
    details["disk_directory"] = disk_dir
    return Topology("local", host_memory(), tuple(gpus), int(disk), None,
                    f"this machine ({n} GPU(s))", "discovered", details)
