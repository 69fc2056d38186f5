"""``conduit profile`` and ``conduit plan``: measure this machine, and explain a placement choice."""

from __future__ import annotations

import argparse
import errno
import json
import sys
import tempfile
import warnings
from pathlib import Path

from conduit.commands import count

__all__ = ["register"]


def _profile(args: argparse.Namespace) -> int:
    from conduit.placement.profile import load_profile, profile_machine, profile_path

    if args.cached:
        prof = load_profile()
    else:  # the command's job is the cache: refused before measuring if it cannot be written, said once written
        _check_cache_writable(profile_path())
        prof = profile_machine(cache=False, quick=args.quick)
        prof.save()
    if args.json:
        print(json.dumps({**prof.to_dict(), "path": str(profile_path())}, indent=1))
        return 0
    gpus = prof.details.get("gpus", 0)
    print(f"bandwidth profile of machine {prof.machine} ({prof.created}), cached at {profile_path()}")
    if not gpus:
        print("no GPU found: host and disk paths only")
    print(f"{'path':28}{'overhead us':>12}{'per row ns':>12}  effective GB/s by transfer size (row width for "
          f"gathers)")
    for name, link in sorted(prof.links.items()):
        pts = "  ".join(f"{_size(b)}{'/row' if link.by_row else ''}:{bw / 1e9:.2f}" for b, bw in link.points
                        if bw != float("inf"))
        print(f"{name:28}{link.overhead_s * 1e6:12.1f}{link.per_row_s * 1e9:12.1f}  {pts}")
    if not prof.details.get("disk_read_cold", True):
        print("note: disk_read was measured with the page cache warm (this OS cannot drop it per file)")
    return 0


def _check_cache_writable(path: Path) -> None:
    """Make sure the profile can be cached at ``path`` (its folder is created; probed, left as it was).

    Raises:
        PlacementError: the folder cannot be created or the file cannot be written.
    """
    from conduit.errors import PlacementError

    try:  # the profile is written beside its path, then renamed over it
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".conduit-probe-"):
            pass
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
    except OSError as e:
        raise PlacementError(f"Cannot cache the bandwidth profile at {path} ({e.strerror or e}); point "
                             f"CONDUIT_CACHE_DIR at a writable directory, or use --cached to show the cached "
                             f"one.") from e


def _size(b: float) -> str:
    for unit, s in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if b >= s:
            return f"{b / s:g}{unit}"
    return f"{b:g}B"


def _plan(args: argparse.Namespace) -> int:
    """``conduit plan``: refuse a ``--batch`` above ``--capacity`` before loading anything, then plan and explain."""
    from conduit.errors import ConfigurationError
    from conduit.placement.cost import Workload
    from conduit.placement.planner import Planner
    from conduit.placement.profile import profile_machine
    from conduit.placement.topology import load_topology

    if args.batch > args.capacity:  # (the workload refused it as "batch (B) exceeds capacity (C).", no flag named)
        raise ConfigurationError(f"--batch {args.batch} is more items per delivery than the buffer holds (--capacity "
                                 f"{args.capacity}); lower --batch or raise --capacity.")
    topo = load_topology(args.topology)
    profile = None
    if topo.source == "discovered":
        with warnings.catch_warnings(record=True) as caught:  # (the filters in force still apply)
            profile = profile_machine(quick=True)  # the cached one when present
        for w in caught:
            if issubclass(w.category, RuntimeWarning):  # the measurement could not be cached: said in one line
                print(f"warning: {' '.join(str(w.message).split())}", file=sys.stderr)
            else:  # anything else as it would have been shown
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    planner = Planner(topo, profile)
    workload = Workload.transitions(args.obs_dim, capacity=args.capacity, batch=args.batch, learners=args.learners)
    plan = planner.plan(workload)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        if topo.source == "discovered":
            print(topo.details.get("gpus", ""))
        print(plan.explain())
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``profile`` and ``plan`` to the ``conduit`` command line."""
    p = sub.add_parser("profile", help="measure this machine's data paths (bandwidth, per-call overhead) and cache "
                                       "them")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    how = p.add_mutually_exclusive_group()  # (--quick says how to measure; --cached does not measure)
    how.add_argument("--quick", action="store_true", help="fewer repetitions, smaller buffers")
    how.add_argument("--cached", action="store_true", help="show the cached profile instead of measuring")
    p.set_defaults(func=_profile)

    q = sub.add_parser("plan", help="choose a placement for a transition buffer and explain every candidate")
    q.add_argument("--topology", required=True, help="a declared topology (dgx-a100-80g, mi250x-node, h200x1) or "
                                                     "'local' (this machine, measured)")
    q.add_argument("--obs-dim", type=count, required=True, help="observation size d (obs and next_obs, float32)")
    q.add_argument("--capacity", type=count, required=True, help="buffer capacity in items (1e6 is accepted)")
    q.add_argument("--batch", type=count, required=True, help="items per delivery, per learner")
    q.add_argument("--learners", type=count, default=1, help="learners (one GPU each where there are GPUs; default 1)")
    q.add_argument("--json", action="store_true", help="print the plan as JSON (top-level 'placement')")
    q.set_defaults(func=_plan)
