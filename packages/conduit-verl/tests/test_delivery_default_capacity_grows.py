"""``MinibatchDelivery``'s default capacity grows; an explicit ``capacity=`` stays a limit.

Its default row capacity was the first shard's size, for good: a later rollout with more rows (a larger GRPO batch,
a rollout put as several data-parallel shards, the next rollout ingested while one waits) was refused with a
``CapacityError`` that pointed at core's ``ExperienceDataPlane`` instead of being delivered. With ``capacity=None``
the buffer now grows (every live row, handle and the rollout's progress kept); an explicit ``capacity=`` is refused
with an error that names it and what to do, the buffer unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
from conduit import CapacityError
from conduit_verl.delivery import MinibatchDelivery
from conduit_verl.testing import check_minibatch, id_shard


def _deliver(d: MinibatchDelivery) -> list[list[int]]:
    """Every minibatch of the next rollout, each checked column by column against its ids."""
    return [check_minibatch(td).tolist() for td, _ in d.minibatches()]


def _epochs(mbs: list[list[int]], per_epoch: int) -> list[list[int]]:
    return [sorted(v for mb in mbs[e:e + per_epoch] for v in mb) for e in range(0, len(mbs), per_epoch)]


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_larger_later_rollout_is_delivered_whole(prefetch: bool) -> None:
    d = MinibatchDelivery(num_minibatches=2, epochs=2, seed=3, device="cpu", prefetch=prefetch)
    d.ingest(id_shard(np.arange(4)), version=0)
    d.seal()
    assert _epochs(_deliver(d), 2) == [list(range(4))] * 2
    d.set_policy_version(1)
    d.ingest(id_shard(np.arange(100, 110)), version=1)  # 10 rows > the first shard's 4
    d.seal()
    assert _epochs(_deliver(d), 2) == [list(range(100, 110))] * 2
    d.close()


@pytest.mark.parametrize("prefetch", [False, True])
def test_shards_and_rollouts_beyond_the_first_shard_while_one_is_being_delivered(prefetch: bool) -> None:
    """A rollout put as two shards, then the next rollout ingested between two of its minibatches (a prefetched
    minibatch staged meanwhile): every row of both delivered, each once per epoch, in verl's order."""
    d = MinibatchDelivery(num_minibatches=2, epochs=1, seed=5, device="cpu", prefetch=prefetch, max_staleness=1)
    d.ingest(id_shard(np.arange(4)), version=0)
    d.ingest(id_shard(np.arange(4, 8)), version=0)  # the same rollout: 8 rows next to the first shard's 4
    d.seal()
    ref = MinibatchDelivery(num_minibatches=2, epochs=1, seed=5, device="cpu", prefetch=False, capacity=64)
    ref.ingest(id_shard(np.arange(8)), version=0)
    ref.seal()
    want = _deliver(ref)
    ref.close()
    it = d.minibatches()
    first = check_minibatch(next(it)[0]).tolist()
    d.ingest(id_shard(np.arange(200, 212)), version=1)  # grows while the first rollout is half delivered
    d.seal()
    rest = [check_minibatch(td).tolist() for td, _ in it]
    assert [first, *rest] == want, "the rollout being delivered changed when the buffer grew"
    assert sorted(v for mb in _deliver(d) for v in mb) == list(range(200, 212))
    d.close()


def test_a_grown_buffer_keeps_growing_its_jagged_pools() -> None:
    """Rows and sequences both grow: the later rollout's longer sequences still arrive intact."""
    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu", prefetch=False)
    d.ingest(id_shard(np.array([5, 10])), version=0)  # sequences of one element
    d.seal()
    _deliver(d)
    ids = np.array([4, 9, 14, 19, 24, 29, 34, 39])  # eight rows of five elements each
    d.ingest(id_shard(ids), version=0)
    d.seal()
    assert sorted(v for mb in _deliver(d) for v in mb) == ids.tolist()
    d.close()


def test_an_explicit_capacity_is_a_limit_refused_typed_with_the_buffer_unchanged() -> None:
    d = MinibatchDelivery(num_minibatches=2, epochs=1, seed=0, device="cpu", prefetch=True, capacity=6)
    d.ingest(id_shard(np.arange(4)), version=0)
    d.seal()
    with pytest.raises(CapacityError, match=r"capacity=6") as e:
        d.ingest(id_shard(np.arange(10, 14)), version=0)
    assert "capacity=None" in str(e.value) and "unchanged" in str(e.value), str(e.value)
    with pytest.raises(CapacityError, match=r"capacity=6"):
        d.ingest(id_shard(np.arange(20, 27)), version=1)  # larger than the capacity itself
    assert d.edp is not None and d.edp.capacity == 6
    assert sorted(v for mb in _deliver(d) for v in mb) == [0, 1, 2, 3], "the refused shards changed the buffer"
    d.ingest(id_shard(np.arange(10, 16)), version=0)  # fits once the rollout was delivered
    d.seal()
    assert sorted(v for mb in _deliver(d) for v in mb) == list(range(10, 16))
    d.close()


def test_growing_does_not_leak_the_previous_buffer() -> None:
    """The replaced buffer is closed and its scheduler let go (its gather buffers and rows go with it)."""
    import gc
    import weakref

    d = MinibatchDelivery(num_minibatches=1, epochs=1, seed=0, device="cpu")
    d.ingest(id_shard(np.arange(2)), version=0)
    old = d.edp
    assert old is not None
    d.ingest(id_shard(np.arange(2, 6)), version=0)
    assert d.edp is not old and old.closed and d.edp.capacity >= 6
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None, "the replaced buffer is still referenced"
    d.seal()
    assert sorted(v for mb in _deliver(d) for v in mb) == list(range(6))
    d.close()
