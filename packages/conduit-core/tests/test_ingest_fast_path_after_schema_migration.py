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


RAGGED_OLD = ExperienceSchema(tok=Field((), torch.int64, ragged=True), r=Field(()))
RAGGED_NEW = ExperienceSchema(tok=Field((), torch.int64, ragged=True), r=Field(()), w=Field(()))


def test_a_batch_stored_after_a_schema_migration_is_checked_once_not_again_when_stored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged batch went through every check twice after a migration: in ``ingest`` and again when stored
    (``_current`` re-checked it against the current schema: its lengths' running sums, one host sync each).
    A batch of the replaced schema is still refused, and a batch validated against another schema object is
    still checked in full."""
    import conduit.batch as batch_module

    edp = ExperienceDataPlane(RAGGED_OLD, capacity=8)
    edp.ingest({"tok": [[1, 2], [3]], "r": torch.tensor([0.0, 1.0])})
    edp.migrate(HostPlacement(), schema=RAGGED_NEW,
                transform=lambda b: {**dict(b), "w": torch.ones(b.batch_size)})
    checks: list[str] = []
    real = batch_module._check_ragged_parts

    def counting(name: str, c: Any) -> None:
        checks.append(name)
        real(name, c)

    monkeypatch.setattr(batch_module, "_check_ragged_parts", counting)
    edp.ingest({"tok": [[4, 5, 6], []], "r": torch.tensor([2.0, 3.0]), "w": torch.tensor([0.5, 0.5])})
    assert checks == ["tok"], f"ragged checks run while ingesting one batch: {checks}"
    with pytest.raises(SchemaError):  # a batch of the replaced schema: refused, nothing stored
        edp.ingest({"tok": [[7]], "r": torch.tensor([4.0])})
    assert len(edp) == 4
    rows = edp.storage.gather(torch.arange(4))
    assert rows["w"].tolist() == [1.0, 1.0, 0.5, 0.5] and rows["r"].tolist() == [0.0, 1.0, 2.0, 3.0]
    # validation is remembered per schema object, not per equal-looking schema
    b = ExperienceBatch.checked({"tok": [[1]], "r": torch.tensor([0.0]), "w": torch.tensor([0.0])}, RAGGED_NEW)
    other = ExperienceSchema(tok=Field((), torch.int64, ragged=True), r=Field(()), w=Field((), torch.int64))
    with pytest.raises(SchemaError):
        b.validate(other)
    edp.close()
