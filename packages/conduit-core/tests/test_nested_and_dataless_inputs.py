"""Nested tensors and data-less (meta) tensors handed to ingestion or priority updates: a typed error that says
what to give instead, and a buffer left as it was (torch raised its own RuntimeError / NotImplementedError)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from conduit import (
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    PriorityError,
    Ragged,
    Replay,
    SchemaError,
)

FIXED = ExperienceSchema(obs=Field((2,), torch.float32), action=Field((), torch.int64))
RAGGED = ExperienceSchema(obs=Field((2,), torch.float32), tokens=Field((), torch.int64, ragged=True))


def _nested(*parts: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():  # (torch warns that the strided layout of nested tensors is a prototype)
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(list(parts))


def _saved(edp: ExperienceDataPlane) -> bytes:
    buf = io.BytesIO()
    torch.save(edp.state_dict(), buf)
    return buf.getvalue()


def _fixed_batch(n: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.ones(n, 2), "action": torch.arange(n)}


@pytest.mark.parametrize("semantics", ["replay", "on_policy"])
@pytest.mark.parametrize("case", ["fixed-field", "fixed-field-batch", "ragged-field", "ragged-field-first"])
def test_a_nested_tensor_column_is_refused_typed(case: str, semantics: str) -> None:
    """A ``torch.nested`` tensor (the strided kind ``nested_tensor`` makes by default) has no ``shape``: reading it
    raised torch's "Internal error ... Please file an issue" from the fast paths and the checks alike."""
    schema = FIXED if case.startswith("fixed") else RAGGED
    sem = Replay() if semantics == "replay" else OnPolicy(num_minibatches=1)
    kw = {} if semantics == "replay" else {"version": 0}
    edp = ExperienceDataPlane(schema, capacity=4, semantics=sem)
    if schema is FIXED:
        edp.ingest(_fixed_batch(1), **kw)
        nested = _nested(torch.zeros(2), torch.ones(2))
        bad: object = {"obs": nested, "action": torch.arange(2)}
        if case == "fixed-field-batch":
            bad = ExperienceBatch({"obs": nested, "action": torch.arange(2)}, 2)
    else:
        edp.ingest({"obs": torch.ones(1, 2), "tokens": Ragged(torch.arange(3), torch.tensor([3]))}, **kw)
        nested = _nested(torch.arange(2), torch.arange(3))
        bad = {"obs": torch.ones(2, 2), "tokens": nested}
        if case == "ragged-field-first":
            bad = {"tokens": nested, "obs": torch.ones(2, 2)}
    before = _saved(edp)
    with pytest.raises(SchemaError, match="nested tensor"):
        edp.ingest(bad, **kw)  # type: ignore[arg-type]
    assert _saved(edp) == before
    assert len(edp) == 1


@pytest.mark.parametrize("where", ["update", "ingest"])
@pytest.mark.parametrize("kind", ["meta", "nested"])
def test_meta_or_nested_priorities_are_refused_typed(kind: str, where: str) -> None:
    """Priorities given as a meta tensor (no values) or a nested tensor raised NotImplementedError / RuntimeError."""
    edp = ExperienceDataPlane(FIXED, capacity=4, semantics=Replay(PrioritizedSampler(alpha=1.0)))
    edp.ingest(_fixed_batch(2))
    before = _saved(edp)
    bad = torch.empty(2, device="meta") if kind == "meta" else _nested(torch.ones(1), torch.ones(1))
    with pytest.raises(PriorityError, match="Priorities must be"):
        if where == "update":
            edp.update_priorities(torch.tensor([0, 1]), bad)
        else:
            edp.ingest(_fixed_batch(2), priorities=bad)
    assert _saved(edp) == before


@pytest.mark.parametrize("kind", ["meta", "nested"])
def test_meta_or_nested_handles_are_refused_typed(kind: str) -> None:
    edp = ExperienceDataPlane(FIXED, capacity=4, semantics=Replay(PrioritizedSampler(alpha=1.0)))
    edp.ingest(_fixed_batch(2))
    before = _saved(edp)
    bad = (torch.empty(2, dtype=torch.int64, device="meta") if kind == "meta"
           else _nested(torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)))
    with pytest.raises(PriorityError, match="Handles must be"):
        edp.update_priorities(bad, torch.tensor([1.0, 2.0]))
    assert _saved(edp) == before


def test_an_unsigned_handle_past_int64_is_named_as_given() -> None:
    """A uint64 handle of 2**64 - 1 was reported as "Handle -1 was never issued" (its int64 reading)."""
    edp = ExperienceDataPlane(FIXED, capacity=4, semantics=Replay(PrioritizedSampler(alpha=1.0)))
    edp.ingest(_fixed_batch(2))
    before = _saved(edp)
    with pytest.raises(PriorityError, match=f"Handle {2**64 - 1} was never issued"):
        edp.update_priorities(np.array([2**64 - 1, 0], dtype=np.uint64), np.array([1.0, 2.0]))
    assert _saved(edp) == before
    assert edp.update_priorities(np.array([1], dtype=np.uint64), np.array([3.0])) == 1
