"""The semantics role: *what* is delivered. The framework defines it; Conduit keeps it."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conduit.checks import is_int
from conduit.errors import ConduitError, ConfigurationError
from conduit.storage.base import AppendResult, Storage, handles_at

__all__ = ["Semantics", "Selection", "SampleInfo", "RingHandles", "select_many", "check_seed", "check_unshared",
           "claim", "release"]


@dataclass
class Selection:
    """Which slots one delivery reads, and what the learner must know about them."""

    slots: torch.Tensor
    info: SampleInfo
    #: the semantics' :meth:`~Semantics.draw_state` just before this selection was made (set by
    #: :func:`select_many` for real selections; None when peeking or when the semantics keep none)
    drawn_from: Any = None
    #: on-policy: the handle up to which the rollout this selection finishes is released once the selection has
    #: been read (:meth:`Semantics.after_gather`); None when it finishes none
    release_upto: int | None = None
    #: on-policy: the first handle of the rollout this selection reads. The semantics count a real selection as
    #: outstanding until it is handed over (:meth:`Semantics.after_gather`), and free no rollout's storage under an
    #: outstanding selection; None for replay selections and predictions
    rollout: int | None = None


class RingHandles:
    """The handles of items drawn by ring slot, computed when first read.

    A full ring holds one live item per slot, so a sampler can draw slots directly; each
    slot's handle (``oldest <= h < oldest + capacity``, ``h % capacity == slot``) is then a
    tensor op that deliveries whose handles nobody reads need not pay for.
    """

    __slots__ = ("slots", "oldest", "capacity")

    def __init__(self, slots: torch.Tensor, oldest: int, capacity: int) -> None:
        self.slots, self.oldest, self.capacity = slots, oldest, capacity

    def compute(self) -> torch.Tensor:
        return handles_at(self.slots, self.oldest, self.capacity)


class _Handles:
    """The ``handles`` field: a tensor, or :class:`RingHandles` turned into one on first read."""

    def __get__(self, obj: SampleInfo | None, owner: type | None = None) -> torch.Tensor:
        if obj is None:
            raise AttributeError("handles")  # a required field: the dataclass gives it no default
        h = obj.__dict__["handles"]
        if type(h) is RingHandles:
            h = obj.__dict__["handles"] = h.compute()
        return h

    def __set__(self, obj: SampleInfo, value: torch.Tensor | RingHandles) -> None:
        obj.__dict__["handles"] = value


@dataclass
class SampleInfo:
    """Per-delivery metadata returned next to the batch.

    Replay fills ``handles`` and, for prioritized sampling, ``probabilities`` and
    ``weights``; on-policy delivery fills ``version``, ``epoch``, ``minibatch``,
    ``num_minibatches``, ``staleness`` and ``last`` (the last minibatch of the rollout).
    """

    #: stable handles of the delivered items (int64); pass them to ``update_priorities``. A sampler
    #: may give :class:`RingHandles` instead; they read as the int64 tensor all the same
    handles: _Handles = _Handles()
    #: importance-sampling weights, normalised by the largest possible weight (prioritized only)
    weights: torch.Tensor | None = None
    #: probability each item had of being drawn (prioritized only)
    probabilities: torch.Tensor | None = None
    version: int | None = None
    epoch: int | None = None
    minibatch: int | None = None
    num_minibatches: int | None = None
    staleness: int | None = None
    last: bool = False


class Semantics(ABC):
    """Selects what one delivery returns, from the live items of a storage.

    Contract for implementations:
      * ``select`` decides before anything changes; on error the state is unchanged. One exception:
        on-policy rollouts found stale and dropped (``on_stale="drop"``) stay dropped when the
        delivery then finds nothing left (:class:`~conduit.EmptyBufferError`), so that their storage
        is free for the producers (on-policy storage never evicts: a buffer full of stale rollouts
        would otherwise stay full for as long as deliveries are refused).
      * ``on_append`` sees every append (including evictions it caused) in order.
      * ``state_dict``/``load_state_dict`` round-trip the RNG, so draws continue identically.
    """

    #: "replay" or "on_policy"
    kind: str
    #: True while :func:`select_many` predicts deliveries (``peek=True``): the semantics' own state is
    #: restored afterwards but the storage's is not, so ``select`` must then leave the storage alone
    peeking: bool = False

    def bind(self, storage: Storage) -> None:
        """Attach to ``storage`` (called once, and again after a migration)."""
        self.storage = storage

    @abstractmethod
    def on_append(self, result: AppendResult, *, version: int | None, priorities: torch.Tensor | None) -> None:
        """Record that ``result.count`` items were appended (and some maybe evicted)."""

    @abstractmethod
    def select(self, n: int | None, **kwargs: Any) -> Selection:
        """The slots of the next delivery."""

    def check_ingest(self, n: int, *, version: int | None, priorities: torch.Tensor | None) -> None:  # noqa: B027
        """Raise before any state changes if an ingestion of ``n`` items is not acceptable."""

    def after_gather(self, selection: Selection) -> None:  # noqa: B027
        """Called once the selected rows have been read (on-policy releases consumed data here)."""

    def draw_state(self) -> Any:
        """What :meth:`select` advances and nothing else changes (the sampler's RNG), or None when these
        semantics cannot give draws back (the default).

        A prefetching scheduler selects ahead of delivery; a checkpoint taken while such selections
        wait undelivered rewinds to the first one's (:meth:`rewind_draws`), so that the checkpoint, and
        the buffer after it, make those draws again instead of skipping them.
        """
        return None

    def rewind_draws(self, state: Any) -> None:  # noqa: B027
        """Put back a :meth:`draw_state` (the caller holds the buffer's lock): the selections made since are
        made again, from the contents and priorities as they are now."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def check_live(self, oldest: int, next_handle: int) -> None:  # noqa: B027
        """Raise :class:`ConfigurationError` when the state just loaded names items outside the live handles
        ``[oldest, next_handle)`` of the storage checkpoint loaded with it (a damaged checkpoint)."""

    def load_checked(self, state: dict[str, Any]) -> dict[str, Any]:
        """:meth:`load_state_dict`, or a typed error with this state unchanged.

        Returns the state it replaced, for the caller to roll back if the rest of its load fails.

        Raises:
            ConfigurationError: ``state`` was saved by other semantics (or another sampler).
        """
        before = self.state_dict()
        try:
            self.load_state_dict(state)
        except ConduitError:
            self.load_state_dict(before)
            raise
        # (LookupError: a key missing, or a state indexed that is a tensor or NumPy scalar; OverflowError: an integer
        # beyond float64 or the RNG's words)
        except (LookupError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError) as e:
            self.load_state_dict(before)
            raise ConfigurationError(
                f"This checkpoint's semantics state does not fit {type(self).__name__} ({type(e).__name__}: {e}); "
                f"load it into a buffer built with the same semantics and sampler.") from e
        return before


#: id of a semantics object (or sampler) -> (weak reference to it, weak reference to the buffer it serves). Kept
#: here, not on the objects: a copied or pickled semantics object is free, and pickles as before
_SERVING: dict[int, tuple[weakref.ref[Any], weakref.ref[Any]]] = {}


def _parts(semantics: Semantics) -> tuple[object, ...]:
    """``semantics`` and the sampler it holds, if any: the objects a buffer binds to its storage."""
    sampler = getattr(semantics, "sampler", None)
    return (semantics,) if sampler is None else (semantics, sampler)


def _serving(part: object) -> Any:
    """The open buffer ``part`` serves (see :func:`claim`), or None."""
    entry = _SERVING.get(id(part))
    if entry is None or entry[0]() is not part:  # (an id reused by another object after the first was freed)
        return None
    buffer = entry[1]()
    return None if buffer is None or getattr(buffer, "closed", False) else buffer


def check_unshared(semantics: Semantics) -> None:
    """:class:`ConfigurationError` when ``semantics``, or the sampler it holds, serves another buffer that is open
    (built with it and not closed, see :func:`claim`).

    A buffer binds its semantics to its storage (:meth:`Semantics.bind`; a sampler is reset there): a second buffer
    built with the same object would take it over, and the first would then draw from the second's items, gather
    its own rows at those slots and update the second's priorities. Called before a buffer builds anything.
    """
    for part in _parts(semantics):
        if _serving(part) is not None:
            raise ConfigurationError(
                f"This {type(part).__name__} already serves another open buffer (a second buffer would take it "
                f"over: the first would draw from the second's items); build a new {type(semantics).__name__}"
                f"(...) (and sampler) for each buffer, or close the other buffer first.")


def claim(semantics: Semantics, buffer: object) -> None:
    """Record that ``buffer``, just built, serves ``semantics`` (and its sampler): :func:`check_unshared` refuses
    them to another buffer while ``buffer`` is open. Held weakly: a buffer dropped frees them, as a closed one."""
    for key, (part, buf) in list(_SERVING.items()):
        if part() is None or buf() is None:
            _SERVING.pop(key, None)  # (entries of objects or buffers freed since)
    for obj in _parts(semantics):
        try:
            _SERVING[id(obj)] = (weakref.ref(obj), weakref.ref(buffer))
        except TypeError:  # (an object that takes no weak reference: not tracked)
            pass


def release(semantics: Semantics) -> None:
    """Forget which buffer serves ``semantics`` (and its sampler), for a hand-over: an adapter that replaces an open
    buffer by a larger one carrying the same semantics (their state is keyed by handle) releases them before it
    builds the new buffer, and claims them back for the old one (:func:`claim`) should that build fail."""
    for part in _parts(semantics):
        entry = _SERVING.get(id(part))
        if entry is not None and entry[0]() is part:
            del _SERVING[id(part)]


def check_seed(seed: object) -> int:
    """``seed`` as an int, or :class:`ConfigurationError` unless it is an int in ``[0, 2**63)``."""
    if not is_int(seed) or not 0 <= int(seed) < 2 ** 63:
        raise ConfigurationError(f"seed must be an int in [0, 2**63), got {seed!r}.")
    return int(seed)


def select_many(semantics: Semantics, sizes: Sequence[int | None], *, peek: bool = False,
                **kwargs: Any) -> list[Selection]:
    """``len(sizes)`` selections in order, exactly as that many deliveries would make them.

    With ``peek=True`` the semantics' state is restored afterwards, so the selections only
    *predict* the next deliveries. The caller holds the buffer's lock.

    On-policy, a call refused part way (the rollouts run out before the last size) selects nothing,
    as a refused delivery makes none: the call is checked on a prediction first. One refused at its
    first selection is refused as that delivery would be (rollouts dropped as stale on the way stay
    dropped). Replay refused at a later selection than its first (e.g. sizes ``[1, 100]`` without replacement from
    50 items) gives the draws made before it back (:meth:`Semantics.rewind_draws`), so that the call changes nothing.
    """
    if not peek and len(sizes) > 1 and semantics.kind == "on_policy":
        made: list[Selection] = []
        try:
            _select(semantics, sizes, True, made, kwargs)
        except ConduitError:
            if made:
                raise
    start = semantics.draw_state() if not peek and len(sizes) > 1 and semantics.kind == "replay" else None
    try:
        return _select(semantics, sizes, peek, [], kwargs)
    except ConduitError:
        if start is not None:
            semantics.rewind_draws(start)
        raise


def _select(semantics: Semantics, sizes: Sequence[int | None], peek: bool, out: list[Selection],
            kwargs: dict[str, Any]) -> list[Selection]:
    """:func:`select_many`'s selections, appended to ``out`` as they are made."""
    snap = semantics.state_dict() if peek else None
    semantics.peeking = peek
    try:
        for n in sizes:
            drawn_from = None if peek else semantics.draw_state()
            sel = semantics.select(n, **kwargs)
            sel.drawn_from = drawn_from
            out.append(sel)
        return out
    finally:
        semantics.peeking = False
        if snap is not None:
            semantics.load_state_dict(snap)
