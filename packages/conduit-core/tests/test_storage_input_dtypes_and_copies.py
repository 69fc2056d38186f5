"""Storage and input handling: per-item sequences or scalars of mixed dtypes are refused
instead of promoted (a value the caller never gave), float8 fields gather from shards and restore from ragged
checkpoints, tensors that require grad are stored by value (the columns stay out of autograd, so gathers
into reused buffers and checkpoints keep working), a disk storage in a relative directory deletes its own
files, masked NumPy arrays with masked entries are refused, and a copied host storage writes into its own
columns (a disk storage refuses to be copied)."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, Replay
from conduit.batch import ExperienceBatch, Ragged
from conduit.errors import ConfigurationError, SchemaError
from conduit.placement import DiskPlacement, HostPlacement, Placement, ShardedPlacement
from conduit.schema import ExperienceSchema, Field
from conduit.storage.base import Storage
from conduit.storage.columnar import ColumnarStorage
from conduit.storage.disk import DiskStorage
from conduit.storage.sharded import ShardedStorage

pytestmark = pytest.mark.timeout(120)

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _storages(schema: ExperienceSchema, tmp_path: Path) -> dict[str, Callable[[], Storage]]:
    return {"host": lambda: ColumnarStorage(schema, 5, ragged_capacity=12),
            "disk": lambda: DiskStorage(schema, 5, directory=tmp_path, ragged_capacity=12),
            "sharded": lambda: ShardedStorage(schema, 5, ["cpu"] * 3, ragged_capacity=12)}


def _live(st: Storage) -> ExperienceBatch:
    return st.gather(torch.remainder(torch.arange(st.oldest, st.next_handle), st.capacity))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (exact comparison for dtypes without ==, such as float8)."""
    return t.contiguous().view(torch.uint8)


# -- mixed dtypes are refused, not promoted ------------------------------------------------------------------


@pytest.mark.parametrize("seqs", [
    [torch.tensor([2**24 + 1]), torch.tensor([0.5])],  # int64 + float32 -> float32 would store 2**24
    [np.array([3], np.int32), np.array([0.25], np.float32)],
    [[1.5, 2.5], [3]],  # a Python int list among float lists
])
def test_per_item_sequences_of_different_dtypes_are_refused_and_the_buffer_is_unchanged(seqs: list[object]) -> None:
    schema = ExperienceSchema(t=Field((), torch.float32, ragged=True), x=Field((), torch.int64))
    edp = ExperienceDataPlane(schema, capacity=4, semantics=Replay(seed=0), ragged_capacity=16)
    edp.ingest({"t": [[1.0]], "x": torch.tensor([7])})
    before = edp.state_dict()["storage"]
    with pytest.raises(SchemaError, match="different dtypes"):
        edp.ingest({"t": seqs, "x": torch.tensor([1, 2])})
    with pytest.raises(SchemaError, match="different dtypes"):
        Ragged.from_sequences(seqs)
    after = edp.state_dict()["storage"]
    assert (after["oldest"], after["next"]) == (before["oldest"], before["next"]) == (0, 1)
    assert torch.equal(after["data"]["t"][0], torch.tensor([1.0]))


def test_sequences_of_one_dtype_with_empty_ones_of_another_still_pack() -> None:
    r = Ragged.from_sequences([np.array([1, 2], np.int32), [], np.array([3], np.int32)])
    assert r.values.dtype == torch.int32 and r.values.tolist() == [1, 2, 3] and r.lengths.tolist() == [2, 0, 1]


@pytest.mark.parametrize("rows", [
    [torch.tensor(2**24 + 1), torch.tensor(0.5)],
    [np.int64(2**53 + 1), np.float32(0.5)],
])
def test_per_item_scalars_of_different_dtypes_are_refused_not_promoted(rows: list[object]) -> None:
    schema = ExperienceSchema(r=Field((), torch.float32))
    with pytest.raises(SchemaError, match="dtypes differ"):
        ExperienceBatch.checked({"r": rows}, schema)
    same = ExperienceBatch.checked({"r": [torch.tensor(1.5), torch.tensor(2.5)]}, schema)
    assert same.tensor("r").tolist() == [1.5, 2.5]


# -- float8 fields on every tier -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT8)
@pytest.mark.parametrize("tier", ["host", "disk", "sharded"])
def test_float8_fields_are_gathered_and_restored_exactly_after_wrap(dtype: torch.dtype, tier: str,
                                                                    tmp_path: Path) -> None:
    schema = ExperienceSchema(x=Field((2,), dtype), t=Field((), dtype, ragged=True))
    make = _storages(schema, tmp_path)[tier]
    st = make()
    xs = (torch.arange(16, dtype=torch.float32) - 8).view(8, 2).to(dtype)
    for first in range(0, 8, 2):  # 4 items of 3 elements each: the pool of 12 and the ring of 5 both wrap
        vals = (torch.arange(6, dtype=torch.float32) + first).to(dtype)
        st.append(ExperienceBatch({"x": xs[first:first + 2], "t": Ragged(vals, torch.tensor([3, 3]))}, 2))
    got = _live(st)  # sharded: a raw NotImplementedError (index_copy_) before the fix
    handles = list(range(st.oldest, st.next_handle))
    assert torch.equal(_bits(got.tensor("x")), _bits(xs[handles]))
    state = st.state_dict()
    restored = make()
    restored.load_state_dict(state)  # ragged layout placed by index_copy_: NotImplementedError before the fix
    again = _live(restored)
    assert torch.equal(_bits(again.tensor("x")), _bits(got.tensor("x")))
    t_got, t_again = got["t"], again["t"]
    assert isinstance(t_got, Ragged) and isinstance(t_again, Ragged)
    assert torch.equal(_bits(t_again.values), _bits(t_got.values)) and torch.equal(t_again.lengths, t_got.lengths)
    layout = restored.ragged_layout()
    assert layout is not None and layout["heads"] == state["ragged_layout"]["heads"]
    assert torch.equal(layout["starts"]["t"], state["ragged_layout"]["starts"]["t"])


# -- tensors that require grad are stored by value -------------------------------------------------------------


@pytest.mark.parametrize("placement", ["host", "disk", "sharded"])
def test_tensors_that_require_grad_are_stored_by_value_and_the_buffer_keeps_serving(placement: str,
                                                                                   tmp_path: Path) -> None:
    places: dict[str, Placement] = {"host": HostPlacement(), "disk": DiskPlacement(directory=tmp_path),
                                    "sharded": ShardedPlacement(["cpu"] * 2)}
    schema = ExperienceSchema(x=Field((3,), torch.float32), t=Field((), torch.float32, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=6, semantics=Replay(seed=0), placement=places[placement],
                              ragged_capacity=32)
    w = torch.arange(12, dtype=torch.float32).view(3, 4).requires_grad_(True)
    x = (w * 1.0).t()  # a transposed (non-contiguous) output of a graph: not copied by memmove
    t = torch.arange(6, dtype=torch.float32, requires_grad=True) * 2.0
    stored_x = x.detach().clone()
    edp.ingest({"x": x, "t": Ragged(t, torch.tensor([1, 2, 0, 3]))})
    got, info = edp.deliver(4)  # index_select(out=...) into reused buffers: refused for a column in a graph
    order = info.handles.tolist()
    assert not got.tensor("x").requires_grad
    assert torch.equal(got.tensor("x"), x.detach()[order])
    tg = got["t"]
    assert isinstance(tg, Ragged) and not tg.values.requires_grad
    want = [t.detach()[[0], ...], t.detach()[1:3], t.detach()[3:3], t.detach()[3:6]]
    assert torch.equal(tg.values, torch.cat([want[h] for h in order]))
    buf = io.BytesIO()
    torch.save(edp.state_dict(), buf)  # a state in a graph cannot be saved
    with torch.no_grad():
        x.add_(100.0)  # the caller's tensors change later: the stored items do not
        t.add_(100.0)
    data = edp.state_dict()["storage"]["data"]
    assert torch.equal(data["x"], stored_x) and torch.equal(data["t"][0], torch.arange(6.0) * 2.0)
    edp.close()


# -- the disk tier's files ----------------------------------------------------------------------------------


def test_a_disk_storage_in_a_relative_directory_deletes_its_files_after_a_change_of_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    schema = ExperienceSchema(x=Field((2,), torch.float32), t=Field((), torch.int64, ragged=True))
    st = DiskStorage(schema, 4, directory="buffers", ragged_capacity=8)
    made = tmp_path / "run" / "buffers" / st.directory.name
    assert sorted(p.name for p in made.iterdir()) == ["t.bin", "x.bin"]
    st.append(ExperienceBatch({"x": torch.ones(1, 2), "t": Ragged(torch.tensor([5]), torch.tensor([1]))}, 1))
    monkeypatch.chdir(tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "buffers" / st.directory.name).mkdir(parents=True)  # the name, relative to here
    st.close()
    assert not made.exists()  # before the fix: left behind (the relative path was removed from the new directory)
    assert (tmp_path / "elsewhere" / "buffers" / st.directory.name).exists()
    assert st.directory == made  # messages name the directory absolutely


# -- NumPy masked arrays -------------------------------------------------------------------------------------


def test_a_masked_array_with_masked_entries_is_refused_and_one_without_is_stored() -> None:
    schema = ExperienceSchema(x=Field((2,), torch.float32), t=Field((), torch.float32, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=4, semantics=Replay(seed=0), ragged_capacity=16)
    data = np.arange(4, dtype=np.float32).reshape(2, 2)
    hidden = np.ma.masked_array(data, mask=[[False, True], [False, False]])  # 1.0 lies under the mask
    with pytest.raises(SchemaError, match=r"masked entries.*filled"):
        edp.ingest({"x": hidden, "t": [[1.0], [2.0]]})
    with pytest.raises(SchemaError, match=r"masked entries.*filled"):
        edp.ingest({"x": data, "t": [np.ma.masked_array([1.0, 9.0], mask=[False, True], dtype=np.float32), [2.0]]})
    assert len(edp) == 0
    edp.ingest({"x": np.ma.masked_array(data), "t": [[1.0], [2.0]]})  # nothing masked: the values are the data
    assert torch.equal(edp.state_dict()["storage"]["data"]["x"], torch.from_numpy(data))
    edp.close()


# -- copies of a storage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_host_storage_writes_into_its_own_columns_not_the_original(how: str) -> None:
    schema = ExperienceSchema(x=Field((2,), torch.float32), y=Field((), torch.int64))
    st = ColumnarStorage(schema, 4)
    st.append(ExperienceBatch({"x": torch.ones(4, 2), "y": torch.tensor([1, 2, 3, 4])}, 4))
    cp = copy.deepcopy(st) if how == "deepcopy" else pickle.loads(pickle.dumps(st))
    cp.append(ExperienceBatch({"x": torch.full((2, 2), 7.0), "y": torch.tensor([5, 6])}, 2))  # contiguous: memmove
    cp.append(ExperienceBatch({"x": torch.full((2, 4), 9.0)[:, ::2], "y": torch.tensor([8, 0, 9])[::2]}, 2))  # NumPy
    assert _live(st).tensor("x")[:, 0].tolist() == [1.0] * 4  # before the fix: the copy's 7s landed here
    assert _live(st).tensor("y").tolist() == [1, 2, 3, 4]
    assert _live(cp).tensor("x")[:, 0].tolist() == [7.0, 7.0, 9.0, 9.0]
    assert _live(cp).tensor("y").tolist() == [5, 6, 8, 9]


def test_a_disk_storage_refuses_to_be_copied_and_keeps_working(tmp_path: Path) -> None:
    st = DiskStorage(ExperienceSchema(x=Field((2,), torch.float32)), 4, directory=tmp_path)
    st.append(ExperienceBatch({"x": torch.ones(1, 2)}, 1))
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(ConfigurationError, match="state_dict"):
            attempt(st)
    st.append(ExperienceBatch({"x": torch.full((1, 2), 2.0)}, 1))
    assert _live(st).tensor("x")[:, 0].tolist() == [1.0, 2.0] and st.directory.exists()
    st.close()
