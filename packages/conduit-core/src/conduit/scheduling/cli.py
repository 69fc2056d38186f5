"""``conduit schedule``: the safe granularity ranges of a job, and what the automatic scheduler picks here.

* ``conduit schedule ranges --on-policy -M 4`` -- the granularities a job may use, from
  nothing but on/off-policy and M (and, off-policy only, the optional caps; given with
  ``--on-policy`` they are refused, not ignored);
* ``conduit schedule calibrate --obs-dim 5000`` -- run the synthetic actor/learner loop with
  :class:`~conduit.scheduling.Automatic` on this machine and explain its choice (the fitted
  latency model, the predicted cost per granularity, the measured confirmation), then the
  medians of the ``--iterations`` run after it (with ``--iterations 0``: said, not printed as 0 ms).
  Without ``--warmup`` it warms up for as many iterations as the calibration can take at
  ``--updates`` deliveries per iteration (:func:`calibration_deliveries`), so it finishes there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import TYPE_CHECKING

from conduit.commands import MAX_COUNT, check_counts, whole_number
from conduit.errors import ConfigurationError

if TYPE_CHECKING:
    from conduit.exposure import IterationExposure
    from conduit.scheduling.auto import Automatic

__all__ = ["register"]

#: ``conduit schedule --help`` (the module docstring, without its reST markup)
_DESCRIPTION = """The safe granularity ranges of a job, and what the automatic scheduler picks here.

  conduit schedule ranges --on-policy -M 4     the granularities a job may use, from nothing but
                                               on/off-policy and M (and, off-policy, the optional caps)
  conduit schedule calibrate --obs-dim 5000    run the synthetic actor/learner loop with the
                                               Automatic scheduler on this machine and explain its
                                               choice (the fitted latency model, the predicted cost
                                               per granularity, the measured confirmation)"""


#: ``conduit schedule ranges``'s caps on g_ing and g_del when not given (off-policy)
_DEFAULT_CAP = 8

#: the most granularities ``conduit schedule ranges`` lists per range (each is printed; more would run for hours)
_MAX_LISTED = 10_000


def _check_listed(*flags: tuple[str, int | None]) -> None:
    """Refuse a cap above :data:`_MAX_LISTED` (the granularities up to it are enumerated one by one).

    Raises:
        ConfigurationError: one is larger; the message names its flag.
    """
    for flag, v in flags:
        if v is not None and v > _MAX_LISTED:
            raise ConfigurationError(f"{flag} {v} would list {v} granularities one by one; give at most "
                                     f"{_MAX_LISTED}.")


def _ranges(args: argparse.Namespace) -> int:
    from conduit.scheduling.granularity import safe_ranges

    check_counts(("-M", args.num_minibatches, 1, None, "minibatch updates per rollout"),
                 ("--g-ing-max", args.g_ing_max, 1, None, "rollouts per ingestion call"),
                 ("--g-del-max", args.g_del_max, 1, None, "batches per delivery call"),
                 ("--batch-bytes", args.batch_bytes, 0, None, "bytes per delivered batch"),
                 ("--memory-budget", args.memory_budget, 0, None, "bytes the delivery buffers may take"))
    _check_listed(("-M", args.num_minibatches), ("--g-ing-max", args.g_ing_max), ("--g-del-max", args.g_del_max))
    if args.on_policy:  # an on-policy job's ranges come from M alone: a cap given with them would be ignored
        caps = [flag for flag, v in (("--g-ing-max", args.g_ing_max), ("--g-del-max", args.g_del_max),
                                     ("--batch-bytes", args.batch_bytes), ("--memory-budget", args.memory_budget))
                if v is not None]
        if caps:
            raise ConfigurationError(f"{', '.join(caps)} cap{'' if len(caps) > 1 else 's'} off-policy "
                                     f"granularities only; an on-policy job's come from -M alone. Drop "
                                     f"{'them' if len(caps) > 1 else 'it'}, or drop --on-policy.")
    if not args.on_policy and args.num_minibatches is not None:  # (taken, as the library does, but it bounds nothing)
        print(f"note: -M {args.num_minibatches} bounds on-policy granularities only; an off-policy job's ranges do not "
              f"depend on it (add --on-policy for an on-policy job's).", file=sys.stderr)
    if (args.batch_bytes is None) != (args.memory_budget is None):  # one alone caps nothing
        given, missing = ("--batch-bytes", "--memory-budget") if args.memory_budget is None else \
            ("--memory-budget", "--batch-bytes")
        raise ConfigurationError(f"{given} caps g_del only together with {missing}; give both, or neither.")
    try:
        r = safe_ranges(on_policy=args.on_policy, num_minibatches=args.num_minibatches,
                        g_ing_max=_DEFAULT_CAP if args.g_ing_max is None else args.g_ing_max,
                        g_del_max=_DEFAULT_CAP if args.g_del_max is None else args.g_del_max,
                        batch_bytes=args.batch_bytes, memory_budget=args.memory_budget)
    except ConfigurationError as e:  # every count was checked above: what is left is the budget (named by the
        if args.memory_budget is None:  # library's parameter): the options that set it are said first
            raise
        raise ConfigurationError(f"--batch-bytes {args.batch_bytes} with --memory-budget {args.memory_budget}: "
                                 f"{e}") from e
    print(r.describe())
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from conduit.demo import check_memory, check_rollout_fits, run_loop
    from conduit.scheduling.auto import Automatic
    from conduit.semantics.replay import MAX_DRAW

    if args.updates < 1:  # without deliveries the calibration never starts, whatever --warmup says
        raise ConfigurationError(f"--updates must be >= 1 to calibrate (Automatic calibrates on the learner's "
                                 f"deliveries), got {args.updates}.")
    # refused before the loop starts (it refused them after "calibrating ...", naming its own parameters)
    check_counts(("--obs-dim", args.obs_dim, 1, MAX_COUNT, "floats per observation"),
                 ("--batch", args.batch, 1, MAX_DRAW, "transitions per learner update"),
                 ("--rollout", args.rollout, 1, None, "transitions per actor rollout"),
                 ("--capacity", args.capacity, 1, MAX_COUNT, "buffer capacity in transitions"),
                 ("--g-ing-max", args.g_ing_max, 1, None, "rollouts per ingestion call"),
                 ("--g-del-max", args.g_del_max, 1, None, "batches per delivery call"),
                 ("--warmup", args.warmup, 0, None, "calibration iterations"),
                 ("--iterations", args.iterations, 0, None, "iterations measured after calibration"))
    _check_listed(("--g-ing-max", args.g_ing_max), ("--g-del-max", args.g_del_max))
    check_rollout_fits(args.rollout, args.capacity)
    check_memory(obs_dim=args.obs_dim, capacity=args.capacity, batch=args.batch)
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    sched = Automatic(overlap=overlap, g_ing_max=args.g_ing_max, g_del_max=args.g_del_max)
    warmup = args.warmup if args.warmup is not None else _warmup_for(sched, args.updates)
    print(f"calibrating on the synthetic loop: d={args.obs_dim}, batch {args.batch}, rollout {args.rollout}, "
          f"{args.updates} updates per iteration, {warmup} warm-up iterations ...")
    calibrating: set[int] = set()  # measured iterations that ended with the calibration still running

    def measured(i: int, _e: IterationExposure) -> None:
        if not sched.calibrated:
            calibrating.add(i)

    res = run_loop(obs_dim=args.obs_dim, scheduler=sched, iterations=args.iterations, warmup=warmup,
                   rollout=args.rollout, batch=args.batch, updates=args.updates, capacity=args.capacity,
                   on_iteration=measured)
    if not sched.calibrated or sched.decision is None:  # (a decision exists before its confirm phase ends)
        print(f"error: calibration did not finish; raise --warmup to {_warmup_for(sched, args.updates)} or more "
              f"(what it can take at --updates {args.updates})", file=sys.stderr)
        return 2
    print(sched.decision.explain())
    if sched.decision.ingest_fit is None and len(sched.decision.range.g_ing) > 1:  # (one rollout per iteration)
        probe, rollouts = calibration_deliveries(sched, probe_only=True), _ingestion_rollouts(sched)
        fix = (f"give --updates {probe // rollouts} or fewer" if probe >= rollouts else
               "no --updates ingests them in time (one rollout per iteration); lower --g-ing-max or raise "
               "--g-del-max")
        print(f"  (g_ing was not calibrated: the decision comes when the delivery probe ends, after {probe} "
              f"deliveries, and one round of the ingestion probe needs {rollouts} rollouts; {fix} to calibrate it "
              f"too)")
    if not res.iterations:  # nothing was measured after it: medians of no iterations are not 0 ms
        print("\nafter calibration: no iterations measured (--iterations 0)")
        return 0
    # (a --warmup shorter than the calibration: it went on into the measured iterations, which time its probes)
    after = [e for i, e in enumerate(res.iterations) if i not in calibrating]
    left_out = (f" ({len(calibrating)} of the {len(res.iterations)} measured iterations ended with the calibration "
                f"still running; give --warmup {_warmup_for(sched, args.updates)} or more to measure after it only)")
    if not after:
        print(f"\nafter calibration: no iterations measured{left_out}")
        return 0
    iteration, exposed, hidden = (statistics.median(getattr(e, k) for e in after)
                                  for k in ("iteration_s", "exposed_s", "hidden_s"))
    print(f"\nafter calibration: iteration {iteration * 1e3:.2f} ms, exposed experience path {exposed * 1e3:.3f} ms, "
          f"hidden {hidden * 1e3:.3f} ms (medians of {len(after)} iterations){left_out if calibrating else ''}")
    return 0


def calibration_deliveries(sched: Automatic, *, probe_only: bool = False) -> int:
    """The most deliveries an off-policy calibration of ``sched`` takes (the synthetic loop is off-policy): the
    probe (``probe_rounds`` chunks of each probed ``g_del``, a chunk being ``g_del`` deliveries), then, unless
    overlap is forced, ``confirm_windows`` windows per configuration of one untimed chunk and
    ``confirm_deliveries`` timed deliveries each, at ``g_del_max`` at most. ``probe_only``: the probe's alone
    (the decision is made when it ends)."""
    from conduit.scheduling.auto import _probe_values

    probed = _probe_values(tuple(float(g) for g in range(1, sched.g_del_max + 1)))
    probe = sched.probe_rounds * int(sum(probed))
    if sched.force_overlap is not None or probe_only:
        return probe
    return probe + 2 * sched.confirm_windows * (sched.g_del_max + sched.confirm_deliveries)


def _ingestion_rollouts(sched: Automatic) -> int:
    """Rollouts one round of the off-policy ingestion probe writes (one write at each probed ``g_ing``): fewer by
    the decision, and it fits no ingestion model."""
    from conduit.scheduling.auto import _probe_values

    return int(sum(_probe_values(tuple(float(g) for g in range(1, sched.g_ing_max + 1)))))


def _warmup_for(sched: Automatic, updates: int) -> int:
    """Warm-up iterations of ``updates`` deliveries each that hold the whole calibration (one more: a switch of
    scheduler may be retried after a later delivery)."""
    return -(-calibration_deliveries(sched) // updates) + 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``conduit schedule`` to the ``conduit`` parser."""
    p = sub.add_parser("schedule", help="granularity ranges and the automatic scheduling choice",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=_DESCRIPTION)
    sp = p.add_subparsers(dest="schedule_command", required=True)
    r = sp.add_parser("ranges", help="safe g_ing / g_del ranges from on/off-policy and M")
    r.add_argument("--on-policy", action="store_true", help="an on-policy job (default: off-policy)")
    r.add_argument("-M", "--num-minibatches", type=whole_number, default=None,
                   help=f"minibatch updates per rollout (on-policy: sets its granularities; at most {_MAX_LISTED})")
    r.add_argument("--g-ing-max", type=whole_number, default=None,
                   help=f"cap on rollouts per ingestion call (off-policy only; default {_DEFAULT_CAP}, at most "
                        f"{_MAX_LISTED})")
    r.add_argument("--g-del-max", type=whole_number, default=None,
                   help=f"cap on batches per delivery call (off-policy only; default {_DEFAULT_CAP}, at most "
                        f"{_MAX_LISTED})")
    r.add_argument("--batch-bytes", type=whole_number, default=None,
                   help="bytes per delivered batch (off-policy only; together with --memory-budget: caps g_del)")
    r.add_argument("--memory-budget", type=whole_number, default=None,
                   help="bytes the delivery buffers may take (off-policy only; together with --batch-bytes)")
    r.set_defaults(func=_ranges, command_parser=r)  # (an unknown option is refused with this parser's usage)
    c = sp.add_parser("calibrate", help="run the synthetic loop under the automatic scheduler and explain its choice")
    c.add_argument("--obs-dim", type=whole_number, default=1000, help="d: floats per observation (default 1000)")
    c.add_argument("--batch", type=whole_number, default=512, help="transitions per learner update (default 512)")
    c.add_argument("--rollout", type=whole_number, default=256, help="transitions per actor rollout (default 256)")
    c.add_argument("--updates", type=whole_number, default=4,
                   help="learner updates (deliveries) per iteration (default 4)")
    c.add_argument("--capacity", type=whole_number, default=8192,
                   help="buffer capacity in transitions (default 8192; 1e6 is accepted)")
    c.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="auto: the scheduler decides whether to overlap; on/off: forced (default auto)")
    c.add_argument("--g-ing-max", type=whole_number, default=8, help=f"default 8, at most {_MAX_LISTED}")
    c.add_argument("--g-del-max", type=whole_number, default=8, help=f"default 8, at most {_MAX_LISTED}")
    c.add_argument("--warmup", type=whole_number, default=None,
                   help="iterations for calibration (not accounted; default: as many as the calibration can take "
                        "at --updates deliveries per iteration)")
    c.add_argument("--iterations", type=whole_number, default=5,
                   help="iterations measured after calibration; 0 for none (default 5)")
    c.set_defaults(func=_calibrate, command_parser=c)
