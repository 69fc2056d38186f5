"""A replay ``select_now`` refused at a later selection than its first.

Bug found: ``select_now([1, 100], replace=False)`` on 50 items (or sizes ``[4, 0]``) made the first selection, then
refused the second with a CapacityError (a ConfigurationError): the sampler's RNG had advanced by the first draw, so
every later delivery differed from what the same seed and calls give without the refused call (a refused call must
leave the buffer unchanged). Now the draws of a refused call are given back.
"""

from __future__ import annotations

import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    PrioritizedSampler,
    Replay,
    UniformSampler,
)

SCHEMA = ExperienceSchema(id=Field((), torch.int64))


def _buffer(sampler: type) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=Replay(sampler(), seed=3))
    edp.ingest({"id": torch.arange(50)})
    return edp


@pytest.mark.parametrize(("sampler", "sizes", "kwargs", "error"), [
    (UniformSampler, [1, 100], {"replace": False}, CapacityError),
    (UniformSampler, [4, 0], {}, ConfigurationError),
    (PrioritizedSampler, [4, 0], {}, ConfigurationError),
], ids=["uniform-distinct", "uniform-size-0", "prioritized-size-0"])
def test_a_refused_call_leaves_the_draws_unchanged(sampler: type, sizes: list[int], kwargs: dict[str, bool],
                                                   error: type[Exception]) -> None:
    refused, control = _buffer(sampler), _buffer(sampler)
    with pytest.raises(error):
        refused.select_now(sizes, **kwargs)
    for _ in range(3):
        assert torch.equal(refused.deliver(8)[1].handles, control.deliver(8)[1].handles)
