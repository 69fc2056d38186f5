"""The multi-node buffer's scheduler primitives record their span when they raise, with no items.

As on the single-node buffer (test_telemetry_failed_background_calls.py): ``ingest_now``, ``deliver_now``,
``gather_now`` and ``prepare_now`` of :class:`DistributedDataPlane` recorded their span only on success, so a
write or a read that failed on a scheduler's worker (e.g. a read that waited for a dead shard until the timeout)
left that worker's time out of the hidden time and the totals. Each primitive is run on a real thread, as a
scheduler's worker runs it; no timing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")

from conduit import ExperienceBatch  # noqa: E402
from conduit.distributed import DistributedDataPlane  # noqa: E402
from conduit.errors import CapacityError, ConfigurationError, EmptyBufferError  # noqa: E402
from conduit.testing.reference import ID_SCHEMA, id_batch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_telemetry_failed_background_calls import _on_worker  # noqa: E402, I001  (runs a primitive on a thread)

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("call", ["ingest_now", "deliver_now", "prepare_now", "gather_now"])
def test_a_primitive_that_raises_on_a_worker_records_its_span(servers: Any, call: str) -> None:
    plane = DistributedDataPlane(ID_SCHEMA, capacity=32, servers=servers, health_period=None, measure=False)
    try:
        fn: Callable[[], Any]
        if call == "ingest_now":  # larger than the capacity
            big = ExperienceBatch.checked(id_batch(np.arange(64)), ID_SCHEMA)
            fn, kind, error = (lambda: plane.ingest_now(big)), "ingest", CapacityError
        elif call == "deliver_now":  # nothing stored yet
            fn, kind, error = (lambda: plane.deliver_now(2)), "deliver", EmptyBufferError
        elif call == "prepare_now":
            fn, kind, error = (lambda: plane.prepare_now([2])), "deliver", EmptyBufferError
        else:  # selected, then the buffer closed before the read
            plane.ingest(id_batch(np.arange(4)))
            sels = plane.select_now([2])
            assert sels is not None
            plane.close()
            fn, kind, error = (lambda: plane.gather_now(sels)), "deliver", ConfigurationError
        before = plane.telemetry.mark()
        err, tid = _on_worker(fn)
        assert isinstance(err, error), f"{call} did not raise as set up: {err!r}"
        calls, dropped = plane.telemetry.calls_since(before)
        assert not dropped
        spans = [r for r in calls if r.kind == kind and r.thread == tid]
        assert len(spans) == 1, f"{call} that raised on a worker recorded no span (or several): {calls}"
        assert spans[0].items == 0 and spans[0].nbytes == 0, "a failed call counted items it did not move"
    finally:
        plane.close()
