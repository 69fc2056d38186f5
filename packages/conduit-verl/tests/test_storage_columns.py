"""Packed columns and the per-field Conduit store behind the TransferQueue backend (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conduit import CapacityError, SchemaError
from conduit_verl.columns import FieldStore, PoolLadder
from conduit_verl.compat import MissingKeyError
from conduit_verl.packing import from_wire, pack_column, select_rows, to_wire, unpack_column
from tensordict import NonTensorStack


def _jagged(lengths: list[int], dtype: torch.dtype = torch.int64, trailing: tuple[int, ...] = ()) -> torch.Tensor:
    parts = [torch.arange(n * (trailing[0] if trailing else 1)).reshape(n, *trailing).to(dtype) + 100 * i
             for i, n in enumerate(lengths)]
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def _same_nested(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.is_nested and b.is_nested and a.dtype == b.dtype
    ua, ub = a.unbind(), b.unbind()
    assert len(ua) == len(ub)
    for x, y in zip(ua, ub, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("trailing", [(), (3,)])
def test_jagged_column_round_trips_packed(trailing: tuple[int, ...]) -> None:
    """A jagged column packs to its elements only and rebuilds the same nested tensor."""
    t = _jagged([3, 0, 5, 1], torch.float32, trailing)
    col = pack_column(t, 4)
    assert col.values.numel() == 9 * (trailing[0] if trailing else 1)  # no padding stored
    back = unpack_column(from_wire(to_wire(col)))
    _same_nested(back, t)


def test_dense_scalar_object_and_bf16_columns() -> None:
    """Dense rows come back jagged (as SimpleStorage returns them), scalars dense, bf16 intact, objects listed."""
    dense = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    back = unpack_column(from_wire(to_wire(pack_column(dense, 4))))
    _same_nested(back, torch.nested.as_nested_tensor(list(dense), layout=torch.jagged))
    sc = torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16)
    out = unpack_column(from_wire(to_wire(pack_column(sc, 3))))
    assert out.dtype == torch.bfloat16 and torch.equal(out, sc)
    assert pack_column(NonTensorStack("a", "b"), 2) == ["a", "b"]
    rows = _jagged([2, 4, 1]).unbind()
    sel = unpack_column(select_rows(pack_column(_jagged([2, 4, 1]), 3), torch.tensor([2, 0])))
    _same_nested(sel, torch.nested.as_nested_tensor([rows[2], rows[0]], layout=torch.jagged))


def _store(items: int = 4, elements: int = 16, **kw: object) -> FieldStore:
    return FieldStore("responses", torch.int64, 2, PoolLadder(items, elements, **kw))  # type: ignore[arg-type]


def test_put_get_replace_clear_in_any_order() -> None:
    """Samples are read back by global index in any order; a put replaces; clears in any order free space."""
    s = _store()
    s.put([10, 11, 12], pack_column(_jagged([2, 3, 1]), 3))
    _same_nested(unpack_column(s.get([12, 10])),
                 torch.nested.as_nested_tensor([_jagged([2, 3, 1]).unbind()[i] for i in (2, 0)], layout=torch.jagged))
    s.put([11], pack_column(torch.nested.as_nested_tensor([torch.tensor([7, 7])], layout=torch.jagged), 1))
    assert s.get([11]).values.tolist() == [7, 7]
    assert s.clear([11, 99]) == 1 and len(s) == 2
    with pytest.raises(MissingKeyError):
        s.get([11])
    s.clear([10, 12])
    assert len(s) == 0 and len(s.storage) == 0  # every slot back


def test_growing_lengths_migrate_without_loss() -> None:
    """Longer sequences than the pool holds move the field to a larger pool (core migrate); every sample survives."""
    s = _store(items=16, elements=8)
    expect = {}
    g = 0
    for length in (2, 3, 8, 20, 40):  # responses grow
        t = torch.nested.as_nested_tensor([torch.full((length,), g + i) for i in range(3)], layout=torch.jagged)
        s.put([g, g + 1, g + 2], pack_column(t, 3))
        for i in range(3):
            expect[g + i] = (length, g + i)
        s.clear([g - 3]) if g else None
        expect.pop(g - 3, None)
        g += 3
    assert {m.kind for m in s.migrations} == {"pool"}, s.migrations  # longer sequences: conduit-core migrate()
    assert all(m.target.elements > m.source.elements or m.target.items > m.source.items for m in s.migrations)
    got = unpack_column(s.get(list(expect)))
    for (gi, (length, val)), row in zip(expect.items(), got.unbind(), strict=True):
        assert row.shape == (length,) and bool((row == val).all()), gi


def test_more_samples_than_slots_reslot_without_loss() -> None:
    """Samples beyond the slot count, and slots held by out-of-order clears, move to more slots; nothing lost."""
    s = _store(items=2, elements=64)
    s.put([0, 1], pack_column(_jagged([1, 2]), 2))
    s.clear([1])  # cleared out of order: slot of 0 still pins the ring
    s.put([2, 3, 4], pack_column(_jagged([3, 1, 2]), 3))
    assert any(m.kind == "slots" for m in s.migrations), s.migrations
    got = unpack_column(s.get([4, 0, 2, 3]))
    want = [_jagged([3, 1, 2]).unbind()[2], _jagged([1, 2]).unbind()[0], *_jagged([3, 1, 2]).unbind()[:2]]
    _same_nested(got, torch.nested.as_nested_tensor(want, layout=torch.jagged))


def test_typed_errors_leave_state_unchanged() -> None:
    """Another dtype, a duplicated index or the storage limit raise typed errors and change nothing."""
    s = _store(items=2, elements=8, max_items=3)
    s.put([0, 1], pack_column(_jagged([1, 2]), 2))
    with pytest.raises(SchemaError):
        s.put([2], pack_column(_jagged([1], torch.float32), 1))
    with pytest.raises(SchemaError):
        s.put([2, 2], pack_column(_jagged([1, 1]), 2))
    with pytest.raises(CapacityError):
        s.put([2, 3], pack_column(_jagged([1, 1]), 2))
    assert len(s) == 2 and s.get([0, 1]).values.tolist() == [0, 100, 101]


def test_unit_state_put_get_clear_and_typed_errors() -> None:
    """A storage unit's state: tensor and object fields, typed errors for unknown fields or samples."""
    from conduit_verl.packing import to_wire
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2))
    unit.put([5, 6], {"responses": to_wire(pack_column(_jagged([3, 1]), 2)), "uid": ["a", "b"]})
    got = unit.get([6, 5], ["responses", "uid"])
    assert from_wire(got["responses"]).values.tolist() == [100, 0, 1, 2] and got["uid"] == ["b", "a"]
    with pytest.raises(MissingKeyError):
        unit.get([5], ["no_such_field"])
    with pytest.raises(MissingKeyError):
        unit.get([7], ["uid"])
    with pytest.raises(SchemaError):  # a tensor field cannot turn into objects; nothing is written
        unit.put([8], {"responses": ["x"], "uid": ["c"]})
    assert unit.get([5], ["uid"])["uid"] == ["a"] and 8 not in unit.fields["responses"]
    assert unit.clear([5, 6]) == 2 and len(unit.fields["responses"]) == 0


def test_unit_state_checkpoint_round_trip(tmp_path: Any) -> None:
    """What a unit saves (TransferQueue's save_checkpoint) comes back exactly on load."""
    from conduit_verl.packing import to_wire
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2))
    unit.put([3, 4, 5], {"responses": to_wire(pack_column(_jagged([2, 5, 1]), 3)), "uid": ["a", "b", "c"]})
    unit.clear([4])
    path = str(tmp_path / "unit.pt")
    assert unit.save(path) == 2
    fresh = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2))
    assert fresh.load(path) == 2
    a, b = unit.get([5, 3], ["responses", "uid"]), fresh.get([5, 3], ["responses", "uid"])
    assert from_wire(a["responses"]).values.tolist() == from_wire(b["responses"]).values.tolist()
    assert b["uid"] == ["c", "a"]
    with pytest.raises(MissingKeyError):
        fresh.get([4], ["uid"])
