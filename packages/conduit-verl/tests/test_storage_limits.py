"""The TransferQueue backend's field store and storage unit: max_items is reachable, a rejected put
writes nothing."""

from __future__ import annotations

import pytest
import torch
from conduit import CapacityError, SchemaError
from conduit_verl.columns import FieldStore, PoolLadder
from conduit_verl.packing import from_wire, pack_column, to_wire, unpack_column


def _rows(vals: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(v, dtype=torch.int64) for v in vals], layout=torch.jagged)


def test_max_items_is_reachable_when_slots_must_grow() -> None:
    """With max_items set, a field fills up to max_items; the re-slot's headroom must not exceed the limit."""
    s = FieldStore("responses", torch.int64, 2, PoolLadder(2, 64, max_items=3))
    s.put([0, 1], pack_column(_rows([[0], [1, 1]]), 2))
    s.put([2], pack_column(_rows([[2, 2, 2]]), 1))  # 3 samples <= max_items=3: must fit
    assert len(s) == 3
    assert [r.tolist() for r in unpack_column(s.get([2, 0, 1])).unbind()] == [[2, 2, 2], [0], [1, 1]]
    with pytest.raises(CapacityError):  # the 4th is over the limit
        s.put([3], pack_column(_rows([[3]]), 1))
    assert len(s) == 3


def test_replacing_at_max_items_needs_no_extra_room() -> None:
    """Re-putting stored global indexes at the limit replaces them (no new samples), even when slots re-map."""
    s = FieldStore("responses", torch.int64, 2, PoolLadder(2, 64, max_items=4))
    s.put([0, 1, 2, 3], pack_column(_rows([[0], [1], [2], [3]]), 4))
    s.clear([0])  # out of order would pin; here the ring just turns
    s.put([4], pack_column(_rows([[4]]), 1))
    s.put([1, 2, 3], pack_column(_rows([[11], [22, 22], [33]]), 3))  # 4 samples stored, 0 new
    assert len(s) == 4
    got = [r.tolist() for r in unpack_column(s.get([1, 2, 3, 4])).unbind()]
    assert got == [[11], [22, 22], [33], [4]]


def test_unit_put_with_a_bad_column_writes_no_column() -> None:
    """A put whose second column is rejected leaves the first column's samples as they were."""
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=4, mean_length=4))
    unit.put([0, 1], {"a": to_wire(pack_column(torch.tensor([[1, 1], [2, 2]]), 2)),
                      "b": to_wire(pack_column(torch.tensor([10, 20]), 2))})
    with pytest.raises(SchemaError):  # "b" is int64; a float32 put is refused
        unit.put([1, 2], {"a": to_wire(pack_column(torch.tensor([[7, 7], [8, 8]]), 2)),
                          "b": to_wire(pack_column(torch.tensor([1.0, 2.0]), 2))})
    assert from_wire(unit.get([1], ["a"])["a"]).values.tolist() == [2, 2]
    assert 2 not in unit.fields["a"] and 2 not in unit.fields["b"]
    with pytest.raises(SchemaError):  # an object column of the wrong length: nothing written either
        unit.put([5, 6], {"c": to_wire(pack_column(torch.tensor([5, 6]), 2)), "uid": ["x"]})
    assert "c" not in unit.fields and "uid" not in unit.objects
