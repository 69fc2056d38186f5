"""``Replay(sampler)`` given something that is no sampler instance.

Bug found: ``Replay(PrioritizedSampler)`` (the class, a common slip) was taken, and building the buffer then failed
with a bare TypeError (``reset() missing 1 required positional argument``); ``Replay("prioritized")`` with an
AttributeError. Now ``Replay`` refuses them at once with a ConfigurationError that names the fix.
"""

from __future__ import annotations

import pytest
import torch
from conduit import (
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    PrioritizedSampler,
    Replay,
    UniformSampler,
)


@pytest.mark.parametrize(("sampler", "hint"), [
    (PrioritizedSampler, r"PrioritizedSampler\(\)"),
    (UniformSampler, r"UniformSampler\(\)"),
    ("prioritized", "PrioritizedSampler"),
    (object(), "PrioritizedSampler"),
])
def test_what_is_no_sampler_instance_is_refused_typed(sampler: object, hint: str) -> None:
    with pytest.raises(ConfigurationError, match=hint):
        Replay(sampler)  # type: ignore[arg-type]


def test_sampler_instances_and_the_default_are_taken() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64))
    for sem in (Replay(), Replay(None), Replay(UniformSampler()), Replay(sampler=PrioritizedSampler())):
        edp = ExperienceDataPlane(schema, capacity=4, semantics=sem)
        edp.ingest({"id": torch.arange(3)})
        assert set(edp.deliver(16)[1].handles.tolist()) == {0, 1, 2}
