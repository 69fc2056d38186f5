"""The verl adapter's delivery, replay plug and packing, as a verl user sees them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

pytestmark = pytest.mark.requires("verl")


def _shard(ids: list[int], temperature: Any) -> TensorDict:
    n = len(ids)
    return TensorDict({"x": torch.tensor(ids, dtype=torch.float32),
                       "uid": NonTensorStack(*[f"u{i}" for i in ids]),
                       "temperature": NonTensorData(temperature)}, batch_size=[n])


def test_a_shard_with_another_constant_in_the_open_rollout_is_refused_and_changes_nothing() -> None:
    """A minibatch carries one value of a constant column, taken from the shard of its first row. Two shards of one
    rollout with temperatures 0.7 and 1.0 used to be accepted, and a minibatch mixing their rows delivered the
    second shard's rows with temperature 0.7 (silently wrong log-probs in verl). The second shard is refused now
    (SchemaError), nothing of it is stored; after seal() a new rollout may carry other constants."""
    from conduit import SchemaError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", capacity=8)
    d.ingest(_shard([0, 1], 0.7), version=0)
    d.ingest(_shard([2, 3], 0.7), version=0)  # the same constant: accepted
    with pytest.raises(SchemaError, match=r"temperature.*seal\(\)"):
        d.ingest(_shard([4, 5], 1.0), version=0)
    d.seal()
    d.ingest(_shard([6, 7], 1.0), version=0)  # a rollout of its own: its own constant
    d.seal()
    got = [(m["x"].tolist(), list(m["uid"]), m["temperature"]) for _ in range(2) for m, _info in d.minibatches()]
    assert got == [([0.0, 1.0, 2.0, 3.0], ["u0", "u1", "u2", "u3"], 0.7), ([6.0, 7.0], ["u6", "u7"], 1.0)]
    d.close()


@pytest.mark.parametrize(("first", "second", "same"), [
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), True),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), False),
    (torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), False),
    ({"max_token_len_per_gpu": 64}, {"max_token_len_per_gpu": 64}, True),
    ("a", "b", False),
    ({"w": np.array([1, 2])}, {"w": np.array([1, 2])}, True),
    ({"w": np.array([1, 2])}, {"w": np.array([1, 3])}, False),
    ([torch.ones(2), "a"], [torch.ones(2), "a"], True),
    ([torch.ones(2)], (torch.ones(2),), False),
    ({"a": [torch.zeros(1)]}, {"a": [torch.zeros(1)], "b": 1}, False),
], ids=["equal-tensors", "other-tensor", "other-dtype", "equal-dicts", "other-strings", "dicts-of-equal-arrays",
        "dicts-of-other-arrays", "lists-of-equal-tensors", "list-vs-tuple", "other-keys"])
def test_constants_are_compared_by_value(first: Any, second: Any, same: bool) -> None:
    """Tensor constants compare by dtype, shape and elements (no ambiguous truth value), others by ==; containers
    (dicts, lists, tuples) item by item: ``{"w": np.array([1, 2])}`` compared with == asked the array inside for a
    truth value (an error, taken as 'different'), so a second shard with an equal, separately built constant was
    refused."""
    from conduit import SchemaError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", capacity=8)
    d.ingest(_shard([0, 1], first), version=0)
    if same:
        d.ingest(_shard([2, 3], second), version=0)
    else:
        with pytest.raises(SchemaError, match="differ from the open rollout"):
            d.ingest(_shard([2, 3], second), version=0)
    d.seal()
    (m, _info), = list(d.minibatches())
    assert m["x"].tolist() == ([0.0, 1.0, 2.0, 3.0] if same else [0.0, 1.0])
    d.close()


@pytest.mark.parametrize("kwargs", [{"on_stail": "raise"}, {"on_stale": "raise", "max_staleness": 0}])
def test_an_unknown_sampler_kwargs_key_is_refused(kwargs: dict[str, Any]) -> None:
    """``trainer.v1.sampler.sampler_kwargs.on_stail=raise`` (a typo) used to be ignored silently: the run went on
    under verl's strategy, dropping stale groups the user asked to stop on. Keys the plug does not read are
    refused, naming the ones it reads; the known key alone (as verl passes it, a DictConfig) is accepted."""
    from conduit import ConfigurationError
    from conduit_verl.replay import ConduitReplayBuffer
    from omegaconf import OmegaConf

    def build(extra: dict[str, Any]) -> Any:
        return ConduitReplayBuffer(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                                   max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create(extra),
                                   refill_fn=lambda k: None)

    with pytest.raises(ConfigurationError, match=r"unknown key\(s\).*\['on_stale'\]"):
        build(kwargs)
    assert build({"on_stale": "raise"}).on_stale == "raise"
    assert build({}).on_stale == "drop"


@pytest.mark.parametrize("key", ["batch_size", "generator", "collate_fn", "batch_sampler"])
def test_dataloader_kwargs_that_the_delivery_sets_itself_are_refused_up_front(key: str) -> None:
    """dataloader_kwargs such as batch_size or generator used to be accepted by MinibatchDelivery and by the hook,
    then DataLoader raised a raw TypeError/ValueError at the first minibatch, inside verl's training loop. They are
    refused (ConfigurationError) when the delivery is built, before the shard is ingested."""
    from conduit import ConfigurationError
    from conduit_verl import delivery

    value = {"batch_size": 2, "generator": torch.Generator(), "collate_fn": list, "batch_sampler": [[0, 1]]}[key]
    with pytest.raises(ConfigurationError, match=rf"sets \['{key}'\]"):
        delivery.MinibatchDelivery(num_minibatches=2, seed=0, device="cpu", dataloader_kwargs={key: value})
    delivery.install()
    td = TensorDict({"x": torch.arange(4.0)}, batch_size=[4])
    with delivery.forced("prefetch"), pytest.raises(ConfigurationError, match=key):
        delivery.conduit_make_iterator(td, 2, 1, seed=0, dataloader_kwargs={"shuffle": True, key: value})
    with delivery.forced("prefetch"):  # verl's own options still pass
        got = [m["x"].tolist() for m in delivery.conduit_make_iterator(td, 2, 1, seed=0,
                                                                         dataloader_kwargs={"drop_last": True})]
    assert got == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize("kwargs", [{"bogus": 1}, {"num_workers": -1}, {"shuffle": True, "sampler": [0, 1]},
                                    {"persistent_workers": True}], ids=["unknown", "negative-workers",
                                                                        "sampler-and-shuffle", "persistent-no-workers"])
def test_dataloader_kwargs_torch_refuses_are_refused_up_front(kwargs: dict[str, Any]) -> None:
    """dataloader_kwargs that torch's DataLoader refuses used to be accepted when the delivery was built; the raw
    TypeError/ValueError came at the first minibatch (verl's own iterator raises when it is built). They are refused
    (ConfigurationError) when the delivery is built, before the shard is ingested, with torch's reason."""
    from conduit import ConfigurationError
    from conduit_verl import delivery

    with pytest.raises(ConfigurationError, match="DataLoader refuses"):
        delivery.MinibatchDelivery(num_minibatches=2, seed=0, device="cpu", dataloader_kwargs=dict(kwargs))
    delivery.install()
    td = TensorDict({"x": torch.arange(4.0)}, batch_size=[4])
    with delivery.forced("prefetch"), pytest.raises(ConfigurationError, match="DataLoader refuses"):
        delivery.conduit_make_iterator(td, 2, 1, seed=0, dataloader_kwargs=dict(kwargs))


def test_hf_rollout_and_reward_replicas_of_one_rank_both_start(tiny: dict[str, Path], ray_local: Path) -> None:
    """The CPU ``hf`` rollout named every replica's server ``conduit_hf_server_<rank>``: a reward-model (or teacher)
    replica of rank 0 beside the policy's rollout replica 0 failed to start (Ray: the actor name is taken). Each
    role's server has a name of its own now, and the policy's weight-sync adapter still finds its replica's."""
    import asyncio
    from types import SimpleNamespace

    import ray
    from conduit_verl.cpu.config import compose
    from conduit_verl.cpu.rollout import HFReplica, HFServerAdapter, server_name

    cfg = compose([f"actor_rollout_ref.model.path={tiny['model']}", "actor_rollout_ref.rollout.name=hf",
                   "actor_rollout_ref.rollout.response_length=4"])
    model: Any = SimpleNamespace(path=str(tiny["model"]), local_path=str(tiny["model"]), trust_remote_code=False)
    roles = [(False, False), (True, False), (False, True)]  # (is_reward_model, is_teacher_model)
    replicas = [HFReplica(0, cfg.actor_rollout_ref.rollout, model, gpus_per_node=1, is_reward_model=reward,
                          is_teacher_model=teacher) for reward, teacher in roles]
    for r in replicas:
        asyncio.run(r.launch_servers())
    names = {str(ray.get(r.servers[0].__ray_call__.remote(lambda _: ray.get_runtime_context().get_actor_name())))
             for r in replicas}
    assert len(names) == 3 and server_name(0) in names
    adapter = HFServerAdapter.__new__(HFServerAdapter)  # the trainer worker's end, without a device mesh
    adapter.replica_rank, adapter._server = 0, None
    assert adapter._handle()._actor_id == replicas[0].servers[0]._actor_id
    for r in replicas:
        ray.kill(r.servers[0])
