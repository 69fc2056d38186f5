"""Placement and spans: a workload whose growing fields cannot grow (or name no field) is refused
instead of planning every size at its own, and a resized workload keeps its class (a replay ratio); the
growth simulation records the size where nothing fits as Conduit's failure instead of throwing the other
strategies' results away; a link with an unlimited point prices transfers next to it as free, never NaN; a
migration of ragged items copies about ``chunk_bytes`` per lock hold, not the whole buffer at once; a span's
NumPy or tensor counts are recorded as ints, so its trace is still JSON."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field
from conduit.errors import ConfigurationError, PlacementError
from conduit.placement import (
    DiskPlacement,
    HostPlacement,
    LinkCost,
    PlacementSpec,
    Planner,
    Workload,
    load_topology,
)
from conduit.placement.growth import simulate_growth
from conduit.placement.migration import migrate
from conduit.telemetry import Telemetry

sys.path.insert(0, str(Path(__file__).parent))
from test_placement_map_beyond_plan import _host_only_planner  # noqa: E402, I001  (sibling test helper)

HOST = PlacementSpec("host", ("cpu",))


# -- 1. a workload resizes to exactly the size asked for, or is refused -------------------------------------------
@pytest.mark.parametrize(("kwargs", "name"), [
    ({"growing": ()}, "growing"),          # nothing grows: resized() kept 412 B whatever size it was asked for
    ({"growing": (1, 1)}, "growing"),      # a field twice: resized() gave it half the growth
    ({"growing": (-1,)}, "growing"),       # field 2 counted fixed and growing at once
    ({"growing": (3,)}, "growing"),        # no such field: IndexError in resized()
    ({"growing": (True,)}, "growing"),
    ({"scalar": (7,)}, "scalar"),
    ({"scalar": (1.0,)}, "scalar"),
])
def test_field_indices_that_name_no_field_or_cannot_grow_are_refused(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Workload((8, 400, 4), capacity=100, batch=4, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("growing", [None, (1,), (0, 1), [1, 2]])
def test_a_resized_workload_has_exactly_the_size_asked_for(growing: object) -> None:
    w = Workload((8, 400, 4), capacity=100, batch=4, growing=growing)  # type: ignore[arg-type]
    for size in (412, 1000, 10_001, 123_457):
        assert w.resized(size).item_bytes == size
    assert isinstance(w.growing, tuple) or w.growing is None


def test_a_resized_workload_keeps_its_class_and_every_other_field() -> None:
    from conduit.simulation.model import ReplayWorkload

    w = ReplayWorkload((8, 400, 4), capacity=100, batch=4, learners=2, growing=(1,), name="r", scalar=(0, 2),
                       replay_ratio=4.0, learner_batch=3.5)
    big = w.resized(2_012)
    # was a plain Workload: replay_ratio 1, so a map planned from it priced 4x the ingestion calls
    assert type(big) is ReplayWorkload and big.replay_ratio == 4.0 and big.learner_batch == 3.5
    # (2 learners drawing 3.5 items each, a quarter of them ingested, in calls of 2 x 4 items)
    assert big.calls_per_iteration == w.calls_per_iteration == 2 * 3.5 / 4.0 / 8
    assert (big.field_bytes, big.capacity, big.batch, big.learners, big.growing, big.scalar, big.name) == (
        (8, 2_000, 4), 100, 4, 2, (1,), (0, 2), "r@2012B")
    planner = _host_only_planner()
    assert planner.cost.ingest(HOST, big) == planner.cost.ingest(HOST, ReplayWorkload(
        (8, 2_000, 4), capacity=100, batch=4, learners=2, growing=(1,), scalar=(0, 2), replay_ratio=4.0,
        learner_batch=3.5))


def test_a_map_planned_from_a_workload_that_cannot_grow_is_refused_before_it_claims_big_items_fit() -> None:
    planner = _host_only_planner()
    with pytest.raises(ConfigurationError, match="growing"):
        planner.placement_map(Workload((8, 32), capacity=100, batch=1, growing=()), min_item_bytes=40,
                              max_item_bytes=100_000, points=4)
    # the same map with a field that grows: items of 1,000 B do not fit 100 items on a 100,000 B host
    pmap = planner.placement_map(Workload((8, 32), capacity=100, batch=1, growing=(1,)), min_item_bytes=40,
                                 max_item_bytes=100_000, points=4)
    assert pmap.lookup(40) == HOST
    with pytest.raises(PlacementError, match="No placement"):
        pmap.lookup(1_000)


# -- 2. the growth simulation past every placement --------------------------------------------------------------
def test_growth_beyond_every_placement_is_conduits_recorded_failure_not_an_exception() -> None:
    planner = Planner(load_topology("mi250x-node"))
    # 4,000,000 floats per observation: 32 MB per transition, 32 TB for 1e6 of them: nothing holds that
    schedule = [128, 1000, 4_000_000]
    result = simulate_growth(planner, schedule, capacity=10**6, updates=2)
    conduit = result.strategies["conduit"]
    assert conduit.failed_at == 2 and "No placement" in conduit.reason
    assert len(conduit.latency_s) == 3 and all(x is not None and x > 0 for x in conduit.latency_s[:2])
    assert conduit.latency_s[2] is None and conduit.placements[2] is None
    assert result.strategies["conservative"].failed_at == 2
    assert result.strategies["greedy"].latency_s[0] is not None
    assert result.to_dict()["strategies"]["conduit"]["failed_at"] == 2
    # the first size fitting nothing is still refused (nothing to simulate)
    with pytest.raises(PlacementError):
        simulate_growth(planner, [4_000_000, 128], capacity=10**6)


# -- 3. a link with an unlimited point ------------------------------------------------------------------------
def test_a_link_with_an_unlimited_point_prices_every_size_as_a_number() -> None:
    link = LinkCost(1e-6, ((100.0, 1e9), (1000.0, math.inf), (2000.0, 1e9)))
    for size in (50, 100, 500, 1000, 1500, 2000, 3000):
        bw, s = link.bandwidth(size), link.seconds(size)
        assert not math.isnan(bw) and not math.isnan(s) and s >= 1e-6, (size, bw, s)
    assert link.bandwidth(100) == 1e9 and link.bandwidth(2000) == 1e9  # measured points as measured
    # between an unlimited point and a finite one: never less than the smaller measured point (session 25)
    assert link.seconds(1500) == link.seconds(100)
    assert LinkCost.from_dict(link.to_dict()).seconds(1500) == link.seconds(1500)


# -- 4. a migration of ragged items holds the lock for about chunk_bytes at a time -------------------------------
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))


def _token_buffer(tmp_path: Path) -> ExperienceDataPlane:
    """64 items of 512 tokens (about 4 KiB each), ingested 8 at a time over a ring of 48: the oldest 16 evicted."""
    edp = ExperienceDataPlane(TOKENS, capacity=48, ragged_capacity=48 * 600,
                              placement=DiskPlacement(directory=tmp_path))
    for k in range(0, 64, 8):
        edp.ingest({"id": torch.arange(k, k + 8), "tok": [torch.full((512,), i) for i in range(k, k + 8)]})
    return edp


def _items(edp: ExperienceDataPlane) -> tuple[int, int, list[tuple[int, list[int]]]]:
    st = edp.storage
    b = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)
    ids, toks = b.tensor("id"), b["tok"]
    return st.oldest, st.next_handle, [(int(ids[k]), toks[k].tolist()) for k in range(b.batch_size)]


def test_a_ragged_migration_copies_about_chunk_bytes_per_lock_hold_and_keeps_every_item(tmp_path: Path) -> None:
    edp = _token_buffer(tmp_path)
    before = _items(edp)
    assert before[:2] == (16, 64) and [i for i, _ in before[2]] == list(range(16, 64))
    chunk_bytes = 16 << 10
    holds: list[int] = []
    report = migrate(edp, HostPlacement(), chunk_bytes=chunk_bytes, progress=lambda chunks, upto: holds.append(upto))
    # 48 items of ~4 KiB: ~190 KiB; the chunk size was 16 KiB / 16 B (fixed bytes + length), the whole buffer in
    # one hold (1 chunk, no progress between holds)
    assert report.nbytes > 10 * chunk_bytes
    assert report.chunks >= report.nbytes // chunk_bytes, (report.chunks, report.nbytes)
    assert len(holds) >= report.nbytes // chunk_bytes - 2 and holds == sorted(holds)
    assert _items(edp) == before and edp.storage.tier == "host"
    assert (report.items, report.oldest, report.next_handle) == (48, 16, 64)
    edp.close()


def test_a_fixed_size_migration_still_copies_chunk_bytes_of_items_per_hold() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), obs=Field((62,), torch.float32))  # 256 B per item
    edp = ExperienceDataPlane(schema, capacity=100)
    edp.ingest({"id": torch.arange(100), "obs": torch.zeros(100, 62)})
    report = migrate(edp, HostPlacement(), chunk_bytes=256 * 10)
    assert report.chunks == 10 and report.items == 100
    edp.close()


# -- 5. span counts that are NumPy or tensor integers ------------------------------------------------------------
def test_span_counts_of_numpy_or_tensor_integers_are_ints_and_the_trace_is_json(tmp_path: Path) -> None:
    tel = Telemetry()
    with tel.span("rollout", items=np.int64(3), nbytes=torch.tensor([5, 7]).sum()):
        pass
    tel.record("update", np.int32(2), np.int64(16), 1.0, 2.0)  # type: ignore[arg-type]
    totals = tel.totals
    assert (totals["rollout"].items, totals["rollout"].nbytes) == (3, 12)
    assert type(totals["rollout"].items) is int and type(totals["rollout"].nbytes) is int  # was np.int64, a tensor
    path = tmp_path / "trace.json"
    tel.chrome_trace(path)  # was: TypeError: Object of type int64 is not JSON serializable, nothing written
    events = {e["name"]: e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert events["rollout"]["args"] == {"items": 3, "bytes": 12}
    assert events["update"]["args"] == {"items": 2, "bytes": 16}


@pytest.mark.parametrize(("kwargs", "match"), [({"items": 1.5}, "items"), ({"nbytes": "8"}, "nbytes"),
                                               ({"items": True}, "items"), ({"items": torch.ones(2)}, "items"),
                                               ({"kind": 5}, "kind")])
def test_a_span_with_a_count_that_is_no_integer_is_refused_and_records_nothing(kwargs: dict[str, Any],
                                                                               match: str) -> None:
    tel = Telemetry()
    args = {"kind": "rollout", **kwargs}
    with pytest.raises(ConfigurationError, match=match):
        tel.span(**args)
    assert tel.records == () and tel.totals == {}
