"""Queue semantics as a Conduit sampler: batches in arrival order, each delivered ``reuses`` times.

This is what SRL's queue buffers do for on-policy trainers, expressed over Conduit's FIFO ring
(``Replay(FifoSampler(reuses=R))``): the ring keeps capacity and eviction, the sampler keeps a
cursor. Samples evicted before they were delivered (the producers outran the trainer by more
than the capacity) are counted in :attr:`FifoSampler.dropped`, never delivered out of order.

A prefetching scheduler selects ahead and may discard what it prepared (on a checkpoint, for
instance). So the sampler keeps two cursors: the *selection* cursor that ``sample`` advances,
and the *confirmed* one, advanced by :meth:`confirm` when a delivery really left the scheduler.
Checkpoints save the confirmed cursor, and :meth:`rewind` moves the selection cursor back to it
after a discard: nothing prepared and dropped is lost, nothing is delivered twice.

Prefetch never changes what is delivered: a selection prepared ahead whose items eviction took
before it was delivered (:meth:`FifoSampler.prepared_evicted`) is discarded by the next delivery
and its items counted in ``dropped``, as a queue without prefetch would have dropped them. So a
buffer delivers the same batches whether or not it prepared ahead or took a checkpoint meanwhile.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from conduit import ConfigurationError, EmptyBufferError
from conduit.semantics import SampleInfo, Sampler, Selection
from conduit.storage.base import AppendResult, Storage

__all__ = ["FifoSampler"]

#: (handle after the last selected batch, (first, count, deliveries so far) of a batch being reused)
_Cursor = tuple[int, "tuple[int, int, int] | None"]


class FifoSampler(Sampler):
    """Deliver the oldest ``n`` undelivered items, then that same batch ``reuses - 1`` more times.

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
        self._sel: _Cursor = (0, None)
        self._conf: _Cursor = (0, None)
        #: handle after the last item ``sample`` selected (unlike ``_sel``, not moved past evicted items)
        self._picked = 0
        #: selections made and confirmed (each written by one thread: ``sample`` runs in Conduit's worker,
        #: ``confirm`` in the delivering thread); the difference is what the scheduler holds prepared
        self._selected = 0
        self._confirmed = 0
        #: first handle of each selection not confirmed yet, in order (appended by ``sample``, taken by ``confirm``)
        self._starts: deque[int] = deque()
        #: items evicted before they were delivered
        self.dropped = 0
        #: batches delivered (confirmed) fewer than ``reuses`` times whose remaining reuses were skipped because
        #: eviction took some of their items, counted once the confirmed cursor left them (see :meth:`owed_evicted`)
        self.abandoned = 0

    # -- what is left --------------------------------------------------------------------------
    def undelivered(self) -> int:
        """Live items not yet delivered (by the confirmed cursor)."""
        st = self.storage
        return st.next_handle - max(self._conf[0], st.oldest)

    def held_ahead(self) -> int:
        """Items selected ahead (not confirmed) that eviction took from storage since: their prepared delivery
        is discarded, not delivered, and they count in ``dropped`` (see :meth:`prepared_evicted`)."""
        oldest = self.storage.oldest
        first = self._starts[0] if self._starts else self._picked
        return max(0, min(self._picked, oldest) - max(self._conf[0], first))

    def owed_evicted(self) -> int:
        """1 when eviction took items of the batch the confirmed cursor still owes reuses (it is abandoned: its
        prepared reuses are discarded, as :meth:`prepared_evicted`, and no selection reaches it again), else 0.
        ``abandoned`` counts it once the cursor leaves it (:meth:`confirm` of the next batch, :meth:`rewind`).

        Only delivered batches are abandoned: a batch selected ahead that eviction took before its first delivery
        is never delivered, and its items count in ``dropped`` (:meth:`held_ahead`), as without prefetch."""
        cur = self._conf[1]
        return int(cur is not None and cur[0] < self.storage.oldest)

    def prepared_evicted(self) -> bool:
        """Whether eviction took items of a selection prepared ahead (not confirmed): the scheduler must discard
        what it prepared before the next delivery (then :meth:`rewind`), so that the delivery is what a queue
        without prefetch delivers now. Read it under the buffer's lock, where storing evicts."""
        return bool(self._starts) and self._starts[0] < self.storage.oldest

    def can_deliver(self, n: int) -> bool:
        """Whether a batch of ``n`` is waiting (by the confirmed cursor, so live prepared ones count).

        A batch owed more reuses counts only while its items are live (eviction abandons it).
        """
        cur = self._conf[1]
        if (self._selected > self._confirmed and not self.prepared_evicted()) or (
                cur is not None and cur[0] >= self.storage.oldest):
            return True
        return self.undelivered() >= n

    # -- the two cursors -----------------------------------------------------------------------
    def confirm(self, info: SampleInfo) -> None:
        """A delivery selected by this sampler left the scheduler: advance the confirmed cursor past it."""
        h = info.handles
        first, count, uses = int(h[0]), int(h.shape[0]), int(info.epoch or 0) + 1
        self._confirmed += 1
        if self._starts:
            self._starts.popleft()
        owed = self._conf[1]
        if owed is not None and owed[0] != first:  # selection left a batch owed reuses: only eviction does that
            self.abandoned += 1
        self._conf = (max(self._conf[0], first + count), None if uses >= self.reuses else (first, count, uses))

    def _rewound(self) -> tuple[_Cursor, int, int]:
        """The cursor, ``dropped`` and ``abandoned`` once unconfirmed selections are forgotten.

        The cursor is the confirmed one moved past evicted items, without a reused batch that
        eviction took. ``dropped`` adds the items selected, not confirmed and evicted meanwhile
        (lost if their delivery is discarded); items evicted before any selection reached them
        were counted in :meth:`on_append` already (also those between the confirmed cursor and
        the first unconfirmed selection, which eviction made the selection skip). ``abandoned``
        adds the confirmed cursor's reused batch when eviction took it (:meth:`owed_evicted`).
        """
        oldest = self.storage.oldest
        nxt, cur = self._conf
        owed = self.owed_evicted()
        return (max(nxt, oldest), None if owed else cur), self.dropped + self.held_ahead(), self.abandoned + owed

    def rewind(self) -> None:
        """Forget selections that were not confirmed (their deliveries were discarded)."""
        cursor, self.dropped, self.abandoned = self._rewound()
        self._sel = self._conf = cursor
        self._picked = cursor[0]
        self._confirmed = self._selected
        self._starts.clear()

    def draw_state(self) -> Any:
        """Where selection stands (selections made, the selection cursor, :attr:`_picked`): what a prefetching
        scheduler gives back through :meth:`rewind_draws` when it drops selections it made ahead."""
        return self._selected, self._sel, self._picked

    def rewind_draws(self, state: Any) -> None:
        """Forget the selections made since ``state`` (a :meth:`draw_state`): they were not delivered (a prefetch
        whose storage read failed, or prepared batches a scheduler discarded), so their items are selected again,
        in order. Selections made before ``state`` and not confirmed yet stay selected.

        Run under the buffer's lock. Items of the forgotten selections that eviction took meanwhile count in
        ``dropped`` (as in :meth:`rewind`: no selection reaches them again); a reused batch that eviction took is
        not selected again (``abandoned`` counts it by the confirmed cursor, :meth:`owed_evicted`).
        """
        selected, (nxt, cur), picked = state
        if self._selected <= selected:
            return  # (nothing selected since)
        for _ in range(min(self._selected - selected, len(self._starts))):
            self._starts.pop()
        oldest = self.storage.oldest
        # the forgotten selections read [nxt, _picked) anew; on_append counted evictions past that only
        self.dropped += max(0, min(self._picked, oldest) - nxt)
        if cur is not None and cur[0] < oldest:
            cur = None
        self._sel = (max(nxt, oldest), cur)
        self._picked = picked
        self._selected = selected

    # -- Sampler -------------------------------------------------------------------------------
    def on_append(self, result: AppendResult, priorities: torch.Tensor | None) -> None:
        nxt, cur = self._sel
        if result.evicted_to > nxt:
            self.dropped += result.evicted_to - max(result.evicted_from, nxt)
            nxt = result.evicted_to
        if cur is not None and cur[0] < result.evicted_to:  # (abandoned: counted by the confirmed cursor)
            cur = None
        self._sel = (nxt, cur)

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        st = self.storage
        nxt, cur = self._sel
        if cur is None:
            start = max(nxt, st.oldest)
            if st.next_handle - start < n:
                raise EmptyBufferError(f"{st.next_handle - start} new samples wait, a batch needs {n}; put more "
                                       f"samples first.")
            cur = (start, n, 0)
        elif cur[1] != n:
            raise ConfigurationError(f"A batch of {cur[1]} is being reused; ask for {cur[1]} items until its "
                                     f"reuses are done.")
        first, count, uses = cur
        handles = torch.arange(first, first + count, dtype=torch.int64)
        uses += 1
        self._sel = (max(nxt, first + count), None if uses >= self.reuses else (first, count, uses))
        self._picked = max(self._picked, first + count)
        self._selected += 1
        self._starts.append(first)
        return Selection(handles % st.capacity, SampleInfo(handles=handles, epoch=uses - 1))

    def state_dict(self) -> dict[str, Any]:
        # saved as rewind() would leave it (a restored sampler would otherwise redeliver evicted slots' new occupants)
        cursor, dropped, abandoned = self._rewound()
        return {"cursor": cursor, "dropped": dropped, "abandoned": abandoned}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        nxt, cur = state["cursor"]
        self._sel = self._conf = (int(nxt), None if cur is None else tuple(cur))  # type: ignore[assignment]
        self._picked = int(nxt)
        self._selected = self._confirmed = 0
        self._starts.clear()
        self.dropped = int(state["dropped"])
        self.abandoned = int(state["abandoned"])
