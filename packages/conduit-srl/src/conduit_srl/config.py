"""``buffer_args`` of a Conduit buffer: parsed, checked and defaulted in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from conduit import ConfigurationError
from conduit.checks import is_bool

__all__ = ["BufferConfig", "SEMANTICS"]

#: what a Conduit buffer can deliver
SEMANTICS = ("queue", "replay", "prioritized", "on_policy")

#: SRL buffer arguments that do not carry over, and what to write instead
_SRL_HINTS = {
    "max_size": "Conduit counts capacity in samples (trajectory segments): write capacity=...",
    "warmup_transitions": "write warmup=<samples> (Conduit counts samples, not transitions)",
    "sample_length": "T is taken from the first sample; drop it",
    "batch_length": "delivered samples keep their full length T; slice them in the trainer",
    "beta_scheduler": "pass a fixed beta=...",
    "max_priority": "new samples get the largest priority seen so far; drop it",
    "priority_interpolation_eta": "initial priorities are the largest seen so far; drop it",
    "burn_in_steps": "drop it (priorities are set through update_priorities)",
}


#: arguments that only some semantics read, and which (any other value than the default is refused elsewhere: it
#: would be ignored)
_ONLY_FOR = {
    "num_minibatches": ("on_policy",),
    "minibatch_size": ("on_policy",),
    "num_epochs": ("on_policy",),
    "max_staleness": ("on_policy",),
    "on_stale": ("on_policy",),
    "version_field": ("on_policy",),
    "alpha": ("prioritized",),
    "beta": ("prioritized",),
    "warmup": ("replay", "prioritized"),
}


@dataclass(frozen=True)
class BufferConfig:
    """Everything a Conduit buffer is built from (``make_buffer("conduit", **buffer_args)``).

    Semantics (``semantics=``):

    * ``"queue"`` (default): batches of ``batch_size`` samples in arrival order, each delivered
      ``reuses`` times (SRL's queue buffers, for on-policy trainers).
    * ``"replay"``: ``batch_size`` samples drawn uniformly with replacement once ``warmup``
      samples are stored (SRL's uniform replay buffer).
    * ``"prioritized"``: proportional prioritized replay (``alpha``, ``beta``); the trainer's
      ``update_priorities(entry.sampling_indices, priorities)`` updates them.
    * ``"on_policy"``: Conduit's freshness semantics: rollouts of one policy version, each
      delivered as ``num_minibatches`` minibatches per epoch for ``num_epochs`` epochs, with a
      staleness bound (``max_staleness``, ``on_stale``). On-policy storage never evicts: a put that does
      not fit waits for a delivery to free room (``on_full="wait"``), raises
      :class:`~conduit_srl.errors.BufferFullError` at once (``on_full="raise"``, for hosts that put and get
      on one thread, such as SRL's buffer worker, over a claimed stream), or is kept by the buffer and
      stored first once room is freed (``on_full="keep"``, such a host over SRL's native streams).
    """

    semantics: str = "queue"
    batch_size: int | None = None
    capacity: int | None = None
    reuses: int = 1
    warmup: int | None = None
    alpha: float = 0.6
    beta: float = 0.4
    num_minibatches: int | None = None
    minibatch_size: int | None = None
    num_epochs: int = 1
    #: on_policy: rollouts more than this many versions behind the learner's are dropped or raise (``on_stale``); the
    #: learner's version is what ``ConduitBuffer.set_policy_version`` last set (0 until then: SRL's stock trainer never
    #: calls it, so without that call nothing is stale)
    max_staleness: int = 0
    on_stale: str = "drop"
    #: seal an on-policy rollout after this many samples (None: only on a version change or seal()); a sample of a newer
    #: version seals the open rollout before room for it is looked for, so capacity may be one rollout's worth
    rollout_size: int | None = None
    seed: int = 0
    #: Conduit's scheduler: ingestion granularity (off-policy: puts per storage write; on-policy: part of a rollout)
    g_ing: float = 1
    #: Conduit's scheduler: batches it gathers ahead per delivery (replay, prioritized; queue and on_policy: 1)
    g_del: int = 1
    #: run ingestion and gathering in the background. False (default): the same granularity, stored in ``put`` and
    #: gathered in the delivery: with one putting thread a background worker only shares the GIL with it (1.2x-2.3x
    #: per put; the default moved 1.24x-1.43x the samples/s end to end, benchmarks/docs/srl.md); the assembler still
    #: prepares ahead
    overlap: bool = False
    #: puts that may wait for storage before ``put`` blocks (backpressure)
    queue_depth: int = 8
    #: copy each sample first thing in ``put`` (otherwise its arrays are read when stored: after the checks in
    #: ``put``, or later on a worker with ``overlap=True``: do not write into them before ``put`` returns, nor, with
    #: ``overlap=True``, before ``flush``)
    copy_on_put: bool = False
    #: entries assembled ([T, B, ...] records) ahead in the background (None: 1; 0 for prioritized and for
    #: on_policy with on_stale="raise", where an entry prepared ahead could miss a priority or version change)
    prefetch: int | None = None
    #: every put is a batched [T, B, ...] sample (otherwise [T, ...]; put_batch always takes [T, B, ...])
    batched_puts: bool = False
    #: on_policy: what a put does when its samples do not fit until a delivery frees room. "wait": it waits for a
    #: get() on another thread (SRL's trainer: put on the main thread, get on the training thread); "raise": it never
    #: waits, it raises BufferFullError at once, carrying the refused sample (hosts that put and get on one thread,
    #: e.g. SRL's buffer worker, where a waiting put could never be released, over a claimed stream, whose consumer
    #: keeps what is refused); "keep": it never waits and never refuses for room: the buffer keeps what does not fit,
    #: in order, and stores it first as deliveries free room (one thread over SRL's native streams, whose
    #: consume_to holds no sample whose put raises and lets the error stop the worker)
    on_full: str = "wait"
    version_field: str = "policy_version_steps"
    drop_fields: tuple[str, ...] = ("policy_name",)
    #: page-lock delivered arrays (None: when CUDA is available)
    pin_memory: bool | None = None

    @classmethod
    def from_args(cls, **kwargs: Any) -> BufferConfig:
        """Parse ``buffer_args``.

        Raises:
            ConfigurationError: an unknown argument (with the Conduit spelling of SRL's ones), a value
                out of range, or arguments that do not fit the semantics (also one that the semantics would
                ignore, given a value other than its default).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = "; ".join(f"{k}: {_SRL_HINTS[k]}" for k in unknown if k in _SRL_HINTS)
            raise ConfigurationError(f"Unknown Conduit buffer argument(s) {unknown}. {hints + '. ' if hints else ''}"
                                     f"Known: {sorted(known)}.")
        if "drop_fields" in kwargs:
            drop = kwargs["drop_fields"]
            # one name, not its letters; None drops nothing
            kwargs["drop_fields"] = () if drop is None else (drop,) if isinstance(drop, str) else tuple(drop)
        cfg = cls(**kwargs)
        cfg._check()
        defaults = cls()
        ignored = sorted(k for k, only in _ONLY_FOR.items()
                         if cfg.semantics not in only and getattr(cfg, k) != getattr(defaults, k))
        if ignored:
            where = "; ".join(f"{k} applies to semantics={' or '.join(map(repr, _ONLY_FOR[k]))}" for k in ignored)
            raise ConfigurationError(f"Buffer argument(s) {ignored} would be ignored with semantics={cfg.semantics!r} "
                                     f"({where}); drop them or choose the semantics they belong to.")
        return cfg

    # -- checks ----------------------------------------------------------------------------
    def _check(self) -> None:
        def positive(name: str, v: Any, *, zero: bool = False) -> None:
            ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if zero else v > 0)
            if not ok:
                raise ConfigurationError(f"{name} must be an int {'>= 0' if zero else '> 0'}, got {v!r}.")

        if self.semantics not in SEMANTICS:
            raise ConfigurationError(f"semantics must be one of {SEMANTICS}, got {self.semantics!r}.")
        if self.semantics == "on_policy":
            if self.batch_size is not None:
                raise ConfigurationError("on_policy delivers minibatches sized by num_minibatches or minibatch_size; "
                                         "drop batch_size.")
            if self.capacity is None:
                raise ConfigurationError("on_policy needs capacity=<samples> (at least one rollout's worth).")
            if self.rollout_size is not None:
                positive("rollout_size", self.rollout_size)
                positive("capacity", self.capacity)
                if self.rollout_size > self.capacity:  # (storage never evicts a rollout before its delivery)
                    raise ConfigurationError(f"rollout_size {self.rollout_size} is larger than capacity "
                                             f"{self.capacity}; a rollout could never be completed. Raise capacity "
                                             f"or lower rollout_size.")
        else:
            if self.batch_size is None:
                raise ConfigurationError(f"semantics={self.semantics!r} needs batch_size=<samples per get()>.")
            positive("batch_size", self.batch_size)
            if self.capacity is None and self.semantics != "queue":
                raise ConfigurationError(f"semantics={self.semantics!r} needs capacity=<samples to keep>.")
            if self.rollout_size is not None:
                raise ConfigurationError("rollout_size is an on_policy argument.")
        positive("capacity", self.resolved_capacity)
        if self.semantics == "queue" and self.batch_size is not None and self.batch_size > self.resolved_capacity:
            raise ConfigurationError(f"batch_size {self.batch_size} is larger than capacity "
                                     f"{self.resolved_capacity}; raise capacity.")
        positive("reuses", self.reuses)
        if self.reuses != 1 and self.semantics != "queue":
            raise ConfigurationError("reuses applies to semantics='queue' (on_policy reuses through num_epochs).")
        if self.warmup is not None:
            positive("warmup", self.warmup)
            if self.warmup > self.resolved_capacity:
                raise ConfigurationError(f"warmup {self.warmup} is larger than capacity {self.resolved_capacity}; "
                                         f"it could never be reached.")
        positive("seed", self.seed, zero=True)
        if self.prefetch is not None:
            positive("prefetch", self.prefetch, zero=True)
            if self.prefetch and self.semantics == "on_policy" and self.on_stale == "raise":
                raise ConfigurationError("on_stale='raise' checks staleness when get() is called, so nothing can be "
                                         "prepared ahead; use prefetch=0 or on_stale='drop'.")
        positive("queue_depth", self.queue_depth)
        if (not isinstance(self.g_ing, (int, float)) or isinstance(self.g_ing, bool) or not self.g_ing > 0
                or not math.isfinite(self.g_ing)):
            raise ConfigurationError(f"g_ing must be a positive number, got {self.g_ing!r}.")
        for name in ("overlap", "copy_on_put", "batched_puts", "pin_memory"):
            v = getattr(self, name)
            if not is_bool(v) and not (v is None and name == "pin_memory"):
                raise ConfigurationError(f"{name} must be True or False{' (or None)' if name == 'pin_memory' else ''}"
                                         f", got {v!r}; a string such as 'no' would read as True.")
        if not isinstance(self.version_field, str) or not self.version_field:
            raise ConfigurationError(f"version_field must be a field name, got {self.version_field!r}.")
        bad = [f for f in self.drop_fields if not isinstance(f, str)]
        if bad:
            raise ConfigurationError(f"drop_fields are field names (str), got {bad!r}.")
        if self.semantics == "on_policy":
            # (a dropped field, or one inside a dropped record, is never stored: no version could be read from it)
            hides = [f for f in self.drop_fields
                     if self.version_field == f or self.version_field.startswith(f + ".")]
            if hides:
                raise ConfigurationError(f"on_policy reads policy versions from {self.version_field!r}, which "
                                         f"drop_fields {hides!r} would drop before it is stored; remove it from "
                                         f"drop_fields, or set version_field= to another field.")
            if self.g_ing > 1:
                raise ConfigurationError(f"on_policy g_ing is a part of one rollout, in (0, 1]; got {self.g_ing}.")
            if self.g_del != 1:
                raise ConfigurationError("on_policy delivers one minibatch per get(): drop g_del.")
        else:
            if int(self.g_ing) != self.g_ing:
                raise ConfigurationError(f"g_ing counts puts per storage write: an int >= 1, got {self.g_ing}.")
            positive("g_del", self.g_del)
            if self.semantics == "queue" and self.g_del != 1:
                raise ConfigurationError("queue delivers the oldest waiting batch, one per get(): gathering g_del "
                                         "batches per delivery would need that many batches waiting, so drop g_del "
                                         "(prefetch= assembles entries ahead).")
        if self.on_stale not in ("drop", "raise"):
            raise ConfigurationError(f"on_stale must be 'drop' or 'raise', got {self.on_stale!r}.")
        if self.on_full not in ("wait", "raise", "keep"):
            raise ConfigurationError(f"on_full must be 'keep', 'wait' or 'raise', got {self.on_full!r}.")
        if self.never_waits:
            if self.semantics != "on_policy":
                raise ConfigurationError(f"on_full applies to semantics='on_policy' (a {self.semantics} buffer never "
                                         f"waits for room: it evicts the oldest samples); drop on_full.")
            if self.prefetch:
                raise ConfigurationError(f"on_full={self.on_full!r} decides from the room deliveries made so far, and "
                                         f"an entry assembled ahead frees room at a time the caller does not control; "
                                         f"use prefetch=0 (or leave it unset).")

    # -- resolved values -------------------------------------------------------------------
    @property
    def replay_like(self) -> bool:
        """Deliveries are independent draws (prepared ones may be dropped and redrawn)."""
        return self.semantics in ("replay", "prioritized")

    @property
    def never_waits(self) -> bool:
        """On-policy: a put never waits for a delivery to free room (``on_full`` is "raise" or "keep")."""
        return self.on_full in ("raise", "keep")

    @property
    def resolved_capacity(self) -> int:
        if self.capacity is not None:
            return self.capacity
        assert self.batch_size is not None
        return 16 * self.batch_size

    @property
    def resolved_prefetch(self) -> int:
        if self.prefetch is not None:
            return self.prefetch
        if self.semantics == "prioritized":
            return 0
        if self.semantics == "on_policy" and (self.on_stale == "raise" or self.never_waits):
            return 0
        return 1

    @property
    def resolved_warmup(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return min(self.batch_size or 1, self.resolved_capacity)
