"""On-policy semantics: a rollout is delivered as M minibatches per epoch for E epochs.

A *rollout* is the set of items ingested with one policy version. It is *sealed* when
``seal()`` is called or when items of another version arrive. Versions never go backwards:
a version lower than the open rollout's, or than the last sealed rollout's (delivered or
not, checkpointed with the buffer), is refused with :class:`ConfigurationError`; the same
version as the open rollout joins it, after a seal it starts a new rollout. Delivery serves sealed
rollouts oldest first; within one rollout each epoch is a fresh seeded permutation cut
into M minibatches (sizes differ by at most one), so each item appears exactly once per
epoch and a minibatch never mixes versions (an adapter that overrides ``epoch_sizes`` may end
the last epoch early: a partial extra pass, as RLlib's cyclic minibatches need). After the last
minibatch of the last epoch the rollout's storage is released.

Staleness is ``policy_version - rollout_version``; when it exceeds ``max_staleness`` at
delivery time the rollout is dropped (``on_stale="drop"``, counted in ``dropped_items``)
or :class:`conduit.StaleExperienceError` is raised (``on_stale="raise"``, state unchanged: the
stale rollout keeps waiting, and every delivery raises again until :meth:`OnPolicy.drop_stale`,
``ExperienceDataPlane.drop_stale()``, drops it as ``"drop"`` would, or the policy version goes back).

Consumed storage is never freed under a selection that was made but not handed over yet
(:meth:`OnPolicy.after_gather`, i.e. ``release_now``): a rollout dropped, or finished, while an
earlier selection of it or of an older rollout is still outstanding keeps its items live until that
selection is handed over (schedulers that select ahead, and direct callers of ``select_now``, hand
over every real selection; the built-in ones do so at once). Checkpoints keep both the outstanding
selections and the release they hold back.

Selections made ahead of their delivery (an adapter that assembles the next minibatches while the learner steps)
and then discarded undelivered because their rollout went stale can give their permutation draws back
(:meth:`OnPolicy.draw_mark`, :meth:`OnPolicy.take_back_draws`): the rollouts ordered afterwards are then shuffled
exactly as if those selections had never been made, so the order a learner sees does not depend on how far
ahead, or how fast, the adapter selected.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, Literal

import torch

from conduit.checks import is_bool, is_int
from conduit.errors import ConfigurationError, EmptyBufferError, StaleExperienceError
from conduit.semantics.base import SampleInfo, Selection, Semantics, check_seed
from conduit.storage.base import AppendResult

__all__ = ["OnPolicy", "check_version"]


def _non_negative_number(x: object) -> bool:
    """Whether ``x`` is a real number (not a bool) >= 0 (NaN is not)."""
    return not isinstance(x, bool) and isinstance(x, Real) and float(x) >= 0


def check_version(version: object) -> int:
    """``version`` as an int, or :class:`ConfigurationError` unless it is an integer (not a bool; a
    NumPy or 0-d tensor integer is fine)."""
    v = _as_version(version)
    if v is None:
        raise ConfigurationError(f"A policy version is an int (a NumPy or 0-d tensor integer is fine), got "
                                 f"{version!r}; pass the integer version of the policy.")
    return v


def _as_version(v: object) -> int | None:
    """``v`` as an int when it is an integer (not a bool), else None."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        return None


def _checked_rollout(t: object) -> tuple[int, int, int] | None:
    """A saved rollout ``(version, first, count)``, or None; ConfigurationError when it is neither."""
    if t is None:
        return None
    if (not isinstance(t, (tuple, list)) or len(t) != 3 or any(_as_version(x) is None for x in t)
            or int(t[1]) < 0 or int(t[2]) <= 0):  # (a rollout of no items is never kept: nothing to deliver)
        raise ConfigurationError(f"This checkpoint's on-policy rollout {t!r} is damaged (expected (version, first, "
                                 f"count) integers, first >= 0 and count > 0); load an undamaged state_dict().")
    return int(t[0]), int(t[1]), int(t[2])


@dataclass
class _Rollout:
    version: int
    first: int
    count: int


class OnPolicy(Semantics):
    """On-policy freshness semantics.

    Keyword Args:
        num_minibatches: M, minibatches per epoch (give this or ``minibatch_size``).
        minibatch_size: alternatively, the minibatch size; M = ceil(N / size), the last one smaller.
        num_epochs: E, passes over each rollout.
        max_staleness: versions a rollout may fall behind the policy and still be delivered.
        on_stale: ``"drop"`` or ``"raise"``.
        shuffle: reshuffle per epoch (``False`` keeps ingestion order).
        seed: seeds the per-epoch permutations.
    """

    kind = "on_policy"

    def __init__(self, *, num_minibatches: int | None = None, minibatch_size: int | None = None,
                 num_epochs: int = 1, max_staleness: int = 0, on_stale: Literal["drop", "raise"] = "drop",
                 shuffle: bool = True, seed: int = 0) -> None:
        if (num_minibatches is None) == (minibatch_size is None):
            raise ConfigurationError("Give exactly one of num_minibatches (M) or minibatch_size.")
        for name, v in (("num_minibatches", num_minibatches), ("minibatch_size", minibatch_size)):
            # (an integer of NumPy is one, a bool is none: True would silently mean 1)
            if v is not None and (not is_int(v) or v <= 0):
                raise ConfigurationError(f"{name} must be a positive int, got {v!r}.")
        if not is_int(num_epochs) or num_epochs <= 0:
            raise ConfigurationError(f"num_epochs must be a positive int, got {num_epochs!r}.")
        if not _non_negative_number(max_staleness):
            raise ConfigurationError(f"max_staleness must be a number >= 0 (versions), got {max_staleness!r}.")
        if not isinstance(on_stale, str) or on_stale not in ("drop", "raise"):  # (np.array(["drop"]) is "in" them)
            raise ConfigurationError(f"on_stale must be 'drop' or 'raise', got {on_stale!r}.")
        if not is_bool(shuffle):  # (a string such as "no" is truthy: it shuffled)
            raise ConfigurationError(f"shuffle must be True or False, got {shuffle!r}.")
        # plain ints: the cuts are Python lists, and a checkpoint holds them (torch.load(weights_only=True) reads it)
        self.num_minibatches = None if num_minibatches is None else int(num_minibatches)
        self.minibatch_size = None if minibatch_size is None else int(minibatch_size)
        self.num_epochs = int(num_epochs)
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.shuffle = bool(shuffle)
        self.seed = check_seed(seed)
        self.policy_version = 0
        self.dropped_items = 0
        self._gen = torch.Generator().manual_seed(self.seed)
        #: real selections made so far (a :meth:`draw_mark` records it; checkpointed)
        self._selections = 0
        #: set (under the buffer's lock) around a selection made ahead of its delivery: while it is True a selection
        #: that finds a waiting rollout stale raises :class:`~conduit.EmptyBufferError` and changes nothing, instead
        #: of dropping it (``on_stale="drop"``) or raising :class:`~conduit.StaleExperienceError`; the delivery the
        #: learner asks for drops it, at the policy version of that request. Not checkpointed
        self.defer_stale: bool = False
        self._open: _Rollout | None = None
        self._sealed: deque[_Rollout] = deque()
        self._cur: _Rollout | None = None
        self._epoch = 0
        self._k = 0
        self._perm: torch.Tensor | None = None
        self._bounds: list[int] = []
        self._finished_end: int | None = None
        self._last_sealed: int | None = None  # version of the rollout sealed last (delivered or not)
        #: real selections made and not handed over yet, by their rollout's first handle
        self._outstanding: dict[int, int] = {}
        #: handles below this are consumed (dropped, or finished and handed over) but not all released yet: some
        #: are under an outstanding selection (None: nothing held back)
        self._due: int | None = None

    # -- ingestion -------------------------------------------------------------------------
    def check_ingest(self, n: int, *, version: int | None, priorities: torch.Tensor | None) -> None:
        if version is None:
            raise ConfigurationError("On-policy ingestion needs the producing policy version: ingest(batch, "
                                     "version=v).")
        v = check_version(version)
        if priorities is not None:
            raise ConfigurationError("On-policy buffers take no priorities.")
        self.check_version_order(v)

    def check_version_order(self, version: int) -> None:
        """Refuse ``version`` (:class:`ConfigurationError`) when it is lower than the open rollout's or
        than the last sealed rollout's (delivered, dropped or not): versions must not go backwards."""
        open_, sealed = self._open, self._last_sealed  # read once: a background store may change them
        if open_ is not None and version < open_.version:
            raise ConfigurationError(f"Version {version} arrived after version {open_.version}; on-policy "
                                     f"versions must not go backwards.")
        if sealed is not None and version < sealed:
            raise ConfigurationError(f"Version {version} arrived after a rollout of version {sealed} was sealed; "
                                     f"on-policy versions must not go backwards.")

    def on_append(self, result: AppendResult, *, version: int | None, priorities: torch.Tensor | None) -> None:
        if not result.count:  # no items arrived: nothing to seal or to open
            return
        assert version is not None
        if type(version) is not int:
            # a NumPy or 0-d tensor integer (check_ingest took it) is kept as a plain int: deliveries report ints, and
            # torch.load(weights_only=True) reads the checkpoint
            version = operator.index(version)
        if self._open is not None and self._open.version != version:
            self.seal()
        if self._open is None:
            self._open = _Rollout(version, result.first, 0)
        self._open.count += result.count

    def seal(self) -> None:
        """Close the open rollout: it becomes deliverable and later items start a new one."""
        if self._open is not None and self._open.count:
            self._sealed.append(self._open)
            self._last_sealed = self._open.version
        self._open = None

    @property
    def open_rollout(self) -> tuple[int, int] | None:
        """(version, first handle) of the rollout being filled, None when none is open."""
        r = self._open
        return None if r is None else (r.version, r.first)

    @property
    def pending_rollouts(self) -> int:
        """Sealed rollouts not yet fully delivered (including the one in progress)."""
        return len(self._sealed) + (self._cur is not None)

    @property
    def fresh_rollouts(self) -> int:
        """Of :attr:`pending_rollouts`, those not too stale to deliver at the current policy version."""
        waiting = ([self._cur] if self._cur is not None else []) + list(self._sealed)
        return sum(not self.stale(r.version) for r in waiting)

    # -- delivery --------------------------------------------------------------------------
    def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
        """The order in which epoch ``epoch`` of the current rollout (``n`` items) visits them.

        Default: a permutation from the seeded generator (the identity with ``shuffle=False``).
        Adapters override it to reproduce a framework's own loader order; whatever it returns
        must be a permutation of ``range(n)`` (checked, so an override can never skip or
        repeat an item within an epoch).
        """
        return torch.randperm(n, generator=self._gen) if self.shuffle else torch.arange(n)

    def epoch_sizes(self, n: int, epoch: int) -> list[int]:
        """The sizes of the minibatches epoch ``epoch`` of the current rollout (``n`` items) is cut into,
        in delivery order.

        Default: ``num_minibatches`` sizes that differ by at most one, or chunks of ``minibatch_size``
        (the last one smaller). Adapters override it to reproduce a framework's own minibatch cuts;
        whatever it returns must be a list of positive ints summing to ``n`` (checked), except that the
        last epoch may stop early (sum ``<= n``: a partial pass that delivers only the head of its order,
        e.g. to fill a fixed-size minibatch as RLlib's cyclic iterator does). Called when the epoch
        starts, after :meth:`epoch_order` (the next epoch starts as the current one's last minibatch is
        selected). A refused order or cut raises :class:`ConfigurationError` from that delivery and changes
        nothing: the permutation RNG is untouched and the same minibatch is the next delivery.
        """
        if self.num_minibatches is not None:
            m = min(self.num_minibatches, n)
            q, r = divmod(n, m)
            return [q + (1 if i < r else 0) for i in range(m)]
        assert self.minibatch_size is not None
        return [min(self.minibatch_size, n - s) for s in range(0, n, self.minibatch_size)]

    def _start_epoch(self) -> None:
        """Order and cut epoch ``self._epoch``; a refused order or cut (ConfigurationError) leaves the
        permutation RNG as it was."""
        rng = self._gen.get_state()
        try:
            self._start_epoch_checked()
        except ConfigurationError:
            self._gen.set_state(rng)
            raise

    def _start_epoch_checked(self) -> None:
        assert self._cur is not None
        n = self._cur.count
        perm = self.epoch_order(n, self._epoch)
        if type(self).epoch_order is not OnPolicy.epoch_order and (
                tuple(perm.shape) != (n,) or not torch.equal(torch.sort(perm).values, torch.arange(n))):
            raise ConfigurationError(f"{type(self).__name__}.epoch_order returned {tuple(perm.shape)} indices that "
                                     f"are not a permutation of range({n}); return each index exactly once.")
        sizes = self.epoch_sizes(n, self._epoch)
        if type(self).epoch_sizes is not OnPolicy.epoch_sizes:
            ok = isinstance(sizes, (list, tuple)) and all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
            total = sum(sizes) if ok else -1
            whole = self._epoch < self.num_epochs - 1
            if total <= 0 or total > n or (whole and total != n):
                raise ConfigurationError(f"{type(self).__name__}.epoch_sizes returned {sizes!r} for epoch "
                                         f"{self._epoch} of {self.num_epochs} over {n} items; return a list of "
                                         f"positive ints summing to {n} (at most {n} in the last epoch).")
        self._perm = perm
        self._bounds = _cuts(sizes)
        self._k = 0

    def stale(self, version: int) -> bool:
        """Whether a rollout of policy ``version`` is now more than ``max_staleness`` versions behind."""
        return self.policy_version - version > self.max_staleness

    def _drop(self, r: _Rollout) -> None:
        self.dropped_items += r.count
        if not self.peeking:  # a prediction only: the real delivery drops it (and frees its storage) again
            self._release(r.first + r.count)

    def _release(self, end: int) -> None:
        """Free the consumed handles below ``end`` now, except those at or above the first handle of a rollout
        with an outstanding selection (selected, not handed over yet): those wait for :meth:`after_gather`."""
        due = end if self._due is None else max(self._due, end)
        upto = min(due, min(self._outstanding, default=due))
        self.storage.release(upto)
        self._due = None if upto >= due else due
        if self._finished_end is not None and self._finished_end <= upto:
            self._finished_end = None

    def select(self, n: int | None = None, **unknown: Any) -> Selection:
        if unknown:
            raise ConfigurationError(f"On-policy delivery takes no options (its minibatches are set by "
                                     f"num_minibatches/minibatch_size), got {', '.join(sorted(unknown))}; call "
                                     f"deliver() without them.")
        if n is not None:
            raise ConfigurationError("On-policy delivery sizes are set by num_minibatches/minibatch_size; "
                                     "call deliver() without n.")
        if self.defer_stale and self.fresh_rollouts < self.pending_rollouts:
            raise EmptyBufferError("A rollout waiting for delivery is stale; a selection made ahead leaves it to the "
                                   "delivery the learner asks for (defer_stale).")
        if self.on_stale == "drop":
            self.drop_stale()
        elif self._cur is not None and self.stale(self._cur.version):
            raise self.stale_error(self._cur.version)
        if self._cur is None:
            if not self._sealed:
                hint = " (an open rollout exists: call seal())" if self._open is not None else ""
                raise EmptyBufferError(f"No sealed rollout is waiting for delivery{hint}; ingest a rollout and "
                                       f"seal it.")
            r = self._sealed[0]
            if self.stale(r.version):  # (on_stale="raise": "drop" dropped every stale rollout above)
                raise self.stale_error(r.version)
            epoch = self._epoch
            self._cur, self._epoch = r, 0
            try:
                self._start_epoch()
            except ConfigurationError:
                self._cur, self._epoch = None, epoch  # the rollout stays pending
                raise
            self._sealed.popleft()
        cur = self._cur
        assert self._perm is not None
        lo, hi = self._bounds[self._k], self._bounds[self._k + 1]
        handles = self._perm[lo:hi] + cur.first
        slots = torch.remainder(handles, self.storage.capacity)
        m = len(self._bounds) - 1
        last = self._epoch == self.num_epochs - 1 and self._k == m - 1
        info = SampleInfo(handles=handles, version=cur.version,
                          epoch=self._epoch, minibatch=self._k, num_minibatches=m,
                          staleness=self.policy_version - cur.version, last=last)
        sel = Selection(slots, info, rollout=None if self.peeking else cur.first)
        self._k += 1
        if self._k == m:
            self._epoch += 1
            if self._epoch == self.num_epochs:
                self._finished_end = sel.release_upto = cur.first + cur.count
                self._cur = None
            else:
                try:
                    self._start_epoch()
                except ConfigurationError:  # refused: this minibatch stays the next one, nothing changed
                    self._epoch -= 1
                    self._k -= 1
                    raise
        if not self.peeking:  # outstanding until handed over (after_gather): its rollout's storage stays live
            self._outstanding[cur.first] = self._outstanding.get(cur.first, 0) + 1
            self._selections += 1
        return sel

    def draw_mark(self) -> tuple[int, torch.Tensor]:
        """A mark of where the permutation generator and the real selections are now, for :meth:`take_back_draws`.

        Take it under the buffer's lock (``ExperienceDataPlane.read_locked``) right before a real selection that is
        made ahead of its delivery (an adapter's prefetch), with no other real selection in between.
        """
        return self._selections, self._gen.get_state()

    def take_back_draws(self, mark: tuple[int, torch.Tensor], discarded: int) -> bool:
        """Give back the permutation draws of ``discarded`` real selections made since ``mark`` (:meth:`draw_mark`)
        that the caller threw away undelivered because their rollout went stale (an adapter's prefetch).

        The generator goes back to ``mark``, so every rollout ordered from now on (the next epoch's order, or the next
        rollout's) is shuffled as it would have been had those selections never been made: without them the next
        delivery drops the stale rollout where they found it, and orders the next one from the generator as it was
        at ``mark``. Only the generator moves back: the selections stay made (their rollout's position, rollouts
        dropped, ``dropped_items``, storage releases and outstanding selections are as they were), so each item is
        still delivered at most once per epoch and the staleness counts do not change.

        Given back only where that holds: ``discarded`` are all the real selections made since ``mark`` (none of them
        was kept), and the rollout being delivered, if any, is stale at the current policy version (the next
        delivery, or :meth:`drop_stale` under ``on_stale="raise"``, drops it without another selection from it).
        Otherwise nothing changes and ``False`` is returned (e.g. a later selection was kept, or the policy version
        went back so that the rollout goes on being delivered). Call it under the buffer's lock.

        Returns:
            Whether the draws were given back.
        """
        count, rng = mark
        if self.peeking or discarded <= 0 or self._selections != count + discarded:
            return False
        if self._cur is not None and not self.stale(self._cur.version):
            return False
        self._gen.set_state(rng)
        return True

    def check_live(self, oldest: int, next_handle: int) -> None:
        """:class:`ConfigurationError` when the current state (a checkpoint just loaded) does not account for the
        live handles ``[oldest, next_handle)`` exactly: a rollout naming an item outside them (it would deliver rows
        of evicted or never written slots), a live item before the first rollout that neither a finished rollout nor
        a held-back release keeps for a selection (it would never be delivered nor freed), or a selection
        outstanding in no rollout being delivered and none held back (its release would never come)."""
        live = [r for r in (self._cur, *self._sealed, self._open) if r is not None]
        rollouts = [(r.version, r.first, r.count) for r in live]
        bad = [(v, first, count) for v, first, count in rollouts if first < oldest or first + count > next_handle]
        fin, due = self._finished_end, self._due
        out = [first for first in self._outstanding if not oldest <= first < next_handle]
        covered_from = live[0].first if live else next_handle  # (rollouts are kept oldest first)
        delivering = {r.first for r in live if r is not self._open}
        held = max((end for end in (fin, due) if end is not None), default=oldest)  # (kept for a selection)
        stray = oldest < covered_from and held < covered_from
        phantom = [first for first in self._outstanding if first not in delivering and first >= covered_from]
        if (bad or out or stray or phantom or (fin is not None and not oldest <= fin <= next_handle)
                or (due is not None and not oldest <= due <= next_handle)):
            raise ConfigurationError(f"This checkpoint's on-policy rollouts {bad or rollouts!r} (finished up to "
                                     f"{fin}, held back up to {due}, selections outstanding in rollouts from "
                                     f"{sorted(self._outstanding)}) do not account for its live handles [{oldest}, "
                                     f"{next_handle}) (each in a rollout, or held back for a selection not handed "
                                     f"over); the checkpoint is damaged.")

    def after_gather(self, selection: Selection) -> None:
        """``selection`` was handed over: it is no longer outstanding, and a rollout's storage is released
        once its last minibatch has been read.

        Only the rollout ``selection`` finishes is released: a later rollout already selected (several
        selections made before they are handed over) keeps its items until its own last minibatch is read.
        Storage of rollouts consumed while a selection reading them (or an older rollout) was outstanding,
        dropped as stale or finished, is released once no such selection is left. Hand each real selection
        over once; a prediction (``peek``), or a selection handed over again, counts for nothing.
        """
        key = selection.rollout
        if key is None:  # a prediction (every real selection names its rollout): its release_upto frees nothing
            return
        was_outstanding = key in self._outstanding
        if was_outstanding:
            self._outstanding[key] -= 1
            if not self._outstanding[key]:
                del self._outstanding[key]
        end = None
        if selection.info.last:
            end = selection.release_upto if selection.release_upto is not None else self._finished_end
        if end is not None:
            self._release(end)
        elif was_outstanding and self._due is not None:  # a held-back release may be free to go now
            self._release(self._due)

    def drop_stale(self) -> int:
        """Drop the rollouts waiting for delivery that are too stale at the current policy version, oldest first,
        as ``on_stale="drop"`` drops them at a delivery: counted in ``dropped_items``, their storage released (once
        no selection of them is outstanding). Fresh rollouts, and the open one, are untouched. The way on after
        ``on_stale="raise"`` refused a delivery (the refusal leaves the stale rollout waiting). Call it under the
        buffer's lock (:meth:`conduit.ExperienceDataPlane.drop_stale` does).

        Returns:
            The items dropped (0 when nothing is stale).
        """
        dropped = 0
        if self._cur is not None and self.stale(self._cur.version):
            dropped += self._cur.count
            self._drop(self._cur)
            self._cur = None
        # (versions never go backwards: the stale rollouts are the oldest ones)
        while self._cur is None and self._sealed and self.stale(self._sealed[0].version):
            r = self._sealed.popleft()
            dropped += r.count
            self._drop(r)
        return dropped

    def stale_error(self, version: int) -> StaleExperienceError:
        """The error a delivery raises (``on_stale="raise"``) for a rollout of policy ``version`` that is stale."""
        waiting = [r for r in (self._cur, *self._sealed) if r is not None and r.version == version]
        items = f" ({waiting[0].count} items)" if waiting else ""
        return StaleExperienceError(
            f"Rollout of policy version {version}{items} is {self.policy_version - version} versions behind policy "
            f"{self.policy_version} (max_staleness={self.max_staleness}); nothing was delivered or dropped, and "
            f"every delivery raises again while it waits. To go on, drop the stale rollouts with drop_stale() "
            f"(counted in dropped_items) and deliver again; or deliver sooner, raise max_staleness, or use "
            f"on_stale='drop'.")

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        def rd(r: _Rollout | None) -> tuple[int, int, int] | None:
            return None if r is None else (r.version, r.first, r.count)
        return {"rng": self._gen.get_state(), "policy_version": self.policy_version,
                "dropped_items": self.dropped_items, "open": rd(self._open),
                "sealed": [rd(r) for r in self._sealed], "cur": rd(self._cur), "epoch": self._epoch,
                "k": self._k, "perm": None if self._perm is None else self._perm.clone(),
                "bounds": list(self._bounds), "finished_end": self._finished_end,
                "last_sealed": self._last_sealed, "outstanding": sorted(self._outstanding.items()),
                "due": self._due, "selections": self._selections}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def rr(t: tuple[int, int, int] | None) -> _Rollout | None:
            return None if t is None else _Rollout(*t)
        # checked before anything changes: a damaged checkpoint leaves this state as it was
        open_, cur = _checked_rollout(state["open"]), _checked_rollout(state["cur"])
        sealed = [_checked_rollout(t) for t in state["sealed"]]
        maybe = [_as_version(state[k]) for k in ("policy_version", "dropped_items", "epoch", "k")]
        maybe_bounds = [_as_version(b) for b in state["bounds"]]
        counters = [c for c in maybe if c is not None]
        bounds = [b for b in maybe_bounds if b is not None]
        perm = state["perm"]
        # a finished rollout whose last minibatch was selected but not yet handed over (absent in older checkpoints)
        finished = state.get("finished_end")
        if finished is not None and _as_version(finished) is None:
            raise ConfigurationError(f"This checkpoint's on-policy finished_end {finished!r} is damaged; load an "
                                     f"undamaged state_dict().")
        # the version of the rollout sealed last (absent in older checkpoints: see below)
        last_sealed = state.get("last_sealed")
        if last_sealed is not None and _as_version(last_sealed) is None:
            raise ConfigurationError(f"This checkpoint's on-policy last_sealed {last_sealed!r} is damaged (expected "
                                     f"None or an integer version); load an undamaged state_dict().")
        # selections made and not handed over yet, and the release they hold back (absent in older checkpoints)
        outstanding, due = _checked_outstanding(state.get("outstanding", ())), state.get("due")
        if due is not None and (_as_version(due) is None or int(due) < 0):
            raise ConfigurationError(f"This checkpoint's on-policy held-back release {due!r} is damaged (expected None "
                                     f"or a handle >= 0); load an undamaged state_dict().")
        # real selections made (absent in older checkpoints: counted from 0 again)
        selections = state.get("selections", 0)
        if _as_version(selections) is None or int(selections) < 0:
            raise ConfigurationError(f"This checkpoint's on-policy selection count {selections!r} is damaged "
                                     f"(expected an integer >= 0); load an undamaged state_dict().")
        if (len(counters) != len(maybe) or len(bounds) != len(maybe_bounds)
                or not (perm is None or isinstance(perm, torch.Tensor)) or not isinstance(state["rng"], torch.Tensor)):
            raise ConfigurationError("This checkpoint's on-policy state is damaged (a counter, the permutation or "
                                     "the RNG state has the wrong type); load an undamaged state_dict().")
        if counters[1] < 0:  # (reported back as rows dropped)
            raise ConfigurationError(f"This checkpoint's on-policy dropped_items {counters[1]} is damaged (expected "
                                     f"a count >= 0); load an undamaged state_dict().")
        try:  # (torch's own TypeError or RuntimeError would escape the load untyped, after nothing changed)
            torch.Generator().set_state(state["rng"])
        except (TypeError, RuntimeError) as e:
            raise ConfigurationError(f"This checkpoint's on-policy RNG state is damaged ({e}); load an undamaged "
                                     f"state_dict().") from e
        if cur is not None:  # the rollout being delivered: its epoch's order and cuts must fit it
            epoch, k = counters[2], counters[3]
            # (epochs are not bounded by num_epochs here: an adapter may save its rollout's own; one that starts an
            # epoch on its first delivery, as verl's, is saved between epochs with k past the last cut)
            last_k = len(bounds) - (2 if type(self)._start_epoch is OnPolicy._start_epoch else 1)
            ok = (isinstance(perm, torch.Tensor) and perm.dtype == torch.int64 and tuple(perm.shape) == (cur[2],)
                  and len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] <= cur[2]
                  and all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
                  and epoch >= 0 and 0 <= k <= last_k)
            if ok:
                assert isinstance(perm, torch.Tensor)
                ok = bool(torch.equal(torch.sort(perm).values, torch.arange(cur[2])))
            cls = type(self)
            own_cuts = cls.epoch_sizes is OnPolicy.epoch_sizes and cls._start_epoch is OnPolicy._start_epoch
            if ok and own_cuts:
                # this buffer's own epochs and cuts: a checkpoint of other OnPolicy settings (more epochs, another
                # M) would deliver past the last epoch forever, or cut the rollout differently from here on
                cuts = _cuts(self.epoch_sizes(cur[2], epoch)) if epoch < self.num_epochs else None
                if bounds != cuts:
                    here = (f"cuts it at {cuts!r}" if cuts is not None
                            else f"has epochs 0 to {self.num_epochs - 1} only")
                    raise ConfigurationError(
                        f"This checkpoint was saved by a buffer with other OnPolicy settings: its rollout of "
                        f"{cur[2]} items is in epoch {epoch}, cut at {bounds!r}, where this buffer "
                        f"(num_minibatches={self.num_minibatches}, minibatch_size={self.minibatch_size}, "
                        f"num_epochs={self.num_epochs}) {here}. Load it "
                        f"into a buffer with the same OnPolicy settings (num_minibatches or minibatch_size, "
                        f"num_epochs) as the one that saved it.")
            if not ok:
                raise ConfigurationError(f"This checkpoint's on-policy progress is damaged (epoch {epoch}, minibatch "
                                         f"{k}, cuts {bounds!r} and an order that must "
                                         f"permute the {cur[2]} items of the rollout being delivered); load an "
                                         f"undamaged state_dict() into a buffer with the same OnPolicy settings.")
        self._gen.set_state(state["rng"])
        self.policy_version, self.dropped_items, self._epoch, self._k = counters
        self._open = rr(open_)
        self._sealed = deque(r for r in (rr(t) for t in sealed) if r is not None)
        self._cur = rr(cur)
        self._perm = perm
        self._bounds = bounds
        self._finished_end = None if finished is None else int(finished)
        self._outstanding = outstanding
        self._due = None if due is None else int(due)
        self._selections = int(selections)
        if "last_sealed" in state:
            self._last_sealed = None if last_sealed is None else int(last_sealed)
        else:  # an older checkpoint: the newest sealed rollout it still holds, if any
            self._last_sealed = max((r.version for r in (*self._sealed, self._cur) if r is not None), default=None)


def _checked_outstanding(pairs: object) -> dict[int, int]:
    """Saved outstanding selections ``[(rollout first handle, count), ...]`` as a dict, or ConfigurationError."""
    out: dict[int, int] = {}
    for p in pairs if isinstance(pairs, (list, tuple)) else [None]:
        first, count = (_as_version(p[0]), _as_version(p[1])) if isinstance(p, (list, tuple)) and len(p) == 2 else (
            None, None)
        if first is None or count is None or first < 0 or count <= 0 or first in out:
            raise ConfigurationError(f"This checkpoint's on-policy outstanding selections {pairs!r} are damaged "
                                     f"(expected distinct (rollout first handle >= 0, count > 0) integer pairs); load "
                                     f"an undamaged state_dict().")
        out[first] = count
    return out


def _cuts(sizes: Sequence[int]) -> list[int]:
    """The row bounds of minibatches of ``sizes`` rows, back to back: ``[0, s0, s0 + s1, ...]``."""
    return [0, *itertools.accumulate(sizes)]
