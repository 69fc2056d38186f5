"""The verl adapter's data path (packing, columns): typed refusals and exact round trips.

* ``PoolLadder`` (the field store's size -> placement map) refused ``growth <= 1`` but let ``growth=inf`` and
  ``growth=nan`` through its check: it then raised an untyped ``OverflowError`` / ``ValueError`` (``int()`` of an
  infinite or NaN rung size), and ``transfer_queue.backend.Conduit.growth=.inf`` got past the backend's config
  validation as a raw ``OverflowError`` (it catches ``TypeError``/``ValueError``/``RuntimeError`` only). Both are now
  a ``ConfigurationError``.
* Regression cover for what no test checked: variable-length columns of every shape verl puts (empty sequences, one
  very long one, left-padded masks with holes, position ids, jagged tensors with holes or offsets not starting at 0)
  and dtypes (bf16, int32 vs int64 ids, unsigned ids) through pack -> wire -> field store -> unpack; object columns
  (strings, lists, dicts, numpy arrays, None) exactly; and a seeded model check of a field store's
  append/settle/rollback/clear against a plain dict.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from conduit import CapacityError, ConfigurationError
from conduit_verl.columns import FieldStore, PoolLadder
from conduit_verl.packing import PackedColumn, from_wire, pack_column, select_rows, to_wire, unpack_column
from tensordict import NonTensorStack, TensorDict


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _samples(t: Any) -> list[torch.Tensor]:
    return list(t.unbind()) if t.is_nested else list(t)


@pytest.mark.parametrize("growth", [math.inf, math.nan])
def test_a_growth_of_infinity_or_nan_is_a_configuration_error(growth: float) -> None:
    """PoolLadder and the backend's config check refuse a non-finite growth typed (it raised OverflowError/ValueError
    from int() of the next rung's size)."""
    with pytest.raises(ConfigurationError, match="growth"):
        PoolLadder(4, 16, growth=growth)
    from conduit_verl.tq_storage import DEFAULTS, _validated

    with pytest.raises(ConfigurationError):
        _validated(dict(DEFAULTS, growth=growth))
    assert PoolLadder(4, 16, growth=1.5).elements[0] == 16  # a finite growth > 1 still builds


def _columns() -> dict[str, torch.Tensor]:
    """Columns as verl puts them: right- and left-padded, masks with holes, position ids, ragged responses."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1], [0, 0, 0, 0, 0]])
    vals = torch.arange(40, dtype=torch.float32)
    return {
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "input_ids_i32": torch.arange(20, dtype=torch.int32).reshape(4, 5),
        "input_ids_u16": torch.tensor([[65535, 0, 1, 2, 3]] * 4, dtype=torch.uint16),
        "logp_bf16": torch.linspace(-3, 0, 20).reshape(4, 5).bfloat16(),
        "responses": _jagged([torch.arange(0), torch.arange(5000), torch.arange(0), torch.arange(3)]),
        "rows_3d": _jagged([torch.ones(0, 3), torch.arange(6.0).reshape(2, 3), torch.ones(1, 3), torch.ones(4, 3)]),
        "holes": torch.nested.nested_tensor_from_jagged(vals, offsets=torch.tensor([0, 10, 20, 30, 40]),
                                                        lengths=torch.tensor([3, 0, 10, 1])),
        "scores": torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16),
    }


def test_every_verl_column_round_trips_through_wire_store_and_select() -> None:
    """Each column packs, crosses the wire, is stored (tiny pools, so the field migrates), is read back in another
    order and unpacks sample for sample equal in dtype, shape and values."""
    n = 4
    order = [2, 0, 3, 1]
    for name, col in _columns().items():
        packed = pack_column(col, n, name)
        assert isinstance(packed, PackedColumn)
        wire = from_wire(to_wire(packed), copy=True)
        store = FieldStore(name, wire.dtype, int(wire.shapes.shape[1]), PoolLadder(1, 1, growth=1.5))
        store.put([10, 11, 12, 13], wire)
        back = unpack_column(store.get([10 + i for i in order]))
        assert isinstance(back, torch.Tensor), f"{name}: came back as {type(back).__name__}"
        want = [_samples(col)[i] for i in order]
        got = _samples(back)
        assert len(got) == n
        for w, g in zip(want, got, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"{name}: {g} != {w}"
        sel = unpack_column(select_rows(packed, torch.tensor(order)))
        assert all(torch.equal(g, w) for g, w in zip(_samples(sel), want, strict=True)), name


def test_a_jagged_column_whose_offsets_do_not_start_at_zero_packs_only_its_own_elements() -> None:
    vals = torch.arange(20.0)
    t = torch.nested.nested_tensor_from_jagged(vals, offsets=torch.tensor([3, 5, 9]))
    packed = pack_column(t, 2, "x")
    assert isinstance(packed, PackedColumn)
    assert packed.values.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0] and packed.lengths.tolist() == [2, 4]


def test_object_columns_come_back_exactly_as_put() -> None:
    """verl's non-tensor fields (numpy object arrays turned NonTensorStack, as DataProto.to_tensordict does):
    strings, lists, dicts, numpy arrays and None are the same objects' values and types after packing."""
    items: list[Any] = ["a", ["x", 1], {"k": [1, 2]}, None, np.array([1, 2, 3]), np.array(["s", "t"], dtype=object),
                        3.5, ("t", 1)]
    n = len(items)
    td = TensorDict({"f": NonTensorStack(*items)}, batch_size=[n])
    got = pack_column(td.get("f"), n, "f")
    assert isinstance(got, list) and len(got) == n
    for a, b in zip(items, got, strict=True):
        assert type(a) is type(b)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b


def test_a_field_store_matches_a_dict_through_appends_rollbacks_and_clears() -> None:
    """Seeded model check: puts of 0..400-element samples (tiny ladders, so pools and slots migrate), rollbacks of
    appends, replacing puts and out-of-order clears read back exactly what a dict of the settled puts holds."""
    for seed in range(40):
        rng = random.Random(seed)
        max_items = rng.choice([None, 8])
        store = FieldStore("r", torch.int32, 2, PoolLadder(rng.randint(1, 3), rng.randint(1, 6),
                                                          growth=rng.choice([1.2, 2.0]), max_items=max_items))
        model: dict[int, torch.Tensor] = {}
        counter = 0
        for step in range(40):
            if rng.random() < 0.6:
                gis = rng.sample(range(16), rng.randint(1, 4))
                rows = []
                for _ in gis:
                    rows.append((torch.arange(rng.choice([0, 0, 1, 4, 9, 400])) + 1000 * counter).int())
                    counter += 1
                col = pack_column(_jagged(rows), len(gis))
                assert isinstance(col, PackedColumn)
                try:
                    appended = store.append(gis, col)
                except CapacityError:
                    assert max_items is not None and len(set(model) | set(gis)) > max_items, (seed, step)
                    continue
                if rng.random() < 0.4:
                    store.rollback(appended)
                else:
                    store.settle(appended)
                    model.update(zip(gis, rows, strict=True))
            else:
                gis = rng.sample(range(16), rng.randint(1, 5))
                store.clear(gis)
                for g in gis:
                    model.pop(g, None)
            assert len(store) == len(model), (seed, step)
            if model:
                keys = list(model)
                rng.shuffle(keys)
                got = store.get(keys)
                for g, part in zip(keys, torch.split(got.values, got.lengths.tolist()), strict=True):
                    assert torch.equal(part, model[g]), (seed, step, g)
