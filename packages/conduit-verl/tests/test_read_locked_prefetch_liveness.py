"""Liveness of conduit-verl's prefetched delivery under ``read_locked``: waits that must end under legitimate use."""

from __future__ import annotations

import torch
from conduit.testing.lifecycle import call_bounded
from conduit_verl.delivery import MinibatchDelivery
from tensordict import TensorDict


def _shard(n: int = 8) -> TensorDict:
    return TensorDict({"x": torch.arange(n, dtype=torch.float32).unsqueeze(1)}, batch_size=n)


def test_prefetched_delivery_inside_read_locked_does_not_deadlock() -> None:
    """Two deliveries in one ``read_locked``: the first submits a prefetch job that waits for the buffer's lock the
    caller holds; the second must not wait for that job forever (core's contract: it draws the batch itself)."""
    d = MinibatchDelivery(num_minibatches=4, epochs=1, seed=0, device="cpu", prefetch=True)
    d.ingest(_shard(), version=0)
    d.seal()
    assert d.edp is not None
    edp = d.edp

    def two() -> list[list[float]]:
        return edp.read_locked(lambda: [d.next_minibatch()[0]["x"].flatten().tolist() for _ in range(2)])

    hang = "a delivery inside read_locked waited forever for the prefetch job that waits for the lock"
    got = call_bounded(two, hang=hang)
    assert not isinstance(got, BaseException), got
    rest = [td["x"].flatten().tolist() for td, _ in d.minibatches()]
    seen = sorted(v for mb in got + rest for v in mb)
    assert seen == [float(i) for i in range(8)]  # nothing lost nor duplicated
    d.close()


def test_close_inside_read_locked_refuses_instead_of_waiting_for_the_prefetch_job() -> None:
    """``close`` holding the buffer's lock while the prefetch job waits for it: ConfigurationError, buffer open."""
    from conduit import ConfigurationError

    d = MinibatchDelivery(num_minibatches=4, epochs=1, seed=0, device="cpu", prefetch=True)
    d.ingest(_shard(), version=0)
    d.seal()
    assert d.edp is not None
    edp = d.edp

    def deliver_then_close() -> list[float]:
        def fn() -> list[float]:
            first = d.next_minibatch()[0]["x"].flatten().tolist()
            d.close()
            return first

        return edp.read_locked(fn)

    got = call_bounded(deliver_then_close,
                       hang="close inside read_locked waited forever for the prefetch job that waits for the lock")
    assert isinstance(got, ConfigurationError), got
    assert not edp.closed
    rest = [td["x"].flatten().tolist() for td, _ in d.minibatches()]  # the buffer goes on: nothing lost
    assert sorted(v for mb in rest for v in mb) == [float(i) for i in range(2, 8)]
    d.close()
    assert edp.closed
