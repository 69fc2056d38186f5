"""The ``Conduit`` TransferQueue backend over two storage units: a field keeps one kind (tensor or Python
objects), one dtype and one rank across every unit, not only within each.

Samples are routed by ``global_index % num_units``, so two puts of one key each land on different units. Each
unit used to check only what it held itself: a field stored as tensors on one unit and as objects (or another
dtype) on the other was accepted, and a get spanning both raised a raw ``TypeError`` (or silently cast)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def _row(value: Any, name: str = "f") -> TensorDict:
    """One sample with the single column ``name`` = ``value`` (a tensor column or a NonTensorStack)."""
    return TensorDict({name: value}, batch_size=[1])


def _held(manager: Any, name: str) -> list[int]:
    """Samples of field ``name`` each unit holds (tensor or object field)."""
    out = []
    for s in manager.stats():
        if name in s["fields"]:
            out.append(s["fields"][name]["samples"])
        else:
            out.append(s["objects"].get(name, 0))
    return out


class TestOneKindAcrossUnits:
    """The tests share one TransferQueue over two units (``tq_shared``); each uses its own partition and fields."""

    TQ_BACKEND = ("Conduit", {"num_units": 2, "capacity": 4, "mean_length": 2})

    @pytest.mark.parametrize(("first", "second", "match"), [
        (torch.tensor([1.5]), NonTensorStack("text"), "tensor"),
        (NonTensorStack(["a", "list"]), torch.tensor([[1, 2]]), "tensor"),
        (torch.tensor([1.5]), torch.tensor([7]), "float32"),
        (torch.tensor([1.5]), torch.tensor([[1.0, 2.0]]), "rank"),
    ], ids=["tensor-then-object", "object-then-tensor", "other-dtype", "higher-rank"])
    def test_a_put_that_disagrees_with_another_unit_is_refused(self, tq_shared: Any, first: Any, second: Any,
                                                               match: str) -> None:
        """The second put lands on the other unit only; it must be refused with a SchemaError that says what the field
        holds, store nothing, and leave the field readable across both units once a put of the right kind follows."""
        import transfer_queue as tq
        import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
        from conduit import SchemaError

        part, f = tq_shared("train"), tq_shared("f")  # this test's partition and field
        manager = tq.get_client().storage_manager
        tq.kv_batch_put(keys=["a"], partition_id=part, fields=_row(first, f), tags=[{}])
        held = _held(manager, f)
        assert sorted(held) == [0, 1], f"the first sample should sit on one unit: {held}"
        with pytest.raises(SchemaError, match=match) as err:
            tq.kv_batch_put(keys=["b"], partition_id=part, fields=_row(second, f), tags=[{}])
        assert "another field name" in str(err.value), f"the message should say what to do: {err.value}"
        after = _held(manager, f)
        assert after == held, f"a refused put stored its sample: {held} -> {after}"
        tq.kv_batch_put(keys=["b"], partition_id=part, fields=_row(first, f), tags=[{}])  # the field's kind: accepted
        assert sorted(_held(manager, f)) == [1, 1], "the two samples should sit on different units"
        got = tq.kv_batch_get(keys=["b", "a"], partition_id=part, select_fields=[f])[f]
        if isinstance(first, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == first.dtype and got.tolist() == [*first.tolist()] * 2
        else:
            assert list(got) == [*first.tolist()] * 2

    def test_a_get_over_units_holding_different_kinds_or_dtypes_is_a_schema_error(self, tq_shared: Any) -> None:
        """Should two units still come to hold a field in different kinds or dtypes (two clients' first puts racing past
        each other's checks), a get spanning them must raise a SchemaError naming the field, not a raw TypeError, a
        column of garbage or a silently cast column, whichever unit answers first."""
        import asyncio

        import ray
        import transfer_queue as tq
        import verl  # noqa: F401
        from conduit import SchemaError
        from conduit_verl.packing import pack_column, to_wire
        from transfer_queue.metadata import BatchMeta

        g, h = tq_shared("g"), tq_shared("h")  # this test's fields
        manager = tq.get_client().storage_manager
        # what two racing first puts leave behind: unit 0 holds g as tensors, unit 1 as objects
        ray.get(manager.units[0].put.remote([0], {g: to_wire(pack_column(torch.tensor([2.0]), 1))}))
        ray.get(manager.units[1].put.remote([1], {g: ["text"]}))
        # and h as float32 on unit 0, int64 on unit 1 (a get used to cast unit 1's samples silently)
        ray.get(manager.units[0].put.remote([0], {h: to_wire(pack_column(torch.tensor([0.5]), 1))}))
        ray.get(manager.units[1].put.remote([1], {h: to_wire(pack_column(torch.tensor([3]), 1))}))
        for name, gis in [(g, [0, 1]), (g, [1, 0]), (h, [0, 1]), (h, [1, 0])]:
            meta = BatchMeta(global_indexes=gis, partition_ids=["train"] * 2, field_schema={name: {}})
            with pytest.raises(SchemaError, match=f"'{name}'") as err:
                asyncio.run(manager.get_data(meta))
            assert "another field name" in str(err.value), f"the message should say what to do: {err.value}"
