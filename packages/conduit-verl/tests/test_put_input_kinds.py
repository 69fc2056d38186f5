"""What kinds of column data a put through the ``Conduit`` TransferQueue backend takes: each comes back exactly
(views of every stride, view bits, every storable dtype, zero-width and jagged columns, Python objects), or is
refused with a ``SchemaError`` that says what to do, before anything of the put is stored."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.filterwarnings("ignore::UserWarning")]


def _complex(n: int, k: int) -> torch.Tensor:
    return torch.complex(torch.arange(n * k, dtype=torch.float32).reshape(n, k),
                         torch.arange(n * k, dtype=torch.float32).reshape(n, k) + 100)


def _rows(v: Any) -> list[Any]:
    """A column's samples as plain Python values (tensors by value, view bits resolved)."""
    if isinstance(v, torch.Tensor):
        rows = v.unbind() if v.is_nested else list(v)
        return [r.resolve_conj().resolve_neg().tolist() for r in rows]
    if isinstance(v, NonTensorStack):
        return v.tolist()
    return list(v)


@pytest.mark.parametrize("column", [
    _complex(3, 2).conj(),
    _complex(3, 1)[:, 0].conj(),
    torch._neg_view(torch.arange(6.0).reshape(3, 2)),  # what z.conj().imag is, contiguous
    torch.nested.nested_tensor_from_jagged(_complex(6, 1)[:, 0].conj(), torch.tensor([0, 1, 3, 6])),
], ids=["conj", "conj-scalars", "negative-bit", "jagged-conj"])
def test_a_column_with_a_view_bit_is_stored_by_value(column: torch.Tensor) -> None:
    """``z.conj()`` is a view with the conjugate bit set; packing shared its memory and the wire format then
    reinterpreted it as bytes, which torch refuses for a view bit: the put failed with a raw RuntimeError."""
    from conduit_verl.packing import from_wire, pack_column, to_wire, unpack_column
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2))
    unit.put([7, 8, 9], {"z": to_wire(pack_column(column, 3))})
    got = unpack_column(from_wire(unit.get([9, 7, 8], ["z"])["z"]))
    assert isinstance(got, torch.Tensor) and got.dtype == column.dtype
    want = _rows(column)
    assert _rows(got) == [want[2], want[0], want[1]], f"the column did not come back by value: {got}"


def _dense() -> torch.Tensor:
    return torch.arange(6.0).reshape(3, 2)


#: columns of 3 samples Conduit cannot store, by name (built on demand)
_BAD: dict[str, Any] = {
    "sparse_coo": lambda: _dense().to_sparse(),
    "sparse_csr": lambda: _dense().to_sparse_csr(),
    "meta": lambda: torch.empty(3, 2, device="meta"),
    "jagged-meta": lambda: torch.nested.as_nested_tensor([torch.ones(i + 1) for i in range(3)],
                                                         layout=torch.jagged).to("meta"),
    "quantized": lambda: torch.quantize_per_tensor(_dense(), 0.5, 0, torch.quint8),
    "sub-tensordict": lambda: TensorDict({"a": torch.arange(3)}, batch_size=[3]),
}


@pytest.mark.parametrize(("kind", "hint"), [("sparse_coo", "to_dense"), ("sparse_csr", "to_dense"),
                                            ("meta", "meta device"), ("jagged-meta", "meta device"),
                                            ("quantized", "dequantize"), ("sub-tensordict", "flatten_keys")])
def test_a_column_without_dense_values_is_refused_typed(kind: str, hint: str) -> None:
    """Sparse, meta and quantized tensors used to fail with raw RuntimeError/NotImplementedError while packing (or
    lose their quantization); a nested TensorDict was stored as objects and then every get of it raised a raw
    RuntimeError ("All tensordicts must be non-tensors"). Each must be a SchemaError naming the field."""
    from conduit import SchemaError
    from conduit_verl.packing import pack_column

    with pytest.raises(SchemaError, match=hint):
        pack_column(_BAD[kind](), 3)  # named in the error: see the put through TransferQueue below


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
def test_a_shard_of_a_dtype_conduit_cannot_gather_goes_to_verls_iterator(mode: str) -> None:
    """A uint16 column (no index_select in torch) is a shard Conduit cannot represent: like the other such shards it
    must go to verl's own iterator, not fail verl's training with the storage's ConfigurationError."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    td = TensorDict({"ids": torch.arange(8).reshape(4, 2).to(torch.uint16), "adv": torch.arange(4.0),
                     "uid": NonTensorStack(*"abcd")}, batch_size=[4])
    ref = [(m["ids"].tolist(), m["adv"].tolist(), list(m["uid"])) for m in delivery._verl_iterator()(td, 2, 2, seed=0)]
    with delivery.forced(mode):  # type: ignore[arg-type]
        got = [(m["ids"].tolist(), m["adv"].tolist(), list(m["uid"])) for m in tu.make_iterator(td, 2, 2, seed=0)]
    assert got == ref and len(ref) == 4


def _good_columns(n: int) -> dict[str, Any]:
    """Columns verl (or a user) may put: every layout of dense tensor, view bits, dtypes, zero widths, jagged
    tensors, objects, a constant."""
    z = _complex(n, 2)
    return {
        "conj": z.conj(), "conj_imag": z.conj().imag,
        "transposed": torch.arange(2.0 * n).reshape(2, n).t(), "strided": torch.arange(4.0 * n).reshape(n, 4)[:, ::2],
        "expanded": torch.arange(3.0).expand(n, 3), "bf16": torch.arange(2.0 * n).reshape(n, 2).bfloat16(),
        "f16": torch.arange(float(n)).half(), "bool": torch.arange(n) % 2 == 0, "u8": torch.arange(n).to(torch.uint8),
        "i32": torch.arange(2 * n).reshape(n, 2).int(), "zero_width": torch.zeros(n, 0),
        "zero_inner": torch.zeros(n, 2, 0),
        "jagged": torch.nested.as_nested_tensor([torch.arange(float(i)) for i in range(n)], layout=torch.jagged),
        "jagged_rows": torch.nested.as_nested_tensor([torch.arange(3.0 * i).reshape(i, 3) for i in range(n)],
                                                     layout=torch.jagged),
        "numpy": np.arange(2 * n).reshape(n, 2),  # TensorDict makes it a tensor
        "strings": NonTensorStack(*[f"s{i}" for i in range(n)]),
        "objects": NonTensorStack(*[{"i": i} if i % 2 else None for i in range(n)]),
        "constant": NonTensorData("c"),
    }


def _held(manager: Any) -> list[tuple[dict[str, int], dict[str, int]]]:
    return [({k: f["samples"] for k, f in s["fields"].items()}, dict(s["objects"])) for s in manager.stats()]


@pytest.mark.slow
def test_every_kind_comes_back_exactly_over_three_units_and_a_refused_put_stores_nothing(tq_session: Any) -> None:
    """One put of every kind, routed over three units (tiny placements, so fields migrate), read back for a reordered
    subset of rows and of fields; then puts carrying one column Conduit cannot store next to good ones are refused
    with a SchemaError and store nothing on any unit."""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit import SchemaError

    tq_session("Conduit", num_units=3, capacity=2, mean_length=1)
    manager = tq.get_client().storage_manager
    n = 6
    cols = _good_columns(n)
    keys = [f"k{i}" for i in range(n)]
    td = TensorDict(cols, batch_size=[n])
    tq.kv_batch_put(keys=keys, partition_id="train", fields=td, tags=[{}] * n)
    order = [4, 1, 5, 0]
    names = [k for k in cols if k != "i32"]
    got = tq.kv_batch_get(keys=[keys[i] for i in order], partition_id="train", select_fields=names)
    assert sorted(got.keys()) == sorted(names)
    for name in names:
        col = td.get(name)
        want = ["c"] * len(order) if isinstance(col, NonTensorData) else [_rows(col)[i] for i in order]
        back = got.get(name)
        assert _rows(back) == want, f"field {name!r} came back as {back}, not {want}"
        if isinstance(col, torch.Tensor):
            assert back.dtype == col.dtype, f"field {name!r}: {back.dtype}, put as {col.dtype}"
    held = _held(manager)
    assert all(set(f.values()) == {2} and set(o.values()) == {2} for f, o in held), f"two samples per unit: {held}"
    small = _good_columns(3)
    for kind, make in _BAD.items():
        fields = TensorDict({"jagged": small["jagged"], "strings": small["strings"], kind: make()}, batch_size=[3])
        with pytest.raises(SchemaError, match=f"'{kind}'"):
            tq.kv_batch_put(keys=["b0", "b1", "b2"], partition_id="train", fields=fields, tags=[{}] * 3)
        assert _held(manager) == held, f"a refused put of a {kind} column stored something"


def test_an_object_field_keeps_max_items_and_refuses_a_repeated_index_like_a_tensor_field() -> None:
    """``max_items`` limits the samples of every field on a unit, and a put naming a global index twice is refused;
    a put of Python-object columns only used to pass both (the last value of a repeated index won silently)."""
    from conduit import CapacityError, SchemaError
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2, max_items=2))
    unit.put([0, 1], {"uid": ["a", "b"]})
    with pytest.raises(CapacityError, match="max_items"):
        unit.put([2], {"uid": ["c"]})
    with pytest.raises(SchemaError, match="twice"):
        unit.put([1, 1], {"uid": ["x", "y"]})
    assert unit.objects["uid"] == {0: "a", 1: "b"}, f"a refused put changed the field: {unit.objects['uid']}"
    unit.put([1], {"uid": ["b2"]})  # replacing a held sample needs no room
    unit.clear([0])
    unit.put([2], {"uid": ["c"]})
    assert unit.get([2, 1], ["uid"])["uid"] == ["c", "b2"]
