"""Which verl this adapter speaks to, and the typed errors it raises.

The worker-side delivery hook replaces one module attribute of verl
(``verl.utils.tensordict_utils.make_iterator``) whose contract changed in verl 0.8 and
again in 0.9, so it is gated to the verl minor series it was written against.
"""

from __future__ import annotations

from conduit import ConduitError, ConfigurationError

__all__ = [
    "SUPPORTED_VERL",
    "UnsupportedVerlError",
    "MissingKeyError",
    "MissingFieldError",
    "UnitTimeoutError",
    "verl_version",
    "require_supported_verl",
]

#: the verl minor series the hooks are written against (major, minor)
SUPPORTED_VERL = (0, 9)


class UnsupportedVerlError(ConfigurationError):
    """The installed verl is not the series conduit-verl's hooks are written for."""


try:  # TransferQueue's type for a read of a sample its storage does not hold (callers that tolerate a read racing a
    # clear catch it, as TransferQueue's docs say, instead of matching messages)
    from transfer_queue import StorageKeyNotFoundError as _KeyNotFound
except ImportError:  # TransferQueue absent: only the in-process parts are used
    _KeyNotFound = KeyError  # type: ignore[assignment,misc]


class MissingKeyError(ConduitError, _KeyNotFound):
    """A read asked for a sample or field that Conduit's TransferQueue storage does not hold.

    It is a ``transfer_queue.StorageKeyNotFoundError`` (a ``KeyError``), as SimpleStorage raises for a sample it does
    not hold, so code written against TransferQueue catches it the same way."""

    def __str__(self) -> str:  # KeyError quotes its message; say it plainly
        return str(self.args[0]) if self.args else ""


class MissingFieldError(MissingKeyError, RuntimeError):
    """A read asked for a field that the storage unit the sample routes to holds nothing of (with one unit: no put of
    the field ever reached Conduit's TransferQueue storage).

    SimpleStorage answers such a read with a ``RuntimeError`` (only a sample missing from a field the unit holds is
    a ``StorageKeyNotFoundError`` there), so this is a ``RuntimeError`` too: code written against TransferQueue
    catches it the same way. It stays a :class:`MissingKeyError`."""


def verl_version() -> str | None:
    """The installed verl version string, or None when verl is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        return None


def _minor(ver: str) -> tuple[int, int]:
    parts = ver.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (-1, -1)


def require_supported_verl(what: str = "conduit-verl") -> str:
    """Return the installed verl version, or raise when it is not the supported series.

    Raises:
        UnsupportedVerlError: verl is missing or not 0.9.x.
    """
    ver = verl_version()
    want = f"{SUPPORTED_VERL[0]}.{SUPPORTED_VERL[1]}.x"
    if ver is None:
        raise UnsupportedVerlError(f"{what} needs verl {want}, and verl is not installed: "
                                   f"pip install 'verl>=0.9.1,<0.10'.")
    if _minor(ver) != SUPPORTED_VERL:
        raise UnsupportedVerlError(
            f"{what} is written against verl {want} (it replaces verl.utils.tensordict_utils.make_iterator, whose "
            f"contract changed in 0.8 and 0.9), but verl {ver} is installed. Install verl>=0.9.1,<0.10, or use a "
            f"conduit-verl release made for verl {ver}.")
    return ver


class UnitTimeoutError(ConduitError, TimeoutError):
    """A Conduit storage unit did not answer a call within the backend's ``call_timeout_s`` (a unit whose process or
    host stopped answering without Ray declaring it dead; SimpleStorage raises ``StorageUnitTimeout`` there)."""
