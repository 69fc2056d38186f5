"""The one door to Ray: imported lazily, so ``import conduit`` never needs it."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from conduit.distributed.errors import ClusterError, RayUnavailableError
from conduit.errors import ConduitError, ConfigurationError
from conduit.scheduling.base import thread_flag

__all__ = ["ray_module", "ray_is_up", "current_node_id", "wait_all", "Outcome", "without_auto_init",
           "positive_finite", "check_seconds"]

_tls = threading.local()


def positive_finite(x: Any) -> bool:
    """``x`` is a finite real number > 0, not a bool: what a timeout, a period or a rate must be.

    Infinity is refused: every remote call of the multi-node tier is bounded, so "wait forever" is not a timeout.
    """
    real = isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
    return real and bool(0 < x < float("inf"))



def check_seconds(name: str, value: object, *, none_means: str | None = None) -> None:
    """Refuse a duration setting that is not a finite real number of seconds > 0 (see :func:`positive_finite`).

    Args:
        name: the setting as the user wrote it (``"timeout"``, ``"start_timeout"``), the first word of the message.
        value: what was given.
        none_means: when given, ``None`` is accepted too and this says what it means (e.g. ``"no monitor
            thread"``); the message then offers it as ``or None (<none_means>)``.

    Raises:
        ConfigurationError: ``"<name> must be a finite number of seconds > 0[ or None (<none_means>)], got
            <value!r>."`` -- for None (unless ``none_means``), a string, a bool, 0, a negative number, NaN or
            infinity. Nothing is started or changed by the check.
    """
    if none_means is not None and value is None:
        return
    if not positive_finite(value):
        offer = f" or None ({none_means})" if none_means is not None else ""
        raise ConfigurationError(f"{name} must be a finite number of seconds > 0{offer}, got {value!r}.")


def ray_module(*, initialized: bool = True) -> Any:
    """The ``ray`` module; raises a typed error when it is missing or (with ``initialized``) not started."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - ray is in the dev environment
        raise RayUnavailableError("The multi-node tier needs Ray: pip install 'conduit-core[ray]'.") from e
    if initialized and not ray.is_initialized():
        raise ClusterError("Ray is not initialised in this process; call ray.init(address=...) (or start a local "
                           "cluster with conduit.distributed.testing.local_cluster()) before building shards.")
    return ray


def ray_is_up() -> bool:
    """Whether Ray is importable and started in this process (after ``ray.shutdown()`` it is not)."""
    try:
        ray_module()
    except ClusterError:
        return False
    return True


@contextmanager
def without_auto_init() -> Iterator[None]:
    """Inside the block, Ray calls made on this thread never start a Ray nor connect to one.

    Ray's API starts a local Ray, or connects to the newest cluster on the machine, when it is called in a process
    where Ray is not initialised ("auto-init"). A thread of ours that checks for Ray and then calls it (the health
    monitor, a finalizer, ``close()``) races with a ``ray.shutdown()`` on another thread: a call landing after the
    shutdown would start a new Ray, or join another process's cluster. Inside this block such a call raises
    Ray's own "not started" error instead; other threads keep Ray's behaviour.
    """
    _guard_auto_init()
    with thread_flag(_tls, "no_auto_init"):
        yield


def _guard_auto_init() -> None:
    """Route Ray's auto-init hook through a check of :func:`without_auto_init`'s flag (once per process).

    Ray's wrapped APIs (``ray.get``, ``ray.wait``, ``ray.put``, ``ray.kill``, actor method calls) look the hook up
    in its module at each call, so replacing it there covers them all. A Ray without that hook is left as it is.
    """
    hook: Any = getattr(getattr(ray_module(initialized=False), "_private", None), "auto_init_hook", None)
    original = getattr(hook, "auto_init_ray", None)
    if original is None or getattr(original, "_conduit_guarded", False):
        return

    def auto_init_ray() -> None:
        if not getattr(_tls, "no_auto_init", False):
            original()

    auto_init_ray._conduit_guarded = True  # type: ignore[attr-defined]
    hook.auto_init_ray = auto_init_ray


def current_node_id() -> str:
    """The Ray node id of the calling process."""
    return str(ray_module().get_runtime_context().get_node_id())


class Outcome:
    """The result of one remote call: a value, or the error that replaced it.

    ``lost`` is True when the callee is gone (its actor or node died) or did not answer in time;
    ``error`` then says why. A ``ConduitError`` raised inside the callee is ``error`` with ``lost`` False.
    :attr:`unconfirmed` tells a proven death from a call that may have met a passing fault.
    """

    __slots__ = ("value", "error", "lost")

    def __init__(self, value: Any = None, error: BaseException | None = None, lost: bool = False) -> None:
        self.value, self.error, self.lost = value, error, lost

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def unconfirmed(self) -> bool:
        """Lost without proof that the callee died: no answer in time, or Ray's ``ActorUnavailableError`` (the
        actor is unreachable for now, e.g. a broken connection, and may answer again). A caller must not count
        the callee dead on this alone: a health probe decides."""
        return self.lost and (isinstance(self.error, TimeoutError) or _unavailable(self.error))

    @property
    def argument_lost(self) -> bool:
        """Failed because an object the call took as argument was lost before the callee had it (Ray's
        ``ObjectLostError`` and its kinds, e.g. the object's node died after the task that made it ran): the
        callee did nothing wrong, the maker of the object is the one to suspect."""
        return self.error is not None and not self.lost and _object_lost(self.error)


def _unavailable(e: BaseException | None) -> bool:
    """Whether ``e`` is Ray's ``ActorUnavailableError`` (a ``RayActorError`` that proves no death)."""
    if e is None:
        return False
    cls = getattr(getattr(ray_module(initialized=False), "exceptions", None), "ActorUnavailableError", None)
    return cls is not None and isinstance(e, cls)


def _object_lost(e: BaseException) -> bool:
    """Whether ``e`` is Ray's ``ObjectLostError`` (or one of its kinds: reconstruction failed, owner died...)."""
    cls = getattr(getattr(ray_module(initialized=False), "exceptions", None), "ObjectLostError", None)
    return cls is not None and isinstance(e, cls)


def _classify(ray: Any, e: BaseException) -> Outcome:
    exc = ray.exceptions
    if isinstance(e, (exc.RayActorError, exc.ActorUnavailableError)):
        return Outcome(error=e, lost=True)
    if isinstance(e, exc.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, ConduitError):
            return Outcome(error=cause)
        if isinstance(cause, (exc.ObjectLostError, exc.OwnerDiedError)):
            return Outcome(error=cause)
        return Outcome(error=e)
    if isinstance(e, (exc.ObjectLostError, exc.OwnerDiedError)):
        return Outcome(error=e)
    return Outcome(error=e)


def wait_all(refs: Mapping[Any, Any] | Sequence[Any], timeout: float) -> dict[Any, Outcome]:
    """Wait for every ObjectRef at once, at most ``timeout`` seconds in all; never raises.

    Args:
        refs: a mapping key -> ObjectRef (or a sequence, keyed by position).
        timeout: seconds for all of them together.

    Returns:
        key -> :class:`Outcome`, for every key (one ObjectRef under several keys gives each of them its
        outcome; the ref is waited for once). A call still pending after ``timeout`` is an outcome with
        ``lost=True`` and a ``TimeoutError``.
    """
    ray = ray_module()
    items = dict(refs) if isinstance(refs, Mapping) else dict(enumerate(refs))
    if not items:
        return {}
    by_ref: dict[Any, list[Any]] = {}
    for key, ref in items.items():
        by_ref.setdefault(ref, []).append(key)
    ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=max(0.0, timeout), fetch_local=True)
    out: dict[Any, Outcome] = {}
    for ref in ready:
        try:
            got = Outcome(ray.get(ref, timeout=max(1.0, timeout)))
        except Exception as e:  # noqa: BLE001 - classified into a typed outcome
            got = _classify(ray, e)
        for key in by_ref[ref]:
            out[key] = got
    for key in items:
        if key not in out:
            out[key] = Outcome(error=TimeoutError(f"no answer within {timeout:.1f} s"), lost=True)
    return out
