"""A replay batch whose items cannot share the shards' ragged pools, even empty, is refused before anything is
evicted.

The check made before a replay write counted elements only (no item longer than a pool, no more elements than the
live pools hold together). Items are never split between shards, so [3, 6, 6] elements into two pools of 8 (15 of
16 elements) can never be stored: two items of 6 need a pool each, and the 3 fits beside neither. The write went
ahead, evicted the oldest items to make room (here every item), and was refused after all, leaving them evicted.
Such a batch is now refused first, typed, with the buffer unchanged, by a lower bound on the pools its items need
(it never refuses a batch that some placement into the empty pools fits). Runs in the in-process harness of
``test_distributed_bookkeeping``.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from conduit import ExperienceBatch, Ragged
from conduit.distributed.errors import ClusterError
from conduit.distributed.plan import pools_needed

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import RAGGED, _plane, fake_ray  # noqa: E402, F401, I001

pytestmark = pytest.mark.timeout(300)


def _batch(ids: list[int], lengths: list[int]) -> ExperienceBatch:
    total = sum(lengths)
    return ExperienceBatch({"id": torch.tensor(ids, dtype=torch.int64),
                            "tok": Ragged(torch.arange(total, dtype=torch.int64),
                                          torch.tensor(lengths, dtype=torch.int64))}, len(ids))


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("lengths", [[3, 6, 6], [6, 3, 6], [5, 5, 5], [2, 7, 7]])
def test_a_batch_whose_items_fit_no_placement_into_the_empty_pools_is_refused_before_anything_is_evicted(lengths):
    p = _plane(["a", "b"], schema=RAGGED, capacity=16, ragged_capacity=8)
    p.ingest(_batch([0, 1, 2, 3], [4, 4, 4, 4]), node="a")
    assert sum(lengths) <= 16 and max(lengths) <= 8  # what the check counted
    with pytest.raises(ClusterError, match="need at least 3 .*pools of 8"):
        p.ingest(_batch([10, 11, 12], lengths))
    got = p.read(p.live_handles())
    assert got["id"].tolist() == [0, 1, 2, 3] and p.index.oldest == 0 and len(p) == 4, "nothing evicted"
    assert got["tok"].values.tolist() == list(range(16))
    p.ingest(_batch([10, 11], [6, 6]))  # what fits is stored, evicting the oldest
    assert p.read(p.live_handles())["id"].tolist()[-2:] == [10, 11]


def _least_pools(lengths: list[int], pool: int) -> int:
    """The fewest pools the items fit in (exhaustive)."""
    for k in range(1, len(lengths) + 1):
        for assign in itertools.product(range(k), repeat=len(lengths)):
            if all(sum(w for w, b in zip(lengths, assign, strict=True) if b == j) <= pool for j in range(k)):
                return k
    return 0


@pytest.mark.parametrize("pool", [7, 8])
def test_the_bound_never_exceeds_the_pools_a_placement_needs(pool):
    """The bound refuses only what no placement fits: checked against an exhaustive search, on every batch of up to
    5 items of 0 to ``pool`` elements (and it is tight on the examples above)."""
    for n in range(1, 6):
        for lengths in itertools.combinations_with_replacement(range(pool + 1), n):
            assert pools_needed(torch.tensor(lengths), pool) <= max(1, _least_pools(list(lengths), pool)), lengths
    assert pools_needed(torch.tensor([3, 6, 6]), 8) == 3 and pools_needed(torch.tensor([4, 4, 4, 4]), 8) == 2
