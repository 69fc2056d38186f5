"""A built plan's ragged pools, the on-policy pool refusal and monotone link costs, reproduced and fixed.

1. ``Plan.build()`` sizes the ragged pools as the plan assumed: ``capacity`` items of the workload's ragged bytes
   (its mean ragged length), not 64 elements per item; a plan without ragged fields builds what it always did.
2. The on-policy "Consume first or raise ragged_capacity" refusal of ``ColumnarStorage.append`` states the pool's
   size, whether it is the default, and what to set.
3. A :class:`LinkCost` never predicts less time for more bytes, whatever its measured samples (a noisy small
   sample used to make ``seconds(4 MiB) <= seconds(4 KiB)``); clean samples predict what they always did.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PlacementError,
)
from conduit.batch import ExperienceBatch, Ragged
from conduit.placement import HostPlacement, LinkCost, PlacementSpec, Planner, Workload, load_topology
from conduit.storage.columnar import DEFAULT_POOL_PER_ITEM, ColumnarStorage, pool_elements

#: 8 B id + int64 tokens (ragged) + float32 log-probs (ragged): 12 B per element of the ragged fields
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True),
                          logp=Field((), torch.float32, ragged=True))
IDS = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))


# -- 1. Plan.build() sizes the ragged pools as the plan assumed ------------------------------------------------------
@pytest.mark.parametrize("length", [4, 10.5, 1000])
def test_a_built_plan_sizes_the_ragged_pools_as_the_plan_assumed(length: float) -> None:
    capacity = 64
    w = Workload.from_schema(TOKENS, capacity=capacity, batch=8, mean_ragged_length=length)
    plan = Planner(load_topology("h200x1")).plan(w)
    edp = ExperienceDataPlane(TOKENS, capacity=capacity, placement=plan.build())
    st = edp.storage
    assert isinstance(st, ColumnarStorage)
    ragged_bytes = sum(w.field_bytes[i] for i in w.ragged)  # what the plan counted per item for the pools
    assert st.ragged_capacity == int(capacity * length), (  # was 64 x capacity = 4,096 whatever the length
        f"the pools hold {st.ragged_capacity} elements; the plan assumed {capacity} items of {length}")
    # the pools take exactly the memory the plan checked for them (12 B per element of both ragged fields)
    assert st.ragged_capacity * 12 == capacity * ragged_bytes
    edp.close()


def test_a_built_plan_holds_its_planned_items_without_eviction() -> None:
    """An on-policy buffer of the plan's capacity takes a full buffer of items at the plan's mean length (the
    pools, sized to the byte, are not too small for what the plan assumed)."""
    w = Workload.from_schema(TOKENS, capacity=64, batch=8, mean_ragged_length=4)
    edp = ExperienceDataPlane(TOKENS, capacity=64, placement=Planner(load_topology("h200x1")).plan(w).build(),
                              semantics=OnPolicy(num_minibatches=1, num_epochs=1))
    edp.ingest({"id": torch.arange(64), "tok": [torch.zeros(4, dtype=torch.int64)] * 64,
                "logp": [torch.zeros(4)] * 64}, version=0)
    assert len(edp) == 64 and getattr(edp.storage, "ragged_capacity", None) == 64 * 4
    edp.close()


@pytest.mark.parametrize("tier", ["host", "pinned", "disk", "sharded"])
def test_every_tier_sizes_its_pools_from_the_planned_bytes(tier: str, tmp_path: Path) -> None:
    devices = ("cpu", "cpu") if tier == "sharded" else ("disk",) if tier == "disk" else ("cpu",)
    placement = PlacementSpec(tier, devices).build(directory=tmp_path, ragged_item_bytes=6 * 12)
    st = placement.storage(TOKENS, 32)
    assert getattr(st, "ragged_capacity", None) == 32 * 6
    placement.storage_abandoned(st)  # (the disk tier's files)


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "72", True])
def test_a_spec_refuses_bad_ragged_item_bytes(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="ragged_item_bytes"):
        PlacementSpec("host", ("cpu",)).build(ragged_item_bytes=bad)  # type: ignore[arg-type]


def test_an_explicit_ragged_capacity_wins_over_the_plan() -> None:
    w = Workload.from_schema(TOKENS, capacity=64, batch=8, mean_ragged_length=4)
    edp = ExperienceDataPlane(TOKENS, capacity=64, placement=Planner(load_topology("h200x1")).plan(w).build(),
                              ragged_capacity=1000)
    assert getattr(edp.storage, "ragged_capacity", None) == 1000


def test_a_plan_without_ragged_fields_builds_what_it_always_did() -> None:
    w = Workload.from_schema(IDS, capacity=64, batch=8)
    placement = Planner(load_topology("h200x1")).plan(w).build()
    assert placement.ragged_item_bytes is None
    # a ragged buffer on it (the plan knew nothing of its pools) keeps the default pool, as before
    st = placement.storage(TOKENS, 64)
    assert getattr(st, "ragged_capacity", None) == pool_elements(None, 64) == 64 * DEFAULT_POOL_PER_ITEM


def test_a_plan_of_ragged_fields_at_no_length_needs_a_pool() -> None:
    """mean_ragged_length=0: the plan checked no pool memory; the build refuses to pick a size it never checked."""
    w = Workload.from_schema(TOKENS, capacity=64, batch=8)
    placement = Planner(load_topology("h200x1")).plan(w).build()
    with pytest.raises(PlacementError, match="mean_ragged_length"):
        ExperienceDataPlane(TOKENS, capacity=64, placement=placement)
    edp = ExperienceDataPlane(TOKENS, capacity=64, placement=placement, ragged_capacity=500)
    assert getattr(edp.storage, "ragged_capacity", None) == 500


def test_a_placement_built_by_hand_keeps_the_default_pool() -> None:
    placement = HostPlacement()
    assert placement.ragged_item_bytes is None
    assert getattr(placement.storage(TOKENS, 10), "ragged_capacity", None) == 10 * DEFAULT_POOL_PER_ITEM


# -- 2. the on-policy pool refusal says what to set ------------------------------------------------------------------
def _tok(ids: range, length: int) -> ExperienceBatch:
    n = len(ids)
    return ExperienceBatch({"id": torch.tensor(list(ids), dtype=torch.int64),
                            "tok": Ragged(torch.zeros(n * length, dtype=torch.int64),
                                          torch.full((n,), length, dtype=torch.int64)),
                            "logp": Ragged(torch.zeros(n * length), torch.full((n,), length, dtype=torch.int64))}, n)


def test_the_on_policy_pool_refusal_names_the_default_pool_and_what_to_set() -> None:
    st = ColumnarStorage(TOKENS, 4, "cpu")  # the default pool: 256 elements
    st.append(_tok(range(1), 200), evict=False)
    with pytest.raises(CapacityError) as err:
        st.append(_tok(range(1, 2), 100), evict=False)
    msg = str(err.value)
    assert "Consume first" in msg and "256 elements" in msg
    assert "default" in msg and "ExperienceDataPlane(..., ragged_capacity=N)" in msg, msg
    assert len(st) == 1 and st.oldest == 0  # unchanged


def test_the_on_policy_pool_refusal_of_a_set_pool_does_not_call_it_the_default() -> None:
    st = ColumnarStorage(TOKENS, 4, "cpu", ragged_capacity=300)
    st.append(_tok(range(1), 200), evict=False)
    with pytest.raises(CapacityError) as err:
        st.append(_tok(range(1, 2), 150), evict=False)
    msg = str(err.value)
    assert "300 elements" in msg and "default" not in msg and "ragged_capacity=N" in msg, msg


def test_the_on_policy_buffer_refusal_reaches_the_caller_with_the_hint() -> None:
    edp = ExperienceDataPlane(TOKENS, capacity=4, semantics=OnPolicy(num_minibatches=1, num_epochs=1))
    edp.ingest({"id": torch.tensor([0]), "tok": [torch.zeros(200, dtype=torch.int64)], "logp": [torch.zeros(200)]},
               version=0)
    with pytest.raises(CapacityError, match=r"default.*ragged_capacity=N"):
        edp.ingest({"id": torch.tensor([1]), "tok": [torch.zeros(100, dtype=torch.int64)],
                    "logp": [torch.zeros(100)]}, version=0)
    assert len(edp) == 1


# -- 3. a link never predicts less time for more bytes ----------------------------------------------------------------
KIB, MIB = 1 << 10, 1 << 20
SIZES = [2**k for k in range(0, 34)] + [3 * 2**k for k in range(0, 32)] + [4 * KIB, 4 * MIB]


def _non_decreasing(link: LinkCost, rows: float = 0) -> None:
    sizes = sorted(set(SIZES))
    times = [link.seconds(b, rows) for b in sizes]
    for (b0, t0), (b1, t1) in zip(zip(sizes, times, strict=True), zip(sizes[1:], times[1:], strict=True),
                                   strict=False):
        assert t1 >= t0, f"{b1} B predicts {t1} s, less than {b0} B ({t0} s)"


NOISY = [
    # a small sample slowed by a busy machine: 4 KiB "took" longer than 4 MiB
    [(4 * KIB, 2e-3), (256 * KIB, 1.5e-3), (4 * MIB, 1e-3)],
    # one bad sample in the middle
    [(4 * KIB, 5e-5), (256 * KIB, 9e-3), (4 * MIB, 2e-3)],
    # the two-probe case of the distributed link measurement
    [(256 * KIB, 4e-3), (4 * MIB, 3e-3)],
]


@pytest.mark.parametrize("samples", NOISY)
def test_a_link_fitted_from_noisy_samples_never_predicts_less_time_for_more_bytes(
        samples: list[tuple[float, float]]) -> None:
    for link in (LinkCost.fit(samples, 1e-5), LinkCost.fit_or_bound(samples, 1e-5)):
        assert link.seconds(4 * MIB) >= link.seconds(4 * KIB)  # was: 4 MiB predicted faster
        _non_decreasing(link)
        # the bandwidth agrees (what callers that price the bytes alone use: nbytes / bandwidth(nbytes))
        moving = [b / link.bandwidth(b) for b in sorted(set(SIZES))]
        assert all(m1 >= m0 for m0, m1 in zip(moving, moving[1:], strict=False))
        for b, t in samples:  # no point predicts less than it measured
            assert link.seconds(b) >= t * (1 - 1e-12)


def test_a_bound_from_samples_within_the_overhead_never_predicts_less_time_for_more_bytes() -> None:
    samples = [(4 * KIB, 3e-4), (4 * MIB, 2e-4)]  # every sample within the (noisy) overhead: the bound
    link = LinkCost.fit_or_bound(samples, 5e-4)
    assert link.seconds(4 * MIB) >= link.seconds(4 * KIB)
    _non_decreasing(link)


def test_a_row_gather_never_predicts_less_time_for_wider_rows() -> None:
    link = LinkCost.fit_rows([(1000, 8 * 1000, 5e-3), (1000, 512 * 1000, 1e-3), (1000, 8192 * 1000, 4e-3)], 1e-6)
    for rows in (1, 16, 1000):
        _non_decreasing(link, rows)


def test_interpolation_between_points_never_dips() -> None:
    """Moving times that grow between two points, but the bandwidth grows almost as fast: the log-size
    interpolation alone predicted less time in between than at the smaller point."""
    link = LinkCost(0.0, ((1.0, 1.0), (100.0, 99.0)))
    assert link.seconds(10) >= link.seconds(1) == 1.0
    _non_decreasing(link)


def _interpolated(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """The log-size interpolation of ``points`` (the model of LinkCost's docstring), written out independently."""
    if nbytes <= points[0][0]:
        return points[0][1]
    if nbytes >= points[-1][0]:
        return points[-1][1]
    for (b0, w0), (b1, w1) in zip(points, points[1:], strict=False):
        if b0 <= nbytes <= b1:
            if math.isinf(w0) or math.isinf(w1):
                return math.inf
            f = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
            return w0 + f * (w1 - w0)
    raise AssertionError


def test_clean_samples_predict_what_they_always_did() -> None:
    overhead = 2e-5
    # bandwidth rising with size, each larger transfer slower: 1, 4, 10 GB/s at 4 KiB, 256 KiB, 4 MiB
    samples = [(4 * KIB, overhead + 4 * KIB / 1e9), (256 * KIB, overhead + 256 * KIB / 4e9),
               (4 * MIB, overhead + 4 * MIB / 1e10)]
    link = LinkCost.fit(samples, overhead)
    for b, t in samples:
        assert link.seconds(b) == pytest.approx(t, rel=1e-12)
    for b in sorted(set(SIZES)):
        assert link.seconds(b) == pytest.approx(overhead + b / _interpolated(link.points, b), rel=1e-12), b
    _non_decreasing(link)
    # the declared topologies' links predict as their data files say
    for name in ("h200x1", "dgx-a100-80g", "mi250x-node"):
        prof = load_topology(name).declared
        assert prof is not None
        for kind, ln in prof.links.items():
            for b in sorted(set(SIZES)):
                bw = _interpolated(ln.points, b)
                want = ln.overhead_s + (0.0 if math.isinf(bw) else b / bw)
                assert ln.seconds(b) == pytest.approx(want, rel=1e-12), (name, kind, b)
