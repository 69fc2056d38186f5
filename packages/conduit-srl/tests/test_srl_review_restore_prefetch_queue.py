"""A queue restored from a checkpoint assembles ahead as the live buffer it was taken from (``prefetch`` > 0).

Once a ``get()`` happened, a live buffer's assembler is *armed*: when it found nothing to assemble, the next put that
completes a batch wakes it, and the batch it turns is delivered as turned, also if later puts evict its samples
(README: entries the assembler turned already are delivered as turned). A restored buffer came back disarmed: it
assembled nothing until its first ``get()``, so the same later puts evicted that batch there, and the restored buffer
counted it in ``queue_dropped`` where the live one delivered it. The checkpoint changed what the trainer got and split
the drop counters between the two (live: 0 dropped; restored: 2).
"""

from __future__ import annotations

import pickle

import numpy as np
from conduit_srl import ConduitBuffer
from conduit_srl.testing import entry_ids, make_sample

WAIT_S = 60.0  # only a failure waits this long


def put(b: ConduitBuffer, lo: int, hi: int) -> None:
    b.put_batch(make_sample(np.arange(lo, hi), batched=True))
    b.flush()


def prepared(b: ConduitBuffer, n: int) -> bool:
    """Whether the assembler thread comes to hold ``n`` entries (it notifies the buffer's condition per entry)."""
    a = b._a
    with a._cv:
        return a._cv.wait_for(lambda: len(a._ready) >= n, timeout=WAIT_S)


def test_a_restored_queue_delivers_and_drops_what_the_live_one_does() -> None:
    live = ConduitBuffer(batch_size=2, capacity=6, prefetch=2)
    restored: ConduitBuffer | None = None
    try:
        put(live, 0, 4)
        put(live, 4, 5)  # one sample short of the next batch after [2, 3]
        assert entry_ids(live.get()).tolist() == [0, 1]
        assert prepared(live, 1)  # [2, 3] assembled ahead; [4] alone is no batch: the assembler waits for a put
        restored = pickle.loads(pickle.dumps(live))
        got: dict[str, list[list[int]]] = {}
        counts = {}
        for name, b in (("live", live), ("restored", restored)):
            put(b, 5, 9)  # completes [4, 5]: the armed assembler turns it
            assert prepared(b, 2), f"{name}: the put that completed a batch did not wake the assembler"
            put(b, 9, 12)  # evicts 3, 4, 5 (capacity 6): [4, 5] was turned already
            got[name] = [entry_ids(b.get()).tolist() for _ in range(2)]
            assert prepared(b, 2)
            s = b.stats()
            counts[name] = {k: s[k] for k in ("samples_delivered", "queue_dropped", "samples_waiting", "qsize")}
            assert s["samples_put"] == s["samples_delivered"] + s["queue_dropped"] + s["samples_waiting"], s
        assert got["live"] == got["restored"] == [[2, 3], [4, 5]], got
        assert counts["live"] == counts["restored"], counts
        assert counts["restored"]["queue_dropped"] == 0, counts
    finally:
        live.close()
        if restored is not None:
            restored.close()
