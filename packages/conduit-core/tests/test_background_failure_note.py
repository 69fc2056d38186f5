"""A background write that fails with an error that is not Conduit's reaches the producer's next call as that
error, with a note that says where it came from and what to do (its type, which callers may catch, is kept)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conduit import ExperienceDataPlane, ExperienceSchema, Overlapped, Replay
from conduit.placement import HostPlacement
from conduit.storage.columnar import ColumnarStorage
from conduit.testing.reference import ID_SCHEMA, id_batch


class _FailingOnce(ColumnarStorage):
    """Host storage whose first append fails as a broken tier would (a RuntimeError of its own)."""

    failed = False

    def append(self, batch: Any, *, evict: bool = True) -> Any:
        if not _FailingOnce.failed:
            _FailingOnce.failed = True
            raise RuntimeError("tier lost its device")
        return super().append(batch, evict=evict)


class _FailingPlacement(HostPlacement):
    def storage(self, schema: ExperienceSchema, capacity: int, *, ragged_capacity: int | None = None) -> Any:
        return _FailingOnce(schema, capacity, "cpu")


def test_a_foreign_background_failure_keeps_its_type_and_says_what_happened() -> None:
    _FailingOnce.failed = False
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=100, semantics=Replay(seed=0), placement=_FailingPlacement(),
                              scheduler=Overlapped(g_ing=1, g_del=1))
    try:
        edp.ingest(id_batch(np.arange(4)))
        with pytest.raises(RuntimeError, match="tier lost its device") as info:
            edp.flush()
        notes = getattr(info.value, "__notes__", [])
        assert len(notes) == 1 and "Background ingestion failed" in notes[0] and "flush() retries" in notes[0], notes
        edp.flush()  # the retry stores the batch the failure left queued
        assert len(edp) == 4
        with pytest.raises(RuntimeError) as again:  # raised once more (e.g. by another call): one note, not two
            raise info.value
        assert len(again.value.__notes__) == 1
    finally:
        edp.close()
