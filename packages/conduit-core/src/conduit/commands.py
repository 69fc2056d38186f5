"""Core's own subcommands beyond ``demo`` (each area adds a ``cli`` module with ``register(sub)``), and the
argument checks they share: whole numbers and counts read exactly (:func:`whole_number`, :func:`count`; ``1e6``
accepted), finite numbers within bounds (:func:`finite_number`), and counts refused by the option typed
(:func:`check_counts`)."""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable

from conduit.errors import ConfigurationError

__all__ = ["register", "MAX_COUNT", "whole_number", "count", "finite_number", "check_counts"]

#: the largest count a command takes: sizes are int64 in torch and NumPy, so larger ones would overflow
MAX_COUNT = 2**63 - 1

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


def whole_number(text: str) -> int:
    """An argparse type: a whole number, accepting ``1e6`` and ``1_000_000`` (whole numbers written out are read
    exactly, not through a float). Its bounds are the command's to check (:func:`check_counts` names the option and
    what it counts); :func:`count` is this with the bounds of a count."""
    try:
        v: float = int(text.replace("_", ""))
    except ValueError:
        try:
            v = float(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v != int(v):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number")
    return int(v)


def count(text: str) -> int:
    """An argparse type: a count from 1 to :data:`MAX_COUNT`, read as :func:`whole_number` reads it (``1e6`` and
    ``1_000_000`` accepted)."""
    v = whole_number(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number")
    if v > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is too large: use a whole number up to 2**63 - 1")
    return v


def finite_number(least: float, *, inclusive: bool, most: float = math.inf,
                  meaning: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number > ``least`` (>= ``least`` when ``inclusive``) and at most ``most``.

    ``nan``, ``inf`` and numbers out of bounds are refused (an argument error, exit status 2) with the bounds and,
    past ``most``, what ``meaning`` says that bound stands for (e.g. "one second per remote fetch").
    """
    bound = f"{'>=' if inclusive else '>'} {least:g}" + ("" if most == math.inf else f" and at most {most:g}")

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < least or (v == least and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number {bound}")
        if v > most:
            raise argparse.ArgumentTypeError(f"{text!r} is too large: give a finite number {bound}"
                                             + (f" ({meaning})" if meaning else ""))
        return v

    parse.__doc__ = f"A finite number {bound}."
    return parse


def check_counts(*flags: tuple[str, int | None, int, int | None, str]) -> None:
    """Refuse a count outside its bounds, before a command runs anything: ``(flag, value, least, most, meaning)``
    each, a value of None (not given) passing and a ``most`` of None bounding nothing.

    Raises:
        ConfigurationError: one is out of bounds; the message names its flag, what it counts and what to give.
    """
    for flag, v, least, most, meaning in flags:
        if v is not None and v < least:
            raise ConfigurationError(f"{flag} must be {least} or more ({meaning}), got {v}; give {flag} {least} or "
                                     f"more.")
        if v is not None and most is not None and v > most:
            raise ConfigurationError(f"{flag} must be at most {most} ({meaning}), got {v}; give a smaller {flag}.")
