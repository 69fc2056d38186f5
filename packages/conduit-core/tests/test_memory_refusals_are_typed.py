"""Requests that no machine's memory holds are refused typed, and change nothing.

1. A buffer whose capacity cannot be allocated raised NumPy's ``ValueError: array is too big`` (or its
   ``MemoryError: Unable to allocate ...``) from inside the storage: no Conduit error, nothing saying which
   argument to change.

The sizes are far beyond any machine's address space, so the allocations fail at once and nothing is committed.
"""

from __future__ import annotations

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay
from conduit.errors import CapacityError

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))


@pytest.mark.parametrize("capacity", [2**50, 2**62])
def test_a_capacity_no_memory_holds_is_a_capacity_error_and_the_semantics_stay_usable(capacity: int) -> None:
    semantics = Replay(PrioritizedSampler(), seed=0)
    with pytest.raises(CapacityError, match="lower capacity"):
        ExperienceDataPlane(SCHEMA, capacity=capacity, semantics=semantics)
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=semantics)  # not claimed by the failed buffer
    edp.ingest({"obs": torch.ones(2, 4), "action": torch.zeros(2, dtype=torch.int64)})
    assert len(edp) == 2
    edp.close()


def test_the_synthetic_loop_still_names_its_own_options_for_a_buffer_no_memory_holds() -> None:
    """The storage's refusal (capacity, ragged_capacity, placement) is turned into the loop's (capacity, obs_dim)."""
    from conduit.demo import run_loop
    from conduit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="lower capacity or obs_dim"):
        run_loop(obs_dim=4, capacity=2**50, iterations=1, warmup=0, rollout=8, batch=4)
