"""The adapter's typed errors (all are :class:`conduit.ConduitError` subclasses)."""

from __future__ import annotations

from conduit import ConfigurationError

__all__ = ["UnsupportedAlgorithmError", "UnsupportedConfigError"]


class UnsupportedAlgorithmError(ConfigurationError):
    """``conduit_rllib.enable`` was given an algorithm it does not support (it names the supported ones)."""


class UnsupportedConfigError(ConfigurationError):
    """A supported algorithm was configured in a way the adapter cannot serve (it says what to change)."""
