"""The scheduling role: *when* ingestion and delivery work runs, and in what granularity."""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from conduit.errors import ConfigurationError

if TYPE_CHECKING:
    from conduit.batch import ExperienceBatch
    from conduit.edp import ExperienceDataPlane
    from conduit.semantics.base import SampleInfo

__all__ = ["Scheduler", "Synchronous", "check_scheduler_entry", "scheduler_entry", "lock_held", "thread_flag",
           "unattached", "wait_refused"]


class Scheduler(ABC):
    """Decides when the EDP's ingest and deliver work runs.

    The EDP validates every call in the caller's thread before handing it to the
    scheduler, so errors surface at the call that caused them. A scheduler then calls
    ``edp.ingest_now`` / ``edp.deliver_now`` (the synchronous primitives) when it chooses.

    Contract for implementations:
      * nothing handed over is lost, duplicated or reordered within one producer;
      * ``flush`` returns once everything handed over is in storage;
      * delivered batches keep the semantics' guarantees (on-policy never crosses a version).
    """

    #: how many delivered batches may be alive at once (output buffers rotate over this many)
    output_depth: int = 2
    #: ingestion granularity: rollouts (off-policy) or rollout fractions (on-policy) per call
    g_ing: float = 1
    #: delivery granularity: batches prepared per delivery call
    g_del: float = 1
    #: the buffer served (see :attr:`edp`), held weakly; None before :meth:`attach`
    _edp_ref: weakref.ref[ExperienceDataPlane] | None = None

    @property
    def edp(self) -> ExperienceDataPlane:
        """The buffer this scheduler serves.

        Held weakly: the buffer holds its scheduler, so a strong reference back would make a cycle, and a buffer
        its user dropped (closed or not) would keep its storage, delivery buffers and worker threads until the
        cyclic garbage collector ran. This way reference counting frees it at once.

        Raises:
            AttributeError: the scheduler serves no buffer (never attached, or the buffer was freed), as for an
                attribute never set (``getattr(scheduler, "edp", None)`` is None then).
        """
        ref = self._edp_ref
        edp = None if ref is None else ref()
        if edp is None:
            raise AttributeError(f"This {type(self).__name__} scheduler serves no buffer (it was never passed as "
                                 f"scheduler= to one, or that buffer was freed).")
        return edp

    @edp.setter
    def edp(self, edp: ExperienceDataPlane) -> None:
        self._edp_ref = weakref.ref(edp)

    @edp.deleter
    def edp(self) -> None:
        self._edp_ref = None

    def attach(self, edp: ExperienceDataPlane) -> None:
        """Serve ``edp`` (the buffer calls this once, when it is built).

        A scheduler whose buffer was closed may serve a new one (an adapter that rebuilds its
        buffer passes the same scheduler again).

        Raises:
            ConfigurationError: this scheduler already serves another open buffer (a shared
                scheduler would store one buffer's batches in the other); build one scheduler per buffer.
        """
        prev = getattr(self, "edp", None)
        if prev is not None and prev is not edp and not getattr(prev, "closed", False):
            raise ConfigurationError(f"This {type(self).__name__} scheduler already serves another buffer; build one "
                                     f"scheduler per buffer.")
        self.edp = edp
        try:
            self._attach(edp)
        except BaseException:
            del self.edp  # refused: free to serve another buffer
            raise

    @property
    def _serves(self) -> bool:
        """Whether this scheduler was attached to a buffer (see :meth:`attach`; a closed one still counts, and so
        does one since freed)."""
        return self._edp_ref is not None

    def _attach(self, edp: ExperienceDataPlane) -> None:  # noqa: B027 - an optional hook
        """Set up for ``edp`` (subclasses); raising refuses the buffer and leaves the scheduler free."""

    @abstractmethod
    def ingest(self, batch: ExperienceBatch, *, version: int | None,
               priorities: torch.Tensor | None) -> torch.Tensor | None:
        """Hand over one validated batch; returns its handles, or None if it is stored later."""

    @abstractmethod
    def deliver(self, n: int | None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        """The next delivery."""

    def flush(self) -> None:  # noqa: B027
        """Block until every batch handed over before the call is in storage."""

    def invalidate(self, reason: str = "contents") -> None:  # noqa: B027
        """Something changed under prepared deliveries.

        ``reason`` is ``"contents"`` (a checkpoint was loaded: drop everything prepared),
        ``"priorities"`` (``update_priorities`` ran) or ``"policy"`` (``set_policy_version``
        ran). A prefetching scheduler decides per reason what stays deliverable.
        """

    def close(self) -> None:
        self.flush()

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a new scheduler of the same kind needs to go on exactly as this one would after a checkpoint
        (e.g. a calibrated decision); plain Python values. Default: nothing (``{}``), as for a scheduler whose
        behaviour is all in its constructor's settings. The buffer's ``state_dict`` keeps it only when non-empty."""
        return {}

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check ``state`` (what :meth:`state_dict` of this kind returned) before anything changes.

        Raises:
            ConfigurationError: ``state`` is not what :meth:`state_dict` returns, or is damaged.
        """
        if not isinstance(state, Mapping):
            raise ConfigurationError(f"The checkpoint's scheduler state must be a dict (what state_dict() returns), "
                                     f"got {type(state).__name__}.")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 - an optional hook
        """Go on as the scheduler that saved ``state`` (same kind) would; checked first (:meth:`check_state_dict`),
        so a refused state changes nothing. Default: nothing to restore.

        Raises:
            ConfigurationError: ``state`` is damaged (nothing changed).
        """
        self.check_state_dict(state)


def lock_held(lock: object) -> bool:
    """Whether the calling thread holds ``lock``, a data plane's re-entrant lock (what both planes'
    ``holds_lock()`` answer). Without CPython's ``RLock._is_owned`` the answer is False: nothing is refused."""
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if is_owned is not None else False


@contextmanager
def thread_flag(tls: threading.local, name: str) -> Iterator[None]:
    """Set the flag ``name`` of the thread-local ``tls`` for the calling thread inside the block (nested blocks
    restore the outer value); read it with ``getattr(tls, name, False)``."""
    outer = getattr(tls, name, False)
    setattr(tls, name, True)
    try:
        yield
    finally:
        setattr(tls, name, outer)


def wait_refused(call: str, worker: str) -> ConfigurationError:
    """The error for ``call``, which would wait for a scheduler's ``worker`` thread while the calling thread holds the
    buffer's lock that worker needs (``holds_lock()`` of either data plane: inside ``read_locked()``, or a callback the
    buffer runs under its lock); nothing was changed."""
    return ConfigurationError(f"{call} would wait for the scheduler's {worker}, which needs the buffer's lock that "
                              f"this thread holds (inside read_locked(), or a callback the buffer runs under its "
                              f"lock): it would wait forever. Nothing was changed; call it after the locked function "
                              f"returns.")


def unattached(scheduler: Scheduler, call: str) -> ConfigurationError:
    """The error for ``call``, which depends on the buffer ``scheduler`` serves (its kind, its storage) while it serves
    none yet."""
    return ConfigurationError(f"{call} depends on the buffer this {type(scheduler).__name__} scheduler serves, and it "
                              f"serves none yet; pass it as scheduler= to a buffer (ExperienceDataPlane(..., "
                              f"scheduler=...)) first.")


def _kind(scheduler: Scheduler) -> str:
    return f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"


def scheduler_entry(scheduler: Scheduler, buffer: object) -> dict[str, Any] | None:
    """``buffer``'s checkpoint's ``"scheduler"`` entry: ``{"kind": class path, "state": scheduler.state_dict()}``,
    or None when the scheduler has nothing to keep, or serves another buffer by now (that one's state)."""
    if getattr(scheduler, "edp", None) is not buffer:
        return None
    state = scheduler.state_dict()
    return {"kind": _kind(scheduler), "state": state} if state else None


def check_scheduler_entry(scheduler: Scheduler, entry: object) -> bool:
    """Check a checkpoint's ``"scheduler"`` entry before anything changes; True when ``scheduler`` is of the
    kind that saved it (then ``scheduler.load_state_dict(entry["state"])`` applies it), False when it is of
    another kind (the entry is ignored: a checkpoint loads into a buffer with any scheduler).

    Raises:
        ConfigurationError: the entry is damaged (not ``{"kind": str, "state": dict}``, or a state this
            scheduler's kind refuses).
    """
    if (not isinstance(entry, Mapping) or not isinstance(entry.get("kind"), str)
            or not isinstance(entry.get("state"), Mapping)):
        raise ConfigurationError("The checkpoint's 'scheduler' entry is damaged (expected {'kind': str, 'state': "
                                 "dict}, as ExperienceDataPlane.state_dict() writes it); drop the entry to load the "
                                 "checkpoint without the scheduler's state.")
    if entry["kind"] != _kind(scheduler):
        return False
    scheduler.check_state_dict(entry["state"])
    return True


class Synchronous(Scheduler):
    """Everything runs in the caller's thread, one call at a time, in call order."""

    def __repr__(self) -> str:
        return "Synchronous()"

    def ingest(self, batch: ExperienceBatch, *, version: int | None,
               priorities: torch.Tensor | None) -> torch.Tensor | None:
        return self.edp.ingest_now(batch, version=version, priorities=priorities)

    def deliver(self, n: int | None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        return self.edp.deliver_now(n, **kwargs)
