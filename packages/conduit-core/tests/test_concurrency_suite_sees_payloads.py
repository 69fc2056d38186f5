"""The concurrency suite checks payloads, not only ids: a torn concurrent write fails it.

The mutant is a real core endpoint whose ``insert`` writes, whenever the inserting thread
changes, the first row's payload from the previous (another thread's) batch: every id is still
stored exactly once, so only a payload check can see it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from conduit.testing import ConcurrencySuite, CoreReplayEndpoint
from conduit.testing.reference import id_batch


class TornWriteEndpoint(CoreReplayEndpoint):
    """On every change of producer thread, the first row of the call carries the last call's payload."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._last_thread: int | None = None
        self._last_obs: Any = None
        self.torn = 0

    def insert(self, ids: np.ndarray) -> None:
        batch = id_batch(ids)
        with self._lock:
            me = threading.get_ident()
            if self._last_thread is not None and me != self._last_thread:
                batch["obs"][0] = self._last_obs  # another batch's payload under this batch's id
                self.torn += 1
            self._last_thread, self._last_obs = me, id_batch(ids)["obs"][0].clone()
            self.edp.ingest(batch)


class NoInPlaceRead(TornWriteEndpoint):
    """The same mutant, for an adapter that cannot read payloads in place: the suite samples."""

    def verified_contents(self) -> None:  # type: ignore[override]  # the base ReplayEndpoint allows None
        return None


class _Suite(ConcurrencySuite):
    threads = 8
    items_per_thread = 5_000
    chunk = 50
    endpoint_type: type[CoreReplayEndpoint] = CoreReplayEndpoint
    made: list[CoreReplayEndpoint]

    def make_replay(self, **kwargs: Any) -> CoreReplayEndpoint:
        ep = self.endpoint_type(**kwargs)
        self.made.append(ep)
        return ep


def _run(endpoint_type: type[CoreReplayEndpoint]) -> tuple[BaseException | None, CoreReplayEndpoint]:
    suite = _Suite()
    suite.endpoint_type, suite.made = endpoint_type, []
    try:
        suite.test_concurrent_producers_lose_and_duplicate_nothing()
    except AssertionError as e:
        return e, suite.made[0]
    return None, suite.made[0]


def test_unmutated_core_endpoint_passes() -> None:
    err, _ = _run(CoreReplayEndpoint)
    assert err is None, f"the unmutated core endpoint failed the concurrency suite: {err}"


@pytest.mark.parametrize("mutant", [TornWriteEndpoint, NoInPlaceRead], ids=["verified_contents", "sampled"])
def test_torn_concurrent_write_fails_the_suite(mutant: type[TornWriteEndpoint]) -> None:
    err, ep = _run(mutant)
    assert isinstance(ep, TornWriteEndpoint) and ep.torn >= _Suite.threads - 1, (
        f"the mutant tore only {getattr(ep, 'torn', 0)} rows; every thread's first insert follows another's")
    assert err is not None, f"the concurrency suite passed an endpoint with {ep.torn} torn rows"
    msg = str(err)
    assert "torn write" in msg and "payload does not match its id" in msg, f"unreadable failure: {msg}"
