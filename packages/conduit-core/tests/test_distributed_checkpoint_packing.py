"""A ragged checkpoint whose items pack into the live pools only grouped otherwise than in row order loads whole.

The load checks, before emptying the shards, that the items pack into the live pools (in row order, else first fit
decreasing), then stored them through the plan, which places rows by item slots, blind to the pools. Items of 4,
5, 4 and 3 elements into two pools of 8 pack as 5 + 3 and 4 + 4, the check passed, the shards were emptied, and
the load then stored none of them: every item lost (``ClusterError`` after the buffer's contents were gone). The
load now stores each item on the shard the packing found. The first test uses the in-process harness of
``test_distributed_bookkeeping``; the second runs on the real two-node cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conduit.distributed.plane import DistributedDataPlane

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import RAGGED, _plane, fake_ray  # noqa: E402, F401, I001
from test_distributed_ragged_pool_compaction import _batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _load_and_check(src: DistributedDataPlane, dst: DistributedDataPlane, lengths: list[int]) -> None:
    src.ingest(_batch(list(range(len(lengths))), lengths))
    dst.load_state_dict(src.state_dict())
    got = dst.read(dst.live_handles())
    assert got["id"].tolist() == list(range(len(lengths))) and not dst.lost_items and len(dst) == len(lengths)
    assert got["tok"].values.tolist() == list(range(sum(lengths)))


@pytest.mark.usefixtures("fake_ray")
@pytest.mark.parametrize("lengths", [[4, 5, 4, 3], [6, 1, 6, 1, 2], [1, 3, 6, 2, 4]])
def test_a_checkpoint_that_packs_only_out_of_row_order_loads_every_item(lengths):
    _load_and_check(_plane(["a", "b"], schema=RAGGED, capacity=16, ragged_capacity=64),
                    _plane(["a", "b"], schema=RAGGED, capacity=16, ragged_capacity=8), lengths)


@pytest.mark.slow
def test_real_cluster_a_checkpoint_that_packs_only_out_of_row_order_loads_every_item(servers):
    kw = {"capacity": 16, "servers": servers, "measure": False, "health_period": None}
    src = DistributedDataPlane(RAGGED, ragged_capacity=64, **kw)
    dst = DistributedDataPlane(RAGGED, ragged_capacity=8, **kw)
    try:
        _load_and_check(src, dst, [4, 5, 4, 3])
    finally:
        src.close()
        dst.close()
