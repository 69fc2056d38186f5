"""Typed errors of the multi-node tier. Each says what happened and what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conduit.errors import ConduitError, ConfigurationError

if TYPE_CHECKING:
    from conduit.distributed.faults import LossReport

__all__ = ["DistributedError", "RayUnavailableError", "ClusterError", "RemoteTimeoutError", "ShardLostError",
           "TransferError"]


class DistributedError(ConduitError):
    """Base class of the errors of the multi-node tier (``conduit.distributed``)."""


class RayUnavailableError(DistributedError, ConfigurationError):
    """Ray is not installed: ``pip install 'conduit-core[ray]'``."""


class ClusterError(DistributedError):
    """The Ray cluster cannot serve the request: Ray not initialised, an unknown or dead node, no live shard."""


class RemoteTimeoutError(DistributedError, TimeoutError):
    """A remote call did not answer within its timeout (the shard is then treated as lost)."""


class ShardLostError(DistributedError):
    """A shard (its actor or its node) is gone; ``report`` says which items were lost or recovered."""

    def __init__(self, message: str, report: LossReport | None = None) -> None:
        super().__init__(message)
        self.report = report


class TransferError(DistributedError):
    """Experience staged on another node could not be read (its producer or its node died before ingestion)."""
