"""The latency model that picks granularities, calibrated from the job's own telemetry.

One experience-path call (an ingestion write or a delivery call) moving ``x`` bytes costs

    t(x) = a + b * x + c * max(0, x - C) + s * x * [the call staged several units]

* ``a`` -- per-call overhead (locking, sampling set-up, bookkeeping, accounting);
* ``b`` -- per-byte cost (copy or gather bandwidth);
* ``c``, ``C`` -- chunk-management cost: past ``C`` bytes a chunk no longer stays in
  cache (or fast memory) while it is built and read back, and every further byte costs
  ``c`` more;
* ``s`` -- staging: coalescing several rollouts into one write copies them once more.

A granularity ``g`` moves ``g`` units of ``u`` bytes per call, so the cost per unit is
``t(g u) / g``: the overhead is amortised, the chunk term grows. With overlap, work that
fits in the learner's (or actor's) time between calls is hidden; what remains exposed is
the hand-over plus the part that does not fit.

The fit uses a robust low quantile per size and non-negative least squares on relative errors
(the knee ``C`` searched between the observed sizes). With as many sizes as parameters it
interpolates the measurements, so its choice is the measured best among probed sizes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from conduit.errors import ConfigurationError
from conduit.telemetry import CallRecord

__all__ = ["LatencyFit", "fit_latency", "observations", "per_unit", "exposed_per_unit", "choose_granularity"]


@dataclass(frozen=True)
class LatencyFit:
    """Fitted parameters of ``t(x) = a + b x + c max(0, x - C) + s x [staged]`` (seconds, bytes)."""

    overhead_s: float
    per_byte_s: float
    chunk_per_byte_s: float
    knee_bytes: float
    stage_per_byte_s: float
    #: calls the fit was built from, and distinct sizes among them
    calls: int
    sizes: int
    #: root-mean-square relative error of the fit on the per-size medians
    rel_error: float

    def seconds(self, nbytes: float, *, staged: bool = False) -> float:
        """Predicted seconds of one call moving ``nbytes``."""
        extra = max(0.0, nbytes - self.knee_bytes) if math.isfinite(self.knee_bytes) else 0.0
        return (self.overhead_s + self.per_byte_s * nbytes + self.chunk_per_byte_s * extra
                + (self.stage_per_byte_s * nbytes if staged else 0.0))

    def describe(self) -> str:
        knee = f"{self.knee_bytes / 2**20:.1f} MiB" if math.isfinite(self.knee_bytes) else "none"
        return (f"{self.overhead_s * 1e6:.1f} us/call + {self.per_byte_s * 1e9:.3f} ns/B, chunk +"
                f"{self.chunk_per_byte_s * 1e9:.3f} ns/B past {knee}, staging {self.stage_per_byte_s * 1e9:.3f} ns/B "
                f"({self.calls} calls, {self.sizes} sizes, rms error {self.rel_error:.1%})")


def observations(records: Iterable[CallRecord], kind: str) -> list[tuple[float, float, bool]]:
    """``(bytes, seconds, staged)`` per call of ``kind`` ("ingest" or "deliver").

    An ingestion write that followed a "stage" record of the same items on the same
    thread counts as staged, and the staging time is added to it. A call that raised (recorded
    with no items) moved nothing to fit a model by, and is left out.
    """
    out = []
    stage: dict[int, CallRecord] = {}
    for r in records:
        if r.kind == "stage":
            stage[r.thread] = r
        elif r.kind == kind and r.items:
            s = stage.pop(r.thread, None)
            if s is not None and s.items == r.items and kind == "ingest":
                out.append((float(r.nbytes), r.seconds + s.seconds, True))
            else:
                out.append((float(r.nbytes), r.seconds, False))
    return out


def _nnls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares by enumerating active sets (few columns)."""
    best, best_err = np.zeros(x.shape[1]), float(np.sum(y * y))
    cols = range(x.shape[1])
    for k in range(1, x.shape[1] + 1):
        for subset in itertools.combinations(cols, k):
            sub = x[:, subset]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-18:
                full = np.zeros(x.shape[1])
                full[list(subset)] = coef
                best, best_err = full, err
    return best, best_err


def _low_quantile(v: list[float]) -> float:
    """The 25th percentile: interference from other work only ever adds time, so the low end of a
    size's calls is the closest to what the call itself costs (the minimum, below four calls)."""
    return sorted(v)[len(v) // 4]


def fit_latency(obs: Sequence[tuple[float, float, bool]]) -> LatencyFit:
    """Fit the model to ``(bytes, seconds, staged)`` observations.

    Raises:
        ConfigurationError: (a ``ValueError``) no observations, or one whose bytes or seconds are negative or
            not finite (a timing that is no measurement: drop it before fitting).
    """
    if not obs:
        raise ConfigurationError("no calls to fit a latency model to; run some ingest/deliver calls first")
    for b, s, _ in obs:
        if not (math.isfinite(b) and math.isfinite(s) and b >= 0 and s >= 0):
            raise ConfigurationError(f"cannot fit a latency model to a call of {b!r} bytes taking {s!r} s: bytes "
                                     f"and seconds must be finite and >= 0; drop such observations before fitting")
    groups: dict[tuple[float, bool], list[float]] = {}
    for b, s, staged in obs:
        groups.setdefault((b, staged), []).append(s)
    pts = sorted((b, st, _low_quantile(v)) for (b, st), v in groups.items())
    xb = np.array([p[0] for p in pts])
    st = np.array([1.0 if p[1] else 0.0 for p in pts])
    y = np.array([p[2] for p in pts])
    w = 1.0 / np.maximum(y, 1e-9)  # relative errors: small and large calls count alike
    # knees strictly inside the observed sizes (at the smallest it would only duplicate the linear term)
    sizes = sorted(set(xb.tolist()))
    knees = [math.inf]
    if len(sizes) >= 3:
        # (a geometric grid needs a positive start: a zero-byte call's size only bounds the knees from below)
        low = sizes[0] if sizes[0] > 0 else sizes[1] / 2
        knees += [k for k in np.geomspace(low, sizes[-1], 48)[1:-1].tolist() if k < sizes[-2]]
        knees += sizes[1:-1]
    best: tuple[float, np.ndarray, float] | None = None
    for knee in knees:
        cols = [np.ones_like(xb), xb]
        cols.append(np.maximum(0.0, xb - knee) if math.isfinite(knee) else np.zeros_like(xb))
        cols.append(xb * st)
        x = np.stack(cols, axis=1)
        coef, err = _nnls(x * w[:, None], y * w)
        if best is None or err < best[2] - 1e-12:
            best = (knee, coef, err)
    assert best is not None
    knee, coef, err = best
    if coef[2] == 0:
        knee = math.inf
    return LatencyFit(float(coef[0]), float(coef[1]), float(coef[2]), float(knee), float(coef[3]),
                      len(obs), len(pts), math.sqrt(err / len(pts)))


def per_unit(fit: LatencyFit, g: float, unit_bytes: float, *, staged: bool = False) -> float:
    """Seconds per unit (rollout or batch) at granularity ``g`` (``g`` units per call), sequentially."""
    return fit.seconds(g * unit_bytes, staged=staged) / g


def exposed_per_unit(fit: LatencyFit, g: float, unit_bytes: float, *, gap_s: float, handover_s: float,
                     wake_s: float = 0.0, window_units: float | None = None, staged: bool = False) -> float:
    """Seconds per unit left on the critical path with overlap.

    A call of ``g`` units runs in the background during ``window_units`` gaps of the
    caller's own work (``g`` by default: prepared one chunk ahead); what does not fit is
    exposed, plus the hand-over on every unit and ``wake_s`` per background call (handing
    a job to the worker thread and waking it, which on a busy machine can also take the
    caller's core for a moment).
    """
    window = (g if window_units is None else window_units) * gap_s
    return handover_s + (wake_s + max(0.0, fit.seconds(g * unit_bytes, staged=staged) - window)) / g


def choose_granularity(costs: dict[float, float], *, tolerance: float = 0.02, slack_s: float = 0.0) -> float:
    """The smallest granularity whose predicted cost is within ``tolerance`` (relative) plus
    ``slack_s`` (seconds) of the cheapest.

    Smaller is preferred on ties: it bounds staleness and memory at no predicted cost. With
    overlap the predicted exposed costs are tiny, and differences far below the caller's own
    cycle buy nothing measurable, while larger chunks take more memory and compete longer with
    the caller for caches and memory bandwidth; ``slack_s`` (e.g. 1% of that cycle) says how
    small a difference counts as a tie.

    Raises:
        ConfigurationError: (a ``ValueError``) no costs, or a cost that is negative or not finite (no prediction
            to rank).
    """
    if not costs:
        raise ConfigurationError("no granularities to choose from: pass the predicted cost of at least one")
    bad = {g: c for g, c in costs.items() if not (math.isfinite(c) and c >= 0)}
    if bad:
        raise ConfigurationError(f"predicted costs must be finite and >= 0 to rank granularities, got {bad}; "
                                 f"check the latency fit and the unit sizes they were predicted from")
    best = min(costs.values())
    return min(g for g, c in costs.items() if c <= best * (1 + tolerance) + slack_s + 1e-9)
