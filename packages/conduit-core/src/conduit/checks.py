"""Predicates the argument checks share (each check still raises its own typed error).

Public, for adapters that check their own settings the way core does (a flag is a Python or NumPy bool; a count
an integer that is not a bool; a duration or a ratio a real number that is not a bool), so that a setting core
takes is not refused by an adapter, nor the reverse.
"""

from __future__ import annotations

import numbers
from typing import TypeGuard

import numpy as np
import torch

__all__ = ["first_line", "is_bool", "is_int", "is_real", "out_of_memory"]


def is_int(x: object) -> TypeGuard[int]:
    """``x`` is an integer (Python's, NumPy's or any other ``numbers.Integral``), not a bool: what a count, a
    size or a handle must be (``int`` to the type checker: NumPy integers compare and index as ints do)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_bool(x: object) -> TypeGuard[bool]:
    """``x`` is a bool (Python's or NumPy's): what a flag must be (a string such as ``"no"`` is truthy)."""
    return isinstance(x, (bool, np.bool_))


def is_real(x: object) -> TypeGuard[float]:
    """``x`` is a real number (Python's, NumPy's or any other ``numbers.Real``), not a bool: what a duration, a ratio
    or a size in bytes must be (``float`` to the type checker; NaN and infinity are the caller's to refuse)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def out_of_memory(e: BaseException) -> bool:
    """``e`` is an allocation that failed for want of memory: NumPy's ``MemoryError`` (or its ``ValueError`` for a
    size past what an array can have), torch's ``OutOfMemoryError`` or its CPU allocator's ``RuntimeError``."""
    if isinstance(e, MemoryError):
        return True
    if isinstance(e, ValueError):
        return "array is too big" in str(e) or "Maximum allowed dimension exceeded" in str(e)
    return isinstance(e, RuntimeError) and (isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e))


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, for a refusal that quotes it; the exception's type name when the message is
    empty (a bare ``MemoryError()``, as a custom allocator may raise)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
