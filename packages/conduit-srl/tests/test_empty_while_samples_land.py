"""``empty()`` while the last samples land: a batch stored between its looks is still seen.

``empty()`` looks at what is stored, then at what is still on its way to storage. Read apart, a group the
ingestion stored in between counted as neither, and ``empty()`` said True with a whole batch waiting: SRL's
training thread then stopped with that batch undelivered (seen once as 224 of 256 samples delivered in the
driver benchmark).
"""

from __future__ import annotations

import threading

from conduit_srl import ConduitBuffer
from conduit_srl.testing import entry_ids, make_sample


def test_a_batch_stored_between_empty_looks_is_not_reported_empty() -> None:
    b = ConduitBuffer(batch_size=4, capacity=16, overlap=True)  # (Conduit's worker stores: its call is gated)
    try:
        b.put(make_sample([0]))
        b.flush()
        a = b._a
        edp = a.edp
        assert edp is not None
        landed = threading.Event()  # the storing of the next puts waits for it
        real_ingest, real_pending = edp.ingest_now, a._pending_samples

        def gated_ingest(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the ingestion worker's call
            landed.wait(30)
            return real_ingest(*args, **kwargs)

        def pending_after_landing() -> int:
            # the ingestion stores what is on its way right before empty() reads it; it cannot while this thread
            # holds the plane's lock (where the reads belong together)
            landed.set()
            if not edp.holds_lock():
                edp.flush()
            return real_pending()

        edp.ingest_now = gated_ingest  # type: ignore[method-assign]
        a._pending_samples = pending_after_landing  # type: ignore[method-assign]
        for i in range(1, 4):
            b.put(make_sample([i]))  # completes a batch of 4, still on its way to storage
        assert not b.empty(), "empty() said True with a whole batch stored during its call"
        landed.set()
        assert entry_ids(b.get()).tolist() == [0, 1, 2, 3]
    finally:
        b.close()
