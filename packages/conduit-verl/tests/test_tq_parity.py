"""Conduit's TransferQueue backend raises what TransferQueue's own storage (SimpleStorage) raises, and a client's cached
claims do not outlive a checkpoint restore by another client.

* A read of a field the storage holds nothing of: SimpleStorage raises a ``RuntimeError`` (only a sample missing from
  a field the unit holds is a ``StorageKeyNotFoundError``); Conduit (one unit, the default) raised a
  ``StorageKeyNotFoundError`` that is no ``RuntimeError``, so code catching TransferQueue's error did not catch it. It
  is now both.
* A client caches the field kinds unit 0 confirmed to its puts and asks no more for them. A restore (by any client)
  drops unit 0's claims, yet other clients kept their cache: such a client's first put of a field after the restore
  skipped the claim, so a racing first put of the field in another kind from another client was not refused, and
  the two units ended up holding the field in two kinds (a later read of both failed). A client now checks unit 0's
  restore generation with every put over several units and asks again after a restore.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

pytestmark = pytest.mark.requires("verl")

WAIT_S = 120.0


def _wire(values: list[float]) -> dict[str, Any]:
    from conduit_verl.packing import PackedColumn, pack_column, to_wire

    col = pack_column(torch.tensor(values).reshape(-1, 1), len(values), "r")
    assert isinstance(col, PackedColumn)
    return {"r": to_wire(col), "uid": [f"u{v}" for v in values]}


def test_a_read_of_a_field_the_unit_never_held_is_a_runtime_error_as_on_simple_storage() -> None:
    """SimpleStorage: unknown field -> RuntimeError (its manager's wrap of the unit's ValueError); a sample missing
    from a held field -> StorageKeyNotFoundError, no RuntimeError. Conduit's unit must raise the same types."""
    from conduit_verl.compat import MissingKeyError
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState
    from transfer_queue import StorageKeyNotFoundError
    from transfer_queue.storage import StorageUnitData

    simple = StorageUnitData()
    simple.put_data({"uid": ["a"]}, [0])
    with pytest.raises(ValueError):  # SimpleStorage's manager turns this into a RuntimeError (no key-not-found marker)
        simple.get_data(["nope"], [0])
    with pytest.raises(StorageKeyNotFoundError):
        simple.get_data(["uid"], [2])

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2, num_units=1))
    unit.put([0], _wire([1.0]))
    with pytest.raises(MissingKeyError) as err:
        unit.get([0], ["nope"])
    assert isinstance(err.value, RuntimeError), (
        f"a read of a field the unit never held raised {type(err.value).__mro__}, no RuntimeError: code catching "
        f"what SimpleStorage raises (RuntimeError) does not catch it")
    for field in ("r", "uid"):  # a sample missing from a held field: key-not-found, as on SimpleStorage
        with pytest.raises(StorageKeyNotFoundError) as missing:
            unit.get([2], [field])
        assert not isinstance(missing.value, RuntimeError), (
            f"a missing sample of held field {field!r} must read as key-not-found only, as on SimpleStorage")


def test_a_read_through_the_manager_of_a_never_held_field_is_caught_as_simple_storages_error(tq_session: Any) -> None:
    """Through TransferQueue's client and the Conduit manager (Ray actors): ``except RuntimeError`` catches a read of a
    field no unit holds; the message still names the field."""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from transfer_queue.metadata import BatchMeta

    tq_session("Conduit", num_units=1, capacity=4, mean_length=2)
    manager = tq.get_client().storage_manager
    tq.kv_batch_put(keys=["a", "b"], partition_id="train",
                    fields=TensorDict({"o": NonTensorStack("x", "y")}, batch_size=[2]), tags=[{}, {}])
    meta = BatchMeta(global_indexes=[0, 1], partition_ids=["train"] * 2, field_schema={"nope": {}})
    with pytest.raises(Exception) as err:  # noqa: PT011 - the type is what is checked below
        asyncio.run(manager.get_data(meta))
    assert isinstance(err.value, RuntimeError), (
        f"a read of a field no unit holds raised {type(err.value).__mro__}, no RuntimeError: code catching what "
        f"SimpleStorage raises there does not catch it")
    assert "'nope'" in str(err.value), f"the error does not name the field: {err.value}"


def _on_unit(client: Any, partition: str, prefix: str, rank: int, units: int = 2) -> Any:
    """Metadata of one new key whose global index routes to unit ``rank``."""
    for i in range(4 * units):
        meta = client.kv_retrieve_meta(keys=[f"{prefix}{i}"], partition_id=partition, create=True)
        if int(meta.global_indexes[0]) % units == rank:
            return meta
    raise AssertionError(f"no key of {prefix!r} routed to unit {rank}")


class _HeldCommits:
    """A manager's unit handles whose ``commit`` waits until :meth:`open` (``arrived`` is set when one got there), so
    a put is held after unit 0 answered its claim and before it stores; every other call goes straight through."""

    def __init__(self, manager: Any) -> None:
        self.manager, self.real = manager, list(manager.units)
        self.arrived = asyncio.Event()
        self.go = asyncio.Event()
        outer = self

        class Handle:
            def __init__(self, real: Any) -> None:
                self.real = real

            def __getattr__(self, name: str) -> Any:
                method = getattr(self.real, name)
                if name != "commit":
                    return method

                class Held:
                    @staticmethod
                    def remote(*args: Any, **kwargs: Any) -> Any:
                        async def held() -> Any:
                            outer.arrived.set()
                            await outer.go.wait()
                            return await method.remote(*args, **kwargs)

                        return held()

                return Held()

        manager.units = [Handle(u) for u in self.real]

    def restore(self) -> None:
        self.manager.units = self.real


def _field_kinds(manager: Any, tmp: Path, field: str) -> dict[int, str | None]:
    """How each unit holds ``field``: its dtype, "objects", or None (not at all), read from the unit's checkpoint."""
    import ray

    out: dict[int, str | None] = {}
    for rank, unit in enumerate(manager.units):
        path = tmp / f"kinds-{rank}.pt"
        ray.get(unit.save.remote(str(path)))
        saved = torch.load(path, weights_only=False)
        if field in saved["fields"] and saved["fields"][field]["gis"]:
            out[rank] = saved["fields"][field]["dtype"]
        elif saved["objects"].get(field):
            out[rank] = "objects"
        else:
            out[rank] = None
    return out


def test_cached_claims_of_another_client_do_not_outlive_a_restore(tq_session: Any, tmp_path: Path) -> None:
    """Client B stores field "f" as float32 (caching unit 0's claim); client A restores a checkpoint without "f" (unit
    0 forgets every claim). A's first put of "f" as Python objects (to unit 0) claims it and is held before storing;
    B's put of "f" as float32 (to unit 1) must then be refused (SchemaError), and "f" held in one kind only."""
    import transfer_queue as tq
    import verl  # noqa: F401
    from conduit import SchemaError
    from conduit_verl.tq_storage import ConduitStorageManager
    from transfer_queue.storage.managers.base import StorageManager

    tq_session("Conduit", num_units=2, capacity=4, mean_length=2)
    client = tq.get_client()
    a = client.storage_manager
    b = ConduitStorageManager(a.controller_info, a.config)  # a second client of the same units
    try:
        ckpt = tmp_path / "empty"
        asyncio.run(a.save_checkpoint(str(ckpt)))  # nothing held: "f" is not in it
        floats = lambda v: TensorDict({"f": torch.tensor([[v]])}, batch_size=[1])  # noqa: E731
        asyncio.run(b.put_data(floats(1.0), _on_unit(client, "p", "pre", 1)))
        assert "f" in b._claimed, "client B should have cached unit 0's claim of 'f' (the scenario needs it)"
        asyncio.run(a.load_checkpoint(str(ckpt)))
        assert _field_kinds(a, tmp_path, "f") == {0: None, 1: None}, "the restore should have dropped 'f'"

        meta_a, meta_b = _on_unit(client, "p", "a", 0), _on_unit(client, "p", "b", 1)

        async def race() -> tuple[BaseException | None, BaseException | None]:
            held = _HeldCommits(a)
            try:
                put_a = asyncio.ensure_future(a.put_data(TensorDict({"f": NonTensorStack("text")}, batch_size=[1]),
                                                         meta_a))
                await asyncio.wait_for(held.arrived.wait(), WAIT_S)  # A claimed "f" as objects, not stored yet
                b_error: BaseException | None = None
                try:
                    await asyncio.wait_for(b.put_data(floats(2.0), meta_b), WAIT_S)
                except SchemaError as e:
                    b_error = e
                held.go.set()
                a_error: BaseException | None = None
                try:
                    await asyncio.wait_for(put_a, WAIT_S)
                except Exception as e:  # noqa: BLE001 - reported by the assertion
                    a_error = e
                return a_error, b_error
            finally:
                held.restore()

        a_error, b_error = asyncio.run(race())
        kinds = _field_kinds(a, tmp_path, "f")
        assert a_error is None, f"put A, which claimed 'f' first after the restore, was refused: {a_error!r}"
        assert isinstance(b_error, SchemaError), (
            f"client B's put of 'f' as float32 passed while A's put of it as objects held unit 0's claim (B trusted "
            f"claims cached before the restore); 'f' is now held as {kinds}")
        assert kinds == {0: "objects", 1: None}, f"'f' should be held by A's put alone, as objects: {kinds}"
    finally:
        StorageManager.close(b)  # its sockets only: the units belong to the session
