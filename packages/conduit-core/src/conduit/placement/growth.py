"""Experience growth, simulated on the cost model: the paper's online-migration experiment.

Over a schedule of observation sizes (one per training iteration) three strategies keep a
replay buffer of transitions on a topology:

* **greedy**: the fastest placement for the first size, never moved; it fails (runs out of
  memory) at the first size its placement cannot hold;
* **conservative**: sharded over every GPU from the start;
* **conduit**: follows a placement map computed ahead of time over the whole size range
  and migrates when the size crosses a boundary, paying the predicted cost of moving the
  live items (no re-profiling).

Every figure is a :class:`~conduit.placement.CostModel` prediction; nothing is executed.
An iteration runs ``updates`` learner updates, each with one ingestion and one delivery of
``batch`` items per learner; the buffer gains ``batch * learners * updates`` items per iteration (up
to its capacity), which is what a migration must move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conduit.errors import ConfigurationError, PlacementError
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import Workload
from conduit.placement.planner import Planner

__all__ = ["StrategyTrace", "GrowthResult", "simulate_growth", "paper_schedule"]


def paper_schedule(iterations: int = 40, sizes: Sequence[int] = (128, 1000, 5000, 10000, 20000)) -> list[int]:
    """Observation sizes growing from 128 to 20000 in equal stages over ``iterations``.

    Raises:
        ConfigurationError: ``iterations`` is not an int >= 1, ``sizes`` is empty, or there are fewer
            iterations than sizes (a stage would get no iteration: the largest sizes would be left out).
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ConfigurationError(f"iterations must be an int >= 1, got {iterations!r}.")
    if not sizes:
        raise ConfigurationError("sizes is empty; give the observation sizes of the stages, e.g. (128, 1000).")
    if iterations < len(sizes):
        raise ConfigurationError(f"{iterations} iterations cannot hold the {len(sizes)} stages of sizes {tuple(sizes)} "
                                 f"(each stage needs at least one iteration; the largest sizes would be left out). "
                                 f"Give iterations >= {len(sizes)}, or fewer sizes.")
    # stage j starts at the first iteration i with i >= j * iterations / len(sizes), in integers (float division
    # put i / (iterations / len(sizes)) just below a whole j, e.g. 9 / (18 / 14), and started that stage late)
    return [sizes[i * len(sizes) // iterations] for i in range(iterations)]


@dataclass
class StrategyTrace:
    """One strategy's predicted experience-path latency per iteration."""

    name: str
    #: seconds per iteration (``None`` from the iteration it failed on)
    latency_s: list[float | None] = field(default_factory=list)
    #: the placement used in each iteration (``None`` once failed)
    placements: list[str | None] = field(default_factory=list)
    #: ``(iteration, seconds, from, to)`` of each migration (included in ``latency_s``)
    migrations: list[tuple[int, float, str, str]] = field(default_factory=list)
    #: the iteration it could not run (out of memory), if any
    failed_at: int | None = None
    reason: str = ""

    @property
    def cumulative_s(self) -> float:
        """Total latency over the iterations it completed."""
        return sum(x for x in self.latency_s if x is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "latency_ms": [None if x is None else x * 1e3 for x in self.latency_s],
                "placements": self.placements, "migrations": [
                    {"iteration": i, "ms": s * 1e3, "from": a, "to": b} for i, s, a, b in self.migrations],
                "failed_at": self.failed_at, "reason": self.reason, "cumulative_ms": self.cumulative_s * 1e3}


@dataclass
class GrowthResult:
    """The three strategies over one schedule."""

    schedule: list[int]
    strategies: dict[str, StrategyTrace]
    settings: dict[str, Any]

    @property
    def conservative_over_conduit(self) -> float:
        """Cumulative latency of Conservative divided by Conduit's (the paper reports 1.9x)."""
        return self.strategies["conservative"].cumulative_s / self.strategies["conduit"].cumulative_s

    def to_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "settings": self.settings,
                "conservative_over_conduit": self.conservative_over_conduit,
                "strategies": {k: v.to_dict() for k, v in self.strategies.items()}}


def simulate_growth(planner: Planner, schedule: Sequence[int], *, capacity: int = 10**6, batch: int = 512,
                    learners: int = 1, updates: int = 16) -> GrowthResult:
    """Predict the three strategies over ``schedule`` (observation size per iteration).

    A size that no placement holds fails Conduit there (:attr:`StrategyTrace.failed_at`, as the
    other strategies fail when theirs runs out of memory); the iterations before it are kept.

    Raises:
        PlacementError: the topology has no GPU to shard over, or nothing fits the first size.
        ConfigurationError: an empty schedule, or ``updates`` < 1.
    """
    if not schedule:
        raise ConfigurationError("The schedule is empty; give one observation size per iteration, e.g. "
                                 "paper_schedule().")
    if isinstance(updates, bool) or not isinstance(updates, int) or updates < 1:
        raise ConfigurationError(f"updates must be an int >= 1 (learner updates per iteration), got {updates!r}.")
    topo = planner.topology
    if topo.num_gpus < 2:
        raise PlacementError(f"Topology {topo.name!r} has {topo.num_gpus} GPU(s); the experiment shards over "
                             f"several. Use e.g. dgx-a100-80g.")
    model = planner.cost

    def workload(d: int) -> Workload:
        return Workload.transitions(d, capacity=capacity, batch=batch, learners=learners)

    def per_iteration(spec: PlacementSpec, w: Workload) -> float | None:
        e = model.estimate(spec, w)
        return updates * e.total_s if e.feasible else None

    ws = [workload(d) for d in schedule]
    greedy = StrategyTrace("greedy")
    g_spec = planner.plan(ws[0]).placement
    for i, w in enumerate(ws):
        t = per_iteration(g_spec, w) if greedy.failed_at is None else None
        if t is None and greedy.failed_at is None:
            greedy.failed_at = i
            greedy.reason = f"{g_spec} cannot hold {capacity} items at d={schedule[i]}: " + \
                "; ".join(model.estimate(g_spec, w).shortfalls())
        greedy.latency_s.append(t)
        greedy.placements.append(str(g_spec) if t is not None else None)

    conservative = StrategyTrace("conservative")
    c_spec = PlacementSpec("sharded", tuple(g.device for g in topo.gpus))
    for i, w in enumerate(ws):
        t = per_iteration(c_spec, w) if conservative.failed_at is None else None  # out of memory: stays failed
        if t is None and conservative.failed_at is None:
            conservative.failed_at = i
            conservative.reason = "; ".join(model.estimate(c_spec, w).shortfalls())
        conservative.latency_s.append(t)
        conservative.placements.append(str(c_spec) if t is not None else None)

    conduit = StrategyTrace("conduit")
    pmap = planner.placement_map(ws[0], min_item_bytes=min(w.item_bytes for w in ws),
                                 max_item_bytes=max(w.item_bytes for w in ws), points=32,
                                 resize=lambda b: ws[0].resized(b))
    current: PlacementSpec | None = None
    for i, w in enumerate(ws):
        if conduit.failed_at is not None:  # out of memory everywhere: stays failed, as the others do
            conduit.latency_s.append(None)
            conduit.placements.append(None)
            continue
        try:
            spec = pmap.lookup(w.item_bytes)
        except PlacementError as e:  # no placement holds this size (the first one fits: planned above)
            conduit.failed_at = i
            conduit.reason = str(e)
            conduit.latency_s.append(None)
            conduit.placements.append(None)
            continue
        t = per_iteration(spec, w)
        assert t is not None  # the map only holds feasible placements
        if current is not None and spec != current:
            live = min(capacity, i * batch * learners * updates)
            move = model.move_seconds(live * w.item_bytes, current, spec)
            conduit.migrations.append((i, move, str(current), str(spec)))
            t += move
        current = spec
        conduit.latency_s.append(t)
        conduit.placements.append(str(spec))
    settings = {"topology": topo.name, "capacity": capacity, "batch": batch, "learners": learners,
                "updates_per_iteration": updates, "profile": planner.profile.machine,
                "boundaries_bytes": pmap.boundaries}
    return GrowthResult(list(schedule), {"greedy": greedy, "conservative": conservative, "conduit": conduit},
                        settings)
