"""The synthetic actor/learner loop: experience through the EDP, and where the time went.

One iteration: the actor runs its policy to produce a rollout of transitions (``rollout``
span), ingests it, and the learner takes ``updates`` batches, each followed by a real
update step of a small MLP Q-network (``update`` span). The scheduler decides when the
experience path runs: synchronously, sequentially at a granularity, overlapped behind the
rollout and the updates, or chosen automatically. Every iteration is accounted for
(:mod:`conduit.exposure`): experience-path time in total, the part hidden behind rollout
and update, the part exposed on the critical path. The spans are written as a Chrome trace.

``conduit demo --synthetic`` runs it; the benchmarks and the configuration sweep reuse
:func:`run_loop`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conduit.checks import first_line, out_of_memory
from conduit.commands import MAX_COUNT, check_counts, whole_number
from conduit.edp import ExperienceDataPlane
from conduit.errors import AllocationError, ConfigurationError
from conduit.exposure import ExposureLog, IterationExposure
from conduit.placement.base import HostPlacement, Placement
from conduit.scheduling import Automatic, Overlapped, Scheduler, Synchronous
from conduit.schema import ExperienceSchema, Field
from conduit.semantics import Replay
from conduit.semantics.replay import MAX_DRAW
from conduit.telemetry import Telemetry, probe_writable

__all__ = ["run_synthetic", "run_loop", "LoopResult", "make_scheduler", "SCHEDULERS", "check_memory"]

#: ``--scheduler`` choices
SCHEDULERS = ("sync", "sequential", "overlapped", "auto")

#: the largest ``--g-ing`` / ``--g-del`` of ``conduit demo --synthetic`` (the most ``conduit schedule`` lists)
_MAX_GRANULARITY = 10_000

#: where ``conduit demo --synthetic`` writes its Chrome trace unless ``--trace`` says otherwise
DEFAULT_TRACE = "conduit-synthetic-trace.json"


def transition_schema(d: int) -> ExperienceSchema:
    """The synthetic transition: ``obs`` and ``next_obs`` of ``d`` floats, action, reward, done."""
    return ExperienceSchema(obs=Field((d,)), next_obs=Field((d,)), action=Field((), torch.int64),
                            reward=Field(()), done=Field((), torch.bool))


def make_scheduler(kind: str, *, g_ing: int = 1, g_del: int = 1) -> Scheduler:
    """``sync``: Synchronous; ``sequential``: granularity only; ``overlapped``: granularity + overlap;
    ``auto``: :class:`~conduit.scheduling.Automatic` (granularity and overlap from telemetry)."""
    if kind == "sync":
        return Synchronous()
    if kind == "sequential":
        return Overlapped(g_ing=g_ing, g_del=g_del, overlap=False)
    if kind == "overlapped":
        return Overlapped(g_ing=g_ing, g_del=g_del, overlap=True)
    if kind == "auto":
        return Automatic()
    raise ValueError(f"unknown scheduler {kind!r}; choose from {SCHEDULERS}")


@dataclass
class LoopResult:
    """Per-iteration accounting of one run (after warm-up)."""

    obs_dim: int
    scheduler: str
    placement: str
    iterations: list[IterationExposure] = field(default_factory=list)
    #: what the automatic scheduler decided (its ``explain()``), if it was used
    decision: str = ""
    #: calls the trace misses because the telemetry ring dropped them (its ``otherData.dropped_calls``)
    trace_dropped_calls: int = 0

    def median(self, key: str) -> float:
        return statistics.median(getattr(i, key) for i in self.iterations) if self.iterations else 0.0

    def mean(self, key: str) -> float:
        return statistics.fmean(getattr(i, key) for i in self.iterations) if self.iterations else 0.0


class _Learner:
    """A small MLP Q-network and one SGD step of a TD loss on a delivered batch."""

    def __init__(self, d: int, hidden: int, actions: int, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, actions))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        self.net.to(device)
        self.device = device
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-3)

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.net(obs).argmax(1)

    def update(self, batch: object) -> None:
        b = batch  # an ExperienceBatch; fixed fields are tensors
        q = self.net(b["obs"]).gather(1, b["action"][:, None]).squeeze(1)  # type: ignore[index]
        with torch.no_grad():
            nxt = self.net(b["next_obs"]).max(1).values  # type: ignore[index]
            target = b["reward"] + 0.99 * (~b["done"]).float() * nxt  # type: ignore[index, operator]
        loss = torch.nn.functional.mse_loss(q, target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.device.type == "cuda":  # the update's span covers its GPU work
            torch.cuda.synchronize(self.device)


def run_loop(*, obs_dim: int, scheduler: Scheduler | None = None, placement: Placement | None = None,
             iterations: int = 10, warmup: int = 2, rollout: int = 256, batch: int = 512, updates: int = 4,
             capacity: int = 8192, hidden: int = 64, actions: int = 4, seed: int = 0, prefill: int | None = None,
             device: torch.device | str | None = None, trace: str | Path | None = None,
             on_iteration: Callable[[int, IterationExposure], None] | None = None) -> LoopResult:
    """Run the synthetic loop and account for every iteration after ``warmup``.

    Keyword Args:
        obs_dim: d, the observation size (transitions carry ``obs`` and ``next_obs``).
        scheduler: how the experience path runs (default: synchronous).
        placement: where the buffer lives (default: host memory).
        iterations: accounted iterations.
        warmup: iterations run first and not accounted (calibration, allocation).
        rollout: transitions the actor produces per iteration.
        batch: transitions per learner update.
        updates: learner updates per iteration.
        capacity: buffer capacity.
        prefill: items ingested before the first iteration (default ``batch``).
        device: the learner's device (default: the storage's); the actor stays on the host.
        hidden: width of the MLP's hidden layer.
        actions: size of the action space.
        seed: seeds the buffer's sampler, the network and the synthetic environment.
        trace: write a Chrome trace of the accounted iterations there.
        on_iteration: called with (index, accounting) after each accounted iteration.
    """
    if rollout < 1:  # the prefill below would ingest empty rollouts forever
        raise ConfigurationError(f"rollout must be a positive number of transitions, got {rollout!r}.")
    for nm, v, least in (("obs_dim", obs_dim, 1), ("batch", batch, 1), ("iterations", iterations, 0),
                         ("warmup", warmup, 0), ("updates", updates, 0), ("hidden", hidden, 1),
                         ("actions", actions, 1)):
        if v < least:  # a negative count would silently run nothing (or a network without units)
            raise ConfigurationError(f"{nm} must be an int >= {least}, got {v!r}.")
    if isinstance(capacity, int) and 0 < capacity < rollout:  # (the buffer refuses it as "a batch ... split it")
        raise ConfigurationError(f"A rollout of {rollout} transitions does not fit in a buffer of capacity "
                                 f"{capacity}; lower rollout or raise capacity.")
    if isinstance(capacity, int) and capacity > MAX_COUNT:  # (numpy refuses such a shape with a bare ValueError)
        raise ConfigurationError(f"capacity must be at most 2**63 - 1 items, got {capacity!r}; lower it.")
    sched = scheduler if scheduler is not None else Synchronous()
    plc = placement if placement is not None else HostPlacement()
    try:
        edp = ExperienceDataPlane(transition_schema(obs_dim), capacity=capacity, semantics=Replay(seed=seed),
                                  placement=plc, scheduler=sched, device=device)
    except (MemoryError, RuntimeError) as e:  # the buffer is allocated whole, up front
        if not out_of_memory(e):
            raise
        # (the storage's AllocationError names no option of the loop: the allocator's words, under the loop's)
        cause = e.__cause__ if isinstance(e, AllocationError) and e.__cause__ is not None else e
        raise ConfigurationError(f"Not enough memory for a buffer of capacity {capacity} transitions of "
                                 f"d={obs_dim} ({first_line(cause)}); lower capacity or obs_dim.") from e
    # every call of an iteration must fit the telemetry's ring, or the ExposureLog refuses to account for it (and
    # tells the user to raise a maxlen that `conduit demo` has no option for): per update, the delivery call, the
    # scheduler's work for it (twice at most: a prefetch it dropped and its own draw) and the update; the rest is the
    # rollout, its ingestion and the iteration's own span
    calls = _CALLS_PER_UPDATE * updates + _CALLS_PER_ITERATION
    if calls > edp.telemetry.maxlen:
        edp.telemetry = Telemetry(maxlen=calls)
    env = torch.Generator().manual_seed(seed + 1)
    try:
        learner = _Learner(obs_dim, hidden, actions, seed, edp.device)
    except (MemoryError, RuntimeError) as e:
        edp.close()
        if not out_of_memory(e):
            raise
        raise ConfigurationError(f"Not enough memory for the learner's network (d={obs_dim}, hidden {hidden}, "
                                 f"{actions} actions) ({first_line(e)}); lower hidden or obs_dim.") from e
    actor = _Learner(obs_dim, 16, actions, seed + 2, torch.device("cpu"))
    tel = edp.telemetry
    log = ExposureLog(tel)
    result = LoopResult(obs_dim, repr(sched), plc.describe())

    def make_rollout() -> dict[str, torch.Tensor]:
        obs = torch.randn((rollout, obs_dim), generator=env)
        act = actor.act(obs)
        nxt = torch.randn((rollout, obs_dim), generator=env)
        return {"obs": obs, "next_obs": nxt, "action": act, "reward": torch.randn((rollout,), generator=env),
                "done": torch.rand((rollout,), generator=env) < 0.01}

    try:
        target = min(capacity, max(batch, prefill or 0))
        while len(edp) < target:
            edp.ingest(make_rollout())
            edp.flush()
        t_start = float("inf")  # until the first accounted iteration starts: no warm-up span is traced
        for it in range(warmup + iterations):
            if it == warmup:
                t_start = time.perf_counter()
            with log.iteration():
                with tel.span("rollout", rollout):
                    data = make_rollout()
                edp.ingest(data)
                for _ in range(updates):
                    b, _info = edp.deliver(batch)
                    with tel.span("update", batch):
                        learner.update(b)
            if it >= warmup:
                if it > warmup:  # the previous entry, revised with the worker spans still running when it ended
                    result.iterations[-1] = log.iterations[-2]
                result.iterations.append(log.iterations[-1])
                if on_iteration is not None:
                    on_iteration(it - warmup, log.iterations[-1])
        if result.iterations:  # the last one too (see ExposureLog.settle)
            log.settle()
            result.iterations[-1] = log.iterations[-1]
        if trace is not None:
            result.trace_dropped_calls = tel.chrome_trace(trace, since=t_start)["otherData"]["dropped_calls"]
        decision = getattr(sched, "decision", None)
        if decision is not None:
            result.decision = decision.explain()
        result.scheduler = repr(sched)
    finally:
        edp.close()
    return result


#: the most calls :func:`run_loop` records per learner update, and per iteration besides them (with room to spare)
_CALLS_PER_UPDATE = 4
_CALLS_PER_ITERATION = 64


def _change(new: float, old: float) -> str:
    r = 1 - new / old
    return f"{r:.0%} lower" if r >= 0 else f"{-r:.0%} higher"


def _ms(x: float) -> str:
    return f"{x * 1e3:9.2f}"


def check_rollout_fits(rollout: int, capacity: int) -> None:
    """Refuse a ``--rollout`` larger than ``--capacity`` by the options typed, before a command prints anything
    (:func:`run_loop` refuses it too, but only once the run has started, naming its own parameters).

    Raises:
        ConfigurationError: the rollout does not fit; the message names both options and what to do.
    """
    if rollout > capacity:
        raise ConfigurationError(f"--rollout {rollout} is more transitions than the buffer holds (--capacity "
                                 f"{capacity}); lower --rollout or raise --capacity.")


def check_memory(*, obs_dim: int, capacity: int, batch: int, hidden: int | None = None) -> None:
    """Refuse, before a command prints or runs anything, sizes whose float32 observations alone need more than this
    machine's memory (nothing is refused where the OS does not say it): the buffer's observations and next
    observations (``--capacity`` x ``--obs-dim``, allocated whole), one delivered batch's (``--batch``), and the
    learner's first layer (``--hidden``, when the command takes it). Without it, an array larger than memory was
    refused only once the run had started, and arrays each smaller but together larger were allocated and
    filled until the machine ran out.

    Raises:
        ConfigurationError: naming the options, the GiB needed and the machine's memory.
    """
    from conduit.placement.profile import host_memory

    host = host_memory()
    if not host:
        return
    for given, floats, what, lower in (
            (f"--capacity {capacity} with --obs-dim {obs_dim}", 2 * capacity * obs_dim,
             "the buffer's observations and next observations", "--capacity or --obs-dim"),
            (f"--batch {batch} with --obs-dim {obs_dim}", 2 * batch * obs_dim,
             "one delivered batch's observations and next observations", "--batch or --obs-dim"),
            *(() if hidden is None else ((f"--hidden {hidden} with --obs-dim {obs_dim}", hidden * obs_dim,
                                          "the learner's first layer", "--hidden or --obs-dim"),))):
        need = 4 * floats
        if need > host:
            raise ConfigurationError(f"{given}: {what} would need {need / 2**30:,.1f} GiB alone (float32), more than "
                                     f"this machine's {host / 2**30:,.1f} GiB of memory; lower {lower}.")


def _check_output(path: Path) -> None:
    """Make sure the trace can be written to ``path`` once the run is over (probed now, left as it was): it is
    written beside ``path`` and renamed over it (:func:`~conduit.telemetry.write_atomically`), so ``path`` is a
    regular file or none yet, in a folder that takes new files (a symbolic link: its target, see
    :func:`~conduit.telemetry.write_atomically`).

    Raises:
        ConfigurationError: it is a directory or no regular file (a device such as /dev/null, a FIFO: the rename
            would replace it, or the probe wait for a reader), its folder is missing, or it or its folder cannot
            be written.
    """
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ConfigurationError(f"Cannot write the trace to {str(path)!r}: it is not a regular file (a device or "
                                 f"a FIFO, which writing the trace would replace by a file); give --trace a file "
                                 f"name, or --trace '' for none.")
    try:
        probe_writable(path)
        # the trace's rename needs it, beside the file a link points to
        with tempfile.NamedTemporaryFile(dir=Path(os.path.realpath(path)).parent, prefix=".conduit-probe-"):
            pass
    except OSError as e:
        raise ConfigurationError(f"Cannot write the trace to {str(path)!r} ({e.strerror or e}); give --trace a "
                                 f"writable file in an existing folder, or --trace '' for none.") from e


def run_synthetic(argv: Sequence[str] | None = None) -> int:
    """``conduit demo --synthetic``: run the loop, print per-iteration accounting, write a Chrome trace."""
    p = argparse.ArgumentParser(prog="conduit demo --synthetic",
                                description="Synthetic actor/learner loop through the EDP, with exposed-latency "
                                            "accounting per iteration.")
    p.add_argument("--obs-dim", type=whole_number, default=5000, help="d: observation size (default 5000)")
    p.add_argument("--iterations", type=whole_number, default=20, help="accounted iterations (default 20)")
    p.add_argument("--warmup", type=whole_number, default=3, help="iterations run before accounting starts (default 3)")
    p.add_argument("--rollout", type=whole_number, default=256, help="transitions per actor rollout (default 256)")
    p.add_argument("--batch", type=whole_number, default=512, help="transitions per learner update (default 512)")
    p.add_argument("--updates", type=whole_number, default=4, help="learner updates per iteration (default 4)")
    p.add_argument("--capacity", type=whole_number, default=8192,
                   help="buffer capacity in transitions (default 8192; 1e6 is accepted)")
    p.add_argument("--hidden", type=whole_number, default=64, help="MLP hidden width (default 64)")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="overlapped",
                   help="how the experience path runs (default overlapped)")
    p.add_argument("--g-ing", type=whole_number,
                   help=f"rollouts per ingestion call (sequential/overlapped only; default 1, "
                   f"at most {_MAX_GRANULARITY})")
    p.add_argument("--g-del", type=whole_number,
                   help=f"batches per delivery call (sequential/overlapped only; default 4, at "
                   f"most {_MAX_GRANULARITY}); with overlap, one worker hand-off per chunk of this many batches")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the synchronous baseline and report the exposed-latency reduction")
    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help=f"Chrome trace output (default {DEFAULT_TRACE} in the current directory; '' for none)")
    args = p.parse_args(list(argv or []))
    # refused before the table header (the loop refused them after it, naming its own parameters, or not at all:
    # a --g-del past the index range ended in a traceback)
    check_counts(("--obs-dim", args.obs_dim, 1, MAX_COUNT, "obs_dim: floats per observation"),
                 ("--iterations", args.iterations, 0, None, "accounted iterations"),
                 ("--warmup", args.warmup, 0, None, "iterations before accounting starts"),
                 ("--rollout", args.rollout, 1, None, "transitions per actor rollout"),
                 ("--batch", args.batch, 1, MAX_DRAW, "transitions per learner update"),
                 ("--updates", args.updates, 0, None, "learner updates per iteration"),
                 ("--capacity", args.capacity, 1, MAX_COUNT, "buffer capacity in transitions"),
                 ("--hidden", args.hidden, 1, None, "MLP hidden width"),
                 ("--g-ing", args.g_ing, 1, None, "rollouts per ingestion call"),
                 ("--g-del", args.g_del, 1, None, "batches per delivery call"))
    check_rollout_fits(args.rollout, args.capacity)
    check_memory(obs_dim=args.obs_dim, capacity=args.capacity, batch=args.batch, hidden=args.hidden)
    for flag, given in (("--g-ing", args.g_ing), ("--g-del", args.g_del)):
        if given is not None and args.scheduler not in ("sequential", "overlapped"):  # it would be ignored
            raise ConfigurationError(f"{flag} sets the granularity of the sequential and overlapped schedulers; "
                                     f"--scheduler {args.scheduler} does not take it (the automatic one chooses "
                                     f"its own). Drop {flag}, or use --scheduler sequential or overlapped.")
    deliveries = args.updates * (args.warmup + args.iterations)
    if args.g_del is not None and args.g_del > max(1, deliveries):  # one call would prepare them all
        raise ConfigurationError(f"--g-del {args.g_del} would prepare {args.g_del} batches in one delivery call, more "
                                 f"than the {deliveries} the run takes (--updates x (--warmup + --iterations)); "
                                 f"use --g-del {max(1, deliveries)} or less.")
    # (after the check above, which says what this run takes; past the cap, a run long enough to take them made the
    # first call prepare more batches than a list can index: an OverflowError traceback)
    check_counts(("--g-ing", args.g_ing, 1, _MAX_GRANULARITY, "rollouts per ingestion call"),
                 ("--g-del", args.g_del, 1, _MAX_GRANULARITY, "batches per delivery call"))
    rollouts = args.warmup + args.iterations  # ingestion calls of the loop (one rollout each)
    if args.g_ing is not None and args.g_ing > max(1, rollouts):  # no group is written in the loop
        print(f"note: --g-ing {args.g_ing} stores {args.g_ing} rollouts per ingestion call, more than the {rollouts} "
              f"the run produces (--warmup + --iterations): none of them reaches the buffer while the loop runs "
              f"(only when it closes), so the figures time no ingestion; use --g-ing {max(1, rollouts)} or less to "
              f"time it.", file=sys.stderr)
    if args.trace and not args.trace.strip():  # (else a file named with spaces in the current directory)
        raise ConfigurationError(f"--trace {args.trace!r} names no file; give --trace a file name, or --trace '' "
                                 f"for none.")
    if args.trace:
        _check_output(Path(args.trace))
    torch.manual_seed(0)
    common = dict(obs_dim=args.obs_dim, iterations=args.iterations, warmup=args.warmup, rollout=args.rollout,
                  batch=args.batch, updates=args.updates, capacity=args.capacity, hidden=args.hidden)
    print(f"synthetic loop: d={args.obs_dim}, rollout {args.rollout}, {args.updates} updates of batch {args.batch} "
          f"per iteration, MLP hidden {args.hidden}, torch threads {torch.get_num_threads()}")
    header = f"{'iter':>5}{'iteration':>10}{'rollout':>10}{'update':>10}{'exp.path':>10}{'hidden':>10}{'exposed':>10}"

    sched = make_scheduler(args.scheduler, g_ing=1 if args.g_ing is None else args.g_ing,
                           g_del=4 if args.g_del is None else args.g_del)
    probing: list[int] = []  # accounted iterations that ended with the automatic scheduler still calibrating

    def show(i: int, e: IterationExposure) -> None:
        print(f"{i:5d}{_ms(e.iteration_s)}{_ms(e.rollout_s)}{_ms(e.update_s)}{_ms(e.total_s)}{_ms(e.hidden_s)}"
              f"{_ms(e.exposed_s)}")
        if isinstance(sched, Automatic) and sched.decision is None:
            probing.append(i)

    print(f"\nscheduler {sched!r} (ms per iteration)\n{header}")
    res = run_loop(scheduler=sched, trace=args.trace or None, on_iteration=show, **common)  # type: ignore[arg-type]
    _summary(res)
    if probing:  # those figures time its probes of every granularity, not its choice
        assert isinstance(sched, Automatic)
        if args.updates:  # the warm-up that holds its calibration at this --updates (not a fixed count: it
            from conduit.scheduling.cli import _warmup_for  # calibrates on deliveries, --updates per iteration)

            fix = (f"give --warmup {_warmup_for(sched, args.updates)} or more (what its calibration can take at "
                   f"--updates {args.updates}, as `conduit schedule calibrate` warms up) to time its choice alone")
        else:
            fix = "it calibrates on the learner's deliveries, and --updates 0 gives it none: raise --updates"
        print(f"note: the automatic scheduler was still calibrating in {len(probing)} of the {len(res.iterations)} "
              f"accounted iterations ({'it decided later' if res.decision else 'it never decided'}), so these "
              f"figures include its probing; {fix}.")
    if res.decision:
        print("\nautomatic configuration:\n" + res.decision)
    if args.trace:
        print(f"\nChrome trace of the accounted iterations: {args.trace} (open in chrome://tracing or Perfetto)")
        if res.trace_dropped_calls:
            print(f"note: the trace misses {res.trace_dropped_calls} calls that the telemetry ring dropped to make "
                  f"room (the oldest); run fewer --iterations for a complete trace.")
    if args.baseline and args.scheduler != "sync" and not args.iterations:  # it would account nothing either
        print("\nbaseline: not run (--iterations 0 accounts no iteration to compare)")
    elif args.baseline and args.scheduler != "sync":
        print("\nbaseline: synchronous scheduling of the same loop")
        base = run_loop(scheduler=Synchronous(), **common)  # type: ignore[arg-type]
        _summary(base)
        e0, e1 = base.median("exposed_s"), res.median("exposed_s")
        i0, i1 = base.median("iteration_s"), res.median("iteration_s")
        if e0 > 0 and i0 > 0:
            print(f"\nexposed experience-path latency {e1 * 1e3:.2f} ms vs {e0 * 1e3:.2f} ms synchronous "
                  f"({_change(e1, e0)}); iteration {i1 * 1e3:.2f} ms vs {i0 * 1e3:.2f} ms ({_change(i1, i0)})")
    return 0


def _summary(res: LoopResult) -> None:
    it, tot, hid, exp = (res.median(k) for k in ("iteration_s", "total_s", "hidden_s", "exposed_s"))
    # (each is the median of its own column: the medians of hidden and exposed need not add up to the total's)
    print(f"median: iteration {it * 1e3:.2f} ms, experience path {tot * 1e3:.2f} ms, hidden {hid * 1e3:.2f} ms, "
          f"exposed {exp * 1e3:.2f} ms ({exp / it:.0%} of the iteration exposed)" if it else "no iterations")
