"""Core's own subcommands beyond ``demo``: each area adds a ``cli`` module with ``register(sub)``."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["register"]

#: modules whose ``register(subparsers)`` adds subcommands (a module not written yet is skipped)
MODULES = ("conduit.placement.cli", "conduit.scheduling.cli", "conduit.simulation.cli")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add core's subcommands to the ``conduit`` parser."""
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue
            raise
        mod.register(sub)
