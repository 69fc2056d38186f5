"""After a migration to a grown schema, synchronous replay ingestion of an exact dict still takes the compiled row
store (``append_rows``), as on a buffer built with that schema.

It was turned off for good by the first schema migration (the buffer keeps the replaced schemas, to transform batches
validated before the swap): every later ingest validated and built a batch, and checked it against the current schema
once more, about three times the time per call. A dict the row store takes holds exactly the current schema's
fields, so the general path would store it untransformed too; a dict of the replaced schema is still refused typed,
changing nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conduit import ExperienceBatch, ExperienceDataPlane, ExperienceSchema, Field, SchemaError
from conduit.placement import HostPlacement
from conduit.semantics import PrioritizedSampler, Replay

OLD = ExperienceSchema(obs=Field((3,)), act=Field((), torch.int64))
NEW = ExperienceSchema(obs=Field((5,)), act=Field((), torch.int64))


def _pad(batch: ExperienceBatch) -> dict[str, Any]:
    obs = batch["obs"]
    assert isinstance(obs, torch.Tensor)
    return {"obs": torch.cat([obs, torch.full((obs.shape[0], 2), -1.0)], dim=1), "act": batch["act"]}


def _items(first: int, n: int, width: int) -> dict[str, torch.Tensor]:
    h = torch.arange(first, first + n)
    return {"obs": h[:, None].to(torch.float32).expand(n, width).contiguous(), "act": h.clone()}


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_exact_dicts_take_the_row_store_after_a_schema_migration(prioritized: bool) -> None:
    sem = Replay(PrioritizedSampler(alpha=0.6), seed=0) if prioritized else Replay(seed=0)
    edp = ExperienceDataPlane(OLD, capacity=16, semantics=sem)
    edp.ingest(_items(0, 10, 3))
    edp.migrate(HostPlacement(), schema=NEW, transform=_pad)
    storage = edp.storage
    stored_by_rows: list[int] = []
    append_rows = storage.append_rows

    def spy(columns: dict[str, Any]) -> Any:
        res = append_rows(columns)
        if res is not None:
            stored_by_rows.append(res.count)
        return res

    storage.append_rows = spy  # type: ignore[method-assign]
    handles = edp.ingest(_items(10, 4, 5))
    assert handles is not None and handles.tolist() == [10, 11, 12, 13]
    assert stored_by_rows == [4], "the exact dict of the new schema did not take the row store"
    # a dict of the replaced schema: refused typed, nothing stored
    with pytest.raises(SchemaError):
        edp.ingest(_items(14, 2, 3))
    assert (storage.oldest, storage.next_handle) == (0, 14) and stored_by_rows == [4]
    # wrapping the ring: evictions as on the general path
    edp.ingest(_items(14, 6, 5))
    assert (storage.oldest, storage.next_handle) == (4, 20)
    rows = storage.gather(torch.arange(4, 20) % 16)
    obs, act = rows["obs"], rows["act"]
    assert isinstance(obs, torch.Tensor) and isinstance(act, torch.Tensor)
    assert act.tolist() == list(range(4, 20))
    assert torch.equal(obs[:, 0], torch.arange(4, 20, dtype=torch.float32))
    pad = obs[:, 3:]
    assert torch.equal(pad[:6], torch.full((6, 2), -1.0)), "migrated items lost their transform"
    assert torch.equal(pad[6:], torch.arange(10, 20, dtype=torch.float32)[:, None].expand(10, 2))
    batch, info = edp.deliver(8)
    assert torch.equal(batch.tensor("act"), info.handles), "a drawn row of another item"
    edp.close()
