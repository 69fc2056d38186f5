"""MinibatchDelivery across policy versions: the learner's version is checked as core checks it, and a shard of a
newer version opens a rollout of its own (with its own constants), as core's on-policy semantics define it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

pytestmark = pytest.mark.requires("verl")


def _shard(ids: list[int], temperature: float) -> TensorDict:
    return TensorDict({"x": torch.tensor(ids, dtype=torch.float32),
                       "uid": NonTensorStack(*[f"u{i}" for i in ids]),
                       "temperature": NonTensorData(temperature)}, batch_size=[len(ids)])


@pytest.mark.parametrize("bad", ["3", 1.7, None, True, np.float64(2.0)],
                         ids=["str", "float", "none", "bool", "np-float"])
def test_set_policy_version_refuses_a_non_integer_typed_and_keeps_the_version(bad: Any) -> None:
    """``set_policy_version`` used ``int(version)``: 1.7 became version 1 silently (and True version 1), "3" or None
    raised a raw ValueError/TypeError. ExperienceDataPlane.set_policy_version refuses all of them with a
    ConfigurationError and keeps the version; the verl-facing delivery does the same."""
    from conduit import ConfigurationError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", capacity=8, max_staleness=0)
    d.set_policy_version(np.int64(2))  # a NumPy integer is an integer
    d.ingest(_shard([0, 1], 0.7), version=2)
    d.seal()
    with pytest.raises(ConfigurationError, match="policy version is an int"):
        d.set_policy_version(bad)
    assert d.semantics.policy_version == 2
    (m, info), = list(d.minibatches())  # still fresh: the refused call changed nothing
    assert m["x"].tolist() == [0.0, 1.0] and info.version == 2 and info.staleness == 0
    d.close()


def test_set_policy_version_on_a_closed_delivery_is_refused() -> None:
    from conduit import ConfigurationError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", capacity=8)
    d.ingest(_shard([0, 1], 0.7), version=0)
    d.close()
    with pytest.raises(ConfigurationError, match="closed"):
        d.set_policy_version(1)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_shard_of_a_newer_version_opens_a_rollout_with_its_own_constants(prefetch: bool) -> None:
    """A shard of another policy version starts a new rollout (core's on-policy semantics seal the open one), so it
    may carry other constants. It used to be refused as if it joined the open rollout (SchemaError: 'differ from
    the open rollout's earlier shards'), so shards of successive versions had to be split by seal() calls."""
    from conduit import SchemaError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", capacity=16, max_staleness=5,
                          prefetch=prefetch)
    d.ingest(_shard([0, 1], 0.7), version=0)
    d.ingest(_shard([2, 3], 1.0), version=1)  # a new rollout: its own temperature
    d.ingest(_shard([4, 5], 1.0), version=1)  # the same rollout, the same temperature
    with pytest.raises(SchemaError, match="differ from the open rollout"):
        d.ingest(_shard([6, 7], 0.7), version=1)  # the version-1 rollout's constant is 1.0 now
    d.seal()
    got = [(m["x"].tolist(), list(m["uid"]), m["temperature"], info.version)
           for _ in range(2) for m, info in d.minibatches()]
    assert got == [([0.0, 1.0], ["u0", "u1"], 0.7, 0),
                   ([2.0, 3.0, 4.0, 5.0], ["u2", "u3", "u4", "u5"], 1.0, 1)]
    d.close()


def _responses(ids: list[int], length: int) -> TensorDict:
    return TensorDict({"responses": torch.nested.as_nested_tensor([torch.full((length + i % 3,), i) for i in ids],
                                                                  layout=torch.jagged),
                       "id": torch.tensor(ids)}, batch_size=[len(ids)])


@pytest.mark.parametrize("prefetch", [False, True])
def test_later_rollouts_with_longer_sequences_fit_the_default_pool(prefetch: bool) -> None:
    """GRPO responses grow during training. With ``ragged_capacity`` left to its default (sized from the first
    shard), a later rollout whose sequences hold more tokens than the first shard's was refused (CapacityError,
    'more than its pool') even with the buffer empty, and its advice named ExperienceDataPlane's argument. The
    default pool now grows (conduit-core's online migration) for it, also while an earlier rollout is half
    delivered; every row arrives intact."""
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=2, epochs=2, seed=0, dataloader_kwargs={"shuffle": True}, device="cpu",
                          capacity=8, prefetch=prefetch)
    seen: list[int] = []

    def deliver(count: int | None = None) -> None:
        for _ in range(count or 10**9):
            m, info = d.next_minibatch()
            for i, row in zip(m["id"].tolist(), m["responses"].unbind(), strict=True):
                assert bool((row == i).all()) and row.shape[0] == lengths[i] + i % 3, f"row {i} came back as {row}"
                seen.append(i)
            if info.last:
                return

    lengths = {i: 2 for i in range(4)}
    d.ingest(_responses(list(range(4)), 2), version=0)
    d.seal()
    deliver(1)  # the first rollout half delivered: the pool holds its rows while the next one arrives
    lengths.update({i: 40 for i in range(4, 8)})
    d.ingest(_responses(list(range(4, 8)), 40), version=0)
    d.seal()
    deliver()
    deliver()
    lengths.update({i: 300 for i in range(8, 12)})
    d.ingest(_responses(list(range(8, 12)), 300), version=0)
    d.seal()
    deliver()
    assert sorted(seen) == sorted(2 * list(range(12))), "a row was lost or repeated"
    d.close()


def test_a_pool_the_user_sized_is_not_grown() -> None:
    """An explicit ``ragged_capacity`` is a limit: a rollout past it is refused and the delivery is unchanged."""
    from conduit import CapacityError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", capacity=8, ragged_capacity=16)
    d.ingest(_responses([0, 1], 2), version=0)
    with pytest.raises(CapacityError, match="pool"):
        d.ingest(_responses([2, 3], 40), version=0)
    d.seal()
    (m, _info), = list(d.minibatches())
    assert m["id"].tolist() == [0, 1] and d.edp is not None and d.edp.storage.ragged_capacity == 16
    d.close()


@pytest.mark.parametrize("built", [False, True], ids=["closed-before-a-shard", "closed-after-a-shard"])
def test_a_closed_delivery_refuses_every_call(built: bool) -> None:
    """A delivery closed before any shard built its buffer used to go on as if open: the next ingest built a buffer
    (and a prefetch thread) and minibatches came out of it. Closed, it now refuses every call, as it does once
    built (ConfigurationError)."""
    from conduit import ConfigurationError
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", capacity=8)
    if built:
        d.ingest(_shard([0, 1], 0.7), version=0)
    d.close()
    for call in (lambda: d.ingest(_shard([2, 3], 0.7), version=0), d.seal, d.next_minibatch,
                 lambda: d.set_policy_version(1)):
        with pytest.raises(ConfigurationError, match="closed"):
            call()
    assert d.edp is None or d.edp.closed
    d.close()  # (closing again is harmless)
