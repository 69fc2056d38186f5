"""A write that fails part way (an interrupt, a device error) after it evicted items.

``ColumnarStorage.append`` advances its oldest live handle before it writes, and keeps the evictions if a write then
fails: the evicted items are gone (their slots hold parts of the failed batch). The prioritized sampler was told
nothing (the buffer informed its semantics only after a write that succeeded), so it kept their weights and later
draws returned those slots, under handles never issued. The buffer now tells the semantics of such evictions
before it raises. (Uniform draws read the live range from the storage: a control.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay, UniformSampler
from conduit.storage import columnar

SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))


def _items(lo: int, hi: int) -> dict[str, np.ndarray]:
    """NumPy columns: validated, then stored by ``append`` (the compiled row store takes host tensors only)."""
    ids = np.arange(lo, hi)
    return {"id": ids, "obs": np.repeat(ids[:, None], 4, axis=1).astype(np.float32)}


@pytest.mark.parametrize("sampler", [PrioritizedSampler, UniformSampler], ids=["prioritized", "uniform"])
def test_items_a_failed_write_evicted_are_never_drawn(sampler: type, monkeypatch: pytest.MonkeyPatch) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(sampler=sampler(), seed=0))
    try:
        edp.ingest(_items(0, 8))
        if sampler is PrioritizedSampler:  # the two oldest items weigh the most: a draw would find them
            edp.update_priorities(torch.tensor([0, 1]), torch.tensor([1000.0, 1000.0]))

        class Fails:  # the obs column's copy is interrupted (the id column was written before it)
            def __setitem__(self, key: object, value: object) -> None:
                raise KeyboardInterrupt

        st = edp.storage
        assert isinstance(st, columnar.ColumnarStorage)
        monkeypatch.setitem(st._raw_cols, "obs", None)  # (the copy goes through _np_cols then)
        monkeypatch.setitem(st._np_cols, "obs", Fails())
        with pytest.raises(KeyboardInterrupt):
            edp.ingest(_items(8, 10))
        monkeypatch.undo()
        oldest = edp.storage.oldest
        assert oldest == 2 and edp.storage.next_handle == 8, "the premise: the failed write kept its evictions"
        for _ in range(50):
            batch, info = edp.deliver(4)
            handles = info.handles.numpy()
            assert ((handles >= oldest) & (handles < 8)).all(), \
                f"drew the slots the failed write evicted (their handles were never issued): {handles}"
            assert np.array_equal(batch.tensor("obs")[:, 0].numpy(), handles)
        edp.ingest(_items(8, 10))  # the buffer goes on
        assert edp.storage.oldest == 2 and edp.storage.next_handle == 10
    finally:
        edp.close()
