"""Queue semantics as a Conduit sampler: batches in arrival order, each delivered ``reuses`` times.

This is what SRL's queue buffers do for on-policy trainers, expressed over Conduit's FIFO ring
(``Replay(FifoSampler(reuses=R))``): the ring keeps capacity and eviction, the sampler keeps a
cursor. Samples evicted before their first delivery (the producers outran the trainer by more
than the capacity) are counted in :attr:`FifoSampler.dropped`, never delivered out of order.
"""

from __future__ import annotations

from typing import Any

import torch
from conduit import ConfigurationError, EmptyBufferError
from conduit.semantics import SampleInfo, Sampler
from conduit.semantics.base import Selection
from conduit.storage.base import AppendResult, Storage

__all__ = ["FifoSampler"]


class FifoSampler(Sampler):
    """Deliver the oldest ``n`` never-delivered items, then that same batch ``reuses - 1`` more times.

    ``SampleInfo.epoch`` of a delivery is how many times its batch was delivered before.

    Keyword Args:
        reuses: deliveries per batch (>= 1).
    """

    def __init__(self, *, reuses: int = 1) -> None:
        if not isinstance(reuses, int) or isinstance(reuses, bool) or reuses < 1:
            raise ConfigurationError(f"reuses must be an int >= 1, got {reuses!r}.")
        self.reuses = reuses

    def reset(self, storage: Storage, seed: int) -> None:
        super().reset(storage, seed)
        self._next = 0
        self._cur: tuple[int, int, int] | None = None  # (first handle, count, deliveries so far)
        #: items evicted before their first delivery
        self.dropped = 0
        #: batches whose remaining reuses were skipped because eviction took some of their items
        self.abandoned = 0

    @property
    def unread(self) -> int:
        """Live items never delivered."""
        st = self.storage
        return st.next_handle - max(self._next, st.oldest)

    def can_deliver(self, n: int) -> bool:
        """Whether ``sample(n)`` would succeed now."""
        return self._cur is not None or self.unread >= n

    def on_append(self, result: AppendResult, priorities: torch.Tensor | None) -> None:
        if result.evicted_to > self._next:
            self.dropped += result.evicted_to - max(result.evicted_from, self._next)
            self._next = result.evicted_to
        if self._cur is not None and self._cur[0] < result.evicted_to:
            self.abandoned += 1
            self._cur = None

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        st = self.storage
        if self._cur is None:
            start = max(self._next, st.oldest)
            if st.next_handle - start < n:
                raise EmptyBufferError(f"{st.next_handle - start} new samples wait, a batch needs {n}; put more "
                                       f"samples first.")
            cur = (start, n, 0)
        else:
            cur = self._cur
            if cur[1] != n:
                raise ConfigurationError(f"A batch of {cur[1]} is being reused; ask for {cur[1]} items until its "
                                         f"reuses are done.")
        first, count, uses = cur
        handles = torch.arange(first, first + count, dtype=torch.int64)
        uses += 1
        self._next = max(self._next, first + count)
        self._cur = None if uses >= self.reuses else (first, count, uses)
        return Selection(handles % st.capacity, SampleInfo(handles=handles, epoch=uses - 1))

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next, "cur": self._cur, "dropped": self.dropped, "abandoned": self.abandoned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next = int(state["next"])
        self._cur = None if state["cur"] is None else tuple(state["cur"])  # type: ignore[assignment]
        self.dropped = int(state["dropped"])
        self.abandoned = int(state["abandoned"])
