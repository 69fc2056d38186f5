"""Core's own subcommands beyond ``demo`` (placement and scheduling add theirs here)."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add core's subcommands to the ``conduit`` parser."""
