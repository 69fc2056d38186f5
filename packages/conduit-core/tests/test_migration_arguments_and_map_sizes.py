"""Bad arguments to the online migration and to the placement map are refused typed, changing nothing.

* ``migrate``'s ``chunk_bytes`` that is no int >= 1 (a string raised a bare TypeError; 0, a negative count, a float
  or a bool were taken silently) and a ``progress`` that is not callable (a bare TypeError after the first chunk)
  are a ConfigurationError before anything is built or copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field
from conduit.placement import HostPlacement
from conduit.placement.migration import migrate

SCHEMA = ExperienceSchema(obs=Field((3,)))

def _buffer() -> ExperienceDataPlane:
    edp = ExperienceDataPlane(SCHEMA, capacity=16)
    for i in range(3):  # 30 items through a ring of 16: the live range is [14, 30)
        edp.ingest({"obs": torch.arange(30, dtype=torch.float32).view(10, 3) + 30 * i})
    edp.flush()
    return edp

@pytest.mark.parametrize("kwargs", [
    {"chunk_bytes": "4MiB"}, {"chunk_bytes": 0}, {"chunk_bytes": -5}, {"chunk_bytes": 1.5}, {"chunk_bytes": True},
    {"chunk_bytes": 12, "progress": 5},
], ids=["str", "zero", "negative", "float", "bool", "progress-not-callable"])
def test_bad_chunk_bytes_or_progress_is_refused_before_anything_changes(kwargs: dict[str, Any]) -> None:
    edp = _buffer()
    storage, before = edp.storage, edp.state_dict()
    with pytest.raises(ConfigurationError, match="chunk_bytes|progress"):
        migrate(edp, HostPlacement(), **kwargs)
    assert edp.storage is storage, "a refused migration swapped the storage"
    after = edp.state_dict()
    assert (after["storage"]["oldest"], after["storage"]["next"]) == (before["storage"]["oldest"],
                                                                       before["storage"]["next"])
    assert torch.equal(after["storage"]["data"]["obs"], before["storage"]["data"]["obs"])
    # the same migration with good arguments goes through (a NumPy integer is an int)
    seen: list[tuple[int, int]] = []
    report = migrate(edp, HostPlacement(), chunk_bytes=np.int64(12), progress=lambda c, h: seen.append((c, h)))
    assert report.items == 16 and report.chunks > 1 and seen
    assert torch.equal(edp.state_dict()["storage"]["data"]["obs"], before["storage"]["data"]["obs"])
