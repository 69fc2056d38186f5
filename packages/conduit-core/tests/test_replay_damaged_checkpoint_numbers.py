"""A replay checkpoint damaged in its numbers is refused typed, with the buffer unchanged.

``Semantics.load_checked`` turned the errors a damaged semantics state raises into :class:`ConfigurationError`, but
not ``OverflowError`` (an integer beyond float64 or the RNG's words) nor ``IndexError`` (a sampler state that is a
tensor or a NumPy scalar, indexed by key): those escaped ``ExperienceDataPlane.load_state_dict`` untyped.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay

SCHEMA = ExperienceSchema(id=Field((), torch.int64))


def prioritized() -> ExperienceDataPlane:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(PrioritizedSampler(alpha=0.5), seed=1))
    edp.ingest({"id": torch.arange(5)})
    edp.update_priorities(torch.tensor([1, 3]), torch.tensor([0.25, 4.0]))
    return edp


def uniform() -> ExperienceDataPlane:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(seed=1))
    edp.ingest({"id": torch.arange(5)})
    return edp


def damaged(state: dict[str, Any], path: tuple[str, ...], value: object) -> dict[str, Any]:
    out = copy.deepcopy(state)
    d = out["semantics"]
    for key in path[:-1]:
        d = d[key]
    d[path[-1]] = value
    return out


CASES = [
    (prioritized, ("sampler", "max_priority"), 10**400),
    (prioritized, ("sampler", "alpha"), -10**400),
    (prioritized, ("sampler", "leaves"), 10**400),
    (prioritized, ("sampler", "rng", "state", "state"), -1),
    (prioritized, ("sampler", "rng", "uinteger"), 2**70),
    (prioritized, ("sampler",), torch.tensor([1.0])),
    (uniform, ("sampler",), np.int64(3)),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch warns about indexing a tensor by a string key)
@pytest.mark.parametrize(("make", "path", "value"), CASES, ids=[f"{m.__name__}-{'.'.join(p)}" for m, p, _ in CASES])
def test_a_damaged_number_is_refused_typed_and_changes_nothing(make: Any, path: tuple[str, ...], value: object) -> None:
    edp = make()
    state = damaged(edp.state_dict(), path, value)
    fresh = make()  # the same buffer, never asked to load: what the refused one must go on drawing
    with pytest.raises(ConfigurationError, match="semantics state does not fit"):
        edp.load_state_dict(state)
    assert edp.semantics.select(64).info.handles.tolist() == fresh.semantics.select(64).info.handles.tolist()
    edp.close()
    fresh.close()
