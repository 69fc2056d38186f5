"""The planner: the fastest placement that fits, with every candidate explained.

Candidates span the memory hierarchy of the topology: host memory (and pinned host memory
when there are GPUs), each single GPU, the buffer sharded over 2, 4, ... GPUs, and the
disk tier. For every shard count the planner proposes the GPUs with the fastest links to
the learners (on non-uniform interconnects these differ from the first ``k`` GPUs, which
are proposed too, so the plan shows why they lose) and, when the topology declares
``host_link_groups`` (GPUs behind one PCIe switch), the best-ranked GPUs spread over as
many host links as possible (staged ingestion fills the shards over their host links at
once, so GPUs sharing a switch ingest no faster than one). Each candidate is priced by the
:class:`~conduit.placement.CostModel`; the chosen one is the fastest feasible (candidates
within ``tie_tolerance`` of it prefer fewer devices, then the simpler tier, then the faster; of costs
equal up to float rounding, the first proposed, so the choice is a function of the costs, not of the
order their sums were added in). The disk tier
is chosen only when nothing in memory fits: it is for buffers larger than memory.

GPUs are ranked by their links to the learners: first by the learners they host, then by
their bandwidth to the other learners' GPUs, so with a learner on every GPU the ones with
the fastest links to the rest (MI250X: 0/2/4/6) still come first, and a GPU hosting a
learner outranks one that hosts none however fast (even unlimited) its links.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conduit.checks import is_real
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement.base import TIERS, Placement, PlacementSpec
from conduit.placement.cost import CostModel, Estimate, Workload
from conduit.placement.profile import BandwidthProfile
from conduit.placement.topology import Topology

if TYPE_CHECKING:
    from conduit.placement.placement_map import PlacementMap

__all__ = ["Candidate", "Plan", "Planner", "NothingFitsError"]


#: costs this close (relative) are one cost: they differ only by float rounding (:meth:`Planner.plan`)
_ROUNDING = 1e-12


def _same_cost(t: float, fastest: float) -> bool:
    """Whether ``t`` is ``fastest`` up to float rounding (``t >= fastest``)."""
    return t == fastest or t <= fastest + _ROUNDING * abs(fastest)


class NothingFitsError(PlacementError):
    """No candidate placement holds the workload (:meth:`Planner.plan`): its items, at this capacity,
    fit nowhere on the topology. Other refusals of the planner (more learners than GPUs, a profile
    without a path the candidates need) raise a plain :class:`~conduit.errors.PlacementError`: they
    hold for every item size."""


@dataclass(frozen=True)
class Candidate:
    """One candidate placement, its prediction, and why it was chosen or lost."""

    estimate: Estimate
    chosen: bool
    reason: str
    #: what this candidate tries (e.g. "fastest links to the learners", "first 4 GPUs")
    label: str = ""

    @property
    def spec(self) -> PlacementSpec:
        return self.estimate.spec

    @property
    def feasible(self) -> bool:
        return self.estimate.feasible

    def to_dict(self) -> dict[str, Any]:
        return {**self.estimate.to_dict(), "chosen": self.chosen, "reason": self.reason, "label": self.label}


@dataclass(frozen=True)
class Plan:
    """The planner's answer: the chosen placement and every candidate considered."""

    topology: Topology
    workload: Workload
    candidates: tuple[Candidate, ...]
    #: where the figures came from: ``declared:<topology>``, ``measured:<machine>``, or a measured profile
    #: completed by the topology's declared figures, saying so (``measured:<machine>, declared:<topology> for N
    #: path(s) it lacks``)
    profile_source: str

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.chosen)

    @property
    def placement(self) -> PlacementSpec:
        return self.chosen.spec

    def build(self, **kwargs: Any) -> Placement:
        """The chosen :class:`~conduit.placement.Placement`, ready for ``ExperienceDataPlane(placement=...)``.

        With ragged fields in the workload, the placement sizes a buffer's ragged pools (when the buffer
        gives no ``ragged_capacity``) as the plan assumed: ``capacity`` items of the workload's ragged field
        bytes (its ``mean_ragged_length``), so the pools take the memory the plan checked
        (:attr:`Placement.ragged_item_bytes`); a workload of ragged fields at length 0 checked none, and its
        placement needs the buffer's ``ragged_capacity``. Without ragged fields the pools keep the storage's
        default. ``kwargs`` go to :meth:`PlacementSpec.build` (``directory`` for the disk tier: by default the
        volume whose free space the plan checked, ``discover_topology(disk_directory=...)``'s, else the temp dir).
        """
        w = self.workload
        if w.ragged and "ragged_item_bytes" not in kwargs:
            kwargs["ragged_item_bytes"] = sum(w.field_bytes[i] for i in w.ragged)
        if self.placement.tier == "disk" and kwargs.get("directory") is None:
            kwargs["directory"] = self.topology.details.get("disk_directory")
        return self.placement.build(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        c = self.chosen
        return {"placement": {**c.spec.to_dict(), "ingest_ms": c.estimate.ingest_s * 1e3,
                              "deliver_ms": c.estimate.deliver_s * 1e3, "total_ms": c.estimate.total_s * 1e3},
                "topology": self.topology.to_dict(), "profile": self.profile_source,
                "workload": self.workload.to_dict(), "candidates": [x.to_dict() for x in self.candidates]}

    def explain(self) -> str:
        """A readable table of every candidate (the candidate column as wide as its longest placement, so the
        columns stay aligned however many GPUs a sharded placement names)."""
        w = self.workload
        width = max([46, *(len(str(c.spec)) + 2 for c in self.candidates)])
        lines = [f"topology {self.topology.name} (bandwidth: {self.profile_source}), item {w.item_bytes} B, "
                 f"capacity {w.capacity}, batch {w.batch}, learners {w.learners}",
                 f"chosen: {self.placement}  (ingest {self.chosen.estimate.ingest_s * 1e3:.3f} ms + deliver "
                 f"{self.chosen.estimate.deliver_s * 1e3:.3f} ms per iteration)", "",
                 f"{'':2}{'candidate':{width}}{'ingest ms':>11}{'deliver ms':>12}{'memory GiB':>12}  {'fits':5} why"]
        for c in self.candidates:
            e = c.estimate
            mem = max(e.memory.values()) / 2**30 if e.memory else 0.0
            lines.append(f"{'*' if c.chosen else ' ':2}{str(c.spec):{width}}{e.ingest_s * 1e3:11.3f}"
                         f"{e.deliver_s * 1e3:12.3f}{mem:12.2f}  {'yes' if c.feasible else 'no':5} {c.reason}")
        return "\n".join(lines)


class Planner:
    """Capacity-constrained, bandwidth-aware placement.

    Args:
        topology: where the buffer could live.
        profile: path costs (default: the topology's declared figures).

    Keyword Args:
        tie_tolerance: candidates this close (relative) to the fastest count as tied.
        **cost_kwargs: passed to :class:`CostModel` (``headroom``, ``gpu_usable``, ...).

    Examples:
        >>> from conduit.placement import Planner, Workload, load_topology
        >>> planner = Planner(load_topology("dgx-a100-80g"))
        >>> planner.plan(Workload.transitions(5000, capacity=10**6, batch=512)).placement.tier
        'gpu'
        >>> planner.plan(Workload.transitions(20000, capacity=10**6, batch=512)).placement.tier
        'sharded'
    """

    #: tiers chosen only when no other feasible candidate exists (the disk tier: for buffers larger than memory)
    fallback_tiers: tuple[str, ...] = ("disk",)

    def __init__(self, topology: Topology, profile: BandwidthProfile | None = None, *, tie_tolerance: float = 0.02,
                 **cost_kwargs: Any) -> None:
        tol: object = tie_tolerance  # (checked as what a caller may pass, not as what the signature says)
        if not is_real(tol) or not float(tol) >= 0:
            raise ConfigurationError(f"tie_tolerance must be a number >= 0 (a fraction of the fastest candidate's "
                                     f"latency), got {tie_tolerance!r}.")
        self.topology = topology
        self.cost = CostModel(topology, profile, **cost_kwargs)
        self.tie_tolerance = tie_tolerance

    @property
    def profile(self) -> BandwidthProfile:
        return self.cost.profile

    # -- candidates --------------------------------------------------------------------------
    def _link_score(self, gpu: int, learners: Sequence[str]) -> tuple[int, float]:
        """How well ``gpu`` is linked to the learners' GPUs (higher is better): ``(learners it hosts,
        its bandwidth to every other learner's GPU)``, compared in that order (a pair, not a sum, so
        no bandwidth, not even an unlimited one, outranks hosting a learner).
        """
        hosts = 0
        bandwidth = 0.0
        for ld in learners:
            if not ld.startswith("cuda:"):
                continue
            j = int(ld.split(":")[1])
            if j == gpu:
                hosts += 1
                continue
            try:
                bandwidth += self.profile.link("p2p", gpu, j).peak_bandwidth
            except PlacementError:
                pass
        return hosts, bandwidth

    def _spread(self, order: Sequence[int], k: int) -> list[int]:
        """``k`` GPUs over as many host links as possible: each time the best-ranked one on the least-used link."""
        picked: list[int] = []
        used: dict[int, int] = {}
        for _ in range(k):
            i = min((i for i in order if i not in picked),
                    key=lambda i: (used.get(self.cost.host_link_group(i), 0), order.index(i)))
            picked.append(i)
            used[self.cost.host_link_group(i)] = used.get(self.cost.host_link_group(i), 0) + 1
        return picked

    def candidates(self, workload: Workload) -> list[tuple[PlacementSpec, str]]:
        """Every placement worth pricing, with a short label saying what it tries."""
        topo = self.topology
        out: list[tuple[PlacementSpec, str]] = [(PlacementSpec("host", ("cpu",)), "host memory")]
        n = topo.num_gpus
        if n:
            out.append((PlacementSpec("pinned", ("cpu",)), "page-locked host memory"))
            for g in topo.gpus:
                out.append((PlacementSpec("gpu", (g.device,)), f"GPU {g.index} alone"))
            learners = self.cost.learner_devices(workload)
            def rank(i: int) -> tuple[int, float, int]:
                hosts, bandwidth = self._link_score(i, learners)
                return -hosts, -bandwidth, i

            order = sorted(range(n), key=rank)
            grouped = bool(topo.details.get("host_link_groups"))
            # (no more shards than item slots: ShardedStorage refuses a shard without a slot)
            sizes = sorted(k for k in {k for k in (2, 4, 8, 16, 32, 64) if k < n} | ({n} if n > 1 else set())
                           if k <= workload.capacity)
            seen: set[frozenset[int]] = set()
            for k in sizes:
                tries = [(order[:k], f"{k} GPUs with the fastest links to the learners")]
                if grouped and k < n:
                    tries.append((self._spread(order, k), f"{k} GPUs spread over the host links"))
                tries.append((list(range(k)), f"the first {k} GPUs"))
                for devs, label in tries:
                    key = frozenset(devs)
                    if key in seen:
                        continue
                    seen.add(key)
                    home = min(devs, key=rank)
                    devs_sorted = [home, *sorted(d for d in devs if d != home)]
                    out.append((PlacementSpec("sharded", tuple(f"cuda:{i}" for i in devs_sorted)), label))
        if topo.disk_bytes > 0 and self.profile.has("disk_read") and self.profile.has("disk_write"):
            out.append((PlacementSpec("disk", ("disk",)), "memory-mapped files"))
        return out

    # -- choice ------------------------------------------------------------------------------
    def plan(self, workload: Workload) -> Plan:
        """Price every candidate and choose the fastest feasible one.

        Raises:
            NothingFitsError: no candidate fits (the message says by how much the best one misses).
            PlacementError: the workload cannot be planned on this topology at any size (e.g. more
                learners than GPUs).
        """
        priced = [(self.cost.estimate(spec, workload), label) for spec, label in self.candidates(workload)]
        feasible = [(e, lb) for e, lb in priced if e.feasible]
        if not feasible:
            closest = min(priced, key=lambda p: max(n * (1 + p[0].headroom) / max(p[0].usable.get(d, 1), 1)
                                                     for d, n in p[0].memory.items()))[0]
            raise NothingFitsError(
                f"No placement on {self.topology.name!r} fits {workload.capacity} items of {workload.item_bytes} B "
                f"({workload.capacity * workload.item_bytes / 2**30:.1f} GiB): the closest, {closest.spec}, "
                f"{'; '.join(closest.shortfalls())}. Lower the capacity, shrink the items, or plan on a larger "
                f"topology.")
        in_memory = [(e, lb) for e, lb in feasible if e.spec.tier not in self.fallback_tiers]
        eligible = in_memory or feasible
        best_t = min(e.total_s for e, _ in eligible)
        # (the fastest is always tied with itself: at best_t 0 an unlimited tolerance gives 0 * inf, NaN)
        tied = [(e, lb) for e, lb in eligible if e.total_s == best_t or e.total_s <= best_t * (1 + self.tie_tolerance)]
        simplest = min((len(e.spec.devices), TIERS.index(e.spec.tier)) for e, _ in tied)
        same = [e for e, _ in tied if (len(e.spec.devices), TIERS.index(e.spec.tier)) == simplest]
        fastest = min(e.total_s for e in same)
        # the fastest of the simplest; of candidates whose costs differ only by float rounding (GPUs linked alike to
        # the learners: the same sums added in another order), the first proposed, so the choice does not flip
        # between them with the last bit from one item size to the next (a placement map plans only some sizes)
        chosen = next(e for e in same if _same_cost(e.total_s, fastest))
        cands = [Candidate(e, e is chosen, self._reason(e, chosen, best_t, fallback_only=bool(in_memory)), lb)
                 for e, lb in priced]
        cands.sort(key=lambda c: (not c.chosen, not c.feasible, c.estimate.total_s))
        prof = self.profile
        src = prof.machine if prof.source == "declared" else f"measured:{prof.machine}"
        declared = prof.details.get("declared_paths")
        if declared:  # a profile merged with the topology's declared figures: not every figure is its own
            src += f", declared:{prof.details['declared_fallback']} for {len(declared)} path(s) it lacks"
        return Plan(self.topology, workload, tuple(cands), src)

    @property
    def _tolerance(self) -> str:
        """The tie tolerance as a percentage, to 3 significant digits (``0.005`` is 0.5%, not 0% or 1%)."""
        return f"{float(self.tie_tolerance) * 100:.3g}%"

    def _reason(self, e: Estimate, chosen: Estimate, best_t: float, *, fallback_only: bool = False) -> str:
        if e is chosen:
            if not _same_cost(e.total_s, best_t):
                return (f"chosen: within {self._tolerance} of the fastest and uses fewer devices or a simpler "
                        f"tier")
            return "chosen: fastest feasible"
        short = e.shortfalls()
        if short:
            return "does not fit: " + "; ".join(short)
        if fallback_only and e.spec.tier in self.fallback_tiers:
            return (f"not needed: memory holds the buffer ({e.spec.tier} is for buffers larger than memory; its "
                    f"reads are only this fast while its pages stay cached)")
        if e.total_s <= chosen.total_s:
            simpler = (len(chosen.spec.devices), TIERS.index(chosen.spec.tier)) < (len(e.spec.devices),
                                                                                  TIERS.index(e.spec.tier))
            return (f"within {self._tolerance} of the chosen ({e.total_s * 1e3:.3f} ms vs "
                    f"{chosen.total_s * 1e3:.3f} ms), which "
                    + ("uses fewer devices or a simpler tier" if simpler else "the planner proposed first"))
        diffs = {k: e.breakdown.get(k, 0.0) - chosen.breakdown.get(k, 0.0)
                 for k in set(e.breakdown) | set(chosen.breakdown)}
        # the phase (ingest or deliver) that loses most first: the tiers split a phase into differently named
        # parts, so the single largest part can belong to a phase the candidate is faster in
        phase_of = {k: k.split(":")[0] for k in diffs}
        phases: dict[str, float] = {}
        for k, d in diffs.items():
            phases[phase_of[k]] = phases.get(phase_of[k], 0.0) + d
        phase = max(phases, key=lambda p: phases[p])
        worst = max((k for k in diffs if phase_of[k] == phase), key=lambda k: diffs[k])
        # a profile may price the chosen path at nothing (zero overhead, unlimited bandwidth): no ratio then
        ratio = f"{e.total_s / chosen.total_s:.2f}x" if chosen.total_s > 0 else "the chosen costs nothing"
        part = "" if worst == phase else f"; largest part {worst} +{diffs[worst] * 1e3:.3f} ms"
        return (f"slower: {e.total_s * 1e3:.3f} ms vs {chosen.total_s * 1e3:.3f} ms "
                f"({ratio}), mostly {phase} (+{phases[phase] * 1e3:.3f} ms{part})")

    # -- placement map -----------------------------------------------------------------------
    def placement_map(self, workload: Workload, *, min_item_bytes: float, max_item_bytes: float, points: int = 48,
                      resize: Callable[[float], Workload] | None = None) -> PlacementMap:
        """The placement for every item size in a range, computed ahead of time.

        Plans at ``points`` sizes spaced geometrically over ``[min_item_bytes, max_item_bytes]``,
        then bisects between neighbours that differ to find each boundary to the byte.
        Sizes where nothing fits map to no placement.

        Args:
            workload: the template workload (capacity, batch, learners, field split).

        Keyword Args:
            min_item_bytes: smallest item size covered.
            max_item_bytes: largest item size covered.
            points: grid points before refinement (an int >= 2).
            resize: ``item_bytes -> Workload`` (default: ``workload.resized``).

        Raises:
            ConfigurationError: a size range that is empty, not positive or not finite, or ``points`` < 2.
            PlacementError: the planner refuses the workload whatever its item size (e.g. more learners
                than GPUs); sizes that fit nowhere are no error (they map to no placement).
        """
        from conduit.placement.placement_map import PlacementMap

        return PlacementMap.build(self, workload, min_item_bytes=min_item_bytes, max_item_bytes=max_item_bytes,
                                  points=points, resize=resize)
