"""A queue buffer (nothing assembled ahead) against a sequential queue written from the README, call by call.

Random puts (single and batched, partial batches included), gets, ``empty()``, ``qsize()``, ``stats()`` and
checkpoints (the buffer is replaced by its pickled copy) on small capacities, so that eviction meets batches
owed reuses and Conduit's own selection ahead. Every delivery, refusal and counter must be the model's.
"""

from __future__ import annotations

import pickle
import random

import pytest
from conduit import EmptyBufferError
from conduit_srl import ConduitBuffer
from conduit_srl.testing import entry_ids, make_sample


class _Queue:
    """The oldest ``n`` undelivered samples, each batch ``reuses`` times in a row; storage keeps the newest
    ``capacity`` samples (eviction drops undelivered samples, ``dropped``, and the remaining reuses of a batch
    handed out fewer than ``reuses`` times, ``abandoned``). A reuse ``empty()`` reports while fewer than ``n`` new
    samples wait is assembled then and delivered whatever is evicted after (README: ``empty()``)."""

    def __init__(self, n: int, capacity: int, reuses: int) -> None:
        self.n, self.capacity, self.reuses = n, capacity, reuses
        self.next = self.nxt = 0
        self.cur: tuple[int, int] | None = None  # (first, deliveries so far) of a batch owed reuses
        self.pinned: tuple[list[int], int] | None = None
        self.dropped = self.abandoned = self.delivered = self.entries = 0

    def put(self, k: int) -> None:
        self.next += k
        oldest = max(0, self.next - self.capacity)
        if self.nxt < oldest:
            self.dropped += oldest - self.nxt
            self.nxt = oldest
        if self.cur is not None and self.cur[0] < oldest:
            self.abandoned += 1
            self.cur = None

    def deliverable(self) -> bool:
        return self.pinned is not None or self.cur is not None or self.next - self.nxt >= self.n

    def empty(self) -> bool:
        if self.pinned is None and self.cur is not None and self.next - self.nxt < self.n:
            self.pinned = self._take()
        return not self.deliverable()

    def get(self) -> tuple[list[int], int]:
        self.entries += 1
        if self.pinned is not None:
            out, self.pinned = self.pinned, None
            return out
        return self._take()

    def _take(self) -> tuple[list[int], int]:
        if self.cur is None:
            first, uses = self.nxt, 0
            self.nxt += self.n
            self.delivered += self.n
        else:
            first, uses = self.cur
        self.cur = (first, uses + 1) if uses + 1 < self.reuses else None
        return list(range(first, first + self.n)), uses

    def counters(self) -> dict[str, int]:
        waiting = self.next - self.nxt
        return {"samples_put": self.next, "samples_delivered": self.delivered, "entries_delivered": self.entries,
                "queue_dropped": self.dropped, "queue_abandoned": self.abandoned, "samples_waiting": waiting,
                "qsize": waiting}


@pytest.mark.parametrize("seed", range(24))
def test_queue_calls_match_the_sequential_queue(seed: int) -> None:
    rnd = random.Random(seed)
    n = rnd.choice([1, 2, 3])
    capacity = max(n, rnd.choice([n, n + 1, 2 * n, 5]))
    reuses = rnd.choice([1, 2, 3])
    args = dict(batch_size=n, capacity=capacity, reuses=reuses, prefetch=0, overlap=rnd.choice([True, False]),
                g_ing=rnd.choice([1, 2]))
    b = ConduitBuffer(**args)
    model = _Queue(n, capacity, reuses)
    calls: list[str] = []
    try:
        for _ in range(60):
            call = rnd.choice(["put", "put", "put_batch", "get", "get", "get", "empty", "checkpoint", "stats",
                               "qsize"])
            calls.append(call)
            where = (args, calls)
            if call == "put":
                b.put(make_sample([model.next], time_steps=2))
                model.put(1)
            elif call == "put_batch":
                k = rnd.randint(1, capacity)
                b.put_batch(make_sample(list(range(model.next, model.next + k)), time_steps=2, batched=True))
                model.put(k)
            elif call == "get" and model.deliverable():
                e = b.get()
                ids, uses = model.get()
                assert (entry_ids(e).tolist(), e.reuses, e.reuses_left) == (ids, uses, reuses - 1 - uses), where
            elif call == "get":
                with pytest.raises(EmptyBufferError):
                    b.get()
            elif call == "empty":
                assert b.empty() == model.empty(), where
            elif call == "checkpoint":
                restored = pickle.loads(pickle.dumps(b))
                b.close()
                b = restored
            elif call == "qsize":
                assert b.qsize() == model.next - model.nxt, where
            else:
                b.flush()  # (queue_dropped and queue_abandoned count evictions once the puts are stored)
                s = b.stats()
                assert {k: s[k] for k in model.counters()} == model.counters(), where
    finally:
        b.close()
