"""A rollout worker often hands over what its policy computed (log-probs, values) without ``detach()``. A synchronous
buffer stores such tensors' values; a scheduler that coalesces hand-overs at ``g_ing > 1`` staged them with
``torch.cat(..., out=)``, which torch refuses for tensors that require grad: the batches had been accepted, and the
write raised ``RuntimeError: cat(): functions with out=... arguments don't support automatic differentiation`` at
the next flush, and again at every retry (the batch stays at the head of the queue), so nothing more was stored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conduit import Automatic, ExperienceDataPlane, ExperienceSchema, Field, OnPolicy, Overlapped, Replay

SCHEMA = ExperienceSchema(logp=Field((2,), torch.float32))

#: how the producer's tensor is made from plain values
SOURCES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "leaf": lambda v: v.clone().requires_grad_(True),
    "computed": lambda v: torch.zeros_like(v, requires_grad=True) + v,  # a policy output: not a leaf
    "parameter": lambda v: torch.nn.Parameter(v.clone()),
}
#: on-policy, g_ing is a part of a rollout: half of a 12-item rollout coalesces three hand-overs of 2 items
SCHEDULERS: dict[str, Callable[[bool], Any]] = {
    "in-call": lambda on_policy: (Overlapped(g_ing=0.5, rollout_size=12, overlap=False) if on_policy
                                  else Overlapped(g_ing=4, overlap=False)),
    "background": lambda on_policy: (Overlapped(g_ing=0.5, rollout_size=12) if on_policy
                                     else Overlapped(g_ing=4)),
    "automatic": lambda on_policy: Automatic(copy_on_ingest=True),
}


@pytest.mark.parametrize("on_policy", [False, True], ids=["replay", "on-policy"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_coalesced_batches_that_require_grad_are_stored_by_value(source: str, scheduler: str, on_policy: bool) -> None:
    semantics = OnPolicy(num_minibatches=2, seed=0) if on_policy else Replay(seed=0)
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=semantics, scheduler=SCHEDULERS[scheduler](on_policy))
    values = torch.arange(24, dtype=torch.float32).view(12, 2)
    for i in range(0, 12, 2):
        edp.ingest({"logp": SOURCES[source](values[i:i + 2])}, version=0 if on_policy else None)
    edp.flush()
    data = edp.state_dict()["storage"]["data"]["logp"]
    assert torch.equal(data, values) and not data.requires_grad
    edp.close()
