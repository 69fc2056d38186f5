"""Activation: one call that makes SRL build Conduit buffers (and, optionally, Conduit streams).

SRL has no buffer registry: every trainer and buffer worker calls the module attribute
``make_buffer(buffer_name, **buffer_args)`` of its buffer module at configure time. So
:func:`install` replaces that attribute with a wrapper that builds a :class:`ConduitBuffer` for
``buffer_name="conduit"`` (or ``"conduit:<semantics>"``) and calls the original for every other
name. Call it in the experiment module every SRL worker imports, before workers configure.

Layouts recognised (the first two are the two halves of openpsi-project/srl):

========== ===================== ========================================== =====================
flavour    buffer module         sample-stream module                       stream seam
========== ===================== ========================================== =====================
distributed ``base.buffer``      ``distributed.system.sample_stream``       ``make_producer``/``make_consumer``
local      ``base.buffer``       ``local.system.sample_stream``             the type registries
srl-local  ``rlsrl.base.buffer`` ``rlsrl.system.api.sample_stream``         the type registries
========== ===================== ========================================== =====================

Nothing is imported from SRL when ``conduit_srl`` is imported; :func:`install` imports the
modules above (those that import) and :func:`uninstall` puts every replaced attribute back.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any, cast

from conduit import ConfigurationError

from conduit_srl.buffer import ConduitBuffer, srl_prioritized_class
from conduit_srl.config import SEMANTICS
from conduit_srl.errors import SrlNotFoundError, StreamClaimError, ZeroCopyStreamError
from conduit_srl.streams import ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy

__all__ = ["install", "uninstall", "installed", "Installation", "Flavour", "FLAVOURS", "BUFFER_NAME",
           "STREAM_MARKER", "is_conduit_buffer_name", "make_conduit_buffer", "check_trainer_config",
           "check_buffer_worker_config"]

#: ``buffer_name`` that selects a Conduit buffer (``"conduit:<semantics>"`` also works)
BUFFER_NAME = "conduit"
#: prefix of sample-stream names Conduit claims
STREAM_MARKER = "conduit:"


@dataclass(frozen=True)
class Flavour:
    """One SRL package layout."""

    name: str
    buffer_module: str
    stream_module: str
    #: "factory": wrap make_producer/make_consumer; "registry": wrap the registered classes
    stream_seam: str
    config_module: str


FLAVOURS = (
    Flavour("distributed", "base.buffer", "distributed.system.sample_stream", "factory", "api.config"),
    Flavour("local", "base.buffer", "local.system.sample_stream", "registry", "api.config"),
    Flavour("srl-local", "rlsrl.base.buffer", "rlsrl.system.api.sample_stream", "registry", "rlsrl.api.config"),
)


@dataclass
class Installation:
    """What :func:`install` changed, and what it looked for but left alone (with the reason)."""

    flavours: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    #: the settings :func:`install` was called with (a second call must repeat them)
    settings: dict[str, Any] = field(default_factory=dict, repr=False)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)


_LOCK = threading.Lock()
_CURRENT: Installation | None = None


# -- buffer names and construction ---------------------------------------------------------------
def is_conduit_buffer_name(name: object) -> bool:
    """Whether ``buffer_name`` selects a Conduit buffer."""
    return isinstance(name, str) and (name == BUFFER_NAME or name.startswith(BUFFER_NAME + ":"))


def make_conduit_buffer(name: str, buffer_args: Mapping[str, Any], prioritized_base: type | None = None
                        ) -> ConduitBuffer:
    """The buffer ``make_buffer(name, **buffer_args)`` builds for a Conduit name.

    ``"conduit:<semantics>"`` sets the semantics. With prioritized semantics and SRL's prioritized
    replay class given, the buffer is also an instance of that class (so SRL's trainer sends it
    priorities).

    Raises:
        ConfigurationError: an unknown semantics suffix, or one that contradicts ``buffer_args``; on-policy
            without ``rollout_size`` (SRL's workers never call ``seal()``: no rollout would ever be delivered).
    """
    args = dict(buffer_args)
    if ":" in name:
        sem = name.split(":", 1)[1]
        if sem not in SEMANTICS:
            raise ConfigurationError(f"Unknown Conduit buffer {name!r}; use 'conduit' or 'conduit:<semantics>' with "
                                     f"semantics one of {SEMANTICS}.")
        if args.get("semantics", sem) != sem:
            raise ConfigurationError(f"buffer_name {name!r} and buffer_args semantics={args['semantics']!r} "
                                     f"disagree; give the semantics once.")
        args["semantics"] = sem
    if args.get("semantics") == "on_policy" and args.get("rollout_size") is None:
        raise ConfigurationError(f"buffer_name {name!r} builds an on-policy buffer without rollout_size: SRL's workers "
                                 f"never call seal(), and the policy version the samples carry moves only after the "
                                 f"trainer has trained, so no rollout would ever be sealed and delivered (the trainer "
                                 f"would wait for ever). Add rollout_size=<samples per rollout> to buffer_args.")
    if args.get("semantics") == "prioritized" and isinstance(prioritized_base, type):
        return srl_prioritized_class(prioritized_base)(**args)
    return ConduitBuffer(**args)


def check_trainer_config(cfg: Any) -> None:
    """Raise if a trainer configuration asks for a Conduit buffer that SRL would not build or feed right.

    * ``buffer_zero_copy=True`` with a ``SHARED_MEMORY`` sample stream: SRL's trainer then ignores
      ``buffer_name`` (it builds its own queue and lets the shared-memory dock batch), so Conduit
      would own nothing. Set ``buffer_zero_copy=False``: the shared-memory stream still carries the
      samples and Conduit owns storage, batching, reuse and delivery.
    * a ``SHARED_MEMORY`` stream with ``batch_size`` delivers ``[T, B, ...]`` samples: the buffer
      then needs ``buffer_args["batched_puts"] = True``.
    * a ``SHARED_MEMORY`` stream without ``batch_size`` hands each sample over as a *view* of its
      shared-memory slot, and releases the slot to the writers before ``put`` (SRL's reader does so
      right after reading): an actor may write the next sample into that slot while the put one is
      still to be stored (after ``put``'s checks, or later on a worker with ``overlap=True``). The buffer
      then needs
      ``buffer_args["copy_on_put"] = True`` (a batched read copies: its slots are gathered).

    Raises:
        ZeroCopyStreamError: the first case.
        ConfigurationError: the second and third.
    """
    if not is_conduit_buffer_name(getattr(cfg, "buffer_name", None)):
        return
    stream: Any = getattr(cfg, "sample_stream", None)
    kind = getattr(getattr(stream, "type_", None), "name", None)
    if kind != "SHARED_MEMORY":
        return
    if getattr(cfg, "buffer_zero_copy", False):
        raise ZeroCopyStreamError(
            f"TrainerWorker(buffer_name={cfg.buffer_name!r}, buffer_zero_copy=True) with a SHARED_MEMORY sample "
            f"stream: SRL ignores buffer_name in that case and batches inside the shared-memory dock, so no Conduit "
            f"buffer would be built. Set buffer_zero_copy=False (samples still arrive through shared memory; "
            f"Conduit owns storage, batching, reuse and delivery), or choose an SRL buffer.")
    _check_shared_memory_reads(stream, getattr(cfg, "buffer_args", None))


def _check_shared_memory_reads(stream: Any, args: Any) -> None:
    """The ``buffer_args`` a Conduit buffer needs to take what a ``SHARED_MEMORY`` stream reads (see
    :func:`check_trainer_config`, second and third case)."""
    args = args if isinstance(args, Mapping) else {}
    if getattr(stream, "batch_size", None) and not args.get("batched_puts", False):
        raise ConfigurationError(
            f"The SHARED_MEMORY sample stream has batch_size={stream.batch_size}, so the buffer receives "
            f"[T, B, ...] samples; add batched_puts=True to buffer_args (or drop the stream's batch_size).")
    if not getattr(stream, "batch_size", None) and not args.get("copy_on_put", False):
        raise ConfigurationError(
            "The SHARED_MEMORY sample stream has no batch_size, so each sample reaches put() as a view of a "
            "shared-memory slot that SRL's reader has already released to the actors, which may write the next "
            "sample into it before Conduit stores this one (after put's checks, or later with overlap=True): add "
            "copy_on_put=True, which copies first thing in put, to "
            "buffer_args (or give the stream a batch_size, whose reads copy, with batched_puts=True).")


def check_buffer_worker_config(cfg: Any) -> None:
    """Raise if a buffer-worker configuration asks for an on-policy Conduit buffer whose puts wait for room.

    SRL's buffer worker calls ``consume_to`` (the buffer's ``put``) and ``get`` on one thread, its poll loop. An
    on-policy buffer with ``on_full="wait"`` (the default) makes a put that does not fit wait for a ``get()``,
    which only that same thread could make: once the buffer fills, the worker hangs for ever (its poll loop
    also serves SRL's control requests, so it cannot even be stopped). ``on_full="keep"`` (over SRL's own
    streams) or ``on_full="raise"`` (over a claimed ``conduit:<name>`` stream) never wait. ``on_full="raise"`` over
    a ``from_sample_stream`` that is SRL's own is refused too: SRL's ``consume_to`` lets the error out of the poll
    loop, which stops the worker once the buffer fills (with no ``from_sample_stream`` given it is not checked).

    A ``SHARED_MEMORY`` ``from_sample_stream`` needs the ``buffer_args`` :func:`check_trainer_config` asks for
    (``batched_puts`` with a ``batch_size``, ``copy_on_put`` without one).

    Raises:
        ConfigurationError: such a configuration.
    """
    name = getattr(cfg, "buffer_name", None)
    if not isinstance(name, str) or not is_conduit_buffer_name(name):
        return
    args = getattr(cfg, "buffer_args", None)
    args = args if isinstance(args, Mapping) else {}
    stream: Any = getattr(cfg, "from_sample_stream", None)
    if getattr(getattr(stream, "type_", None), "name", None) == "SHARED_MEMORY":
        _check_shared_memory_reads(stream, args)
    semantics = name.split(":", 1)[1] if ":" in name else args.get("semantics", "queue")
    if semantics != "on_policy":
        return
    on_full = args.get("on_full", "wait")
    if on_full == "raise" and stream is not None and not _claimed_stream(stream):
        raise ConfigurationError(
            f"BufferWorker(buffer_name={name!r}) with on_full='raise' over SRL's own sample stream "
            f"{_stream_name(stream)!r}: SRL's consume_to takes each message off its socket before put, so the first "
            f"put that does not fit raises out of the worker's poll loop, which stops the worker (the refused sample "
            f"leaves with the error). Use on_full='keep' over SRL's own streams, or claim the stream (name it "
            f"'conduit:<name>' with install(streams=True)), whose consumer keeps what a full buffer refuses.")
    if on_full != "wait":
        return
    raise ConfigurationError(
        f"BufferWorker(buffer_name={name!r}) with on_full='wait' (the default): SRL's buffer worker puts and gets "
        f"on one thread, so a put that waits for room could only be released by a get() of that same thread, and "
        f"the worker would hang once the buffer fills. Add on_full='keep' to buffer_args (over SRL's own sample "
        f"streams), or on_full='raise' over a claimed 'conduit:<name>' stream.")


def _stream_name(stream: Any) -> Any:
    """A sample-stream config's name (a plain ``str`` is SRL's shorthand for a NAME stream of that name)."""
    return stream if isinstance(stream, str) else getattr(stream, "stream_name", None)


def _claimed_stream(stream: Any) -> bool:
    """Whether a buffer worker's ``from_sample_stream`` reaches it through a Conduit consumer: named
    ``conduit:<name>``, and not an installation that left streams alone (``install(streams=False)``)."""
    name = _stream_name(stream)
    if not isinstance(name, str) or not name.startswith(STREAM_MARKER):
        return False
    current = _CURRENT
    return current is None or bool(current.settings.get("streams", True))


# -- install / uninstall ----------------------------------------------------------------------------
def installed() -> Installation | None:
    """The current installation, or None."""
    return _CURRENT


def install(*, streams: bool = True, stream_policy: StreamPolicy | None = None,
            stream_policies: Mapping[str, StreamPolicy] | None = None, check_configs: bool = True,
            flavours: tuple[Flavour, ...] = FLAVOURS) -> Installation:
    """Make the SRL in this process build Conduit buffers (idempotent; undo with :func:`uninstall`).

    A second call with the same settings returns the current installation and changes nothing; one with
    other settings is refused (the patches already in place use the first call's).

    Keyword Args:
        streams: also claim sample streams named ``"conduit:<name>"``.
        stream_policy: routing and coalescing of claimed streams (default ``StreamPolicy()``).
        stream_policies: per stream name (without the marker), overriding ``stream_policy``. A claimed
            ``NAME_MULTI_AGENT`` stream needs ``coalesce=1`` (its producer stacks agents along axis 1 itself).
        check_configs: check trainer and buffer-worker configurations as they are built
            (:func:`check_trainer_config`, :func:`check_buffer_worker_config`).
        flavours: the layouts to look for.

    Returns:
        What was patched, and what was looked for and left alone (with the reason).

    Raises:
        SrlNotFoundError: no SRL buffer module could be imported (nothing changed).
        ConfigurationError: already installed with other settings (nothing changed; :func:`uninstall` first), or
            a stream policy that is not a :class:`StreamPolicy`, or a ``stream_policies`` key that is not a bare
            stream name (nothing changed).
    """
    global _CURRENT
    _check_policies(stream_policy, stream_policies)
    settings = {"streams": streams, "stream_policy": stream_policy or StreamPolicy(),
                "stream_policies": dict(stream_policies or {}), "check_configs": check_configs,
                "flavours": tuple(flavours)}
    with _LOCK:
        if _CURRENT is not None:
            if _CURRENT.settings != settings:
                changed = sorted(k for k in settings if settings[k] != _CURRENT.settings.get(k))
                raise ConfigurationError(
                    f"conduit_srl is already installed in this process with other settings ({', '.join(changed)} "
                    f"differ), and its patches use those; call conduit_srl.uninstall() first to install with these.")
            return _CURRENT
        inst = Installation(settings=settings)
        policies = dict(stream_policies or {})
        default_policy = stream_policy or StreamPolicy()
        done: set[int] = set()
        try:
            buffers: list[ModuleType] = []
            for fl in flavours:
                buf = _load(fl.buffer_module, inst)
                if buf is None:
                    continue
                if not callable(getattr(buf, "make_buffer", None)):
                    inst.skipped[fl.buffer_module] = "has no make_buffer"
                    continue
                buffers.append(buf)
                sm = _load(fl.stream_module, inst)
                if sm is None:
                    continue  # this half of SRL is not here (the reason is in skipped)
                inst.flavours.append(fl.name)
                _once(done, buf, lambda b=buf: _patch_make_buffer(b, inst))
                if streams:
                    if fl.stream_seam == "factory":
                        _once(done, sm, lambda m=sm: _patch_factories(m, inst, default_policy, policies))
                    else:
                        _once(done, sm, lambda m=sm: _patch_registries(m, inst, default_policy, policies))
                if check_configs:
                    cm = _load(fl.config_module, inst)
                    if cm is not None:
                        _once(done, cm, lambda m=cm: _patch_config(m, inst))
            if not inst.flavours and buffers:
                # a buffer module without its stream modules: the buffer seam still works
                inst.flavours.append("buffer-only")
                for buf in buffers:
                    _once(done, buf, lambda b=buf: _patch_make_buffer(b, inst))
        except BaseException:
            for undo in reversed(inst._undo):
                undo()
            raise
        if not inst.patched:
            raise SrlNotFoundError(
                "No SRL buffer module (base.buffer or rlsrl.base.buffer) could be imported here, so nothing was "
                f"installed ({inst.skipped}). Put your SRL checkout on PYTHONPATH and call install() in the "
                f"experiment module the workers import.")
        _CURRENT = inst
        return inst


def _check_policies(default: Any, policies: Any) -> None:
    """Refuse stream policies that claimed streams would fail on (or silently not use) once workers run."""
    if default is not None and not isinstance(default, StreamPolicy):
        raise ConfigurationError(f"stream_policy must be a conduit_srl.StreamPolicy, got {type(default).__name__}; "
                                 f"write stream_policy=StreamPolicy(route=..., coalesce=..., max_delay_s=...).")
    if policies is None:
        return
    try:
        pairs = dict(policies).items()
    except (TypeError, ValueError):
        raise ConfigurationError(f"stream_policies maps stream names to StreamPolicy objects, got "
                                 f"{type(policies).__name__}; write stream_policies={{'<name>': StreamPolicy(...)}}."
                                 ) from None
    for name, policy in pairs:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"stream_policies keys are stream names, got {name!r}.")
        if name.startswith(STREAM_MARKER):
            raise ConfigurationError(f"stream_policies key {name!r} carries the {STREAM_MARKER!r} marker, so no "
                                     f"stream would ever use its policy; key it by the bare name "
                                     f"{name[len(STREAM_MARKER):]!r}.")
        if not isinstance(policy, StreamPolicy):
            raise ConfigurationError(f"stream_policies[{name!r}] must be a conduit_srl.StreamPolicy, got "
                                     f"{type(policy).__name__}; write StreamPolicy(route=..., coalesce=..., "
                                     f"max_delay_s=...).")


def uninstall() -> bool:
    """Put back everything :func:`install` replaced; returns whether anything was installed."""
    global _CURRENT
    with _LOCK:
        inst, _CURRENT = _CURRENT, None
        if inst is None:
            return False
        for undo in reversed(inst._undo):
            undo()
        return True


def _once(done: set[int], mod: ModuleType, patch: Callable[..., None]) -> None:
    if id(mod) not in done:
        done.add(id(mod))
        patch()


def _load(name: str, inst: Installation) -> ModuleType | None:
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - a layout that does not import here is reported, not fatal
        inst.skipped[name] = f"{type(e).__name__}: {e}"
        return None


def _set(obj: Any, attr: str, value: Any, inst: Installation, what: str) -> None:
    original = getattr(obj, attr)
    setattr(obj, attr, value)
    inst.patched.append(what)

    def undo() -> None:
        if getattr(obj, attr, None) is value:
            setattr(obj, attr, original)

    inst._undo.append(undo)


# -- the buffer seam ---------------------------------------------------------------------------------
def _patch_make_buffer(mod: ModuleType, inst: Installation) -> None:
    original = mod.make_buffer
    prioritized = getattr(mod, "PrioritizedReplayBuffer", None)

    def make_buffer(name: Any, **buffer_args: Any) -> Any:
        if is_conduit_buffer_name(name):
            return make_conduit_buffer(name, buffer_args, prioritized)
        return original(name, **buffer_args)

    make_buffer.__wrapped__ = original  # type: ignore[attr-defined]
    make_buffer.__doc__ = f"Conduit-aware {mod.__name__}.make_buffer: 'conduit' builds a ConduitBuffer."
    _set(mod, "make_buffer", make_buffer, inst, f"{mod.__name__}.make_buffer")


def _patch_config(mod: ModuleType, inst: Installation) -> None:
    cls = getattr(mod, "TrainerWorker", None)
    if not isinstance(cls, type):
        inst.skipped[mod.__name__] = "has no TrainerWorker class"
    else:
        _patch_config_class(mod, cls, check_trainer_config, inst)
    worker = getattr(mod, "BufferWorker", None)  # (srl-local has no buffer worker)
    if isinstance(worker, type):
        _patch_config_class(mod, worker, check_buffer_worker_config, inst)


def _patch_config_class(mod: ModuleType, cls: type, check: Callable[[Any], None], inst: Installation) -> None:
    """Run ``check`` on each ``cls`` configuration as given and as built."""
    original: Callable[..., None] = cast("Any", cls).__init__  # the class's own or inherited __init__
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # Checked as given, before the original runs: srl-local's __post_init__ turns a zero-copy config into
        # buffer_name="simple_queue" (and aligns the stream to it), after which nothing is left to check.
        given = _given(signature, self, args, kwargs)
        if given is not None:
            check(given)
        original(self, *args, **kwargs)
        check(self)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    _set(cls, "__init__", __init__, inst, f"{mod.__name__}.{cls.__name__}.__init__ (config check)")


def _given(signature: inspect.Signature | None, obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> SimpleNamespace | None:
    """The arguments of a config constructor call by name, defaults filled in (None: they do not bind)."""
    if signature is None:
        return None
    try:
        bound = signature.bind(obj, *args, **kwargs)
    except TypeError:
        return None  # (the constructor raises its own error)
    bound.apply_defaults()
    values = dict(list(bound.arguments.items())[1:])  # without self
    return SimpleNamespace(**{k: v for k, v in values.items() if v is not inspect.Parameter.empty})


# -- the stream seam ---------------------------------------------------------------------------------
def _claim(spec: Any) -> tuple[Any, str] | None:
    """``(spec without the marker, stream name)`` if ``spec`` names a Conduit stream, else None."""
    name = _stream_name(spec)
    if not isinstance(name, str) or not name.startswith(STREAM_MARKER):
        return None
    bare = name[len(STREAM_MARKER):]
    if not bare:
        raise StreamClaimError(f"Stream name {name!r} has nothing after the marker; write 'conduit:<name>'.")
    if isinstance(spec, str):
        return bare, bare
    kind = getattr(getattr(spec, "type_", None), "name", None)
    if kind == "SHARED_MEMORY":
        raise StreamClaimError(f"Stream {name!r} is a SHARED_MEMORY stream: its slots have one fixed sample shape, "
                               f"so Conduit cannot coalesce or route over it. Drop the 'conduit:' marker (a Conduit "
                               f"buffer still works on it) or use a NAME/IP stream.")
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, stream_name=bare), bare
    stripped = copy.copy(spec)
    stripped.stream_name = bare
    return stripped, bare


def _producer_policy(spec: Any, name: str, default: StreamPolicy, policies: dict[str, StreamPolicy]) -> StreamPolicy:
    """The policy of a claimed producer, refused (StreamClaimError) where its native producer would garble it.

    A policy without a route takes the stream type's own rule: round robin for ``NAME_ROUND_ROBIN``, rank otherwise.

    SRL's multi-agent producer caches every post of a flush and sends them stacked along axis 1 (one column
    per agent): coalesced ``[T, k, ...]`` messages posted to it would be stacked again, and the trainer would
    receive records with an extra axis that no consumer can take apart.
    """
    policy = policies.get(name, default)
    kind = None if isinstance(spec, str) else getattr(getattr(spec, "type_", None), "name", None)
    if policy.route is None and kind == "NAME_ROUND_ROBIN":  # (SRL's rule for this stream: each post to the next)
        policy = dataclasses.replace(policy, route="round_robin")
    if kind == "NAME_MULTI_AGENT" and policy.coalesce > 1:
        raise StreamClaimError(f"Stream {STREAM_MARKER + name!r} is a NAME_MULTI_AGENT stream, whose producer stacks "
                               f"the samples of each flush along the agent axis itself; coalescing (coalesce="
                               f"{policy.coalesce}) would stack whole messages. Give this stream a policy with "
                               f"coalesce=1 (stream_policies={{{name!r}: StreamPolicy(coalesce=1)}}) or drop the "
                               f"'conduit:' marker.")
    return policy


def _name_resolving_targets(mod: ModuleType, spec: Any, name: str, worker_info: Any) -> list[Any] | None:
    """One native producer per registered consumer of ``name`` (distributed layout, NAME streams), or None."""
    kind = "NAME" if isinstance(spec, str) else getattr(getattr(spec, "type_", None), "name", None)
    needed = ("name_resolve", "names", "NameResolvingSampleProducer")
    if kind not in ("NAME", "NAME_ROUND_ROBIN") or worker_info is None or not all(hasattr(mod, a) for a in needed):
        return None
    key = mod.names.sample_stream(experiment_name=worker_info.experiment_name, trial_name=worker_info.trial_name,
                                  stream_name=name)
    n = len(mod.name_resolve.get_subtree(key))
    if n == 0:
        return None
    method = "pickle" if isinstance(spec, str) else getattr(spec, "serialization_method", "pickle")
    built: list[Any] = []
    try:
        for r in range(n):
            built.append(mod.NameResolvingSampleProducer(experiment_name=worker_info.experiment_name,
                                                         trial_name=worker_info.trial_name, stream_name=name, rank=r,
                                                         serialization_method=method))
    except BaseException:
        _close_all(built)  # (their sockets would otherwise stay open, unreachable)
        raise
    return built


def _close_all(ends: list[Any]) -> None:
    """Close stream ends built for a producer that could not be completed (their own errors are dropped: the
    caller raises the one that stopped the build)."""
    for end in ends:
        close = getattr(end, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


def _patch_factories(mod: ModuleType, inst: Installation, default: StreamPolicy,
                     policies: dict[str, StreamPolicy]) -> None:
    if not (callable(getattr(mod, "make_producer", None)) and callable(getattr(mod, "make_consumer", None))):
        inst.skipped[mod.__name__] = "has no make_producer/make_consumer"
        return
    make_p, make_c = mod.make_producer, mod.make_consumer

    def make_producer(spec: Any, worker_info: Any = None) -> Any:
        claim = _claim(spec)
        if claim is None:
            return make_p(spec, worker_info)
        bare_spec, name = claim
        policy = _producer_policy(bare_spec, name, default, policies)
        targets = _name_resolving_targets(mod, bare_spec, name, worker_info) or [make_p(bare_spec, worker_info)]
        rank = getattr(worker_info, "worker_index", 0) or 0
        try:
            return ConduitSampleProducer(targets, policy=policy, rank=rank)
        except BaseException:
            _close_all(targets)
            raise

    def make_consumer(spec: Any, worker_info: Any = None) -> Any:
        claim = _claim(spec)
        if claim is None:
            return make_c(spec, worker_info)
        return ConduitSampleConsumer(make_c(claim[0], worker_info))

    make_producer.__wrapped__ = make_p  # type: ignore[attr-defined]
    make_consumer.__wrapped__ = make_c  # type: ignore[attr-defined]
    _set(mod, "make_producer", make_producer, inst, f"{mod.__name__}.make_producer")
    _set(mod, "make_consumer", make_consumer, inst, f"{mod.__name__}.make_consumer")


def _wrap_entry(cls: Any, side: str, default: StreamPolicy, policies: dict[str, StreamPolicy]) -> Any:
    if getattr(cls, "__conduit_wrapped__", None) is not None:
        return cls

    def build(spec: Any, *args: Any, **kwargs: Any) -> Any:
        claim = _claim(spec)
        if claim is None:
            return cls(spec, *args, **kwargs)
        bare_spec, name = claim
        if side == "producer":
            policy = _producer_policy(bare_spec, name, default, policies)
            native = cls(bare_spec, *args, **kwargs)
            info = getattr(bare_spec, "worker_info", None)
            try:
                return ConduitSampleProducer([native], policy=policy, rank=getattr(info, "worker_index", 0) or 0)
            except BaseException:
                _close_all([native])
                raise
        return ConduitSampleConsumer(cls(bare_spec, *args, **kwargs))

    build.__conduit_wrapped__ = cls  # type: ignore[attr-defined]
    build.__name__ = f"conduit_{side}_{getattr(cls, '__name__', 'entry')}"
    return build


def _patch_registries(mod: ModuleType, inst: Installation, default: StreamPolicy,
                      policies: dict[str, StreamPolicy]) -> None:
    for side, table_name, register_name in (("producer", "ALL_SAMPLE_PRODUCER_CLS", "register_producer"),
                                            ("consumer", "ALL_SAMPLE_CONSUMER_CLS", "register_consumer")):
        table = getattr(mod, table_name, None)
        register = getattr(mod, register_name, None)
        if not isinstance(table, dict) or not callable(register):
            inst.skipped[f"{mod.__name__}.{table_name}"] = "no registry of that name"
            continue
        originals = dict(table)
        for key, cls in originals.items():
            table[key] = _wrap_entry(cls, side, default, policies)

        def undo_table(table: dict[Any, Any] = table, originals: dict[Any, Any] = originals) -> None:
            for key, cls in originals.items():
                if getattr(table.get(key), "__conduit_wrapped__", None) is cls:
                    table[key] = cls

        inst._undo.append(undo_table)
        inst.patched.append(f"{mod.__name__}.{table_name} ({len(originals)} entries)")

        def register_wrapped(type_: Any, cls: Any, *args: Any, _register: Any = register, _side: str = side,
                             **kwargs: Any) -> Any:
            out = _register(type_, cls, *args, **kwargs)
            tbl = getattr(mod, "ALL_SAMPLE_PRODUCER_CLS" if _side == "producer" else "ALL_SAMPLE_CONSUMER_CLS")
            tbl[type_] = _wrap_entry(tbl[type_], _side, default, policies)
            return out

        register_wrapped.__wrapped__ = register  # type: ignore[attr-defined]
        _set(mod, register_name, register_wrapped, inst, f"{mod.__name__}.{register_name}")

        def undo_later(table: dict[Any, Any] = table, originals: dict[Any, Any] = originals) -> None:
            # entries registered after install (new types, or types registered again) were wrapped too: unwrap them
            for key, entry in list(table.items()):
                inner = getattr(entry, "__conduit_wrapped__", None)
                if inner is not None and (key not in originals or inner is not originals[key]):
                    table[key] = inner

        inst._undo.append(undo_later)
