"""conduit-verl's conformance endpoints: the freshness suite driven through verl's data format.

Items go in as the rows of a verl TensorDict shard (a jagged ``input_ids`` whose tokens
encode the item id, a dense ``id`` column, a ``uid`` object column, a constant
``temperature``) and come out as the verl minibatch TensorDicts that
:class:`~conduit_verl.delivery.MinibatchDelivery` yields to ``train_mini_batch``, with
verl's per-epoch shuffling (DataLoader generator) and prefetching on. Every column of every
delivered row is checked against its id, so a corrupted or mixed-up row fails the suite.

Registered under the ``conduit.conformance`` entry-point group as ``verl``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from conduit.testing import EndpointFactory, Minibatch, OnPolicyEndpoint
from tensordict import NonTensorData, NonTensorStack, TensorDict

from conduit_verl.delivery import MinibatchDelivery

__all__ = ["VerlOnPolicyEndpoint", "ENDPOINTS", "id_shard", "check_minibatch"]


def id_shard(ids: np.ndarray) -> TensorDict:
    """A verl-shaped shard whose every column is derived from the item ids."""
    ids = np.asarray(ids, dtype=np.int64)
    seqs = [torch.full((1 + int(i) % 5,), int(i), dtype=torch.int64) for i in ids]
    return TensorDict({
        "input_ids": torch.nested.as_nested_tensor(seqs, layout=torch.jagged),
        "id": torch.as_tensor(ids),
        "advantages": torch.as_tensor(ids, dtype=torch.float32)[:, None].expand(-1, 2).contiguous(),
        "uid": NonTensorStack(*[f"uid-{int(i)}" for i in ids]),
        "temperature": NonTensorData(0.7),
    }, batch_size=[len(ids)])


def check_minibatch(td: TensorDict) -> np.ndarray:
    """The ids of a delivered minibatch, after checking every column against them."""
    ids = td["id"].numpy().copy()
    rows = td["input_ids"].unbind()
    assert len(rows) == len(ids), "jagged column and ids disagree on the row count"
    for i, row in zip(ids.tolist(), rows, strict=True):
        assert row.shape == (1 + i % 5,) and bool((row == i).all()), f"row of id {i} carries {row.tolist()}"
    assert torch.equal(td["advantages"][:, 0], td["id"].to(torch.float32)), "dense payload does not match its id"
    assert list(td["uid"]) == [f"uid-{i}" for i in ids.tolist()], "object column does not match its id"
    assert td["temperature"] == 0.7, "constant column lost"
    return ids


class VerlOnPolicyEndpoint(OnPolicyEndpoint):
    """On-policy freshness through the verl-facing delivery: TensorDict shards in, verl minibatches out.

    It declares no checkpoint capability: :class:`~conduit_verl.delivery.MinibatchDelivery` has no state to save.
    verl builds one per ``make_iterator`` call (one step's batch, seeded by verl on each call) and checkpoints
    between training steps, when it is gone; so the conformance checkpoint tests skip here, as
    ``integration-tests/``'s ``KNOWN_GAPS`` declares.
    """

    def __init__(self, *, num_minibatches: int, num_epochs: int, max_staleness: int = 0, on_stale: str = "drop",
                 seed: int = 0, capacity: int = 4096) -> None:
        self.delivery = MinibatchDelivery(num_minibatches=num_minibatches, epochs=num_epochs, seed=seed,
                                          dataloader_kwargs={"shuffle": True}, max_staleness=max_staleness,
                                          on_stale=on_stale, prefetch=True, device="cpu",  # type: ignore[arg-type]
                                          capacity=capacity, ragged_capacity=capacity * 8)

    def ingest(self, ids: np.ndarray, version: int) -> None:
        self.delivery.ingest(id_shard(ids), version=version)

    def end_rollout(self) -> None:
        self.delivery.seal()

    def set_policy_version(self, version: int) -> None:
        self.delivery.set_policy_version(version)

    def consume(self) -> list[Minibatch]:
        out = []
        for td, info in self.delivery.minibatches():
            assert info.version is not None and info.epoch is not None
            out.append(Minibatch(check_minibatch(td), info.version, info.epoch))
        return out

    def close(self) -> None:
        self.delivery.close()


def _make_on_policy(**kwargs: Any) -> VerlOnPolicyEndpoint:
    return VerlOnPolicyEndpoint(**kwargs)


#: conduit-verl's registration in the ``conduit.conformance`` entry-point group
ENDPOINTS = EndpointFactory("verl", make_on_policy=_make_on_policy)
