"""The ``Conduit`` TransferQueue backend over two storage units: an error a storage unit (a Ray actor) raises reaches
the caller as the Conduit error itself, its own message first.

Ray used to hand it over as ``RayTaskError(SchemaError)``: the type check passed, but ``str(e)`` began with Ray's
remote traceback and the typed error's message (which says what to do) was buried under it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow]


def _held(manager: Any, name: str) -> list[int]:
    """Samples of field ``name`` each unit holds (tensor or object field)."""
    return [s["fields"][name]["samples"] if name in s["fields"] else s["objects"].get(name, 0)
            for s in manager.stats()]


def _key_on_unit_0(client: Any, partition: str) -> str:
    """A new key of ``partition`` whose global index routes to unit 0 of two (``global_index % 2 == 0``)."""
    for key in (f"a{i}" for i in range(8)):
        if int(client.kv_retrieve_meta(keys=[key], partition_id=partition, create=True).global_indexes[0]) % 2 == 0:
            return key
    raise AssertionError(f"no key of partition {partition!r} routed to unit 0")


def _assert_plain(err: BaseException, cls: type, start: str) -> None:
    """``err`` is exactly ``cls`` (no Ray wrapper), says ``start`` first, and keeps the remote error as its cause."""
    import ray

    assert type(err) is cls, f"expected a plain {cls.__name__}, got {type(err).__mro__[:3]}"
    assert not isinstance(err, ray.exceptions.RayTaskError), f"the Ray wrapper reached the caller: {type(err)}"
    assert str(err).startswith(start), f"the Conduit message should come first, got: {str(err)[:300]!r}"
    assert isinstance(err.__cause__, ray.exceptions.RayTaskError), \
        f"the remote traceback should stay reachable as __cause__, got {err.__cause__!r}"


class TestUnitErrorsReachTheCaller:
    """The tests share one TransferQueue over two units (``tq_shared``); each uses its own partition and fields."""

    TQ_BACKEND = ("Conduit", {"num_units": 2, "capacity": 4, "mean_length": 2})

    def test_a_refused_put_raises_the_units_schema_error_itself(self, tq_shared: Any) -> None:
        """A field switching kind is refused by a unit's check: the caller gets that SchemaError, message first, and
        neither unit stores anything."""
        import transfer_queue as tq
        import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
        from conduit import SchemaError

        part, f = tq_shared("train"), tq_shared("f")  # this test's partition and field
        manager = tq.get_client().storage_manager
        tq.kv_batch_put(keys=["a"], partition_id=part, fields=TensorDict({f: torch.tensor([1.5])}, batch_size=[1]),
                        tags=[{}])
        held = _held(manager, f)
        with pytest.raises(SchemaError) as err:
            tq.kv_batch_put(keys=["b", "c"], partition_id=part,
                            fields=TensorDict({f: NonTensorStack("x", "y")}, batch_size=[2]), tags=[{}, {}])
        _assert_plain(err.value, SchemaError, f"Field '{f}' is stored as tensors")
        assert _held(manager, f) == held, f"a refused put stored samples: {held} -> {_held(manager, f)}"

    def test_a_get_of_a_missing_key_raises_the_units_missing_key_error_itself(self, tq_shared: Any) -> None:
        """A get of a global index no unit holds: the caller gets the MissingKeyError, message first, and the get
        changes nothing held."""
        import transfer_queue as tq
        import verl  # noqa: F401
        from conduit_verl.compat import MissingFieldError, MissingKeyError
        from transfer_queue.metadata import BatchMeta

        part, o, nope = tq_shared("train"), tq_shared("o"), tq_shared("nope")  # this test's partition and fields
        client = tq.get_client()
        manager = client.storage_manager
        tq.kv_batch_put(keys=["a", "b"], partition_id=part,
                        fields=TensorDict({o: NonTensorStack("x", "y")}, batch_size=[2]), tags=[{}, {}])
        gis = [int(g) for g in client.kv_retrieve_meta(keys=["a", "b"], partition_id=part).global_indexes]
        held = _held(manager, o)
        assert held == [1, 1], f"global indexes {gis} should sit one on each unit: {held}"
        missing = max(gis) + 1  # an index field o holds no sample of
        meta = BatchMeta(global_indexes=[*gis, missing], partition_ids=[part] * 3, field_schema={o: {}})
        with pytest.raises(MissingKeyError) as err:
            asyncio.run(manager.get_data(meta))
        _assert_plain(err.value, MissingKeyError, f"Field '{o}' holds no sample with global index {missing}")
        meta = BatchMeta(global_indexes=[gis[0]], partition_ids=[part], field_schema={nope: {}})
        with pytest.raises(MissingKeyError) as err:
            asyncio.run(manager.get_data(meta))
        # with several units, one unit cannot tell that no other holds the field: it says which samples it lacks
        _assert_plain(err.value, MissingFieldError, f"Field '{nope}' holds no sample with global index {gis[0]}")
        assert _held(manager, o) == held, f"a failed get changed what is held: {held} -> {_held(manager, o)}"

    def test_a_get_from_a_unit_that_holds_none_of_a_field_names_the_sample_not_a_missing_field(self,
                                                                                               tq_shared: Any) -> None:
        """The field lives on unit 0 only; a get that also reaches unit 1 must not read as if the field did not
        exist."""
        import transfer_queue as tq
        import verl  # noqa: F401
        from conduit_verl.compat import MissingFieldError, MissingKeyError
        from transfer_queue.metadata import BatchMeta

        part, o = tq_shared("train"), tq_shared("o")  # this test's partition and field
        client = tq.get_client()
        manager = client.storage_manager
        key = _key_on_unit_0(client, part)
        gi = int(client.kv_retrieve_meta(keys=[key], partition_id=part).global_indexes[0])
        tq.kv_batch_put(keys=[key], partition_id=part, fields=TensorDict({o: NonTensorStack("x")}, batch_size=[1]),
                        tags=[{}])
        meta = BatchMeta(global_indexes=[gi, 7], partition_ids=[part] * 2, field_schema={o: {}})
        with pytest.raises(MissingKeyError) as err:
            asyncio.run(manager.get_data(meta))
        _assert_plain(err.value, MissingFieldError, f"Field '{o}' holds no sample with global index 7")
        assert "global_index % 2 == 1" in str(err.value), f"the message does not say which unit: {err.value}"
