"""Priorities are real numbers: a bool tensor (True read as 1) or numeric strings ("1.0", which NumPy converts) are
refused with PriorityError and change nothing. OnPolicy's on_stale is one of the strings "drop" / "raise": a NumPy
array holding one passed the ``in`` check (its elementwise == is truthy) and was kept as an array."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, OnPolicy, PriorityError, Replay
from conduit.semantics.replay import PrioritizedSampler

SCHEMA = ExperienceSchema(a=Field((), torch.int64))


def _two_prioritized_items() -> tuple[ExperienceDataPlane, torch.Tensor, object]:
    """A prioritized buffer holding two items, their handles and its sampler's state."""
    edp = ExperienceDataPlane(SCHEMA, capacity=4, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=0))
    handles = edp.ingest({"a": torch.arange(2)}, priorities=torch.tensor([3.0, 5.0]))
    assert handles is not None
    return edp, handles, edp.state_dict()["semantics"]["sampler"]


@pytest.mark.parametrize("bad", [torch.tensor([True, False]), np.array([True, True]), ["1.0", "2.0"],
                                 np.array(["1.0", "2.0"]), np.array([1.0, "2"], dtype=object)])
def test_bool_or_string_priorities_are_refused_and_change_nothing(bad: object) -> None:
    edp, handles, before = _two_prioritized_items()
    with pytest.raises(PriorityError, match="real numbers"):
        edp.update_priorities(handles, bad)  # type: ignore[arg-type]
    with pytest.raises(PriorityError, match="real numbers"):
        edp.ingest({"a": torch.arange(2)}, priorities=bad)  # type: ignore[arg-type]
    assert len(edp) == 2
    after = edp.state_dict()["semantics"]["sampler"]
    assert repr(after) == repr(before)
    assert edp.update_priorities(handles, np.array([1, 2], dtype=object)) == 2  # numbers in an object array: fine


@pytest.mark.parametrize("bad", [None, [None, None], np.array([1.0, None], dtype=object)])
def test_none_priorities_are_refused_as_missing_not_as_nan(bad: object) -> None:
    """NumPy reads None as NaN: ``update_priorities(handles, None)`` said "1 priorities are NaN, infinite or
    negative (first: nan)", naming a value the caller never passed."""
    edp, handles, before = _two_prioritized_items()
    with pytest.raises(PriorityError, match="real numbers.*None"):
        edp.update_priorities(handles, bad)  # type: ignore[arg-type]
    if bad is not None:  # (ingest's priorities=None is its default: the max seen)
        with pytest.raises(PriorityError, match="real numbers.*None"):
            edp.ingest({"a": torch.arange(2)}, priorities=bad)  # type: ignore[arg-type]
    assert len(edp) == 2
    assert repr(edp.state_dict()["semantics"]["sampler"]) == repr(before)


@pytest.mark.parametrize("bad", [np.array(["drop"]), np.array(["raise"]), np.array(["drop", "raise"]), ["drop"]])
def test_on_stale_must_be_a_string(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="on_stale must be"):
        OnPolicy(num_minibatches=1, on_stale=bad)  # type: ignore[arg-type]
