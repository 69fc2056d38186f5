"""The disk tier and sharded storage: a sharded write that fails part-way stores nothing of
its batch, disk column files reserve their blocks when built, and boundary behaviour that must hold
(exact capacity and wrap-around gathers, checkpoints, unicode directories, migrations with ragged fields)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, PlacementError, Replay
from conduit.batch import ExperienceBatch, Ragged
from conduit.placement import DiskPlacement, HostPlacement, ShardedPlacement
from conduit.storage import ColumnarStorage, DiskStorage, ShardedStorage

sys.path.insert(0, str(Path(__file__).parent))
from test_schema_storage_refusals_and_disk_names import TOK, _expect, _live, _tok_batch  # noqa: E402, I001
from test_tiers import SCHEMA, _batch  # noqa: E402, I001


def _ids(st: ShardedStorage | ColumnarStorage) -> list[int]:
    """The ids of the live items, read in handle order."""
    got = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)["id"]
    assert isinstance(got, torch.Tensor)
    return got.tolist()


# -- sharded: a write that fails on one shard ---------------------------------------------------------
@pytest.mark.parametrize("evict", [False, True])
def test_a_sharded_write_that_fails_part_way_stores_nothing_of_its_batch(evict: bool) -> None:
    """A fixed field that cannot be copied (here a wrong row shape, given straight to the storage) failed
    after the ring had counted the batch: its items stayed live as half-written rows (ids written, obs not)."""
    st = ShardedStorage(SCHEMA, 6, ["cpu"] * 3)
    st.append(_batch(range(2 if not evict else 4)))
    before = (st.oldest, st.next_handle)
    bad = ExperienceBatch({"id": torch.arange(10, 13), "obs": torch.zeros(3, 5)}, 3)
    with pytest.raises(RuntimeError):
        st.append(bad, evict=evict)
    assert st.next_handle == before[1], "items of a batch whose write failed are live"
    assert 10 not in _ids(st) and 11 not in _ids(st), "half-written rows of a failed append are readable"
    res = st.append(_batch(range(before[1], before[1] + 3)))  # the next append takes the handles and slots
    assert res.first == before[1]
    assert _ids(st) == list(range(st.oldest, st.next_handle))


def test_a_sharded_ragged_write_that_fails_on_a_fixed_field_leaves_the_ragged_part_unstored() -> None:
    """With ragged fields the ragged part was stored (and counted) before the fixed shards failed."""
    schema = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
    st = ShardedStorage(schema, 6, ["cpu"] * 2, ragged_capacity=50)
    seqs = [torch.full((i + 1,), i) for i in range(3)]
    st.append(ExperienceBatch({"id": torch.arange(3), "tok": Ragged.from_sequences(seqs)}, 3))
    bad = ExperienceBatch({"id": torch.zeros(2, 3, dtype=torch.int64),
                           "tok": Ragged.from_sequences([torch.arange(2)] * 2)}, 2)
    with pytest.raises(RuntimeError):
        st.append(bad)
    assert (st.oldest, st.next_handle) == (0, 3), "a failed sharded append left its items counted"
    st.append(ExperienceBatch({"id": torch.tensor([3]), "tok": Ragged.from_sequences([torch.full((4,), 3)])}, 1))
    got = st.gather(torch.arange(4))
    assert got["id"].tolist() == [0, 1, 2, 3]
    assert [got["tok"][j].tolist() for j in range(4)] == [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]


# -- sharded: boundaries and order --------------------------------------------------------------------
@pytest.mark.parametrize("capacity,k", [(7, 3), (8, 4), (5, 5), (9, 2)])
def test_sharded_gathers_in_selection_order_at_exact_capacity_and_after_wrap(capacity: int, k: int) -> None:
    st = ShardedStorage(SCHEMA, capacity, ["cpu"] * k)
    st.append(_batch(range(capacity)))  # exactly full, no eviction
    assert (st.oldest, st.next_handle) == (0, capacity)
    st.append(_batch(range(capacity, capacity + capacity - 1)))  # wraps, ending one slot before the start
    handles = list(range(st.oldest, st.next_handle))
    order = handles[::-1] + handles[::2] + [handles[0]] * 3
    got = st.gather(torch.tensor(order) % capacity)
    assert got["id"].tolist() == order, "rows came back in another order than the selection's"
    assert got["obs"][:, 1].tolist() == [-float(h) for h in order]
    empty = st.gather(torch.zeros(0, dtype=torch.int64))
    assert empty.batch_size == 0 and empty["id"].shape == (0,)


def test_sharded_state_dict_with_ragged_fields_round_trips_exactly_after_wrap() -> None:
    st = ShardedStorage(TOK, 4, ["cpu"] * 3, ragged_capacity=16)
    st.append(_tok_batch(0, [3, 0, 5]))
    st.append(_tok_batch(3, [2, 2]))
    state = st.state_dict()
    other = ShardedStorage(TOK, 4, ["cpu"] * 3, ragged_capacity=16)
    other.load_state_dict(state)
    assert _live(other) == _live(st) == {1: [], 2: _expect(2, 5), 3: _expect(3, 2), 4: _expect(4, 2)}
    again = other.state_dict()
    assert (again["oldest"], again["next"]) == (state["oldest"], state["next"])
    for name in TOK:
        a, b = state["data"][name], again["data"][name]
        if isinstance(a, tuple):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), name
        else:
            assert torch.equal(a, b), name


# -- disk ---------------------------------------------------------------------------------------------
def test_disk_column_files_reserve_their_blocks_when_built(tmp_path: Path) -> None:
    """The column files were sparse: the free-space check passed for every buffer built before the first
    wrote, and a write into a mapped page the full volume could not back killed the process (SIGBUS)
    instead of a PlacementError at construction. The blocks are now reserved with the files."""
    st = DiskStorage(TOK, 50_000, directory=tmp_path, ragged_capacity=200_000)
    try:
        for p in st.directory.iterdir():
            s = p.stat()
            assert s.st_blocks * 512 >= s.st_size, f"{p.name}: {s.st_blocks * 512} of {s.st_size} bytes reserved"
        st.append(_tok_batch(0, [3, 0, 5]))
        assert _live(st) == {0: _expect(0, 3), 1: [], 2: _expect(2, 5)}
    finally:
        st.close()


def test_disk_storage_in_a_directory_with_spaces_and_unicode_round_trips_and_cleans_up(tmp_path: Path) -> None:
    parent = tmp_path / "my buffers é 中"
    a = DiskStorage(TOK, 4, directory=parent, ragged_capacity=16)
    b = DiskStorage(TOK, 4, directory=parent, ragged_capacity=16)  # two buffers in one directory at once
    assert a.directory != b.directory and a.directory.parent == b.directory.parent == parent
    a.append(_tok_batch(0, [3, 0, 5]))
    b.append(_tok_batch(0, [4]))
    a.append(_tok_batch(3, [2, 2]))
    assert _live(b) == {0: _expect(0, 4)}
    state = a.state_dict()
    a.close()
    assert _live(b) == {0: _expect(0, 4)}, "closing one buffer touched the other's files"
    c = DiskStorage(TOK, 4, directory=parent, ragged_capacity=16)
    c.load_state_dict(state)
    assert _live(c) == {1: [], 2: _expect(2, 5), 3: _expect(3, 2), 4: _expect(4, 2)}
    b.close()
    c.close()
    assert list(parent.iterdir()) == []


def test_migration_to_and_from_disk_with_ragged_fields_keeps_items_exactly(tmp_path: Path) -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), tok=Field((2,), torch.float16, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=7, ragged_capacity=40, semantics=Replay(seed=2))
    for i in range(0, 19, 3):
        ids = list(range(i, i + 3))
        edp.ingest({"id": torch.tensor(ids), "tok": [torch.full((j % 5, 2), float(j), dtype=torch.float16)
                                                     for j in ids]})

    def dump() -> tuple:
        s = edp.storage.state_dict()
        return s["oldest"], s["next"], s["data"]["id"].tolist(), [t.tolist() for t in s["data"]["tok"]]

    for placement in (DiskPlacement(directory=tmp_path), ShardedPlacement(["cpu"] * 3),
                      DiskPlacement(directory=tmp_path), HostPlacement()):
        before = dump()
        edp.migrate(placement)
        assert dump() == before, f"migration to {placement.describe()} changed the items"
        edp.ingest({"id": torch.tensor([100]), "tok": [torch.ones(3, 2, dtype=torch.float16)]})
    assert list(tmp_path.iterdir()) == [], "a disk storage migrated away from left its files"


def test_a_refusal_for_too_little_free_space_states_sizes_a_small_volume_can_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a small volume the message said "needs 0.00 GiB ... but only 0.00 GiB is free"."""
    real = shutil.disk_usage

    def small_volume(path: str | Path) -> object:
        return real(path)._replace(free=300 * 1024)  # a volume with 300 KiB left

    monkeypatch.setattr(shutil, "disk_usage", small_volume)
    with pytest.raises(PlacementError) as err:
        DiskStorage(ExperienceSchema(x=Field((1000,), torch.float32)), 150, directory=tmp_path)  # 600 000 B
    assert "585.9 KiB" in str(err.value) and "300.0 KiB" in str(err.value), str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_a_disk_storage_in_a_path_that_is_a_file_is_a_placement_error(tmp_path: Path) -> None:
    """DiskStorage itself raised a raw FileExistsError / NotADirectoryError (only DiskPlacement typed it)."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for path in (not_a_dir, not_a_dir / "sub"):
        with pytest.raises(PlacementError, match="cannot use"):
            DiskStorage(TOK, 4, directory=path, ragged_capacity=8)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_refused_ragged_capacity_makes_no_directory(tmp_path: Path) -> None:
    """The directory was made before ragged_capacity was checked: a refused storage left it behind."""
    with pytest.raises(ConfigurationError, match="ragged_capacity must be"):
        DiskStorage(TOK, 4, directory=tmp_path / "new", ragged_capacity=0)
    assert list(tmp_path.iterdir()) == [], "a refused disk storage made its directory"


@pytest.mark.gpu
def test_a_failed_write_to_staged_gpu_shards_stores_nothing_of_its_batch() -> None:
    """The same on GPU shards written through page-locked staging (the copies are asynchronous). The eviction
    that made room for the refused batch stays made (``ShardedStorage.append``): its slot may hold rows of it."""
    st = ShardedStorage(SCHEMA, 6, ["cuda:0", "cpu", "cuda:0"])
    st.append(_batch(range(4)))
    with pytest.raises(RuntimeError):
        st.append(ExperienceBatch({"id": torch.arange(10, 13), "obs": torch.zeros(3, 5)}, 3))
    assert (st.oldest, st.next_handle) == (1, 4)
    assert _ids(st) == [1, 2, 3], "half-written rows of a failed append are readable"
    st.append(_batch(range(4, 9)))
    assert _ids(st) == list(range(3, 9))


@pytest.mark.parametrize("devices", ["cpu", torch.device("cpu"), ["cpu", "nodev"], [0.5]],
                         ids=["one-name", "one-device", "unknown-name", "float"])
def test_shard_devices_that_are_no_sequence_of_devices_are_refused_typed(devices: object) -> None:
    """A single name ("cpu" read as the devices 'c', 'p', 'u') or a name torch does not know got a raw
    RuntimeError/TypeError from torch.device in ShardedStorage and ShardedPlacement."""
    with pytest.raises(ConfigurationError, match="device"):
        ShardedStorage(SCHEMA, 4, devices)  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="device"):
        ShardedPlacement(devices)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["nodev", 3.5])
def test_a_device_placement_on_a_device_torch_does_not_know_is_a_placement_error(device: object) -> None:
    from conduit.errors import PlacementError
    from conduit.placement import DevicePlacement

    with pytest.raises(PlacementError, match="torch does not know"):
        DevicePlacement(device)  # type: ignore[arg-type]
