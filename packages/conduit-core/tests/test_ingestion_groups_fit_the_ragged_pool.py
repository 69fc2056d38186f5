"""A group of hand-overs (``g_ing > 1``) is stored in one write: it must fit the storage's ragged pools as each of
its batches does, else that write could never succeed, however often ``flush()`` retried it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Ragged, Synchronous

RAGGED = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))


def _ragged(k: int, elements: int) -> dict[str, Any]:
    return {"id": torch.tensor([k]), "tok": Ragged(torch.full((elements,), k, dtype=torch.int64),
                                                   torch.tensor([elements]))}


def _ids(edp: ExperienceDataPlane) -> list[int]:
    return edp.state_dict()["storage"]["data"]["id"].tolist()


def _writes(edp: ExperienceDataPlane) -> list[int]:
    """Items of each storage write, in order (the buffer's telemetry)."""
    return [r.items for r in edp.telemetry.records if r.kind == "ingest"]


@pytest.mark.parametrize("overlap", [False, True], ids=["in-caller", "background"])
def test_a_group_of_two_never_outgrows_a_ragged_pool(overlap: bool) -> None:
    """Each batch fits the ragged pool (100 elements) alone. Before, two 60-element batches at ``g_ing=2`` were
    written as one group of 120 elements and refused (CapacityError) on every try. Now a group stops before the pool
    is exceeded: writes of 1, 2 and 1 items (60 | 60+30 | 30 elements), and the contents are the synchronous
    buffer's."""
    sizes = [60, 60, 30, 30]
    edp = ExperienceDataPlane(RAGGED, capacity=100, ragged_capacity=100, scheduler=Overlapped(g_ing=2, overlap=overlap))
    ref = ExperienceDataPlane(RAGGED, capacity=100, ragged_capacity=100, scheduler=Synchronous())
    try:
        for k, n in enumerate(sizes):
            edp.ingest(_ragged(k, n))
            ref.ingest(_ragged(k, n))
        edp.flush()
        assert _writes(edp) == [1, 2, 1], f"writes of {_writes(edp)} items"
        assert _ids(edp) == _ids(ref) == [2, 3], "the pool's contents differ from the synchronous buffer's"
    finally:
        edp.close()
        ref.close()
