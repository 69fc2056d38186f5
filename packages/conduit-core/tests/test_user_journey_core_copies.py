"""A user who reads that a buffer round-trips through ``state_dict()`` may try ``pickle`` or ``copy.deepcopy`` on the
buffer itself. An ``ExperienceDataPlane`` holds storage, locks and (with a prefetching scheduler) worker threads, so
it cannot be copied that way; the refusal is a typed Conduit error that names the way that works, and the buffer goes
on as before."""
from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import conduit
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, OnPolicy, PrioritizedSampler, Replay

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))


def _replay() -> ExperienceDataPlane:
    return ExperienceDataPlane(SCHEMA, capacity=64, semantics=Replay(PrioritizedSampler(alpha=0.6)))


def _on_policy() -> ExperienceDataPlane:
    return ExperienceDataPlane(SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=2))


@pytest.mark.parametrize("make", [_replay, _on_policy], ids=["replay", "on_policy"])
@pytest.mark.parametrize("copy_with", [pickle.dumps, copy.deepcopy, copy.copy], ids=["pickle", "deepcopy", "copy"])
def test_copying_a_buffer_is_refused_with_a_typed_error_naming_state_dict(make: Callable[[], ExperienceDataPlane],
                                                                         copy_with: Callable[[Any], Any]) -> None:
    edp = make()
    try:
        version = {"version": 0} if isinstance(edp.semantics, OnPolicy) else {}
        edp.ingest({"obs": torch.randn(8, 4), "action": torch.arange(8)}, **version)
        with pytest.raises(conduit.ConfigurationError, match=r"state_dict\(\)") as refused:
            copy_with(edp)
        assert isinstance(refused.value, TypeError), "code that checks picklability catches TypeError"
        assert len(edp) == 8
        # What the error names works: the state pickles and a new buffer built alike takes it.
        blob = io.BytesIO()
        torch.save(edp.state_dict(), blob)
        blob.seek(0)
        other = make()
        try:
            other.load_state_dict(torch.load(blob))
            assert len(other) == 8
        finally:
            other.close()
    finally:
        edp.close()
