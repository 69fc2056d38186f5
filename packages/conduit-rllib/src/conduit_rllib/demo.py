"""``conduit demo``: RLlib DQN on large observations, native replay vs Conduit, side by side.

Runs DQN on :class:`~conduit_rllib.envs.LargeObsCartPole` (``d`` float32 observations, 5000
by default) twice with the same seed: first with RLlib's own replay buffer and learner
connector, then with ``conduit_rllib.enable``. Both run on a local Ray started in-process
(the EnvRunner and the learner live in this process). Per iteration it prints the
experience-path time (replay add, sample and priority updates, turning the sample into a
train batch), how much of it was exposed (the training loop waited for it), the iteration
time and the mean return; then the medians and a PNG plot. :mod:`conduit_rllib.profiling`
says exactly what is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from conduit.commands import MAX_COUNT, whole_number
from conduit.placement.profile import host_memory
from conduit.telemetry import probe_writable

from conduit_rllib.compare import Row

__all__ = ["run", "plot", "median_heading"]


def plot(rows: dict[str, list[Row]], path: Path, title: str) -> Path:
    """Per-iteration experience path (exposed and total), iteration time and return, per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"native": "#7f7f7f", "conduit": "#1f77b4"}
    for name, rs in rows.items():
        c = colors.get(name)
        it = [r.iteration for r in rs]
        axes[0].plot(it, [r.exposed_s * 1e3 for r in rs], "o-", color=c, label=f"{name}: exposed")
        axes[0].plot(it, [r.experience_s * 1e3 for r in rs], "x--", color=c, alpha=0.6, label=f"{name}: total")
        axes[1].plot(it, [r.iteration_s for r in rs], "o-", color=c, label=name)
        axes[2].plot(it, [float("nan") if r.episode_return is None else r.episode_return for r in rs], "o-",
                     color=c, label=name)
    axes[0].set(title="experience path per iteration", xlabel="iteration", ylabel="ms")
    axes[1].set(title="iteration time", xlabel="iteration", ylabel="s")
    axes[2].set(title="mean episode return", xlabel="iteration", ylabel="return")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def median_heading(*, iterations: int, steps: int, capacity: int) -> str:
    """The line above the medians: the iterations they cover, and what the first one, left out, did. It collects
    ``steps`` transitions before learning starts (:func:`~conduit_rllib.workloads.dqn_large_obs` starts learning
    after ``steps``): the buffer is full then only when ``capacity <= steps``."""
    stored = "fills the buffer" if capacity <= steps else \
        f"stores the first {steps} of the buffer's {capacity} transitions"
    return (f"\nmedian over iterations 2..{iterations} (iteration 1 {stored} and pays one-time costs; learning starts "
            f"at its end):")


def _plot_path(p: argparse.ArgumentParser, out: Path) -> Path:
    """Where the plot will be written, checked before the (minutes-long) run.

    A name without a suffix gets ``.png`` (what matplotlib writes then); a format matplotlib cannot
    write, a directory, or a place that cannot be written ends the command with a usage error (exit 2).
    Missing parent folders are created for the probe and removed after it (:func:`plot` creates them once the
    plot is drawn): a run that fails or is interrupted leaves none behind.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    if out.is_dir():
        p.error(f"--out {str(out)!r} is a directory; give a file name, e.g. {str(out / 'conduit-demo-rllib.png')!r}")
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        p.error(f"--out {str(out)!r}: matplotlib cannot write {out.suffix!r} files; use one of "
                f"{', '.join('.' + f for f in sorted(formats))}")
    missing = [d for d in (out.parent, *out.parent.parents) if not d.exists()]  # deepest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe_writable(out)
    except OSError as e:
        p.error(f"cannot write the plot to {str(out)!r} ({e.strerror or e}); give --out a writable file")
    finally:
        for d in missing:  # (empty: only the probe was there, and it is gone)
            with contextlib.suppress(OSError):
                d.rmdir()
    return out


def _check_memory(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before Ray starts, sizes whose float32 observations alone need more than this machine's memory:
    the replay buffer's (``--capacity``: Conduit's preallocates each transition's observation and next
    observation), one train batch's (obs and next_obs) and the network's first layer (``--obs-dim`` x
    ``--hidden``). A usage error (exit 2) naming the options; otherwise the
    native run went first, for as long as it took, and the run ended in an allocation's traceback."""
    host = host_memory()
    if not host:  # not said by this OS: nothing to compare with
        return
    d = args.obs_dim
    for flags, values, count, what in ((("--capacity", "--obs-dim"), (args.capacity, d), 2 * args.capacity * d,
                                        "the replay buffer's observations and next observations"),
                                       (("--batch", "--obs-dim"), (args.batch, d), 2 * args.batch * d,
                                        "one train batch's observations and next observations"),
                                       (("--hidden", "--obs-dim"), (args.hidden, d), args.hidden * d,
                                        "the network's first layer")):
        need = 4 * count
        if need > host:
            given = " with ".join(f"{f} {v}" for f, v in zip(flags, values, strict=True))
            p.error(f"{given}: {what} would need {need / 2**30:,.1f} GiB alone (float32), more than this machine's "
                    f"{host / 2**30:,.1f} GiB of memory; lower {' or '.join(flags)}")


def run(argv: Sequence[str] | None = None) -> int:
    """The ``conduit.demos`` entry point: run both variants, print the per-iteration table, write the plot."""
    p = argparse.ArgumentParser(prog="conduit demo", description="RLlib DQN on large observations, native replay "
                                "vs Conduit, same seed; per-iteration experience-path, exposed and iteration "
                                "time and return for both, and a PNG plot.")
    p.add_argument("--obs-dim", type=whole_number, default=5000,
                   help="observation size d, float32 values (default: 5000)")
    p.add_argument("--iterations", type=whole_number, default=5,
                   help="training iterations per variant, at least 2: the first collects --steps transitions before "
                        "learning starts and pays one-time costs (imports, allocations), so the medians compare "
                        "iterations 2.. (default: 5)")
    p.add_argument("--steps", type=whole_number, default=200,
                   help="env steps (= learner updates) per iteration (default: 200)")
    p.add_argument("--batch", type=whole_number, default=32, help="train batch size (default: 32, RLlib's DQN default)")
    p.add_argument("--capacity", type=whole_number, default=5000,
                   help="replay capacity in transitions (default: 5000; 1e6 is accepted)")
    p.add_argument("--uniform", action="store_true", help="uniform replay (default: prioritized, as RLlib's DQN)")
    p.add_argument("--hidden", type=whole_number, default=64, help="hidden layer width (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of both variants, 0 to 2**32 - 1 (default: 0)")
    p.add_argument("--out", type=Path, default=Path("conduit-demo-rllib.png"),
                   help="where to write the plot (default: conduit-demo-rllib.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in logs)")
    p.epilog = "conduit demo --synthetic [--help] runs conduit-core's synthetic actor/learner loop instead."
    args = p.parse_args(list(argv or []))
    # each refused alone, by name (one message for --iterations, --steps and --obs-dim named all three, whichever
    # was wrong); RLlib would train on empty batches or fail deep inside with a bare AssertionError
    # (--iterations 1 compared only the buffer-filling first iteration, where whichever variant ran first paid one-time
    # costs such as RLlib's prioritized buffer importing scipy: "-100%" from an import)
    for flag, v, least in (("--obs-dim", args.obs_dim, 4), ("--iterations", args.iterations, 2),
                           ("--steps", args.steps, 1), ("--batch", args.batch, 1), ("--capacity", args.capacity, 1),
                           ("--hidden", args.hidden, 1)):
        if v < least:
            p.error(f"{flag} must be >= {least}, got {v}; give {flag} {least} or more")
        if v > MAX_COUNT:  # (RLlib's buffer took a capacity past int64 to numpy: a TypeError traceback)
            p.error(f"{flag} must be at most 2**63 - 1, got {v}; give a smaller {flag}")
    if not 0 <= args.seed < 2**32:  # (RLlib seeds NumPy's global generator with it, in the native variant's build)
        p.error(f"--seed must be from 0 to 2**32 - 1, got {args.seed}; give a seed in that range")
    _check_memory(p, args)
    args.out = _plot_path(p, args.out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    import torch

    from conduit_rllib.compare import run_sequential, summarize, table
    from conduit_rllib.workloads import dqn_large_obs

    torch.set_num_threads(1)
    kw = dict(steps=args.steps, batch=args.batch, capacity=args.capacity, seed=args.seed,
              prioritized=not args.uniform, hidden=args.hidden)
    print(f"RLlib DQN on LargeObsCartPole: d={args.obs_dim} float32 observations, batch {args.batch}, "
          f"{'uniform' if args.uniform else 'prioritized'} replay (capacity {args.capacity}), {args.steps} env steps "
          f"and learner updates per iteration, seed {args.seed}. Native RLlib first, then Conduit.", flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")  # type: ignore[arg-type]  # ray takes level names too; its hint says int
    try:
        rows = run_sequential({"native": dqn_large_obs(args.obs_dim, **kw),
                               "conduit": dqn_large_obs(args.obs_dim, **kw)},
                              args.iterations, progress=not args.no_progress)
    finally:
        ray.shutdown()
    print()
    print(table(rows))
    s = summarize(rows)
    print(median_heading(iterations=args.iterations, steps=args.steps, capacity=args.capacity))
    for attr, label in (("experience_s", "experience path"), ("exposed_s", "exposed experience path"),
                        ("iteration_s", "iteration time"), ("cpu_s", "iteration CPU time")):
        n, c, ch = s["native"][attr], s["conduit"][attr], s["conduit"]["change"][attr]
        print(f"  {label:<24} native {n * 1e3:9.1f} ms   conduit {c * 1e3:9.1f} ms   ({ch:+.0%})")
    out = plot(rows, args.out, f"RLlib DQN, d={args.obs_dim}: native replay vs Conduit")
    print(f"\nplot: {out.resolve()}")
    return 0
