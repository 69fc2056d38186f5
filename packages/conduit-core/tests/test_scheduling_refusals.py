"""The overlapped scheduler: flush after a failed close retries instead of hanging; bad granularities
are refused with a typed error."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from conduit import CapacityError, ExperienceDataPlane, OnPolicy, Overlapped
from conduit.testing.reference import ID_SCHEMA, id_batch


def _run_with_timeout(fn: Any, timeout: float = 10.0) -> tuple[bool, BaseException | None]:
    """Run ``fn`` in a daemon thread: (finished, what it raised)."""
    out: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            out[0] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out[0]


def test_flush_after_a_failed_close_does_not_hang_and_retries() -> None:
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=OnPolicy(num_minibatches=2, seed=5),
                              scheduler=Overlapped())
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    edp.ingest(id_batch(np.arange(100, 110)), version=1)  # does not fit until the first rollout is consumed
    with pytest.raises(CapacityError):
        edp.close()
    assert [h.batch.batch_size for h in edp.scheduler.pending()] == [10]
    # still failing: flush must raise (typed), not wait forever for a worker that has stopped
    finished, err = _run_with_timeout(edp.flush)
    assert finished, "flush() after a failed close() waits forever"
    assert isinstance(err, CapacityError)
    assert [h.batch.batch_size for h in edp.scheduler.pending()] == [10], "the unstored batch was lost"
    while not edp.deliver()[1].last:  # consume the first rollout: room for the second
        pass
    finished, err = _run_with_timeout(edp.flush)
    assert finished and err is None, f"the retry after close failed: {err!r}"
    assert edp.scheduler.pending() == []
    assert len(edp) == 10


@pytest.mark.parametrize("kwargs", [{"g_ing": float("nan")}, {"g_ing": float("inf")}, {"g_del": float("nan")},
                                    {"g_del": float("inf")}, {"g_ing": "2"}])
def test_retune_refuses_non_finite_granularities_typed_and_unchanged(kwargs: dict[str, Any]) -> None:
    from conduit import ConduitError, Replay

    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=Overlapped(g_ing=2, g_del=2))
    s = edp.scheduler
    with pytest.raises(ConduitError):
        s.retune(**kwargs)
    assert (s.g_ing, s.g_del, s._chunk) == (2, 2, 2)
    edp.close()


@pytest.mark.parametrize("kwargs", [{"g_ing": float("inf")}, {"g_del": float("inf")}])
def test_infinite_off_policy_granularity_is_refused_typed(kwargs: dict[str, Any]) -> None:
    from conduit import ConduitError, Replay

    with pytest.raises(ConduitError):
        ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=Overlapped(**kwargs))
