"""The scheduling role: *when* ingestion and delivery work runs, and in what granularity."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from conduit.errors import ConfigurationError

if TYPE_CHECKING:
    from conduit.batch import ExperienceBatch
    from conduit.edp import ExperienceDataPlane
    from conduit.semantics.base import SampleInfo

__all__ = ["Scheduler", "Synchronous"]


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

    def attach(self, edp: ExperienceDataPlane) -> None:
        """Serve ``edp`` (the buffer calls this once, when it is built).

        A scheduler whose buffer was closed may serve a new one (an adapter that rebuilds its
        buffer passes the same scheduler again).

        Raises:
            ConfigurationError: this scheduler already serves another open buffer (a shared
                scheduler would store one buffer's batches in the other); build one scheduler per buffer.
        """
        prev = getattr(self, "edp", None)  # (not self.__dict__: reading it would slow every attribute access)
        if prev is not None and prev is not edp and not getattr(prev, "closed", False):
            raise ConfigurationError(f"This {type(self).__name__} scheduler already serves another buffer; build one "
                                     f"scheduler per buffer.")
        self.edp = edp
        try:
            self._attach(edp)
        except BaseException:
            del self.edp  # refused: free to serve another buffer
            raise

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
        """Block until every handed-over batch is in storage."""

    def invalidate(self, reason: str = "contents") -> None:  # noqa: B027
        """Something changed under prepared deliveries.

        ``reason`` is ``"contents"`` (a checkpoint was loaded: drop everything prepared),
        ``"priorities"`` (``update_priorities`` ran) or ``"policy"`` (``set_policy_version``
        ran). A prefetching scheduler decides per reason what stays deliverable.
        """

    def close(self) -> None:
        self.flush()


class Synchronous(Scheduler):
    """Everything runs in the caller's thread, one call at a time, in call order."""

    def __repr__(self) -> str:
        return "Synchronous()"

    def ingest(self, batch: ExperienceBatch, *, version: int | None,
               priorities: torch.Tensor | None) -> torch.Tensor | None:
        return self.edp.ingest_now(batch, version=version, priorities=priorities)

    def deliver(self, n: int | None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        return self.edp.deliver_now(n, **kwargs)
