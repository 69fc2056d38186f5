"""Typed errors of the SRL adapter (all subclasses of :class:`conduit.ConduitError`)."""

from __future__ import annotations

from conduit.errors import ConfigurationError

__all__ = ["ZeroCopyStreamError", "SrlNotFoundError", "StreamClaimError"]


class ZeroCopyStreamError(ConfigurationError):
    """A trainer asks for a Conduit buffer but its shared-memory stream is zero-copy.

    With ``SampleStream.Type.SHARED_MEMORY`` and ``buffer_zero_copy=True`` SRL's trainer ignores
    ``buffer_name`` and batches inside the shared-memory dock, so Conduit would never see the data.
    """


class SrlNotFoundError(ConfigurationError):
    """``install()`` found no SRL layout in this process (nothing was changed)."""


class StreamClaimError(ConfigurationError):
    """A sample stream marked ``conduit:`` cannot be carried by Conduit (e.g. a shared-memory stream)."""
