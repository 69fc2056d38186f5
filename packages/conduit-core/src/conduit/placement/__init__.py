"""Placement: where experience state lives."""

from conduit.placement.base import HostPlacement, Placement

__all__ = ["Placement", "HostPlacement"]
