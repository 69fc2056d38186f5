"""Checking the cost model against the machine: predicted vs measured host-tier delivery.

For each observation size ``d`` a host-tier :class:`~conduit.ExperienceDataPlane` of
transitions is filled (the buffer larger than the caches, as real buffers are) and its
``deliver(batch)`` timed: the median over ``reps`` calls after a warm-up. The prediction is
the :class:`~conduit.placement.CostModel`'s delivery latency for the same workload on the
host tier, from host paths measured with other sizes and shapes (single-column gathers of
1 to 512 rows, scalar columns, the EDP's overhead on an 8-byte item).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conduit.checks import is_int
from conduit.errors import ConfigurationError
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import CostModel, Workload, transition_schema
from conduit.placement.profile import (
    BandwidthProfile,
    Clock,
    _llc_bytes,
    _median_seconds,
    machine_id,
    measure_host_paths,
)
from conduit.placement.topology import Topology, discover_topology

__all__ = ["DeliveryCheck", "measure_host_delivery", "check_host_delivery", "check_host_delivery_isolated",
           "buffer_capacity"]


@dataclass(frozen=True)
class DeliveryCheck:
    """Predicted vs measured host-tier delivery latency at one observation size."""

    obs_dim: int
    capacity: int
    batch: int
    #: per round: the prediction from that round's profile, and the measured median delivery
    predicted_rounds: tuple[float, ...]
    measured_rounds: tuple[float, ...]

    @property
    def predicted_s(self) -> float:
        return statistics.median(self.predicted_rounds)

    @property
    def measured_s(self) -> float:
        return statistics.median(self.measured_rounds)

    @property
    def error(self) -> float:
        """Median over rounds of the relative error ``(predicted - measured) / measured``.

        Each round pairs a prediction and a measurement taken moments apart, under the
        same machine load; the median drops a round disturbed by other processes.
        """
        return statistics.median((p - m) / m for p, m in zip(self.predicted_rounds, self.measured_rounds,
                                                                 strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {"obs_dim": self.obs_dim, "capacity": self.capacity, "batch": self.batch,
                "predicted_ms": self.predicted_s * 1e3, "measured_ms": self.measured_s * 1e3, "error": self.error,
                "rounds": len(self.predicted_rounds)}


def buffer_capacity(obs_dim: int, batch: int, buffer_bytes: int) -> int:
    """Items that make a transition buffer of about ``buffer_bytes`` (at least ``4 * batch``)."""
    item = transition_schema(obs_dim).fixed_item_bytes
    return max(4 * batch, buffer_bytes // item)


def _check_counts(**counts: tuple[object, int]) -> None:
    """Refuse a count that is no int (a bool is none) or below its least value, before any buffer is built.

    Raises:
        ConfigurationError: naming the count (``name=(value, least)``).
    """
    for name, (v, least) in counts.items():
        if not is_int(v) or v < least:
            raise ConfigurationError(f"{name} must be an int >= {least}, got {v!r}.")


def _filled_buffer(obs_dim: int, capacity: int, seed: int) -> Any:
    from conduit.edp import ExperienceDataPlane
    from conduit.semantics import Replay, UniformSampler

    schema = transition_schema(obs_dim)
    edp = ExperienceDataPlane(schema, capacity=capacity, semantics=Replay(UniformSampler(), seed=seed))
    chunk = max(1, min(capacity, (32 << 20) // schema.fixed_item_bytes))
    filled = 0
    while filled < capacity:
        n = min(chunk, capacity - filled)
        ids = torch.arange(filled, filled + n)
        edp.ingest({"obs": ids[:, None].float().expand(n, obs_dim), "next_obs": ids[:, None].float().expand(n, obs_dim),
                    "action": ids % 16, "reward": ids.float(), "done": ids % 100 == 0})
        filled += n
    return edp


def _median_deliver(edp: Any, batch: int, reps: int, warmup: int, clock: Clock) -> float:
    """Median of ``deliver(batch)`` (cheap calls get more runs, as the profile's measurements do)."""
    return _median_seconds(lambda: edp.deliver(batch), reps=reps, warmup=warmup, clock=clock)


def measure_host_delivery(obs_dim: int, *, batch: int = 512, capacity: int, reps: int = 31, warmup: int = 5,
                          seed: int = 0, clock: Clock = time.perf_counter) -> float:
    """Median seconds of ``deliver(batch)`` from a full host-tier transition buffer.

    Raises:
        ConfigurationError: ``reps`` < 1 or ``warmup`` < 0 (no median to take), or either is no int.
    """
    _check_counts(reps=(reps, 1), warmup=(warmup, 0))
    edp = _filled_buffer(obs_dim, capacity, seed)
    try:
        return _median_deliver(edp, batch, reps, warmup, clock)
    finally:
        edp.close()


def check_host_delivery(obs_dims: Sequence[int] = (128, 1000, 5000, 20000), *, batch: int = 512,
                        buffer_bytes: int = 128 << 20, reps: int = 21, rounds: int = 5,
                        profile: BandwidthProfile | None = None, clock: Clock = time.perf_counter,
                        topology: Topology | None = None) -> list[DeliveryCheck]:
    """Predicted and measured host-tier delivery latency for each of ``obs_dims``.

    Runs ``rounds`` rounds; each measures the host paths (:func:`measure_host_paths`,
    single-column gathers of other sizes than the deliveries; skipped when ``profile`` is
    given) and then every delivery, so prediction and measurement see the same machine
    load. Reports each round; :attr:`DeliveryCheck.error` is the median of the rounds' errors.
    Each buffer holds at least ``buffer_bytes`` and at least twice the last-level cache, so
    deliveries read from memory, as the profile's gathers do (a buffer that fits the cache
    would be served from it, faster than any prediction from memory bandwidth).

    Keyword Args:
        clock: ``time.perf_counter`` (wall) or ``time.thread_time`` (this thread's CPU time:
            on a shared machine it leaves out time other processes held the core), used for
            both the profile and the deliveries.

    Raises:
        ConfigurationError: ``rounds`` or ``reps`` < 1 (no median to take), either no int; checked before any
            buffer is filled.
    """
    _check_counts(rounds=(rounds, 1), reps=(reps, 1))
    topo = topology if topology is not None else discover_topology()
    host = PlacementSpec("host", ("cpu",))
    buffer_bytes = max(buffer_bytes, 2 * _llc_bytes())
    caps = {d: buffer_capacity(d, batch, buffer_bytes) for d in obs_dims}
    predicted: dict[int, list[float]] = {d: [] for d in obs_dims}
    measured: dict[int, list[float]] = {d: [] for d in obs_dims}
    buffers = {d: _filled_buffer(d, caps[d], seed=d) for d in obs_dims}
    try:
        for _ in range(rounds):
            prof = profile
            if prof is None:
                prof = BandwidthProfile(measure_host_paths(quick=True, clock=clock), machine=machine_id(),
                                        details={"llc_bytes": _llc_bytes()})
            model = CostModel(topo, prof)
            for d in obs_dims:
                w = Workload.transitions(d, capacity=caps[d], batch=batch)
                predicted[d].append(sum(model.deliver_one(host, w, "cpu").values()))
                measured[d].append(_median_deliver(buffers[d], batch, reps, 3, clock))
    finally:
        for b in buffers.values():
            b.close()
    return [DeliveryCheck(d, caps[d], batch, tuple(predicted[d]), tuple(measured[d])) for d in obs_dims]


_ISOLATED = """
import json, sys, time
from conduit.placement.validation import check_host_delivery
a = json.loads(sys.argv[1])
checks = check_host_delivery(tuple(a["obs_dims"]), batch=a["batch"], rounds=a["rounds"],
                             buffer_bytes=a["buffer_bytes"], clock=time.thread_time)
print(json.dumps([c.to_dict() for c in checks]))
"""


def check_host_delivery_isolated(obs_dims: Sequence[int] = (128, 1000, 5000, 20000), *, batch: int = 512,
                                 rounds: int = 3, buffer_bytes: int = 96 << 20,
                                 timeout: float = 600.0) -> list[dict[str, Any]]:
    """:func:`check_host_delivery` in a fresh, single-threaded Python process, on its thread's CPU clock.

    A long-running process (a test session after Ray jobs, a benchmark session) slows the
    EDP's Python path on the measured side only, and other processes' time on the core is
    not the code's; a fresh interpreter and the thread clock leave both out. Returns
    :meth:`DeliveryCheck.to_dict` rows.

    Raises:
        RuntimeError: the measuring process failed (its stderr is in the message).
        ConfigurationError: ``rounds`` < 1 or no int (before the process is started).
    """
    _check_counts(rounds=(rounds, 1))
    arg = json.dumps({"obs_dims": list(obs_dims), "batch": batch, "rounds": rounds, "buffer_bytes": buffer_bytes})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _ISOLATED, arg], env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"The delivery check failed in its own process:\n{out.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows
