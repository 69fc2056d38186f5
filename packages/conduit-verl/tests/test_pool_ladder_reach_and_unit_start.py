"""The verl adapter: the pool ladder's reach and the units' start at ``tq.init``.

* A ``growth`` close to 1 (any value > 1 passes the config check) left the ladder 48 rungs short of what a
  field could need: a put that passed every check then failed half-written (its first columns stored, the next
  refused with a ``CapacityError`` that blamed ``max_items=None``).
* Units that together reserve more CPUs (``unit_num_cpus``) than their node has made ``tq.init`` wait forever
  (one unit beyond the node: an untyped Ray error); units held back by CPUs other actors hold did too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import CapacityError, ConfigurationError
from conduit_verl.columns import FieldStore, PoolLadder
from conduit_verl.packing import from_wire, pack_column, to_wire, unpack_column
from conduit_verl.tq_storage import DEFAULTS
from conduit_verl.unit import _UnitState


def _wire(t: torch.Tensor) -> dict[str, Any]:
    return to_wire(pack_column(t, int(t.shape[0])))  # type: ignore[arg-type]


def test_a_ladder_of_small_growth_stores_a_put_whole_and_reads_it_back() -> None:
    st = _UnitState({**DEFAULTS, "capacity": 2, "mean_length": 1, "growth": 1.01})
    small = torch.arange(2, dtype=torch.float32)[:, None]
    long = torch.arange(2000, dtype=torch.float32).reshape(2, 1000)  # past the 48th rung's pool (about 100 elements)
    st.put([0, 1], {"a": _wire(small), "b": _wire(long)})
    got = st.get([1, 0], ["a", "b"])
    assert [r.tolist() for r in unpack_column(from_wire(got["a"])).unbind()] == [[1.0], [0.0]]
    assert [r.tolist() for r in unpack_column(from_wire(got["b"])).unbind()] == [long[1].tolist(), long[0].tolist()]
    many = torch.arange(300, dtype=torch.int64)  # more samples than the 48th rung's slots (about 50)
    st.put(list(range(10, 310)), {"c": _wire(many)})
    assert unpack_column(from_wire(st.get(list(range(10, 310)), ["c"])["c"])).tolist() == many.tolist()


def test_a_small_growth_ladder_reaches_max_items_and_refuses_past_it_unchanged() -> None:
    ladder = PoolLadder(2, 4, growth=1.01, max_items=500)
    assert ladder.elements[ladder.pool(10_000)] >= 10_000
    assert ladder.items[ladder.slots(500)] == 500
    with pytest.raises(CapacityError, match="max_items=500"):
        ladder.slots(501)
    store = FieldStore("responses", torch.int64, 2, ladder)
    for start in range(0, 500, 100):
        store.put(list(range(start, start + 100)), pack_column(torch.arange(start, start + 100)[:, None], 100))  # type: ignore[arg-type]
    with pytest.raises(CapacityError, match="max_items=500"):
        store.put([500], pack_column(torch.tensor([[7]]), 1))  # type: ignore[arg-type]
    assert len(store) == 500 and 500 not in store
    col = store.get(list(range(500)))
    assert col.values.tolist() == list(range(500)) and col.lengths.tolist() == [1] * 500


def _unit_names() -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("ConduitStorageUnit#")]


@pytest.mark.requires("verl")
@pytest.mark.slow
@pytest.mark.parametrize("num_units", [1, 2])
def test_units_that_could_never_start_are_refused_before_any_starts(ray_local: Path, num_units: int) -> None:
    """One node (the local Ray): units reserving more CPUs together than it has. Before: one unit raised Ray's
    ActorUnschedulableError, two units left tq.init waiting for the second forever."""
    import ray
    from conduit_verl.tq_storage import bootstrap
    from omegaconf import OmegaConf

    total = ray.cluster_resources()["CPU"]
    cpus = total + 1 if num_units == 1 else total // 2 + 1
    conf = OmegaConf.create({"backend": {"storage_backend": "Conduit",
                                         "Conduit": {"num_units": num_units, "unit_num_cpus": cpus}}})
    before = _unit_names()
    with pytest.raises(ConfigurationError, match="could never all start; lower unit_num_cpus"):
        bootstrap(conf)
    assert "_run_id" not in conf.backend.Conduit, "a refused config was filled in anyway"
    assert _unit_names() == before, "a unit was started for a refused config"


@pytest.mark.requires("verl")
@pytest.mark.slow
def test_units_held_back_past_the_start_bound_are_refused_and_stopped(ray_local: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CPU of the node held by another actor: the unit waits for one. Before: tq.init waited forever (and a
    unit left behind would start once a CPU came free)."""
    import ray
    from conduit_verl import tq_storage
    from omegaconf import OmegaConf

    @ray.remote
    class Holder:
        def ready(self) -> bool:
            return True

    holder = Holder.options(num_cpus=ray.cluster_resources()["CPU"]).remote()  # type: ignore[attr-defined]
    ray.get(holder.ready.remote())
    monkeypatch.setattr(tq_storage, "UNIT_START_TIMEOUT_S", 1.0)
    conf = OmegaConf.create({"backend": {"storage_backend": "Conduit", "Conduit": {"unit_num_cpus": 1}}})
    try:
        with pytest.raises(ConfigurationError, match="did not start within 1 s"):
            tq_storage.bootstrap(conf)
    finally:
        ray.kill(holder)  # the CPUs come free: a unit left pending would start now
    name = tq_storage.unit_name(conf.backend.Conduit._run_id, 0)
    assert conf.backend.Conduit._run_id not in tq_storage._OWNED_RUNS
    try:
        unit = ray.get_actor(name, namespace=tq_storage.NAMESPACE)
    except ValueError:  # gone, name and all
        return
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(unit.stats.remote())


def _unsigned_columns(start: Any, backend: str, **cfg: Any) -> dict[str, tuple[Any, ...]]:
    """Put uint16 token ids (jagged and dense) and a uint32 scalar column; read a reordered subset back."""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from tensordict import TensorDict

    def u(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(dtype)

    seqs = [u([65535, 1], torch.uint16), u([7], torch.uint16), u([40000, 2, 3], torch.uint16)]
    start(backend, **cfg)
    tq.kv_batch_put(keys=["a", "b", "c"], partition_id="train", tags=[{}, {}, {}], fields=TensorDict({
        "ids": torch.nested.as_nested_tensor(seqs, layout=torch.jagged),
        "pair": u([65535, 0, 1, 2, 3, 60000], torch.uint16).reshape(3, 2),
        "count": u([1, 2**32 - 1, 5], torch.uint32),
    }, batch_size=[3]))
    got = tq.kv_batch_get(keys=["c", "a"], partition_id="train", select_fields=["ids", "pair", "count"])
    out = {k: (str(v.dtype), v.is_nested, [r.to(torch.int64).tolist() for r in v.unbind()]) for k, v in got.items()}
    tq.close()
    return out


@pytest.mark.requires("verl")
@pytest.mark.slow
def test_unsigned_token_ids_come_back_as_simple_storage_returns_them(tq_session: Any) -> None:
    """uint16 token ids (half of int32's memory) and uint32 counters: SimpleStorage stores them; the Conduit units
    refused the field (conduit-core cannot gather rows of these dtypes), so the put failed."""
    want = _unsigned_columns(tq_session, "SimpleStorage")
    assert want["ids"] == ("torch.uint16", True, [[40000, 2, 3], [65535, 1]])
    assert _unsigned_columns(tq_session, "Conduit", num_units=2, capacity=2, mean_length=2) == want


@pytest.mark.parametrize("field", ["objects", "tensors"])
def test_a_restore_past_max_items_is_refused_and_changes_nothing(tmp_path: Path, field: str) -> None:
    """A checkpoint holding more samples of a field than the restoring storage's ``max_items`` is refused before
    anything changes, for a field of Python objects as for a tensor field (an object field used to be restored
    over the limit, after which every put to it was refused)."""
    saved = _UnitState({**DEFAULTS})
    column: Any = [{"uid": i} for i in range(3)] if field == "objects" else _wire(torch.arange(3)[:, None])
    saved.put([0, 1, 2], {"f": column})
    path = str(tmp_path / "unit0.pt")
    saved.save(path)
    small = _UnitState({**DEFAULTS, "max_items": 2})
    small.put([7], {"kept": _wire(torch.tensor([[5]]))})
    with pytest.raises(CapacityError, match="max_items=2"):
        small.load(path)
    assert small.staged is None and set(small.fields) | set(small.objects) == {"kept"}
    assert [r.tolist() for r in unpack_column(from_wire(small.get([7], ["kept"])["kept"])).unbind()] == [[5]]
    roomy = _UnitState({**DEFAULTS, "max_items": 3})
    assert roomy.load(path) == (0 if field == "objects" else 3)
    got = roomy.get([2, 0], ["f"])["f"]
    if field == "objects":
        assert got == [{"uid": 2}, {"uid": 0}]
    else:
        assert [r.tolist() for r in unpack_column(from_wire(got)).unbind()] == [[2], [0]]
