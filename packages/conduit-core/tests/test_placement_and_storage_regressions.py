"""Placement and storage regressions, reproduced and fixed.

1. An adaptive placement refuses a buffer of more items than its placement map was planned for.
2. A declared profile never lands in, or loads from, this machine's measured-profile cache as its measurement.
3. A storage's load checks a checkpoint's ragged layout once (it checked it twice), and still refuses a damaged one.

(Telemetry called from a GC callback inside a fold: ``test_telemetry_gc_inside_folds.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from conduit import (
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PlacementError,
    Replay,
)
from conduit.batch import ExperienceBatch, Ragged
from conduit.placement import (
    AdaptivePlacement,
    BandwidthProfile,
    HostPlacement,
    LinkCost,
    PlacementSpec,
    Workload,
    load_profile,
)
from conduit.placement.placement_map import MapRange, PlacementMap
from conduit.placement.profile import machine_id, profile_machine, profile_path
from conduit.storage.base import Storage
from conduit.storage.columnar import ColumnarStorage
from conduit.storage.disk import DiskStorage
from conduit.storage.sharded import ShardedStorage
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

HOST = PlacementSpec("host", ("cpu",))


# -- 1. a buffer larger than the map's plan --------------------------------------------------------------------
def _host_map(capacity: int) -> PlacementMap:
    """A map planned for ``capacity`` items of ID_SCHEMA: host memory for every size up to 10 kB."""
    workload = Workload.from_schema(ID_SCHEMA, capacity=capacity, batch=8)
    return PlacementMap([MapRange(1.0, float("inf"), HOST)], workload, "test", max_item_bytes=10_000)


def test_a_buffer_of_more_items_than_the_map_was_planned_for_is_refused_typed() -> None:
    adaptive = AdaptivePlacement(_host_map(128))
    with pytest.raises(PlacementError, match=r"129 items.*planned for \(128 items\).*capacity=129"):
        ExperienceDataPlane(ID_SCHEMA, capacity=129, semantics=Replay(seed=0), placement=adaptive)
    assert adaptive.current is None, "the refused build changed the placement's current spec"


@pytest.mark.parametrize("capacity", [64, 128])
def test_a_buffer_the_map_covers_is_built_and_delivers(capacity: int) -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=capacity, semantics=OnPolicy(num_minibatches=2, num_epochs=1),
                              placement=AdaptivePlacement(_host_map(128)))
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    ids = sorted(check_payload(edp.deliver()[0]).tolist() + check_payload(edp.deliver()[0]).tolist())
    assert ids == list(range(10))
    assert edp.storage.tier == "host"
    edp.close()


def test_a_migration_into_an_adaptive_placement_planned_for_fewer_items_is_refused_and_changes_nothing() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, semantics=Replay(seed=0), placement=HostPlacement())
    edp.ingest(id_batch(np.arange(40)))
    before = edp.storage
    with pytest.raises(PlacementError, match=r"planned for \(128 items\)"):
        edp.migrate(AdaptivePlacement(_host_map(128)))
    assert edp.storage is before
    assert sorted(check_payload(edp.storage.gather(torch.arange(40))).tolist()) == list(range(40))
    edp.close()


# -- 2. a declared profile and this machine's measured-profile cache ------------------------------------------
def _profile(source: str, machine: str) -> BandwidthProfile:
    links = {"host_copy": LinkCost.constant(10, 5), "host_gather": LinkCost.constant(8, 6, 100)}
    return BandwidthProfile(links, source=source, machine=machine, created="2026-01-01T00:00:00+00:00")


@pytest.mark.parametrize(("source", "machine"), [("declared", "declared:tiny"), ("declared", "here"),
                                                 ("measured", "0123456789abcdef")],
                         ids=["declared", "declared-as-this-machine", "measured-elsewhere"])
def test_saving_a_profile_that_is_not_this_machines_measurement_to_its_cache_is_refused(
        source: str, machine: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    prof = _profile(source, machine_id() if machine == "here" else machine)
    for path in (None, profile_path(), tmp_path / "." / profile_path().name):  # the cache file, however named
        with pytest.raises(PlacementError, match=r"not this machine's measurement.*save\(path\)"):
            prof.save(path)
        assert not profile_path().exists(), "the refused save wrote the cache file"
    elsewhere = prof.save(tmp_path / "declared.json")  # any other path keeps it, provenance and all
    again = load_profile(elsewhere) if source == "declared" else BandwidthProfile.from_dict(
        json.loads(elsewhere.read_text()))
    assert (again.source, again.machine, again.links) == (prof.source, prof.machine, prof.links)


def test_a_declared_profile_already_in_the_cache_is_never_taken_as_this_machines_measurement(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    data = _profile("declared", machine_id()).to_dict()  # as a save before the fix left it there
    profile_path().write_text(json.dumps(data))
    for path in (None, profile_path()):
        with pytest.raises(PlacementError, match=r"declared.*not a measurement of this machine.*conduit profile"):
            load_profile(path)
    copy = tmp_path / "declared.json"
    copy.write_text(profile_path().read_text())
    assert load_profile(copy).source == "declared"  # anywhere else: what it is, labelled so
    measured = profile_machine(quick=True)  # measures instead of taking it, and caches the measurement over it
    assert (measured.source, measured.machine) == ("measured", machine_id())
    assert measured.links != data["links"] and "edp_deliver" in measured.links
    cached = load_profile()
    assert (cached.source, cached.created) == ("measured", measured.created)


# -- 3. a ragged checkpoint's layout is checked once per load ---------------------------------------------------
TOKENS = ExperienceSchema(r=Field((), torch.float32), tok=Field((), torch.int64, ragged=True))


S = TypeVar("S", bound=Storage)


def _counting(cls: type[S]) -> type[S]:
    """``cls`` counting the calls of its ``checkpoint_layout`` (which it still runs)."""

    class Counting(cls):  # type: ignore[valid-type, misc]
        layout_checks = 0

        def checkpoint_layout(self, state: dict[str, Any], batch: ExperienceBatch) -> dict[str, Any] | None:
            type(self).layout_checks += 1
            return super().checkpoint_layout(state, batch)

    return Counting


def _token_storages(tmp_path: Path) -> dict[str, Any]:
    return {"host": lambda: _counting(ColumnarStorage)(TOKENS, 6, ragged_capacity=30),
            "disk": lambda: _counting(DiskStorage)(TOKENS, 6, directory=tmp_path, ragged_capacity=30),
            "sharded": lambda: _counting(ShardedStorage)(TOKENS, 6, ["cpu", "cpu"], ragged_capacity=30)}


def _tokens(first: int, lengths: list[int]) -> ExperienceBatch:
    n = len(lengths)
    vals = torch.arange(first * 100, first * 100 + sum(lengths), dtype=torch.int64)
    return ExperienceBatch({"r": torch.arange(first, first + n, dtype=torch.float32),
                            "tok": Ragged(vals, torch.tensor(lengths))}, n)


def _live_items(st: Storage) -> list[tuple[float, list[int]]]:
    b = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)
    tok = b["tok"]
    assert isinstance(tok, Ragged)
    return list(zip(b.tensor("r").tolist(), [t.tolist() for t in tok.values.split(tok.lengths.tolist())],
                    strict=True))


@pytest.mark.parametrize("tier", ["host", "disk", "sharded"])
def test_a_storage_load_checks_the_ragged_layout_once_and_restores_it(tier: str, tmp_path: Path) -> None:
    make = _token_storages(tmp_path)[tier]
    saved = make()
    for k in range(4):  # 8 items over a ring of 6 and a pool of 30: both wrap, the layout is not packed
        saved.append(_tokens(2 * k, [3 + k, 5]))
    state = saved.state_dict()
    restored = make()
    type(restored).layout_checks = 0
    restored.load_state_dict(state)
    assert type(restored).layout_checks == 1, f"the load checked the ragged layout {type(restored).layout_checks} times"
    assert _live_items(restored) == _live_items(saved)
    layout, want = restored.ragged_layout(), saved.ragged_layout()
    assert layout is not None and want is not None and layout["heads"] == want["heads"]
    assert torch.equal(layout["starts"]["tok"], want["starts"]["tok"])


@pytest.mark.parametrize("tier", ["host", "disk", "sharded"])
def test_a_damaged_ragged_layout_is_still_refused_by_the_storage_load_and_changes_nothing(tier: str,
                                                                                        tmp_path: Path) -> None:
    make = _token_storages(tmp_path)[tier]
    saved = make()
    for k in range(3):
        saved.append(_tokens(2 * k, [4, 2]))
    state = saved.state_dict()
    starts = state["ragged_layout"]["starts"]["tok"]
    state["ragged_layout"]["starts"]["tok"] = torch.full_like(starts, int(starts[0]))  # items on top of each other
    target = make()
    target.append(_tokens(9, [1]))
    before = _live_items(target)
    with pytest.raises(ConfigurationError, match="ragged_layout"):
        target.load_state_dict(state)
    assert _live_items(target) == before and (target.oldest, target.next_handle) == (0, 1)
