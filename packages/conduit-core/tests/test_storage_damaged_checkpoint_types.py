"""A storage checkpoint whose entries have the wrong types is refused typed, with the buffer unchanged.

``Storage.checkpoint_contents`` turned a damaged header's KeyError/TypeError/AttributeError/ValueError into
:class:`ConfigurationError`, but a schema entry that is a tensor or a NumPy scalar raised IndexError, and a capacity
that is a tensor of several values RuntimeError (its truth is ambiguous); ``checkpoint_layout`` compared a ragged
pool size that is such a tensor with ``!=`` and raised RuntimeError. All escaped ``load_state_dict`` untyped.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, Replay, ShardedPlacement
from conduit.batch import Ragged

SCHEMA = ExperienceSchema(id=Field((), torch.int64), seq=Field((2,), torch.float32, ragged=True))


def buffer(sharded: bool) -> ExperienceDataPlane:
    placement = {"placement": ShardedPlacement(["cpu", "cpu"])} if sharded else {}
    edp = ExperienceDataPlane(SCHEMA, capacity=4, ragged_capacity=16, semantics=Replay(seed=1), **placement)
    for i in range(3):  # wraps the ring and evicts
        edp.ingest({"id": torch.arange(2 * i, 2 * i + 2), "seq": Ragged(torch.full((3, 2), float(i)),
                                                                        torch.tensor([1, 2]))})
    return edp


CASES = [
    (("schema", "id"), torch.tensor([1.0])),
    (("schema", "seq"), np.int64(3)),
    (("capacity",), torch.tensor([4, 4])),
    (("ragged_layout", "pool"), torch.tensor([16, 16])),
    (("ragged_layout", "pool"), "16"),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # (torch warns about indexing a tensor by a string key)
@pytest.mark.parametrize("sharded", [False, True], ids=["host", "sharded"])
@pytest.mark.parametrize(("path", "value"), CASES, ids=[".".join(p) + f"={v!r}"[:24] for p, v in CASES])
def test_a_storage_entry_of_the_wrong_type_is_refused_typed(path: tuple[str, ...], value: object,
                                                            sharded: bool) -> None:
    edp = buffer(sharded)
    state: dict[str, Any] = copy.deepcopy(edp.state_dict())
    entry = state["storage"]
    for key in path[:-1]:
        entry = entry[key]
    entry[path[-1]] = value
    before = edp.storage.state_dict()
    with pytest.raises(ConfigurationError, match="damaged|not a storage checkpoint"):
        edp.load_state_dict(state)
    after = edp.storage.state_dict()
    assert (after["oldest"], after["next"]) == (before["oldest"], before["next"])
    assert torch.equal(after["data"]["id"], before["data"]["id"])
    assert all(torch.equal(a, b) for a, b in zip(after["data"]["seq"], before["data"]["seq"], strict=True))
    assert after["ragged_layout"]["heads"] == before["ragged_layout"]["heads"]
    edp.close()
