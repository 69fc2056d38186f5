"""On-policy drop counters across a checkpoint taken with entries assembled ahead (``prefetch`` > 0).

The open limitation "drop counter split after restore with prefetch" was a queue's (a restored buffer came back
disarmed: test_srl_review_restore_prefetch_queue.py). On-policy it was looked for here too: a rollout's samples must
land in exactly one of ``samples_delivered`` / ``stale_dropped`` (assembled ahead, never handed out) /
``rollout_dropped`` (never assembled), and a buffer restored from ``pickle`` must count a later drop exactly as the
live buffer it was taken from. These cases (prefetch 1 and 2, first or second epoch, version moved before or after
the checkpoint, the drop met by ``get()`` or ``empty()``, a second rollout behind) agreed before that fix too; they
guard the on-policy restore path.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from conduit import EmptyBufferError
from conduit_srl import ConduitBuffer
from conduit_srl.testing import make_sample

WAIT_S = 60.0
COUNTS = ("samples_delivered", "stale_dropped", "rollout_dropped", "samples_waiting", "qsize")


def accounted(s: dict[str, Any]) -> int:
    return (s["samples_delivered"] + s["late_dropped"] + s["stale_dropped"] + s["rollout_dropped"]
            + s["queue_dropped"] + s["samples_waiting"])


def wait_prepared(b: ConduitBuffer, n: int) -> None:
    """Until the assembler thread holds ``n`` entries (it notifies the buffer's condition as it adds one)."""
    a = b._a
    with a._cv:
        assert a._cv.wait_for(lambda: len(a._ready) >= n, timeout=WAIT_S), "the assembler prepared nothing"


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("epochs_before", [0, 1])
@pytest.mark.parametrize("moved", ["before", "after"])
@pytest.mark.parametrize("meet", ["get", "empty"])
@pytest.mark.parametrize("second_rollout", [False, True])
def test_a_restored_buffer_counts_a_drop_as_the_live_one(prefetch: int, epochs_before: int, moved: str, meet: str,
                                                         second_rollout: bool) -> None:
    live = ConduitBuffer(semantics="on_policy", capacity=32, num_minibatches=4, num_epochs=2, max_staleness=0,
                         prefetch=prefetch, seed=0)
    restored: ConduitBuffer | None = None
    try:
        live.put_batch(make_sample(np.arange(8), batched=True, version=0))
        live.seal()
        if second_rollout:
            live.put_batch(make_sample(np.arange(8, 16), batched=True, version=0))
            live.seal()
        for _ in range(4 * epochs_before + 1):
            live.get()
        wait_prepared(live, prefetch)
        if moved == "before":
            live.set_policy_version(1)
        restored = pickle.loads(pickle.dumps(live))
        assert restored.stats() == live.stats()
        seen = []
        for b in (live, restored):
            if moved == "after":
                b.set_policy_version(1)
            if meet == "get":
                with pytest.raises(EmptyBufferError):
                    b.get()
            else:
                assert b.empty()
            s = b.stats()
            assert accounted(s) == s["samples_put"] and s["samples_waiting"] == 0, s
            seen.append({k: s[k] for k in COUNTS})
        assert seen[0] == seen[1], f"live {seen[0]} != restored {seen[1]}"
        first_epoch_done = 8 if epochs_before else 2
        assert seen[0]["samples_delivered"] == first_epoch_done
    finally:
        live.close()
        if restored is not None:
            restored.close()
