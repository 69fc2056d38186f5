"""Native RLlib vs Conduit on the same workload: per-iteration experience path, iteration time, return.

Used by ``conduit demo`` (variants one after the other), the benchmarks and the scripts
under ``benchmarks/scripts`` (variants alternating iteration by iteration, so both see the
same machine load). Timing follows :mod:`conduit_rllib.profiling`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from conduit.errors import ConfigurationError

__all__ = ["Row", "Variant", "run_sequential", "run_interleaved", "summarize", "table"]


@dataclass
class Row:
    """One training iteration of one variant (seconds)."""

    variant: str
    iteration: int
    iteration_s: float
    #: process CPU seconds in the iteration (less sensitive to other jobs on the machine)
    cpu_s: float
    experience_s: float
    exposed_s: float
    episode_return: float | None
    parts: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rng_state() -> tuple[Any, ...]:
    """The process-global random states RLlib seeds and draws from (exploration, shuffling, ...)."""
    import random

    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, ...]) -> None:
    import random

    import numpy as np
    import torch

    py, np_state, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(np_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class Variant:
    """One built algorithm ("native" or "conduit") with its experience-path probe. A variant named "conduit", or one
    given ``enable`` (whatever its name), enables Conduit in a copy of ``config`` (with ``enable``, default
    ``conduit_rllib.enable``): the config given is left unchanged. Any other variant runs RLlib as configured.

    Each variant keeps its own copy of the process-global random states (Python's, NumPy's,
    torch's), seeded when it is built and swapped in around its ``train()`` calls: variants
    built with the same seed draw the same streams whether they run one after the other or
    interleaved in one process.
    """

    def __init__(self, name: str, config: Any, *, enable: Callable[[Any], Any] | None = None) -> None:
        from conduit_rllib.profiling import ExperiencePathProbe

        if name == "conduit" or enable is not None:
            import conduit_rllib

            config = config.copy(copy_frozen=False)  # (the caller's config stays as it is: it may build "native")
            (enable or conduit_rllib.enable)(config)
        self.name = name
        self.algo = config.build_algo()
        self._rng = _rng_state()  # as the build seeded it
        try:
            self.probe = ExperiencePathProbe(self.algo)
        except BaseException:
            self.algo.stop()  # nobody else holds the algorithm yet: stop it before the error leaves
            raise
        self.rows: list[Row] = []

    def iteration(self) -> Row:
        outer = _rng_state()
        _set_rng_state(self._rng)
        try:
            self.probe.take()
            c0, t0 = time.process_time(), time.perf_counter()
            result = self.algo.train()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            p = self.probe.take()
        finally:
            self._rng = _rng_state()
            _set_rng_state(outer)
        ret = result.get("env_runners", {}).get("episode_return_mean")
        row = Row(self.name, len(self.rows) + 1, dt, dc, p["total"], p["exposed"],
                  None if ret is None else float(ret), p)
        self.rows.append(row)
        return row

    def close(self) -> None:
        self.probe.close()
        self.algo.stop()


def _bar(total: int, desc: str, progress: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="it", disable=not progress, leave=True)


def run_sequential(configs: dict[str, Any], iterations: int, *, progress: bool = True) -> dict[str, list[Row]]:
    """Build and train each variant in turn (``configs``: name -> config; "conduit" gets enabled)."""
    out: dict[str, list[Row]] = {}
    for name, cfg in configs.items():
        v = Variant(name, cfg)
        try:
            with _bar(iterations, f"{name:>7}", progress) as bar:
                for _ in range(iterations):
                    r = v.iteration()
                    bar.set_postfix(exposed=f"{r.exposed_s * 1e3:.0f}ms", iter=f"{r.iteration_s:.1f}s")
                    bar.update()
        finally:
            v.close()
        out[name] = v.rows
    return out


def run_interleaved(configs: dict[str, Any], iterations: int, *, progress: bool = True) -> dict[str, list[Row]]:
    """Build every variant, then alternate their iterations (same load for all). Every variant built is
    closed (its algorithm stopped) before this returns or raises, also when a later one fails to build."""
    variants: list[Variant] = []
    try:
        for name, cfg in configs.items():
            variants.append(Variant(name, cfg))
        with _bar(iterations * len(variants), "interleaved", progress) as bar:
            for _ in range(iterations):
                for v in variants:
                    v.iteration()
                    bar.update()
    finally:
        for v in variants:
            v.close()
    return {v.name: v.rows for v in variants}


def summarize(rows: dict[str, list[Row]], *, skip: int = 1, baseline: str = "native",
              attrs: Sequence[str] = ("experience_s", "exposed_s", "iteration_s", "cpu_s")) -> dict[str, Any]:
    """Median per attribute over iterations after the first ``skip``, and each variant's change vs ``baseline``.

    Raises:
        ConfigurationError: a variant has no iterations (nothing to take a median of).
    """
    empty = [name for name, rs in rows.items() if not rs]
    if empty:
        raise ConfigurationError(f"No iterations were recorded for {', '.join(map(repr, empty))}; run every "
                                 f"variant for at least one iteration before summarizing.")

    def med(rs: list[Row], attr: str) -> float:
        vals = [getattr(r, attr) for r in rs[skip:]] or [getattr(r, attr) for r in rs]
        return statistics.median(vals)

    out: dict[str, Any] = {}
    for name, rs in rows.items():
        out[name] = {a: med(rs, a) for a in attrs}
        out[name]["parts"] = {p: statistics.median([r.parts.get(p, 0.0) for r in (rs[skip:] or rs)])
                              for p in rs[0].parts}
    base = out.get(baseline)
    if base:
        for name in rows:
            if name != baseline:
                out[name]["change"] = {a: (out[name][a] / base[a] - 1 if base[a] > 0 else 0.0) for a in attrs}
    return out


def table(rows: dict[str, list[Row]]) -> str:
    """Per-iteration rows of every variant as aligned text."""
    lines = [f"{'variant':>8} {'iter':>4} {'experience ms':>14} {'exposed ms':>11} {'iteration s':>12} "
             f"{'cpu s':>7} {'return':>8}"]
    for rs in rows.values():
        for r in rs:
            ret = "-" if r.episode_return is None else f"{r.episode_return:.1f}"
            lines.append(f"{r.variant:>8} {r.iteration:>4} {r.experience_s * 1e3:>14.1f} {r.exposed_s * 1e3:>11.1f} "
                         f"{r.iteration_s:>12.2f} {r.cpu_s:>7.2f} {ret:>8}")
    return "\n".join(lines)
