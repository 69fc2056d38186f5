"""Overlapped against Synchronous when the request changes (batch size, options), and retune's effect on what is
queued for storage."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conduit import ExperienceDataPlane, Overlapped, PrioritizedSampler, Replay, Scheduler, Synchronous
from conduit.testing.reference import ID_SCHEMA, id_batch

#: batch sizes of consecutive deliveries: every change discards what was prepared for the earlier size
SIZES = (4, 8, 8, 4, 2, 2, 8, 4)


def _handles(scheduler: Scheduler, *, prioritized: bool) -> list[tuple[list[int], list[float]]]:
    sem = Replay(PrioritizedSampler(alpha=1.0), seed=5) if prioritized else Replay(seed=5)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=sem, scheduler=scheduler)
    edp.ingest(id_batch(np.arange(40)))
    edp.flush()
    out = []
    for n in SIZES:
        _, info = edp.deliver(n, beta=0.5) if prioritized else edp.deliver(n)
        out.append((info.handles.tolist(), [] if info.weights is None else info.weights.tolist()))
    edp.close()
    return out


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("kwargs", [{"g_del": 1}, {"g_del": 3}, {"g_del": 2, "overlap": False}])
def test_a_change_of_batch_size_gives_the_prepared_draws_back(kwargs: dict[str, Any], prioritized: bool) -> None:
    """With nothing ingested or updated between deliveries, the draws are the synchronous ones, in order, also across
    changes of batch size: the draws prepared for the old size are made again for the new one, not skipped."""
    want = _handles(Synchronous(), prioritized=prioritized)
    got = _handles(Overlapped(**kwargs), prioritized=prioritized)
    assert [h for h, _ in got] == [h for h, _ in want], "draws prepared for another batch size were skipped"
    for (_, w_got), (_, w_want) in zip(got, want, strict=True):
        np.testing.assert_allclose(w_got, w_want, rtol=1e-6)
