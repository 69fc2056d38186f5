"""The errors of a read that finds no sample, built without importing TransferQueue.

A storage unit (:mod:`conduit_verl.unit`, and the :class:`~conduit_verl.columns.FieldStore` it holds) reports a read of
a sample or field it does not hold as :class:`conduit_verl.compat.MissingKeyError` or
:class:`~conduit_verl.compat.MissingFieldError`. Those subclass ``transfer_queue.StorageKeyNotFoundError`` (users catch
TransferQueue's type), and importing TransferQueue, which imports tensordict, would double the CPU time a unit's
process takes to start. So :func:`missing_key` and :func:`missing_field` return:

* where :mod:`conduit_verl.compat` is already imported (``sys.modules``: every TransferQueue client, which imports
  :mod:`conduit_verl.tq_storage`, and in-process users that imported it), compat's own class;
* elsewhere (a unit's Ray actor process), a light stand-in: a :class:`~conduit.ConduitError` and a ``KeyError`` (and a
  ``RuntimeError`` for a missing field, as :class:`~conduit_verl.compat.MissingFieldError`) that pickles as compat's
  class with the same arguments. Ray pickles a unit's error to the caller, so the caller unpickles compat's error, as
  if the unit had raised that (``tq_storage._unit_errors`` re-raises it, a ``ConduitError``, itself).
"""

from __future__ import annotations

import sys
from typing import Any

from conduit import ConduitError

__all__ = ["missing_key", "missing_field"]

#: the module whose classes these errors are, or pickle as
COMPAT = "conduit_verl.compat"


def missing_key(message: str) -> ConduitError:
    """A :class:`conduit_verl.compat.MissingKeyError` of ``message`` (a sample a field does not hold), or where
    :mod:`conduit_verl.compat` is not imported, its stand-in (see the module docstring)."""
    if COMPAT in sys.modules:
        from conduit_verl.compat import MissingKeyError

        return MissingKeyError(message)
    return _MissingKey(message)


def missing_field(message: str) -> ConduitError:
    """A :class:`conduit_verl.compat.MissingFieldError` of ``message`` (a field the unit holds nothing of), or where
    :mod:`conduit_verl.compat` is not imported, its stand-in (see the module docstring)."""
    if COMPAT in sys.modules:
        from conduit_verl.compat import MissingFieldError

        return MissingFieldError(message)
    return _MissingField(message)


class _MissingKey(ConduitError, KeyError):
    """Stands in for :class:`conduit_verl.compat.MissingKeyError` in a process that has not imported compat; it
    unpickles as that class."""

    #: the name of the class in :mod:`conduit_verl.compat` this one unpickles as
    stands_for = "MissingKeyError"

    def __str__(self) -> str:  # KeyError quotes its message; say it plainly (as compat's class does)
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self.stands_for, *self.args)


class _MissingField(_MissingKey, RuntimeError):
    """Stands in for :class:`conduit_verl.compat.MissingFieldError`, as :class:`_MissingKey` does."""

    stands_for = "MissingFieldError"


def _rebuild(name: str, *args: Any) -> ConduitError:
    """Class ``name`` of :mod:`conduit_verl.compat` (imported here) with ``args``: what a stand-in unpickles as."""
    from conduit_verl import compat

    cls: type[ConduitError] = getattr(compat, name)
    return cls(*args)
