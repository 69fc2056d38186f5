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
