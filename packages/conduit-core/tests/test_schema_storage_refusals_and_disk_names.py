"""Storage, schema and batches, third review: ragged pools wrapping apart from the item ring, exact pool
and capacity boundaries, both gather paths on the same data, narrow dtypes, checkpoints on every tier,
truncate/release, the disk tier's files, and refusals of bad schemas and batches."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit.batch import ExperienceBatch, Ragged
from conduit.errors import CapacityError, ConfigurationError, PlacementError, SchemaError
from conduit.schema import ExperienceSchema, Field
from conduit.storage import columnar
from conduit.storage.columnar import ColumnarStorage
from conduit.storage.disk import DiskStorage
from conduit.storage.sharded import ShardedStorage

TOK = ExperienceSchema(tok=Field((), torch.int64, ragged=True), x=Field((), torch.float32))


def _tok_batch(first: int, lengths: list[int]) -> ExperienceBatch:
    """Item ``h`` holds tokens ``1000 * h + j`` and x = h."""
    h = range(first, first + len(lengths))
    vals = [torch.arange(n, dtype=torch.int64) + 1000 * i for i, n in zip(h, lengths, strict=True)]
    return ExperienceBatch({"tok": Ragged(torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64),
                                          torch.tensor(lengths, dtype=torch.int64)),
                            "x": torch.tensor(list(h), dtype=torch.float32)}, len(lengths))


def _live(st: ColumnarStorage | ShardedStorage) -> dict[int, list[int]]:
    """Handle -> tokens of every live item."""
    hs = list(range(st.oldest, st.next_handle))
    g = st.gather(torch.tensor([h % st.capacity for h in hs], dtype=torch.int64))
    assert g.tensor("x").tolist() == [float(h) for h in hs], "fixed field rows are not the live handles"
    tok = g["tok"]
    assert isinstance(tok, Ragged)
    return {h: tok[j].tolist() for j, h in enumerate(hs)}


def _expect(h: int, n: int) -> list[int]:
    return [1000 * h + j for j in range(n)]


# -- ragged pool vs item ring ------------------------------------------------------------------------
def test_pool_wraps_while_the_item_ring_does_not() -> None:
    st = ColumnarStorage(TOK, 10, ragged_capacity=10)
    st.append(_tok_batch(0, [4, 4]))  # pool [0, 8), slots 0-1
    res = st.append(_tok_batch(2, [3]))  # 8 + 3 > 10: placed at 0, over item 0 only
    assert (res.evicted_from, res.evicted_to) == (0, 1), f"evicted {res}: only item 0 overlaps [0, 3)"
    assert _live(st) == {1: _expect(1, 4), 2: _expect(2, 3)}
    res = st.append(_tok_batch(3, [1]))  # [3, 4): overlaps nothing live
    assert res.evicted_to == 1 and _live(st)[3] == _expect(3, 1)


def test_item_ring_wraps_while_the_pool_does_not() -> None:
    st = ColumnarStorage(TOK, 3, ragged_capacity=100)
    st.append(_tok_batch(0, [2, 0, 5]))
    res = st.append(_tok_batch(3, [1, 7]))  # slots 0, 1: ring full, two oldest go; the pool has room
    assert (res.evicted_from, res.evicted_to) == (0, 2)
    assert _live(st) == {2: _expect(2, 5), 3: _expect(3, 1), 4: _expect(4, 7)}


def test_a_block_over_a_newer_item_evicts_every_older_item_too() -> None:
    """FIFO: a block that lands on the second-oldest item takes the oldest with it, not only the one hit."""
    st = ColumnarStorage(TOK, 8, ragged_capacity=10)
    st.append(_tok_batch(0, [0, 6]))  # item 0 holds nothing, item 1 is at [0, 6)
    st.append(_tok_batch(2, [3]))  # [6, 9)
    res = st.append(_tok_batch(3, [2]))  # 9 + 2 > 10: at [0, 2), over item 1
    assert (res.evicted_from, res.evicted_to) == (0, 2)
    assert _live(st) == {2: _expect(2, 3), 3: _expect(3, 2)}


def test_a_ragged_batch_exactly_as_large_as_the_pool() -> None:
    st = ColumnarStorage(TOK, 6, ragged_capacity=8)
    st.append(_tok_batch(0, [3, 0]))
    res = st.append(_tok_batch(2, [0, 8, 0]))  # every element of the pool: item 0 goes, the empty item 1 stays
    assert (res.evicted_from, res.evicted_to) == (0, 1)
    assert _live(st) == {1: [], 2: [], 3: _expect(3, 8), 4: []}
    res = st.append(_tok_batch(5, [0]))  # nothing to place: nothing evicted (the ring has room)
    assert res.evicted_to == 1 and _live(st)[5] == []
    res = st.append(_tok_batch(6, [1]))  # the pool is full: the 8-element item goes, and all before it
    assert (res.evicted_from, res.evicted_to) == (1, 4)
    assert _live(st) == {4: [], 5: [], 6: _expect(6, 1)}
    with pytest.raises(CapacityError, match="more than its pool"):
        st.append(_tok_batch(7, [9]))
    assert (st.oldest, st.next_handle) == (4, 7), "a refused oversized batch changed the ring"


def test_a_full_pool_batch_without_eviction_is_refused_and_changes_nothing() -> None:
    st = ColumnarStorage(TOK, 6, ragged_capacity=8)
    st.append(_tok_batch(0, [1, 0]))
    with pytest.raises(CapacityError, match="may not evict"):
        st.append(_tok_batch(2, [8]), evict=False)
    assert (st.oldest, st.next_handle) == (0, 2) and _live(st) == {0: _expect(0, 1), 1: []}
    st.append(_tok_batch(2, [0, 0, 0, 0]), evict=False)  # empty items need no pool room
    assert len(st) == 6


def test_truncate_then_release_and_wrap_keep_the_pool_consistent() -> None:
    st = ColumnarStorage(TOK, 4, ragged_capacity=12)
    st.append(_tok_batch(0, [4, 4]))
    st.append(_tok_batch(2, [3]))
    st.truncate(2)  # forget item 2; its pool space [8, 11) is not reused until the pool wraps
    st.release(1)
    assert (st.oldest, st.next_handle) == (1, 2)
    res = st.append(_tok_batch(2, [2]))  # 11 + 2 > 12: wraps to [0, 2); item 0 was released already
    assert res.evicted_from == res.evicted_to == 1
    assert _live(st) == {1: _expect(1, 4), 2: _expect(2, 2)}
    st.truncate(st.oldest)
    assert len(st) == 0
    st.release(10)  # past the newest: clamps
    assert (st.oldest, st.next_handle) == (1, 1)
    st.append(_tok_batch(1, [12]))  # the whole pool, over forgotten and released blocks
    assert _live(st) == {1: _expect(1, 12)}


# -- gather: the segment-copy path and the index path -----------------------------------------------
def _both_paths(st: ColumnarStorage | ShardedStorage, slots: torch.Tensor,
                monkeypatch: pytest.MonkeyPatch) -> tuple[ExperienceBatch, ExperienceBatch]:
    monkeypatch.setattr(columnar, "_SEGMENT_COPY_MIN_MEAN", 0)  # always copy segments
    seg = st.gather(slots)
    monkeypatch.setattr(columnar, "_SEGMENT_COPY_MIN_MEAN", 10**9)  # always index elements
    idx = st.gather(slots)
    return seg, idx


@pytest.mark.parametrize("kind", ["columnar", "sharded", "disk"])
def test_both_gather_paths_agree_on_repeats_empty_items_and_a_wrapped_pool(
        kind: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    schema = ExperienceSchema(tok=Field((), torch.int64, ragged=True), x=Field((), torch.float32),
                              img=Field((2, 3), torch.bfloat16, ragged=True))
    cap, rcap = 7, 700
    st: ColumnarStorage | ShardedStorage
    if kind == "sharded":
        st = ShardedStorage(schema, cap, ["cpu"] * 3, ragged_capacity=rcap)
    elif kind == "disk":
        st = DiskStorage(schema, cap, ragged_capacity=rcap, directory=tmp_path)
    else:
        st = ColumnarStorage(schema, cap, ragged_capacity=rcap)
    rng = random.Random(3)
    for first in range(0, 40, 4):
        lengths = [rng.choice([0, 0, 1, 150, rng.randint(0, 120)]) for _ in range(4)]
        b = _tok_batch(first, lengths)
        img = torch.arange(sum(lengths) * 6, dtype=torch.float32).reshape(-1, 2, 3).to(torch.bfloat16)
        st.append(ExperienceBatch({**b, "img": Ragged(img, b["tok"].lengths)}, 4))  # type: ignore[union-attr]
    live = torch.arange(st.oldest, st.next_handle) % cap
    for slots in (live, live.flip(0), live.repeat_interleave(3), torch.cat([live, live]),
                  live[:1].repeat(5), live[:0]):
        seg, idx = _both_paths(st, slots, monkeypatch)
        for name in ("tok", "img"):
            a, b2 = seg[name], idx[name]
            assert isinstance(a, Ragged) and isinstance(b2, Ragged)
            assert torch.equal(a.lengths, b2.lengths) and a.values.dtype == b2.values.dtype == schema[name].dtype
            assert torch.equal(a.values, b2.values), f"{kind}: the two gather paths differ on {name!r}"
        assert torch.equal(seg.tensor("x"), idx.tensor("x"))
        # every item's sequence is its own (checked on the index path's result)
        tok = idx["tok"]
        assert isinstance(tok, Ragged)
        for j, h in enumerate(idx.tensor("x").tolist()):
            assert tok[j].tolist() == _expect(int(h), int(tok.lengths[j]))


# -- dtypes and shapes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["columnar", "sharded", "disk"])
def test_narrow_dtypes_with_multidimensional_ragged_elements_round_trip(dtype: torch.dtype, kind: str,
                                                                       tmp_path: Path) -> None:
    schema = ExperienceSchema(a=Field((2,), dtype), r=Field((2, 3), dtype, ragged=True))

    def make() -> ColumnarStorage | ShardedStorage:
        if kind == "sharded":
            return ShardedStorage(schema, 3, ["cpu", "cpu"], ragged_capacity=10)
        if kind == "disk":
            return DiskStorage(schema, 3, ragged_capacity=10, directory=tmp_path)
        return ColumnarStorage(schema, 3, ragged_capacity=10)

    def item(h: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = h % 4
        return (torch.tensor([h, h + 1]) % 5).to(dtype), ((torch.arange(n * 6).reshape(n, 2, 3) + h) % 7).to(dtype)

    st = make()
    for h in range(8):  # the ring wraps twice, the pool several times
        a, r = item(h)
        st.append(ExperienceBatch({"a": a[None], "r": Ragged(r, torch.tensor([r.shape[0]]))}, 1))
    fresh = make()
    fresh.load_state_dict(st.state_dict())
    for s in (st, fresh):
        assert (s.oldest, s.next_handle) == (5, 8)
        g = s.gather(torch.tensor([2, 0, 1, 2]))  # handles 5, 6, 7, 5
        r = g["r"]
        assert isinstance(r, Ragged) and r.values.dtype == dtype and r.values.shape[1:] == (2, 3)
        for j, h in enumerate([5, 6, 7, 5]):
            a, want = item(h)
            assert torch.equal(g.tensor("a")[j], a) and torch.equal(r[j], want), (kind, dtype, h)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (-1,)])
def test_a_field_with_a_dimension_below_one_is_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ConfigurationError, match="non-positive dimension"):
        Field(shape)
    with pytest.raises(ConfigurationError, match="non-positive dimension"):
        Field(shape, ragged=True)


@pytest.mark.parametrize("shape", ["12", "4", (2.5,), ("4",), (True,), (2, 1.0)],
                         ids=["str", "str-one-digit", "float", "str-size", "bool", "float-one"])
def test_a_shape_of_sizes_that_are_no_integers_is_refused(shape: object) -> None:
    """A string was taken digit by digit (``"12"`` became (1, 2)) and a float was truncated (2.5 became 2)."""
    with pytest.raises(ConfigurationError, match="tuple of sizes"):
        Field(shape)  # type: ignore[arg-type]


def test_integer_like_sizes_are_accepted() -> None:
    assert Field((np.int64(3), torch.tensor(2).item())).shape == (3, 2)
    assert Field(torch.Size([4])).shape == (4,)
    assert Field([2, 2]).shape == (2, 2)


def _torch_gathers(dtype: torch.dtype) -> bool:
    try:
        torch.index_select(torch.zeros(2, dtype=torch.int64).view(dtype)[:2], 0, torch.zeros(1, dtype=torch.int64))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_a_dtype_torch_cannot_gather_is_refused_in_the_schema_or_served(dtype: torch.dtype) -> None:
    """Such a field was accepted, its items were stored, and every read then failed with a raw
    NotImplementedError from index_select."""
    if not _torch_gathers(dtype):
        with pytest.raises(ConfigurationError, match="cannot be stored"):
            Field((2,), dtype)
        return
    schema = ExperienceSchema(a=Field((2,), dtype))  # this torch gathers it: then storage must serve it
    st = ColumnarStorage(schema, 4)
    st.append(ExperienceBatch({"a": torch.ones(3, 2, dtype=dtype)}, 3))
    assert st.gather(torch.tensor([2, 0])).tensor("a").tolist() == [[1, 1], [1, 1]]


# -- schema descriptions --------------------------------------------------------------------------------
@pytest.mark.parametrize("desc", [{"a": {"shape": [2], "dtype": "float33"}}, {"a": {"dtype": "float32"}},
                                  {"a": {"shape": 3, "dtype": "float32"}}, {"a": "float32"}, {"a": None}],
                         ids=["unknown-dtype", "no-shape", "shape-not-a-list", "not-a-dict", "none"])
def test_a_damaged_schema_description_is_a_configuration_error(desc: dict) -> None:
    with pytest.raises(ConfigurationError):
        ExperienceSchema.from_dict(desc)


def test_schema_descriptions_round_trip_for_every_storable_dtype() -> None:
    dtypes = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64]
    s = ExperienceSchema({f"f{i}": Field((2, 1), dt, ragged=i % 2 == 1) for i, dt in enumerate(dtypes)})
    assert ExperienceSchema.from_dict(s.to_dict()) == s


# -- batches ------------------------------------------------------------------------------------------
def test_ragged_values_that_are_a_0d_tensor_are_a_schema_error() -> None:
    batch = ExperienceBatch({"tok": Ragged(torch.tensor(5), torch.tensor([1])), "x": torch.zeros(1)}, 1)
    with pytest.raises(SchemaError, match="Field 'tok'"):
        batch.validate(TOK)


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_an_empty_list_for_a_ragged_field_is_an_empty_batch(empty: object) -> None:
    """An empty batch given as lists was refused with 'give ... a list of per-item sequences'."""
    schema = ExperienceSchema(tok=Field((), torch.int64, ragged=True), emb=Field((3,), torch.float16, ragged=True),
                              x=Field((), torch.float32))
    b = ExperienceBatch.checked({"tok": empty, "emb": [], "x": torch.zeros(0)}, schema)
    assert b.batch_size == 0
    emb = b["emb"]
    assert isinstance(emb, Ragged) and emb.values.shape == (0, 3) and emb.values.dtype == torch.float16
    st = ColumnarStorage(schema, 4)
    res = st.append(b)
    assert (res.first, res.count, len(st)) == (0, 0, 0)
    with pytest.raises(SchemaError, match="disagree on the batch size"):  # with items elsewhere: still refused
        ExperienceBatch.checked({"tok": [], "emb": [], "x": torch.zeros(2)}, schema)


# -- checkpoints on every tier -----------------------------------------------------------------------
@pytest.mark.parametrize("src_kind", ["columnar", "sharded", "disk"])
@pytest.mark.parametrize("dst_kind", ["columnar", "sharded", "disk"])
def test_checkpoints_after_wrap_round_trip_on_every_tier(src_kind: str, dst_kind: str, tmp_path: Path) -> None:
    def make(kind: str) -> ColumnarStorage | ShardedStorage:
        if kind == "sharded":
            return ShardedStorage(TOK, 5, ["cpu"] * 2, ragged_capacity=16)
        if kind == "disk":
            return DiskStorage(TOK, 5, ragged_capacity=16, directory=tmp_path)
        return ColumnarStorage(TOK, 5, ragged_capacity=16)

    src = make(src_kind)
    rng = random.Random(7)
    for first in range(0, 23, 3):  # the ring and the pool both wrap
        src.append(_tok_batch(first, [rng.randint(0, 5) for _ in range(3)]))
    src.release(src.oldest + 1)
    want = _live(src)
    dst = make(dst_kind)
    dst.append(_tok_batch(0, [2]))  # whatever it held goes
    dst.load_state_dict(src.state_dict())
    assert (dst.oldest, dst.next_handle) == (src.oldest, src.next_handle) and _live(dst) == want
    again = make(src_kind)
    again.load_state_dict(dst.state_dict())
    assert _live(again) == want
    # both keep going the same way: next handle, contents
    for s in (src, dst):
        res = s.append(_tok_batch(s.next_handle, [4, 0]))
        assert res.first == 24 and _live(s)[25] == [] and _live(s)[24] == _expect(24, 4)


def test_an_empty_checkpoint_after_release_keeps_the_handles() -> None:
    st = ColumnarStorage(TOK, 3, ragged_capacity=8)
    st.append(_tok_batch(0, [3, 3]))
    st.release(2)
    fresh = ColumnarStorage(TOK, 3, ragged_capacity=8)
    fresh.load_state_dict(st.state_dict())
    assert (fresh.oldest, fresh.next_handle) == (2, 2)
    assert fresh.append(_tok_batch(2, [8])).first == 2 and _live(fresh) == {2: _expect(2, 8)}


# -- the disk tier's files -------------------------------------------------------------------------------
def test_disk_field_names_with_a_slash_map_to_files_in_the_directory(tmp_path: Path) -> None:
    """A field named ``obs/rgb`` was a path into a missing subdirectory: a raw RuntimeError from torch."""
    schema = ExperienceSchema({"obs/rgb": Field((2,), torch.uint8), "../x": Field((), torch.float32),
                               "tok": Field((), torch.int64, ragged=True)})
    st = DiskStorage(schema, 4, directory=tmp_path, ragged_capacity=8)
    files = sorted(p.name for p in st.directory.iterdir())
    assert len(files) == 3 and all(p.is_file() for p in st.directory.iterdir()), files
    st.append(ExperienceBatch({"obs/rgb": torch.ones(2, 2, dtype=torch.uint8), "../x": torch.ones(2),
                               "tok": Ragged(torch.arange(3), torch.tensor([1, 2]))}, 2))
    g = st.gather(torch.tensor([1]))
    assert g.tensor("obs/rgb").tolist() == [[1, 1]] and g["tok"].values.tolist() == [1, 2]  # type: ignore[union-attr]
    st.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "close() left files outside its directory"


@pytest.mark.parametrize("rcap", ["8", 2.5, True, 0], ids=["str", "float", "bool", "zero"])
def test_a_bad_ragged_capacity_is_refused_before_any_file_is_made(rcap: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="ragged_capacity must be"):
        DiskStorage(TOK, 4, directory=tmp_path, ragged_capacity=rcap)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [], "a refused disk storage left a directory behind"
    with pytest.raises(ConfigurationError, match="ragged_capacity must be"):
        ColumnarStorage(TOK, 4, ragged_capacity=rcap)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ragged_capacity must be"):
        ShardedStorage(TOK, 4, ["cpu"] * 2, ragged_capacity=rcap)  # type: ignore[arg-type]
    if rcap != 0:  # a pool size that is no int is refused even where no field uses it
        for build in (lambda: ColumnarStorage(ExperienceSchema(x=Field()), 4, ragged_capacity=rcap),
                      lambda: ShardedStorage(ExperienceSchema(x=Field()), 4, ["cpu"] * 2, ragged_capacity=rcap)):
            with pytest.raises(ConfigurationError, match="ragged_capacity must be"):
                build()  # type: ignore[arg-type]


def test_ragged_capacity_takes_numpy_ints_and_is_ignored_without_ragged_fields() -> None:
    assert ColumnarStorage(TOK, 4, ragged_capacity=np.int64(9)).ragged_capacity == 9
    assert ColumnarStorage(ExperienceSchema(x=Field()), 4, ragged_capacity=0).ragged_capacity == 0


def test_the_disk_tier_keeps_serving_when_its_directory_disappears_and_close_is_clean(tmp_path: Path) -> None:
    """The files stay mapped: a storage whose directory was removed underneath still holds its items;
    close() then succeeds, and a second close() is harmless."""
    st = DiskStorage(TOK, 4, directory=tmp_path / "a" / "b", ragged_capacity=16)
    st.append(_tok_batch(0, [3, 0, 5]))
    shutil.rmtree(tmp_path / "a")
    st.append(_tok_batch(3, [2, 2]))  # wraps
    assert _live(st) == {1: [], 2: _expect(2, 5), 3: _expect(3, 2), 4: _expect(4, 2)}
    state = st.state_dict()
    st.close()
    st.close()
    with pytest.raises(ConfigurationError, match="closed"):
        st.state_dict()
    # "reopen": a new disk storage in the (recreated) directory takes the checkpoint
    again = DiskStorage(TOK, 4, directory=tmp_path / "a" / "b", ragged_capacity=16)
    again.load_state_dict(state)
    assert _live(again) == {1: [], 2: _expect(2, 5), 3: _expect(3, 2), 4: _expect(4, 2)}
    d = again.directory
    again.close()
    assert not d.exists() and (tmp_path / "a" / "b").exists()


def test_a_column_file_the_file_system_refuses_is_a_placement_error_and_leaves_nothing(tmp_path: Path) -> None:
    """A field name too long for a file name got a raw RuntimeError from torch and left the directory."""
    schema = ExperienceSchema({"x" * 300: Field((), torch.float32)})
    with pytest.raises(PlacementError, match="cannot map its column files"):
        DiskStorage(schema, 4, directory=tmp_path)
    assert list(tmp_path.iterdir()) == [], "a refused disk storage left a directory behind"


def test_ragged_lengths_that_are_0d_are_a_schema_error() -> None:
    """0-d lengths got a raw IndexError from from_mapping (and so from every ingest)."""
    for build in (lambda d: ExperienceBatch.from_mapping(d), lambda d: ExperienceBatch.checked(d, TOK)):
        with pytest.raises(SchemaError, match="lengths must be a 1-d tensor"):
            build({"tok": Ragged(torch.arange(3), torch.tensor(3)), "x": torch.zeros(1)})
    with pytest.raises(SchemaError, match="Field 'tok'"):
        ExperienceBatch.checked({"tok": Ragged(torch.arange(3), torch.tensor([[3]])), "x": torch.zeros(1)}, TOK)


@pytest.mark.parametrize("ragged", ["no", None, 1.0], ids=["str", "none", "float"])
def test_a_ragged_flag_that_is_no_bool_is_refused(ragged: object) -> None:
    """``Field(ragged="no")`` made a ragged field (a non-empty string is truthy)."""
    with pytest.raises(ConfigurationError, match="ragged must be True or False"):
        Field((), torch.int64, ragged=ragged)  # type: ignore[arg-type]
    assert Field((), ragged=np.bool_(True)).ragged is True


@pytest.mark.parametrize("entry", ["1-tuple", "lists", "0-d-values", "3-tuple"])
@pytest.mark.parametrize("kind", ["columnar", "sharded"])
def test_a_damaged_ragged_checkpoint_entry_is_a_configuration_error_and_changes_nothing(entry: str,
                                                                                        kind: str) -> None:
    """A ragged entry that was no (values, lengths) pair of tensors got a raw IndexError or AttributeError,
    or (a 3-tuple) was loaded with its extra part silently dropped."""
    def make() -> ColumnarStorage | ShardedStorage:
        return ShardedStorage(TOK, 4, ["cpu"] * 2, ragged_capacity=8) if kind == "sharded" else \
            ColumnarStorage(TOK, 4, ragged_capacity=8)

    src = make()
    src.append(_tok_batch(0, [2, 1]))
    good = src.state_dict()
    values, lengths = good["data"]["tok"]
    bad = {"1-tuple": (values,), "lists": (values.tolist(), lengths.tolist()),
           "0-d-values": (torch.tensor(3), lengths), "3-tuple": (values, lengths, lengths)}[entry]
    dst = make()
    dst.append(_tok_batch(0, [5]))
    with pytest.raises(ConfigurationError, match="checkpoint"):
        dst.load_state_dict({**good, "data": {**good["data"], "tok": bad}})
    assert (dst.oldest, dst.next_handle) == (0, 1) and _live(dst) == {0: _expect(0, 5)}
    dst.load_state_dict(good)
    assert _live(dst) == {0: _expect(0, 2), 1: _expect(1, 1)}


@pytest.mark.parametrize("key", ["oldest", "next"])
def test_a_checkpoint_with_a_non_integer_handle_is_refused_and_changes_nothing(key: str) -> None:
    schema = ExperienceSchema(x=Field((), torch.int64))
    src = ColumnarStorage(schema, 8)
    src.append(ExperienceBatch({"x": torch.arange(5)}, 5))
    state = src.state_dict()
    state[key] = state[key] + 0.5  # a float handle would be truncated to another item's
    dst = ColumnarStorage(schema, 8)
    dst.append(ExperienceBatch({"x": torch.arange(10, 13)}, 3))
    with pytest.raises(ConfigurationError, match="not a storage checkpoint"):
        dst.load_state_dict(state)
    assert (dst.oldest, dst.next_handle) == (0, 3)
    assert torch.equal(dst.gather(torch.arange(3))["x"], torch.arange(10, 13)), "a refused load changed the items"


def test_numpy_of_a_bfloat16_field_is_a_schema_error_naming_the_field() -> None:
    batch = ExperienceBatch({"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.ones(2)}, 2)
    with pytest.raises(SchemaError, match="'a'.*no NumPy dtype"):
        batch.numpy()
    assert ExperienceBatch({"b": torch.ones(2)}, 2).numpy()["b"].tolist() == [1.0, 1.0]


def test_a_shape_with_more_elements_than_torch_can_index_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="more than torch can index"):
        Field((10**19,))
    with pytest.raises(ConfigurationError, match="more than torch can index"):
        Field((2**32, 2**32))  # the product overflowed int64 and came out 0 or negative
    assert Field((2**31, 4)).item_numel == 2**33  # large but representable: exact


def test_workload_of_a_huge_observation_is_refused_typed_not_negative() -> None:
    from conduit.placement.cost import Workload

    with pytest.raises(ConfigurationError, match="more than torch can index"):
        Workload.transitions(10**19, capacity=10, batch=2)
    w = Workload.transitions(10**12, capacity=10, batch=2)
    assert min(w.field_bytes) > 0 and w.field_bytes[0] == 4 * 10**12
