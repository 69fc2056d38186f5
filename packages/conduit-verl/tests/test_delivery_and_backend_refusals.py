"""verl adapter edge cases: delivery buffer lifetimes under prefetch, empty shards, column mismatches, the replay
buffer's staleness plug, zero-size dimensions, backend configuration and checkpoints of another num_units."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

pytestmark = pytest.mark.requires("verl")


def _dense_shard(n: int) -> TensorDict:
    return TensorDict({"rows": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2),
                       "adv": torch.arange(n, dtype=torch.float32),
                       "uid": NonTensorStack(*[f"u{i}" for i in range(n)])}, batch_size=[n])


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_minibatch_stays_valid_until_the_third_one_after_it(prefetch: bool) -> None:
    """MinibatchDelivery documents dense columns as valid until the third minibatch after them. With prefetch the
    staging of minibatch k+3 used to overwrite minibatch k's buffer as soon as k+2 was handed out."""
    from conduit_verl.delivery import MinibatchDelivery

    n = 12
    d = MinibatchDelivery(num_minibatches=6, epochs=1, seed=0, device="cpu", prefetch=prefetch)
    td = _dense_shard(n)
    d.ingest(td, version=0)
    d.seal()
    held: list[TensorDict] = []
    for i, (m, _info) in enumerate(d.minibatches()):
        held.append(m)
        pending = d.scheduler._pending
        if pending is not None:
            pending.wait()  # the staging of the next minibatch has finished writing
        for k in range(max(0, i - 2), i + 1):  # this one and the two before it must be intact
            want = td["rows"][2 * k:2 * k + 2].tolist()
            assert held[k]["rows"].tolist() == want, (
                f"minibatch {k} was overwritten while minibatch {i} is out (prefetch={prefetch})")
    d.close()
    assert len(held) == 6


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
def test_an_empty_shard_yields_nothing_like_verl(mode: str) -> None:
    """verl's iterator over a 0-row shard yields no minibatch; Conduit's hook raised a ConfigurationError
    (num_minibatches 0) instead."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    td = TensorDict({"rows": torch.zeros(0, 2), "adv": torch.zeros(0)}, batch_size=[0])
    ref = list(delivery._verl_iterator()(td, 2, 2, seed=0))
    with delivery.forced(mode):  # type: ignore[arg-type]
        got = list(tu.make_iterator(td, 2, 2, seed=0))
    assert got == ref == []


def _buffer(on_stale: str, strategy: str = "drop", threshold: int = 2) -> Any:
    from conduit_verl.replay import ConduitReplayBuffer

    return ConduitReplayBuffer(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=threshold,
                               max_off_policy_strategy=strategy, sampler_kwargs={"on_stale": on_stale},
                               refill_fn=lambda k: None)


def test_on_stale_wait_holds_sampling_for_stale_in_flight_groups() -> None:
    """sampler_kwargs.on_stale=wait with verl's default strategy (drop) must behave as verl's dropless wait:
    hold sampling while an in-flight group has reached the threshold. It used to keep verl's strategy at drop,
    so nothing waited, nothing was evicted, and verl's own span assertion fired on the stale group."""
    buf = _buffer("wait", strategy="drop", threshold=2)
    buf.running_keys["train"] = {"late"}
    buf.prompt_global_steps["train"] = {"late": 3, "done": 5}
    buf.finished_keys["train"] = {"done"}
    assert buf.max_off_policy_strategy == "wait"
    assert buf._has_enough_samples(4, "train", 1, {"done"}) is False, "a stale in-flight group must hold sampling"
    assert buf._has_enough_samples(3, "train", 1, {"done"}) is True
    drop = _buffer("drop", strategy="wait")
    assert drop.max_off_policy_strategy == "drop" and drop._has_enough_samples(4, "train", 1, {"done"}) is True


def test_stale_groups_are_counted_once_when_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    """conduit/stale_groups counts stale groups dropped. verl's separate-async trainer calls get_sampleable_count
    (which only looks) several times per step; each call used to add the same stale groups again."""
    import verl.trainer.ppo.v1.replay_buffer as rb

    listing = {"train": {"old": {"is_prompt": True, "global_steps": 1, "status": "finished"},
                         "new": {"is_prompt": True, "global_steps": 5, "status": "finished"},
                         "old_0_0": {"status": "success"}, "new_0_0": {"status": "success"}}}
    cleared: list[list[str]] = []

    def kv_list() -> dict[str, dict[str, dict[str, Any]]]:  # TransferQueue's listing, as verl reads it
        return {p: {k: dict(t) for k, t in items.items()} for p, items in listing.items()}

    def kv_clear(*, partition_id: str, keys: list[str]) -> None:
        cleared.append(sorted(keys))
        for k in keys:
            listing[partition_id].pop(k, None)

    monkeypatch.setattr(rb.tq, "kv_list", kv_list)
    monkeypatch.setattr(rb.tq, "kv_clear", kv_clear)
    buf = _buffer("drop", threshold=2)
    assert buf.get_sampleable_count(5, "train") == 1
    assert buf.get_sampleable_count(5, "train") == 1
    assert buf.stale_groups == 0, f"looking at the stale groups counted them: {buf.stale_groups}"
    keys, _ = buf.wait_for_sampleable(5, "train", 1)
    assert keys == {"new"} and cleared == [["old", "old_0_0"]]
    assert buf.stale_groups == 1


@pytest.mark.parametrize("column", [
    torch.zeros(3, 2, 0, dtype=torch.bfloat16),
    torch.nested.as_nested_tensor([torch.zeros(2, 0), torch.zeros(1, 0)], layout=torch.jagged),
], ids=["dense", "jagged"])
def test_a_zero_size_trailing_dimension_reads_back(column: torch.Tensor) -> None:
    """A column whose samples have a zero-size trailing dimension (SimpleStorage returns it as a jagged tensor)
    was stored but every read raised a raw RuntimeError (an ambiguous view(-1, 0))."""
    from conduit_verl.packing import from_wire, pack_column, to_wire, unpack_column
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    rows = column.unbind()
    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2))
    gis = list(range(10, 10 + len(rows)))
    unit.put(gis, {"f": to_wire(pack_column(column, len(rows)))})
    got = unpack_column(from_wire(unit.get(gis[::-1], ["f"])["f"]))
    assert isinstance(got, torch.Tensor) and got.is_nested and got.dtype == column.dtype
    assert [tuple(r.shape) for r in got.unbind()] == [tuple(r.shape) for r in rows[::-1]]


def test_a_checkpoint_of_another_num_units_is_refused(tmp_path: Any) -> None:
    """Samples sit on unit ``global_index % num_units``: a checkpoint restored with another num_units used to
    load silently (extra unit files ignored, samples on the wrong units, reads failing later)."""
    from conduit import SchemaError
    from conduit_verl.packing import pack_column, to_wire
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    three = _UnitState(dict(DEFAULTS, num_units=3, capacity=2, mean_length=2))
    three.put([0, 3], {"x": to_wire(pack_column(torch.tensor([1.0, 2.0]), 2)), "uid": ["a", "b"]})
    path = str(tmp_path / "conduit_unit_0.pt")
    three.save(path)
    two = _UnitState(dict(DEFAULTS, num_units=2, capacity=2, mean_length=2))
    two.put([4], {"uid": ["kept"]})
    with pytest.raises(SchemaError, match="num_units=3"):
        two.load(path)
    assert two.get([4], ["uid"])["uid"] == ["kept"] and "x" not in two.fields  # nothing changed
    same = _UnitState(dict(DEFAULTS, num_units=3, capacity=2, mean_length=2))
    assert same.load(path) == 2 and same.get([3, 0], ["uid"])["uid"] == ["b", "a"]


@pytest.mark.parametrize("second", [["x", "t"], ["x", "uid"], ["x", "uid", "t", "y"], ["xj", "uid", "t"]],
                         ids=["no-objects", "no-constant", "extra-column", "dense-became-jagged"])
def test_a_shard_with_other_columns_is_a_schema_error(second: list[str]) -> None:
    """MinibatchDelivery.ingest documents SchemaError for a shard whose columns differ from the first one's. A
    missing object column raised a raw AttributeError, a missing constant was accepted (and failed at delivery),
    an extra column was silently dropped, a dense column turned jagged raised AttributeError."""
    from conduit import SchemaError
    from conduit_verl.delivery import MinibatchDelivery
    from tensordict import NonTensorData

    def shard(keys: list[str], n: int = 4) -> TensorDict:
        cols = {"x": torch.arange(n, dtype=torch.float32), "uid": NonTensorStack(*[f"u{i}" for i in range(n)]),
                "t": NonTensorData(1), "y": torch.ones(n, 2),
                "xj": torch.nested.as_nested_tensor([torch.ones(1)] * n, layout=torch.jagged)}
        out = TensorDict({k: cols[k] for k in keys}, batch_size=[n])
        if "xj" in keys:
            out.rename_key_("xj", "x")
        return out

    d = MinibatchDelivery(num_minibatches=2, epochs=1, seed=0, device="cpu", capacity=16)
    d.ingest(shard(["x", "uid", "t"]), version=0)
    with pytest.raises(SchemaError, match="differ from the first shard"):
        d.ingest(shard(second), version=0)
    d.seal()
    got = [(m["x"].tolist(), list(m["uid"]), m["t"]) for m, _ in d.minibatches()]
    assert got == [([0.0, 1.0], ["u0", "u1"], 1), ([2.0, 3.0], ["u2", "u3"], 1)], "the refused shard changed state"


@pytest.mark.parametrize(("cfg", "match"), [
    ({"num_units": 0}, "num_units >= 1"),
    ({"capacity": 0}, "positive items"),
    ({"growth": 1.0}, "growth must be > 1"),
    ({"max_items": 0}, "max_items must be >= 1"),
    ({"device": "gpu0"}, "wrong type or form"),
    ({"delivery": "sometimes"}, "delivery='sometimes'"),
    ({"num_unit": 2}, r"unknown key\(s\) \['num_unit'\]"),
])
def test_bad_backend_config_is_refused_at_tq_init(cfg: dict[str, Any], match: str) -> None:
    """transfer_queue.backend.Conduit is checked when tq.init bootstraps the units. num_units=0 used to start no
    unit and fail every put with ZeroDivisionError; other bad values surfaced at the first put inside a unit (or,
    for delivery, at the first minibatch); a misspelt key was silently ignored."""
    from conduit import ConfigurationError
    from conduit_verl.tq_storage import bootstrap
    from omegaconf import OmegaConf

    conf = OmegaConf.create({"backend": {"storage_backend": "Conduit", "Conduit": cfg}})
    with pytest.raises(ConfigurationError, match=match):
        bootstrap(conf)
    assert "_run_id" not in conf.backend.Conduit, "a refused config was filled in anyway"


def test_default_and_tuned_backend_configs_pass_validation() -> None:
    from conduit_verl.tq_storage import _validated, _with_defaults

    assert _validated(_with_defaults(None))["num_units"] == 1
    cfg = _validated(_with_defaults({"num_units": 2, "capacity": 4, "mean_length": 2, "max_items": 2,
                                     "device": "auto", "delivery": "off", "_run_id": "x"}))
    assert cfg["max_items"] == 2 and cfg["device"] == "auto"
