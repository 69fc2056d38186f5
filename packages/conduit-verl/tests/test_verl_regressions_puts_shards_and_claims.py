"""conduit-verl regressions: half-stored puts, an empty first shard, a failed bootstrap, a dead client's claims.

* A storage unit stored a put column by column: when a later column failed while being stored (memory running out
  while its field grew), the earlier columns stayed stored, so the unit held half the put.
* An empty first shard built ``MinibatchDelivery``'s buffer with room for one row, so the next shard was refused.
* A ``tq.init`` whose Conduit bootstrap raised left TransferQueue's controller behind with no config, so the next
  ``tq.init`` waited for that config forever.
* A client process that died between unit 0's claim of a new field's kind and its commits left the claim for good.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.requires("verl")

#: a ladder factor so large that a field's second rung (slots or pool) cannot be allocated on any machine: the
#: first migration of a field fails as running out of memory does, for real
UNALLOCATABLE_GROWTH = 1e14

#: how long a test waits for a ``tq.init`` in a thread (a hang fails the test instead of blocking it)
WAIT_S = 120.0


# -- 1. a unit's put is all or nothing ------------------------------------------------------------
def _unit(**cfg: Any) -> Any:
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    return _UnitState({**DEFAULTS, **cfg})


def _wire(t: torch.Tensor) -> Any:
    """A tensor column as a manager ships it to a unit."""
    from conduit_verl.packing import PackedColumn, pack_column, to_wire

    col = pack_column(t, int(t.shape[0]))
    assert isinstance(col, PackedColumn)
    return to_wire(col)


def _read(unit: Any, gis: list[int], fields: list[str]) -> dict[str, Any]:
    """What the unit holds of ``fields`` at ``gis``: tensor fields as lists of per-sample lists, objects as is."""
    from conduit_verl.packing import from_wire, unpack_column

    out: dict[str, Any] = {}
    for name, w in unit.get(gis, fields).items():
        if isinstance(w, dict):
            t = unpack_column(from_wire(w, copy=True))
            out[name] = [r.tolist() for r in t.unbind()]
        else:
            out[name] = list(w)
    return out


def test_a_put_whose_later_column_runs_out_of_memory_stores_no_column() -> None:
    """Field ``a`` fits, field ``b`` must move to a larger pool, whose allocation fails. ``a``'s part of the put (a
    replaced sample and a new one) used to stay stored; now the unit holds exactly what it held before, and goes on
    storing puts that fit."""
    from conduit_verl.compat import MissingKeyError

    unit = _unit(capacity=4, mean_length=4, growth=UNALLOCATABLE_GROWTH)  # 16-element pools at first
    unit.put([0, 1], {"a": _wire(torch.ones(2, 2)), "b": _wire(torch.ones(2, 2)), "uid": ["u0", "u1"]})
    before = _read(unit, [0, 1], ["a", "b", "uid"])
    stats = unit.stats()

    with pytest.raises((MemoryError, RuntimeError), match="(?i)alloc|memory"):
        unit.put([1, 2], {"a": _wire(torch.full((2, 2), 7.0)), "b": _wire(torch.full((2, 12), 7.0)),
                          "uid": ["x1", "x2"]})

    assert _read(unit, [0, 1], ["a", "b", "uid"]) == before, "a failed put changed what the unit held"
    for name in ("a", "b", "uid"):
        with pytest.raises(MissingKeyError):
            unit.get([2], [name])
    after = unit.stats()
    assert after["fields"] == stats["fields"] and after["objects"] == stats["objects"]
    assert after["migrations"] == []

    unit.put([2], {"a": _wire(torch.full((1, 2), 5.0)), "b": _wire(torch.full((1, 3), 5.0)), "uid": ["u2"]})
    assert _read(unit, [0, 1, 2], ["a", "b", "uid"]) == {
        "a": [[1.0, 1.0], [1.0, 1.0], [5.0, 5.0]], "b": [[1.0, 1.0], [1.0, 1.0], [5.0, 5.0, 5.0]],
        "uid": ["u0", "u1", "u2"]}


def _field(growth: float, slots: int = 2) -> Any:
    from conduit_verl.columns import FieldStore, PoolLadder

    return FieldStore("f", torch.float32, 2, PoolLadder(slots, 8, growth=growth))


def _col(rows: list[list[float]]) -> Any:
    from conduit_verl.packing import PackedColumn, pack_column

    col = pack_column(torch.tensor(rows), len(rows))
    assert isinstance(col, PackedColumn)
    return col


def _values(store: Any, gis: list[int]) -> list[list[float]]:
    from conduit_verl.packing import unpack_column

    t = unpack_column(store.get(gis))
    assert isinstance(t, torch.Tensor)
    return [r.tolist() for r in t.unbind()]


def test_a_field_whose_new_slots_cannot_be_allocated_is_left_as_it_was() -> None:
    """A field out of slots re-slots into a larger store. When that store could not be allocated, the field used to
    record the larger rung anyway (its next move then skipped a rung, its stats named a store it did not have)."""
    store = _field(UNALLOCATABLE_GROWTH)
    store.put([0, 1], _col([[1.0], [2.0]]))
    rung = store.rung
    with pytest.raises((MemoryError, RuntimeError), match="(?i)alloc|memory"):
        store.put([2], _col([[3.0]]))
    assert store.rung == rung and store.storage.capacity == rung.items and not store.migrations
    assert _values(store, [0, 1]) == [[1.0], [2.0]] and 2 not in store


def test_a_rolled_back_append_leaves_the_field_as_it_was_after_a_reslot_too() -> None:
    """The two steps of a put: an append (here one that re-slots the field, replacing sample 1) is invisible until
    settled, and a rollback gives back the field as it was: same samples, same store, same rung; the field then
    stores puts as before."""
    store = _field(2.0)
    store.put([0, 1], _col([[1.0], [2.0]]))
    rung, edp = store.rung, store.edp

    part = store.append([1, 2], _col([[20.0], [30.0]]))
    assert store.edp is not edp, "the test needs an append that re-slots"
    store.rollback(part)
    assert store.edp is edp and store.rung == rung and not store.migrations
    assert _values(store, [0, 1]) == [[1.0], [2.0]] and 2 not in store

    store.put([1, 2], _col([[20.0], [30.0]]))
    assert _values(store, [0, 1, 2]) == [[1.0], [20.0], [30.0]] and len(store) == 3


def test_an_append_in_place_is_invisible_until_settled_and_forgotten_on_rollback() -> None:
    store = _field(2.0, slots=4)
    store.put([0], _col([[1.0]]))
    part = store.append([0, 1], _col([[10.0], [11.0]]))  # fits: appended after the newest sample
    assert not store.migrations
    assert _values(store, [0]) == [[1.0]] and 1 not in store
    store.rollback(part)
    assert len(store.storage) == 1
    store.settle(store.append([0, 1], _col([[10.0], [11.0]])))
    assert _values(store, [0, 1]) == [[10.0], [11.0]] and len(store) == 2
    # the field grows as before: a larger pool (a 20-element sample), then more slots
    store.put([2], _col([[float(i) for i in range(20)]]))
    store.put([3, 4, 5], _col([[3.0], [4.0], [5.0]]))
    assert [m.kind for m in store.migrations] == ["pool", "slots"]
    assert _values(store, [0, 1, 2, 3, 4, 5]) == [[10.0], [11.0], [float(i) for i in range(20)], [3.0], [4.0],
                                                  [5.0]]


# -- 2. an empty first shard ------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [False, True])
def test_an_empty_first_shard_does_not_size_the_buffer(prefetch: bool) -> None:
    """The buffer is built from the first shard; an empty first shard built it with room for one row (and a jagged
    column's pool with one element), so the rollout's next shard was refused as too large."""
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=2, epochs=1, seed=0, device="cpu", prefetch=prefetch)
    d.ingest(TensorDict({"x": torch.zeros(0, 3), "seq": torch.zeros(0, 2)}, batch_size=[0]), version=0)
    rows = torch.arange(24.0).reshape(8, 3)
    d.ingest(TensorDict({"x": rows, "seq": torch.ones(8, 2)}, batch_size=[8]), version=0)
    d.seal()
    got = [m["x"].tolist() for m, _ in d.minibatches()]
    assert got == [rows[:4].tolist(), rows[4:].tolist()]
    d.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_an_empty_first_shard_with_a_jagged_column_does_not_size_its_pool(prefetch: bool) -> None:
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", prefetch=prefetch, capacity=4)
    d.ingest(TensorDict({"x": torch.zeros(0)}, batch_size=[0]), version=0)  # its columns do not fix the buffer's
    seq = torch.nested.nested_tensor([torch.arange(float(n)) for n in [3, 5, 2, 4]], layout=torch.jagged)
    d.ingest(TensorDict({"x": torch.arange(4.0), "seq": seq}, batch_size=[4]), version=0)
    d.seal()
    (mb, _), = list(d.minibatches())
    assert [r.tolist() for r in mb["seq"].unbind()] == [torch.arange(float(n)).tolist() for n in [3, 5, 2, 4]]
    d.close()


def test_an_empty_first_shard_with_a_bad_version_is_still_refused() -> None:
    from conduit import ConfigurationError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", prefetch=False)
    with pytest.raises(ConfigurationError, match="policy version"):
        d.ingest(TensorDict({"x": torch.zeros(0)}, batch_size=[0]), version="v1")  # type: ignore[arg-type]
    d.close()



# -- 3. a tq.init whose Conduit bootstrap failed ---------------------------------------------------
class _Init(threading.Thread):
    """``tq.init(conf)`` in a thread, so that a hang fails the test instead of blocking it."""

    def __init__(self, conf: Any) -> None:
        super().__init__(daemon=True)
        self.conf = conf
        self.error: BaseException | None = None

    def run(self) -> None:
        import transfer_queue as tq

        try:
            tq.init(self.conf)
        except BaseException as e:  # noqa: BLE001  (the test inspects it)
            self.error = e

    def finish(self) -> BaseException | None:
        self.start()
        self.join(WAIT_S)
        assert not self.is_alive(), "tq.init hung"
        return self.error


def _conf(**cfg: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({"backend": {"storage_backend": "Conduit", "Conduit": cfg}})


@pytest.mark.parametrize("bad", [{"num_units": 0}, {"unit_num_cpus": 1000}])
def test_tq_init_after_a_failed_conduit_bootstrap_starts_afresh(ray_local: Path, bad: dict[str, Any]) -> None:
    """A refused config (checked before any unit starts, or units reserving more CPUs than the node has) made
    ``tq.init`` raise with its controller left running and no config stored: the next ``tq.init`` then waited for
    that config forever. Now the failed start is undone, and the next ``tq.init`` starts TransferQueue afresh."""
    import transfer_queue as tq
    from conduit import ConfigurationError
    from conduit_verl import tq_storage  # noqa: F401  (registers the Conduit backend)

    error = _Init(_conf(**bad)).finish()
    assert isinstance(error, ConfigurationError), f"the bad config was not refused with a typed error: {error!r}"
    try:
        assert _Init(_conf(num_units=1)).finish() is None
        tq.kv_batch_put(keys=["k0", "k1"], partition_id="p", fields=TensorDict({"v": torch.arange(4.0).reshape(2, 2)},
                                                                              batch_size=[2]), tags=[{}, {}])
        got = tq.kv_batch_get(keys=["k1", "k0"], partition_id="p", select_fields=["v"])["v"]
        assert [r.tolist() for r in got.unbind()] == [[2.0, 3.0], [0.0, 1.0]]
    finally:
        tq.close()


# -- 4. a dead client's claims on unit 0 -----------------------------------------------------------
def _lease_owner() -> Any:
    """A Ray actor (its own process) that hands out leases it owns: Ray loses them when the actor dies."""
    import ray

    @ray.remote(num_cpus=0)
    class LeaseOwner:
        def lease(self, token: str) -> list[Any]:
            return [ray.put(token)]  # (wrapped: a bare ObjectRef would be resolved to its value)

    return LeaseOwner.remote()  # type: ignore[attr-defined]


def test_the_claims_of_a_client_that_died_before_storing_are_given_back(ray_local: Path) -> None:
    """Unit 0 claims a new field's kind for a put before any unit stores it. A client process that died between its
    claim and its commits kept the claim for good, so the field could never be put in another kind although nothing
    held it. Now a claim holds the put's lease: once Ray reports it lost with its owner, the next claim gives the
    dead put's claims back. A claim kept by a put that went on to store (``keep``, sent before its commits) stays,
    and a live client's claim holds."""
    import ray
    from conduit import SchemaError
    from conduit_verl.unit import _owner_died

    unit0 = _unit(num_units=2)
    dead, stored = _lease_owner(), _lease_owner()
    dead_lease = ray.get(dead.lease.remote("dead"))[0]
    stored_lease = ray.get(stored.lease.remote("stored"))[0]
    live_lease = ray.put("other")  # this process's

    assert unit0.claim({"f": ("float32", 1)}, "dead", dead_lease)[0] == ["f"]
    assert unit0.claim({"g": ("float32", 1)}, "stored", stored_lease)[0] == ["g"]
    unit0.keep("stored")
    with pytest.raises(SchemaError, match="a put of it came first"):  # its client is alive: the claim holds
        unit0.claim({"f": (None, 0)}, "other", live_lease)

    ray.kill(dead, no_restart=True)
    ray.kill(stored, no_restart=True)
    deadline = time.monotonic() + WAIT_S
    while not (_owner_died(dead_lease) and _owner_died(stored_lease)):  # Ray reports the deaths within seconds
        assert time.monotonic() < deadline, "Ray never reported the lease owners dead"
        time.sleep(0.1)

    assert unit0.claim({"f": (None, 0)}, "other", live_lease) == (["f"], {"f": (None, 0)}), (
        "the claim of a put whose client died before storing stayed")
    with pytest.raises(SchemaError, match="a put of it came first"):
        unit0.claim({"g": (None, 0)}, "other", live_lease)
    assert unit0.leases == {"other": live_lease}


def test_a_put_over_several_units_keeps_its_claims_and_leaves_no_lease(tq_session: Any) -> None:
    """The manager hands unit 0 its put's lease with the claim, and tells it the claims stay before committing."""
    import ray
    import transfer_queue as tq
    from conduit_verl import tq_storage  # noqa: F401  (registers the Conduit backend)

    tq_session("Conduit", num_units=2)
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=TensorDict({"f": torch.ones(2, 3)}, batch_size=[2]),
                    tags=[{}, {}])
    unit0 = tq.get_client().storage_manager.units[0]

    def claims(actor: Any) -> Any:
        state = actor.state
        return dict(state.claims), {k: sorted(v) for k, v in state.holders.items()}, dict(state.leases)

    got = ray.get(unit0.__ray_call__.remote(claims))
    assert got == ({"f": ("float32", 2)}, {}, {}), got
