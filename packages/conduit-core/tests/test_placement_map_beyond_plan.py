"""A placement map refuses item sizes above the largest it was planned for (nothing checked that they fit):
above the whole bytes a fractional maximum planned, at or past a finite last range's end; an adaptive
placement holds ragged pools to the largest whole item size in the looked-up range (a range ``[lo, hi)``
holds items of at most ``hi - 1`` whole bytes: ``hi`` is where the map found the placement no longer fits);
the online migration reports a refusal as a PlacementError without touching the buffer; plus the
``conduit simulate`` float arguments."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field
from conduit.batch import ExperienceBatch
from conduit.cli import main
from conduit.errors import PlacementError
from conduit.placement import AdaptivePlacement, BandwidthProfile, LinkCost, PlacementSpec, Planner, Topology, Workload
from conduit.placement.planner import NothingFitsError

#: 40 B per item (8 B id + 8 float32)
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((8,), torch.float32))
#: 136 B per item: the observation grew to 32 floats
GROWN = ExperienceSchema(id=Field((), torch.int64), obs=Field((32,), torch.float32))
CAPACITY = 998  # + 2 output rows (batch 1): host memory of 100,000 B holds items of <= 100 B exactly
HOST = PlacementSpec("host", ("cpu",))
#: 8 B id + 8 B per token
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))


def _host_only_planner() -> Planner:
    links = {"host_copy": LinkCost.constant(10, 5), "host_gather": LinkCost.constant(8, 6, 100),
             "edp_deliver": LinkCost.constant(1e6, 20), "edp_ingest": LinkCost.constant(1e6, 20)}
    prof = BandwidthProfile(links, source="declared", machine="declared:tiny")
    return Planner(Topology("tiny", 100_000, (), 0, prof, "a test machine", "declared"), headroom=0.0,
                   host_usable=1.0)


def _map_up_to(max_item_bytes: float):  # noqa: ANN202 - (planner, template, map)
    planner = _host_only_planner()
    template = Workload.from_schema(SCHEMA, capacity=CAPACITY, batch=1)
    pmap = planner.placement_map(template, min_item_bytes=40, max_item_bytes=max_item_bytes, points=8)
    return planner, template, pmap


def _pad(b: ExperienceBatch) -> dict[str, torch.Tensor]:
    obs = b["obs"]
    return {"id": b["id"], "obs": torch.cat([obs, torch.zeros(obs.shape[0], 24)], dim=1)}


def _filled() -> tuple[ExperienceDataPlane, AdaptivePlacement]:
    _, _, pmap = _map_up_to(64)
    adaptive = AdaptivePlacement(pmap)
    edp = ExperienceDataPlane(SCHEMA, capacity=CAPACITY, placement=adaptive)
    edp.ingest({"id": torch.arange(30), "obs": torch.arange(30, dtype=torch.float32)[:, None].repeat(1, 8)})
    edp.flush()
    return edp, adaptive


def _contents(edp: ExperienceDataPlane) -> list[tuple[int, list[float]]]:
    st = edp.storage
    b = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)
    return [(int(i), o.tolist()) for i, o in zip(b["id"], b["obs"], strict=True)]


# -- the map ------------------------------------------------------------------------------------------------
def test_lookup_beyond_the_planned_maximum_is_a_placement_error_not_an_unchecked_placement() -> None:
    planner, template, pmap = _map_up_to(64)
    assert [r.spec for r in pmap.ranges] == [HOST], pmap.explain()
    with pytest.raises(PlacementError):  # the premise: 136 B items fit nowhere on this machine
        planner.plan(template.resized(136))
    with pytest.raises(PlacementError, match=r"136 B.*planned.*64 B.*max_item_bytes") as e:
        pmap.lookup(136)  # was: host[cpu], which cannot hold 998 items of 136 B
    assert "re-plan" in str(e.value).lower(), str(e.value)
    with pytest.raises(PlacementError, match="planned"):
        pmap.lookup(64.5)  # just above the maximum: not planned either
    with pytest.raises(PlacementError, match="planned"):
        pmap.lookup(float("inf"))


def test_sizes_within_the_planned_range_look_up_as_before() -> None:
    planner, template, pmap = _map_up_to(64)
    for size in (0.0, 1.0, 40.0, 50.5, 64.0):
        assert pmap.lookup(size) == HOST, f"{size} B"
    assert pmap.lookup(64) == planner.plan(template.resized(64)).placement
    assert pmap.range_of(136) is pmap.ranges[-1]  # range_of only locates; lookup decides


def test_a_map_planned_past_the_size_still_answers_it() -> None:
    """Re-planning with a larger maximum (what the error says to do) gives the exact answer: fits nowhere."""
    _, _, pmap = _map_up_to(200)
    assert pmap.lookup(100) == HOST
    with pytest.raises(PlacementError, match="No placement"):
        pmap.lookup(136)


def test_to_dict_states_the_planned_maximum() -> None:
    _, _, pmap = _map_up_to(64)
    assert pmap.to_dict()["max_item_bytes"] == 64
    assert "64 B" in pmap.explain().splitlines()[0], pmap.explain()


# -- the online migration -----------------------------------------------------------------------------------
def test_rebalance_to_a_grown_schema_beyond_the_map_migrates_nothing() -> None:
    edp, adaptive = _filled()
    storage, before = edp.storage, _contents(edp)
    with pytest.raises(PlacementError, match="planned"):
        adaptive.rebalance(edp, schema=GROWN, transform=_pad)  # was: migrated into host[cpu], which does not fit
    assert edp.storage is storage and edp.schema == SCHEMA and edp.placement is adaptive
    assert adaptive.current == HOST and adaptive.migrations == []
    assert _contents(edp) == before
    edp.ingest({"id": torch.tensor([30]), "obs": torch.ones(1, 8)})  # still takes the old schema
    edp.flush()
    assert len(edp) == 31


def test_rebalance_at_a_size_beyond_the_map_is_an_error_not_a_silent_stay() -> None:
    edp, adaptive = _filled()
    storage, before = edp.storage, _contents(edp)
    with pytest.raises(PlacementError, match="planned"):
        adaptive.rebalance(edp, item_bytes=136)  # was: None ("the placement stays"), though it does not fit
    assert edp.storage is storage and adaptive.current == HOST and adaptive.migrations == []
    assert _contents(edp) == before
    assert adaptive.rebalance(edp, item_bytes=64) is None  # within the map: stays, as before


def test_rebalance_on_observed_growth_beyond_the_map_is_an_error_and_keeps_every_item() -> None:
    """Responses grow (ragged tokens) past the map's maximum: the observed size is refused, not stayed on."""
    schema = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
    template = Workload.from_schema(schema, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    pmap = _host_only_planner().placement_map(template, min_item_bytes=40, max_item_bytes=64, points=8)
    adaptive = AdaptivePlacement(pmap, mean_ragged_length=4, window=1)
    # (a pool of the planned 4 tokens per item: the map checked no more for host)
    edp = ExperienceDataPlane(schema, capacity=CAPACITY, placement=adaptive, ragged_capacity=CAPACITY * 4)
    edp.ingest({"id": torch.arange(5), "tok": [torch.full((4,), i) for i in range(5)]})
    assert adaptive.rebalance(edp) is None  # within the map
    edp.ingest({"id": torch.arange(5, 10), "tok": [torch.full((16,), i) for i in range(5, 10)]})
    edp.flush()
    storage = edp.storage
    assert adaptive.observed_item_bytes(edp) > pmap.max_item_bytes
    with pytest.raises(PlacementError, match="planned"):
        adaptive.rebalance(edp)  # was: None, the buffer stayed on a placement nothing checked
    assert edp.storage is storage and adaptive.migrations == [] and len(edp) == 10
    b = storage.gather(torch.arange(10))
    assert [t.tolist() for t in b["tok"]] == [[i] * (4 if i < 5 else 16) for i in range(10)]


def test_an_adaptive_buffer_of_items_beyond_the_map_is_refused_at_construction() -> None:
    _, _, pmap = _map_up_to(64)
    with pytest.raises(PlacementError, match="planned"):
        ExperienceDataPlane(GROWN, capacity=CAPACITY, placement=AdaptivePlacement(pmap))


# -- conduit simulate: the float arguments ------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--replay-ratio", "0", "must be a finite number > 0"), ("--replay-ratio", "-1", "must be a finite number > 0"),
    ("--replay-ratio", "inf", "must be a finite number > 0"), ("--replay-ratio", "x", "is not a number"),
    ("--rpc-us", "-0.5", "must be a finite number >= 0"), ("--rpc-us", "nan", "must be a finite number >= 0"),
    ("--rpc-us", "fast", "is not a number"),
])
def test_simulate_float_arguments_give_argparse_errors(flag: str, value: str, message: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--scenario", "a100", "--gpus", "1", "--out", str(tmp_path / "o"), f"{flag}={value}"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert f"argument {flag}: {value!r} {message}" in err, err
    assert not (tmp_path / "o").exists()


def test_simulate_help_lists_the_float_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "--replay-ratio REPLAY_RATIO" in out and "--rpc-us RPC_US" in out, out


def test_a_fractional_item_size_is_placed_by_the_whole_bytes_it_needs() -> None:
    """A mean item size (ragged items) of 100.5 B needs more than the 100 B a host of 100,000 B holds for
    1000 rows: it was looked up at 100 B (host) and planned as 100 B (banker's rounding)."""
    planner, template, pmap = _map_up_to(200)
    assert [(r.lo, r.spec) for r in pmap.ranges] == [(40, HOST), (101, None)], pmap.explain()
    assert sum(template.resized(100.5).field_bytes) == 101
    assert sum(template.resized(100.0).field_bytes) == 100  # whole sizes stay exact
    with pytest.raises(PlacementError, match="fits"):
        planner.plan(template.resized(100.5))
    with pytest.raises(PlacementError, match=r"100\.50 B.*below 101 B"):
        pmap.lookup(100.5)
    assert pmap.lookup(100) == HOST and pmap.lookup(99.5) == HOST
    assert pmap.range_of(100.5) is pmap.ranges[1] and pmap.range_of(100) is pmap.ranges[0]

def test_map_with_a_fractional_maximum_refuses_sizes_above_the_whole_bytes_it_planned() -> None:
    planner = _host_only_planner()
    template = Workload.from_schema(SCHEMA, capacity=CAPACITY, batch=1)
    pmap = planner.placement_map(template, min_item_bytes=40, max_item_bytes=100.5, points=8)
    # items of 100.4 B are planned as 101 whole bytes: nothing fits them on this machine
    with pytest.raises(NothingFitsError):
        planner.plan(template.resized(100.4))
    with pytest.raises(PlacementError, match="Re-plan with a larger maximum"):
        pmap.lookup(100.4)  # was: host, which does not hold 998 items of 101 B
    assert pmap.lookup(100) == planner.plan(template.resized(100)).placement  # the largest size it planned
    assert pmap.max_item_bytes == 100


def test_map_over_a_range_without_a_whole_byte_still_covers_its_maximum() -> None:
    planner = _host_only_planner()
    template = Workload.from_schema(SCHEMA, capacity=CAPACITY, batch=1)
    pmap = planner.placement_map(template, min_item_bytes=60.2, max_item_bytes=60.7, points=2)
    assert pmap.lookup(60.7) == planner.plan(template.resized(61)).placement

def test_a_pool_for_items_of_the_ranges_end_is_refused_it_was_never_checked() -> None:
    planner = _host_only_planner()
    template = Workload.from_schema(TOKENS, capacity=CAPACITY, batch=1, mean_ragged_length=4)
    pmap = planner.placement_map(template, min_item_bytes=16, max_item_bytes=1000, points=8)
    host = pmap.ranges[0]
    assert host.spec == PlacementSpec("host", ("cpu",)) and pmap.ranges[1].spec is None
    end = int(host.hi)  # the first size the host does not hold
    # the largest pool whose bytes, with the ids', stay within CAPACITY items of `end` bytes
    pool = (CAPACITY * end - 8 * CAPACITY) // 8
    per_item = (8 * CAPACITY + 8 * pool) / CAPACITY
    assert end - 1 < per_item <= end
    with pytest.raises(NothingFitsError):  # the buffer's items at that size fit nowhere on this machine
        planner.plan(template.resized(per_item))
    adaptive = AdaptivePlacement(pmap, mean_ragged_length=4)
    with pytest.raises(PlacementError, match="ragged_capacity"):
        ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=pool)  # was: built
    assert adaptive.current is None
    # the largest pool of items the map checked (end - 1 bytes) is accepted
    most = (CAPACITY * (end - 1) - 8 * CAPACITY) // 8
    planner.plan(template.resized((8 * CAPACITY + 8 * most) / CAPACITY))  # (fits)
    edp = ExperienceDataPlane(TOKENS, capacity=CAPACITY, placement=adaptive, ragged_capacity=most)
    assert edp.storage.tier == "host" and math.isclose(adaptive.map.max_item_bytes, 1000)
