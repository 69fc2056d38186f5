"""``MinibatchDelivery(on_stale="raise")``: a caller that catches the error can drop the stale rollouts and go on.

The refusal leaves the stale rollout at the head (as ``conduit.OnPolicy``'s ``raise`` leaves its state unchanged) and
its staleness only grows, so every later delivery raised again, also for the fresh rollouts behind it, and nothing
public dropped it. The error now says how many items are stale and how to go on; ``drop_stale`` drops them (counted
in ``dropped_items``, as ``on_stale="drop"`` counts them).
"""

from __future__ import annotations

import numpy as np
import pytest
from conduit import StaleExperienceError
from conduit_verl.delivery import MinibatchDelivery
from conduit_verl.testing import check_minibatch, id_shard


@pytest.mark.parametrize("seed", [0, None], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_drop_stale_drops_the_stale_rollouts_and_delivery_goes_on(prefetch: bool, seed: int | None) -> None:
    d = MinibatchDelivery(num_minibatches=2, epochs=2, seed=seed, device="cpu", prefetch=prefetch, on_stale="raise")
    assert d.drop_stale() == 0  # nothing ingested: nothing stale
    d.ingest(id_shard(np.arange(4)), version=0)
    d.seal()
    d.ingest(id_shard(np.arange(10, 13)), version=1)
    d.seal()
    d.ingest(id_shard(np.arange(20, 26)), version=2)
    d.seal()
    d.set_policy_version(2)
    for _ in range(2):  # refused again and again while it stays, nothing dropped
        with pytest.raises(StaleExperienceError) as e:
            d.next_minibatch()
        assert "4 items" in str(e.value) and "drop_stale()" in str(e.value), str(e.value)
    assert d.semantics.dropped_items == 0 and d.delivered == 0
    assert d.drop_stale() == 7  # the rollouts of versions 0 and 1, oldest first
    assert d.semantics.dropped_items == 7
    got = [(check_minibatch(td).tolist(), info.version) for td, info in d.minibatches()]
    assert [v for _, v in got] == [2] * 4
    assert sorted(x for mb, _ in got[:2] for x in mb) == list(range(20, 26))
    assert d.drop_stale() == 0
    d.close()
