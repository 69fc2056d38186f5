"""``conduit simulate``: the paper's scaling experiments in the scale simulator (a SIMULATION).

Writes, per scenario, a Markdown table and a JSON file, and one PNG plot of all scenarios
next to the paper's figures, into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from conduit.commands import count, finite_number
from conduit.errors import ConfigurationError
from conduit.simulation.cluster import NETWORKS, SCENARIOS, Network, Scenario, load_node
from conduit.simulation.model import BASELINES, MAX_NODES, layout, node_workload, run_scenario
from conduit.telemetry import write_atomically

__all__ = ["register", "simulate", "table", "plot"]

LABEL = "SIMULATION"


def _scales(text: str) -> tuple[int, ...]:
    """Comma-separated GPU counts, each >= 1: each simulated once, in increasing order (rows and plot)."""
    parts = [x.strip() for x in text.split(",")]
    if not parts or any(not x for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated GPU counts, e.g. 1,2,4")
    return tuple(sorted({count(x) for x in parts}))


_positive_float = finite_number(0.0, inclusive=False)
#: a remote fetch's cost at the requester, in us: up to one second (the default is 50 us; far past a second, the
#: simulated latencies are the fetch cost alone, printed as 300-digit numbers)
_rpc_us = finite_number(0.0, inclusive=True, most=1e6, meaning="us per remote fetch: at most one second")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(scenario: Scenario, rows: list[dict[str, Any]], baseline: str, network: Network | None = None) -> str:
    """The rows as a Markdown table, labelled as simulation, with the paper's figures beside them."""
    net = network or NETWORKS[scenario.network]
    fetch = "one fetch per pair of nodes" if net.node_fetch else "one fetch per learner"
    fetch += f", {net.rpc_overhead_s * 1e6:g} us per remote fetch"
    sampled = sorted({r["non_adaptive_placements"] for r in rows if r["sim_non_adaptive_ms"] is not None})
    if baseline == "link-blind" and sampled:  # (--samples changes its figures: said, as the JSON's rows say it)
        n = str(sampled[0]) if len(sampled) == 1 else f"{sampled[0]}-{sampled[-1]}"
        baseline += f" (mean of {n} sampled placement{'' if n == '1' else 's'} per scale)"
    head = [f"**{LABEL}** - {scenario.title}: {scenario.topology} nodes, {net.name}, {fetch}, transitions "
            f"d={scenario.obs_dim}, capacity {scenario.capacity}, replay ratio {scenario.replay_ratio:g}, "
            f"non-adaptive = {baseline}", "",
            "| GPUs | nodes | placement per node (adaptive) | sim ms | sim non-adaptive ms (range) | sim gain "
            "| paper ms | paper non-adaptive ms | busiest resources |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        busy = ", ".join(f"{k} {v:.1f}ms" for k, v in r["busiest_ms"][:2])
        if r["sim_non_adaptive_ms"] is None:  # the baseline's placement does not fit (all-gpus)
            off, gain = "does not fit", "-"
        else:
            lo, hi = r["non_adaptive_range_ms"]
            off = f"{r['sim_non_adaptive_ms']:.1f}" + (f" ({lo:.1f}-{hi:.1f})" if hi - lo > 0.05 else "")
            gain = f"{r['gain']:+.1%}"
        head.append(f"| {r['gpus']} | {r['nodes']} | {r['placement']} | {r['sim_ms']:.1f} | {off} | {gain} | "
                    f"{_ms(r['paper_ms'])} | {_ms(r['paper_non_adaptive_ms'])} | {busy} |")
    return "\n".join(head)


def plot(results: dict[str, tuple[Scenario, list[dict[str, Any]]]], path: Path) -> Path | None:
    """One panel per scenario: simulated adaptive and non-adaptive latency, and the paper's points.

    The image is written whole or not at all (a failed write leaves the previous one). Returns None when
    matplotlib is missing (``pip install 'conduit-core[plot]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (scenario, rows) in zip(axes[0], results.values(), strict=True):
        g = [r["gpus"] for r in rows]
        ax.plot(g, [r["sim_ms"] for r in rows], "o-", label="simulation: Conduit (adaptive placement)")
        off = [r for r in rows if r["sim_non_adaptive_ms"] is not None]  # (not where the baseline does not fit)
        ax.plot([r["gpus"] for r in off], [r["sim_non_adaptive_ms"] for r in off], "s--",
                label="simulation: adaptive placement off")
        pg = sorted(scenario.paper)
        ax.plot(pg, [scenario.paper[x][0] for x in pg], "k*", markersize=12, label="paper: Conduit")
        pb = [x for x in pg if scenario.paper[x][1] is not None]
        if pb:
            ax.plot(pb, [scenario.paper[x][1] for x in pb], "kx", markersize=10, label="paper: adaptive off")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("experience-path latency per iteration (ms)")
        ax.set_title(f"{LABEL}: {scenario.title}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Conduit scale simulator (discrete-event SIMULATION, not a measurement)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written whole, then renamed over ``path``
    try:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (the previous file stays when the write fails).

    Raises:
        ConfigurationError: it cannot be written (the message names it and what to do).
    """
    try:
        write_atomically(path, text)
    except OSError as e:
        raise ConfigurationError(f"Cannot write {str(path)!r} ({e.strerror or e}); free space there or give --out "
                                 f"a writable directory.") from e


def _check_scales(scenario: Scenario) -> None:
    """Refuse a scale of ``scenario`` that cannot be laid out on its nodes (see :func:`~.model.layout`), or
    whose nodes' share of the capacity cannot hold one learner's batch (:func:`~.model.node_workload`).

    Raises:
        ConfigurationError: naming ``--gpus`` and the scale.
    """
    per_node = load_node(scenario.topology).num_gpus or 1
    for g in scenario.gpus:
        try:
            node_workload(scenario, layout(g, scenario.total_batch, min(g, per_node)))
        except ConfigurationError as e:
            raise ConfigurationError(f"--gpus {g} ({scenario.name}): {e}") from e


def simulate(args: argparse.Namespace) -> int:
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    changes: dict[str, Any] = {}
    for field in ("obs_dim", "capacity", "replay_ratio"):
        v = getattr(args, field)
        if v is not None:
            changes[field] = v
    if args.gpus:
        changes["gpus"] = args.gpus
    # every scenario and scale checked before any is simulated or the output directory is made (a refused value
    # refuses the command, not its second half)
    scenarios: dict[str, Scenario] = {}
    for name in names:
        try:
            scenarios[name] = dataclasses.replace(SCENARIOS[name], **changes)
        except ConfigurationError as e:  # (it names the scenario's fields: the options that set them are said first)
            given = ", ".join(f"--{f.replace('_', '-')} {changes[f]:{'g' if isinstance(changes[f], float) else 'd'}}"
                              for f in ("obs_dim", "capacity", "replay_ratio") if f in changes)
            raise ConfigurationError(f"{given} ({name}): {e}") from e
    for sc in scenarios.values():
        _check_scales(sc)
    if not args.out.strip():  # (Path("") is the current directory: the files would land there unasked)
        raise ConfigurationError(f"--out {args.out!r} names no directory; give the directory for the tables and the "
                                 f"plot (--out . for the current one).")
    samples = 8 if args.samples is None else args.samples
    if args.samples is not None and args.baseline != "link-blind":
        print(f"note: --samples applies to --baseline link-blind only; the {args.baseline} baseline simulates one "
              f"placement per scale.", file=sys.stderr)
    out = Path(args.out)
    made = [d for d in (out, *out.parents) if not d.exists()]  # the folders this command will make, deepest first
    try:
        return _simulate_into(out, args, scenarios, samples)
    except BaseException:
        # interrupted (Ctrl-C) or refused before a file was written: the directories this command made for its
        # output go (its parents too), those still empty (one that existed before, or that holds any file, is kept)
        for d in made:
            try:
                d.rmdir()
            except OSError:
                break  # (not empty: its parents are not either)
        raise


def _check_outputs(paths: list[Path]) -> None:
    """Refuse, before anything is simulated or written, an output name already taken by something a file cannot
    replace (a folder, a device): found only when that output was written, it ended the command after the
    outputs written before it (a half output).

    Raises:
        ConfigurationError: naming the path and --out.
    """
    for path in paths:
        if path.exists() and not path.is_file():  # (a link to a regular file is written through)
            what = "a directory" if path.is_dir() else "not a regular file"
            raise ConfigurationError(f"Cannot write {str(path)!r}: it is {what}; move it away or give --out another "
                                     f"directory.")


def _simulate_into(out: Path, args: argparse.Namespace, scenarios: dict[str, Scenario], samples: int) -> int:
    """Make ``out``, simulate every scenario, then write the tables, the JSON files and the plot there."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".conduit-probe-"):  # an existing folder may refuse files
            pass
    except OSError as e:
        raise ConfigurationError(f"Cannot use --out {str(out)!r} as the output directory ({e.strerror or e}); "
                                 f"give a directory path that can be created or written.") from e
    _check_outputs([out / f"scale-{name}.{ext}" for name in scenarios for ext in ("md", "json")]
                   + [out / "scale.png"])
    results: dict[str, tuple[Scenario, list[dict[str, Any]]]] = {}
    nets: dict[str, Network] = {}
    # every scenario simulated before any file is written: a refusal (nothing fits) leaves no half output
    for name, sc in scenarios.items():
        net = NETWORKS[sc.network]
        if args.rpc_us is not None:
            net = dataclasses.replace(net, rpc_overhead_s=args.rpc_us * 1e-6)
        nets[name] = dataclasses.replace(net, node_fetch=args.fetch == "per-node")
        results[name] = (sc, run_scenario(sc, baseline=args.baseline, samples=samples, network=nets[name]))
    for name, (sc, rows) in results.items():
        net = nets[name]
        md = table(sc, rows, args.baseline, net)
        _write(out / f"scale-{name}.md", md + "\n")
        scenario = dataclasses.asdict(sc) | {"description": sc.title}
        # (the network's source states its default remote-fetch cost: said when --rpc-us replaced it)
        source = net.source + ("" if args.rpc_us is None else f"; remote fetch cost replaced: --rpc-us {args.rpc_us:g}")
        _write(out / f"scale-{name}.json", json.dumps({"label": LABEL, "scenario": scenario, "network": source,
                                                       "rpc_us": round(net.rpc_overhead_s * 1e6, 9),
                                                       "fetch": args.fetch, "baseline": args.baseline,
                                                       "rows": rows}, indent=1, default=str))
        print(md, "\n")
    try:
        png = plot(results, out / "scale.png")
    except OSError as e:
        raise ConfigurationError(f"Cannot write the plot {str(out / 'scale.png')!r} ({e.strerror or e}); free "
                                 f"space there or give --out a writable directory.") from e
    print(f"wrote {out}/scale-*.md, scale-*.json" + (f" and {png}" if png else
                                                      " (no PNG: pip install 'conduit-core[plot]')"))
    # another scenario's files from an earlier run stay (nothing a user wrote is deleted), but the plot no longer
    # shows them: said, so the folder is not read as one run
    earlier = [p.name for n in SCENARIOS if n not in scenarios for p in (out / f"scale-{n}.md", out / f"scale-{n}.json")
               if p.exists()]
    if earlier:
        print(f"note: {', '.join(earlier)} in {out} are from an earlier run (not this one's --scenario), and "
              f"{out / 'scale.png'} now shows only {', '.join(scenarios)}; remove them, or give --out another "
              f"directory, to keep one run per folder.", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``conduit simulate``."""
    p = sub.add_parser("simulate", help="simulate the paper's scaling experiments (discrete-event SIMULATION)",
                       description="Simulate one iteration of Conduit's experience path on declared clusters "
                                   "(a SIMULATION driving the placement planner and cost model) and write a "
                                   "table and a PNG next to the paper's figures.")
    p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all",
                   help="the cluster to simulate (default all: each, one table each)")
    p.add_argument("--out", default="simulation-out",
                   help="directory for the tables and the plot (default simulation-out in the current directory)")
    p.add_argument("--baseline", choices=BASELINES, default="rank-order",
                   help="what 'adaptive placement off' means (see docs; default rank-order)")
    p.add_argument("--samples", type=count,
                   help="placements simulated per scale with --baseline link-blind (default 8)")
    p.add_argument("--gpus", type=_scales, help="comma-separated scales, simulated in increasing order (default: the "
                   f"paper's; at most {MAX_NODES} nodes)")
    p.add_argument("--obs-dim", dest="obs_dim", type=count, help="transition size d (default 20000)")
    p.add_argument("--capacity", type=count, help="global buffer capacity (default 1e6)")
    p.add_argument("--replay-ratio", dest="replay_ratio", type=_positive_float,
                   help="deliveries per ingested item (default 1; at least total batch / capacity: an iteration "
                        "ingests at most the buffer's capacity)")
    p.add_argument("--rpc-us", dest="rpc_us", type=_rpc_us,
                   help="cost of one remote fetch at the requester (us, 0 to 1e6; default: the network's)")
    p.add_argument("--fetch", choices=("per-node", "per-learner"), default="per-node",
                   help="remote fetches: per-node, one per pair of nodes for all of a node's learners (default "
                        "per-node), or per-learner, one per learner")
    p.set_defaults(func=simulate)
