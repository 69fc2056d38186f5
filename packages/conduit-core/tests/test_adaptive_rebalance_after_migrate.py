"""``AdaptivePlacement.rebalance`` decides from where the buffer's storage lives, not from its own record of
where it last put it: a manual ``edp.migrate`` in between is seen (and a buffer built by another placement)."""

from __future__ import annotations

from pathlib import Path

import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field
from conduit.placement import AdaptivePlacement, DiskPlacement, HostPlacement, PlacementSpec, Workload
from conduit.placement.placement_map import MapRange, PlacementMap

HOST = PlacementSpec("host", ("cpu",))
DISK = PlacementSpec("disk", ("disk",))
CAPACITY = 32
#: 8 B id + 4 float32 = 24 B per item
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))


def _adaptive(tmp_path: Path) -> AdaptivePlacement:
    """Host below 30 B per item (so these 24 B items belong on the host), disk from 30 B on."""
    pmap = PlacementMap([MapRange(1.0, 30.0, HOST), MapRange(30.0, float("inf"), DISK)],
                        Workload.from_schema(SCHEMA, capacity=CAPACITY, batch=1), "test", max_item_bytes=10_000)
    return AdaptivePlacement(pmap, directory=tmp_path)


def _ids(edp: ExperienceDataPlane) -> list[int]:
    st = edp.storage
    return st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)["id"].tolist()


def test_rebalance_after_a_manual_migration_moves_the_buffer_back_where_the_map_places_it(tmp_path: Path) -> None:
    adaptive = _adaptive(tmp_path)
    edp = ExperienceDataPlane(SCHEMA, capacity=CAPACITY, placement=adaptive)
    edp.ingest({"id": torch.arange(10), "obs": torch.ones(10, 4)})
    edp.flush()
    assert adaptive.current == HOST and edp.storage.tier == "host"
    edp.migrate(DiskPlacement(directory=tmp_path))  # by hand: the adaptive placement is not told
    assert edp.storage.tier == "disk"
    report = adaptive.rebalance(edp)
    assert report is not None, (
        "rebalance() kept the buffer on disk although the map places 24 B items on the host: it compared with "
        "its own record (current == host) instead of where the storage lives after the manual migration")
    assert edp.storage.tier == "host" and adaptive.current == HOST and report.items == 10
    assert _ids(edp) == list(range(10))
    assert adaptive.rebalance(edp) is None, "back on the host, where the map places it: stays"


def test_rebalance_of_a_buffer_already_where_the_map_places_it_does_not_migrate(tmp_path: Path) -> None:
    """A buffer built by another placement, already on the host: nothing to do (before: ``current`` was None,
    so every rebalance migrated host -> host)."""
    adaptive = _adaptive(tmp_path)
    edp = ExperienceDataPlane(SCHEMA, capacity=CAPACITY, placement=HostPlacement())
    edp.ingest({"id": torch.arange(5), "obs": torch.ones(5, 4)})
    storage = edp.storage
    assert adaptive.rebalance(edp) is None
    assert edp.storage is storage and adaptive.migrations == []
