"""Session 27 liveness review of conduit-verl: waits that must end under legitimate use."""

from __future__ import annotations

import threading
from typing import Any

import torch
from conduit_verl.delivery import MinibatchDelivery
from tensordict import TensorDict


def _shard(n: int = 8) -> TensorDict:
    return TensorDict({"x": torch.arange(n, dtype=torch.float32).unsqueeze(1)}, batch_size=n)


def _bounded(fn: Any, seconds: float = 45.0) -> dict[str, Any]:
    """Run ``fn`` on a daemon thread; return what it returned or raised (``{}``: it did not return in time)."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    return out


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

    got = _bounded(two)
    assert got, "a delivery inside read_locked waited forever for the prefetch job that waits for the lock"
    assert "error" not in got, got
    rest = [td["x"].flatten().tolist() for td, _ in d.minibatches()]
    seen = sorted(v for mb in got["value"] + rest for v in mb)
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

    got = _bounded(deliver_then_close)
    assert got, "close inside read_locked waited forever for the prefetch job that waits for the lock"
    assert isinstance(got.get("error"), ConfigurationError), got
    assert not edp.closed
    rest = [td["x"].flatten().tolist() for td, _ in d.minibatches()]  # the buffer goes on: nothing lost
    assert sorted(v for mb in rest for v in mb) == [float(i) for i in range(2, 8)]
    d.close()
    assert edp.closed
