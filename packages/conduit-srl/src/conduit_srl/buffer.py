"""The Conduit buffer: SRL's trainer-side buffer contract on an Experience Data Plane.

Build one with ``make_buffer("conduit", **buffer_args)`` after :func:`conduit_srl.install`, or
directly with ``ConduitBuffer(**buffer_args)`` (see :class:`~conduit_srl.config.BufferConfig`).
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any, cast

from conduit import ExperienceDataPlane, Telemetry

from conduit_srl.assembler import Assembler, ReplayEntry
from conduit_srl.config import BufferConfig

__all__ = ["ConduitBuffer", "ReplayEntry", "srl_prioritized_class"]


class ConduitBuffer:
    """SRL's ``Buffer`` contract, with Conduit deciding where experience lives and when work runs.

    * ``put(sample)`` takes one ``[T, ...]`` sample (``put_batch`` or ``batched_puts=True``: a
      ``[T, B, ...]`` one), checks it against the first sample's fields, dtypes and shapes, and
      hands it to the EDP's :class:`~conduit.Overlapped` scheduler, which stores it before ``put`` returns
      (``overlap=True``: a core worker stores it in the background and ``put`` returns once it is handed over).
    * ``get()`` returns a :class:`ReplayEntry` whose ``sample`` is a record of the put samples'
      class with ``[T, B, ...]`` host NumPy fields (page-locked when CUDA exists), including the
      policy-version field; ``reuses`` and ``sampling_indices`` as SRL's trainer reads them. The
      next ``prefetch`` entries are gathered and assembled in the background while the trainer steps.
    * ``empty()`` is False only when ``get()`` will deliver; ``qsize()`` counts samples not yet
      delivered; ``update_priorities(sampling_indices, priorities)`` for prioritized replay.
    * Thread-safe: puts from the consuming thread and gets from the training thread may overlap.
      On-policy storage never evicts: a put that does not fit waits for a ``get()`` on another thread,
      or (``on_full="raise"``, for hosts that put and get on one thread) raises ``BufferFullError``, or
      (``on_full="keep"``) is kept and stored first once a delivery frees room.
    * Picklable (SRL's ``save_buffer_on_exit``): contents, sampler state and prepared deliveries.

    Keyword Args:
        **buffer_args: see :class:`~conduit_srl.config.BufferConfig`.

    Raises:
        ConfigurationError: unknown or inconsistent ``buffer_args``.
    """

    #: (module, class name) of the SRL class this buffer also subclasses (see :func:`srl_prioritized_class`)
    _srl_base: tuple[str, str] | None = None

    def __init__(self, **buffer_args: Any) -> None:
        self._attach(Assembler(BufferConfig.from_args(**buffer_args)))

    def _attach(self, assembler: Assembler) -> None:
        self._a = assembler
        self._finalizer = weakref.finalize(self, Assembler.close, assembler)

    # -- SRL's contract ----------------------------------------------------------------------
    def put(self, x: Any) -> None:
        """Hand over one sample (``[T, ...]``, or ``[T, B, ...]`` with ``batched_puts=True``).

        Fields are NumPy arrays, torch tensors (read detached, on the host, with conjugate/negative
        view bits resolved; like arrays, not written after the put) or nested lists of numbers. A
        big-endian array is the same field as a native one of its dtype; deliveries are native.

        Raises:
            SchemaError: the sample's fields, dtypes or shapes differ from the first sample's, or a field
                cannot be stored (object, string or structured dtypes, no time axis, ragged lists).
            CapacityError: more samples than the capacity in one put, or (first put) storage for
                ``capacity`` such samples cannot be allocated.
            StaleExperienceError: on-policy, a sample older than the newest rollout (open or sealed) with
                ``on_stale="raise"``.
            BufferFullError: on-policy with ``on_full="raise"``, the samples do not fit until a ``get()`` frees
                room; the buffer keeps none of them, the error carries ``x`` (its ``sample``) to be put again
                (with ``on_full="wait"``, the default, the put waits for a ``get()`` on another thread; with
                ``on_full="keep"`` the buffer keeps them, in order, and the next ``put``, ``get()``, ``empty()``
                or ``flush()`` stores them first once room is freed: ``stats()["samples_held"]``, counted in
                ``qsize()`` and in ``samples_put`` once stored).

        An error raised after part of the put was taken (on-policy: a put that spans rollouts and whose
        later part is refused) says how many of its first samples were taken, also in its
        ``samples_stored`` attribute; ``stats()`` counts exactly those. Put only the rest again.
        """
        self._a.put(x, batched=self._a.cfg.batched_puts)

    def put_batch(self, x: Any) -> None:
        """Hand over a batched ``[T, B, ...]`` sample as ``B`` samples."""
        self._a.put(x, batched=True)

    def get(self, batch_size: int | None = None) -> ReplayEntry:
        """The next delivery.

        Args:
            batch_size: replay only: draw this many samples instead of the configured batch size
                (prepared draws of another size are discarded and redrawn).

        An entry assembled ahead that aged (prioritized: more than ``prefetch`` priority updates; on-policy: a
        version change made it too stale) is discarded; one delivered for this call is returned as delivered,
        also while other threads keep updating priorities or moving the policy version. A discarded on-policy entry
        gives its shuffle draws back, so on-policy deliveries (contents and order) are those of ``prefetch=0``.

        Raises:
            EmptyBufferError: nothing to deliver (``empty()`` was True).
            StaleExperienceError: on-policy, the next rollout is too stale and ``on_stale="raise"``.
        """
        return self._a.get(batch_size)

    def empty(self) -> bool:
        """False only when ``get()`` will deliver, also after a put on another thread meanwhile (a queue reuse that
        such a put could evict is assembled here and kept for ``get()``)."""
        return self._a.empty()

    def qsize(self) -> int:
        return self._a.qsize()

    def update_priorities(self, idxes: Any, priorities: Any) -> int:
        """New priorities for delivered samples, named by ``entry.sampling_indices``.

        Returns:
            How many samples were still held (updates for evicted ones are ignored).

        Raises:
            PriorityError: NaN, infinite or negative priorities, or a length mismatch.
            ConfigurationError: the buffer is not prioritized.
        """
        return self._a.update_priorities(idxes, priorities)

    # -- Conduit's additions -----------------------------------------------------------------
    def set_policy_version(self, version: int) -> None:
        """On-policy: the learner's policy version, which staleness is measured against.

        Raises:
            ConfigurationError: the buffer is not on-policy, or ``version`` is not an integer.
        """
        self._a.set_policy_version(version)

    def seal(self) -> None:
        """On-policy: close the open rollout so it can be delivered.

        The rollout is exactly the samples put before the call. It returns at once, also while a
        ``put`` waits for room in another thread: that put's samples go to the next rollout.
        """
        self._a.seal()

    def flush(self) -> None:
        """Wait until every sample put so far is stored (with ``overlap=True`` a core worker stores them)."""
        self._a.flush()

    def __len__(self) -> int:
        """Samples stored (after the puts made so far are stored)."""
        self._a.flush()
        return 0 if self._a.edp is None else len(self._a.edp)

    @property
    def priority_staleness(self) -> int:
        """Prioritized: how many ``update_priorities`` calls a delivered draw may precede (prefetch depth), besides
        calls that other threads make during the ``get()`` that draws it."""
        return self._a.priority_staleness

    @property
    def config(self) -> BufferConfig:
        return self._a.cfg

    @property
    def edp(self) -> ExperienceDataPlane | None:
        """The Experience Data Plane underneath (None until the first put fixes the schema)."""
        return self._a.edp

    @property
    def telemetry(self) -> Telemetry | None:
        """Per-call records of ingest, deliver and assemble (None before the first put)."""
        return None if self._a.edp is None else self._a.edp.telemetry

    def stats(self) -> dict[str, Any]:
        """Counters, and where the samples put are, in one consistent reading (every key present from construction).

        Keys: ``samples_put`` (taken by puts: stored, or dropped as late), ``samples_held`` (on-policy,
        ``on_full="keep"``: accepted, not stored yet), ``entries_delivered``, ``samples_delivered`` (handed out by
        ``get()`` at least once; replay: drawn at least once while stored), ``late_dropped``, ``stale_dropped`` and
        ``rollout_dropped`` (on-policy: never handed out, dropped as late, in an entry assembled ahead that went
        stale, or with a stale rollout), ``queue_dropped`` (evicted before their first delivery) and
        ``queue_abandoned`` (batches handed out fewer than ``reuses`` times whose remaining reuses eviction
        skipped), ``redrawn`` (replay entries
        assembled ahead and discarded), ``samples_waiting`` (queue and on-policy: stored or on their way, never
        handed out, not dropped; replay: held) and ``qsize`` (what :meth:`qsize` returns at the same moment).

        Queue and on-policy, every sample a put accepted is in exactly one place::

            accepted = samples_put + samples_held
            samples_put = samples_delivered + late_dropped + stale_dropped + rollout_dropped + queue_dropped
                          + samples_waiting

        ``qsize`` differs from ``samples_waiting`` where samples delivered once are still owed deliveries
        (on-policy: the rollout's later epochs; it also counts ``samples_held``) or where a queue's samples on
        their way to storage will evict (``qsize`` takes those off already, ``queue_dropped`` counts them once stored).

        All of it is read under the buffer's locks and the data plane's, so no put or delivery is halfway
        through: the identity holds for every call, also while other threads put and get (a call waits for a
        put's hand-over or a delivery in progress to finish).
        """
        return dict(self._a.counts())

    def close(self) -> None:
        """Store what was handed over and stop the assembler thread (also done when the buffer is collected)."""
        self._finalizer()

    def __enter__(self) -> ConduitBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        cfg = self._a.cfg
        return (f"{type(self).__name__}(semantics={cfg.semantics!r}, batch_size={cfg.batch_size}, "
                f"capacity={cfg.resolved_capacity}, prefetch={cfg.resolved_prefetch})")

    # -- pickling ----------------------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self._srl_base, self._a.snapshot()))


def _restore(srl_base: tuple[str, str] | None, state: dict[str, Any]) -> ConduitBuffer:
    cls = ConduitBuffer if srl_base is None else srl_prioritized_class(_load_class(srl_base))
    obj = cls.__new__(cls)
    obj._attach(Assembler.restore(state))
    return obj


def _load_class(ref: tuple[str, str]) -> type:
    return getattr(importlib.import_module(ref[0]), ref[1])  # type: ignore[no-any-return]


_MIXED: dict[type, type[ConduitBuffer]] = {}


def srl_prioritized_class(base: type) -> type[ConduitBuffer]:
    """A ConduitBuffer class that is also a subclass of SRL's ``PrioritizedReplayBuffer`` ``base``.

    SRL's trainer sends priorities only to buffers that are instances of its prioritized
    replay class. This class passes that check while every method is Conduit's (the SRL
    class's ``__init__`` never runs). Pickles restore to the same class.
    """
    cls = _MIXED.get(base)
    if cls is None:
        cls = cast("type[ConduitBuffer]", type(
            "ConduitPrioritizedBuffer", (ConduitBuffer, base),
            {"__module__": __name__, "_srl_base": (base.__module__, base.__qualname__),
             "__doc__": ConduitBuffer.__doc__}))
        _MIXED[base] = cls
    return cls

