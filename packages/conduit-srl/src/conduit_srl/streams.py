"""Conduit on SRL's sample streams: which trainer receives a sample, and how flushes are coalesced.

A stream whose name starts with ``conduit:`` is *claimed* (see :func:`conduit_srl.install`): the
actor gets a :class:`ConduitSampleProducer` over one native producer per trainer, the trainer a
:class:`ConduitSampleConsumer` over its native consumer. The transport stays SRL's.

* **Ingestion granularity.** SRL flushes every producer on every actor poll, one message per
  sample. A Conduit producer sends ``coalesce`` samples as one ``[T, k, ...]`` message (stacked
  on the batch axis and marked in the record's metadata), or fewer once the oldest has waited
  ``max_delay_s``. The consumer hands a coalesced message to a Conduit buffer as one
  ``put_batch``, or to any other buffer (and to a Conduit buffer whose ``put`` takes batched
  ``[T, B, ...]`` samples) as ``k`` ordinary ``put`` calls, so the buffer sees the same samples in
  the same order either way.
* **Placement across trainers.** ``route`` picks the target of each message: ``"rank"`` (SRL's
  rule: actor rank modulo the number of trainers), ``"round_robin"``, or ``"least_sent"`` (the
  trainer this producer has sent the fewest samples to).

Nothing posted is dropped by Conduit: ``close()`` sends what is still pending (after a flush in
flight in another thread), and a ``post`` after it raises instead of being kept unsent. On the
consumer side, a buffer that refuses part of a coalesced message gets an
:class:`UnstoredSamplesError` carrying the samples it did not store (a full Conduit buffer with
``on_full="raise"`` instead has them kept and put first by the next ``consume_to``), and the
consumer's ``close()`` returns the samples of a message that ``consume()`` had not handed out yet,
or that such a buffer refused. So both ends must be
closed: a producer or consumer dropped without ``close()`` loses what it still held, as a socket
dropped unflushed does (no finalizer sends over the network from the garbage collector's thread:
it may run inside a flush of the same targets, on any thread). The loss is not silent: it is
reported with a :class:`~conduit_srl.errors.SamplesLostWarning` and counted in
:func:`lost_without_close`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from conduit import ConfigurationError, SchemaError

from conduit_srl.buffer import ConduitBuffer
from conduit_srl.errors import BufferFullError, ReceiveError, SamplesLostWarning, UnstoredSamplesError
from conduit_srl.protocols import SampleConsumerLike, SampleProducerLike

__all__ = ["StreamPolicy", "ConduitSampleProducer", "ConduitSampleConsumer", "COALESCED_KEY",
           "pack", "ROUTES", "lost_without_close"]

#: metadata key marking a coalesced message and how many samples it holds
COALESCED_KEY = "conduit_coalesced"
ROUTES = ("rank", "round_robin", "least_sent")

#: (kind, samples) per stream end dropped without close() while holding samples (appends are atomic: a
#: finalizer may run on any thread, also one that is reading these)
_LOST: deque[tuple[str, int]] = deque()


def lost_without_close() -> dict[str, int]:
    """Samples lost in this process because a Conduit stream end was dropped without ``close()``.

    ``"unsent"``: posted to a :class:`ConduitSampleProducer` and never sent; ``"unreturned"``: received
    by a :class:`ConduitSampleConsumer` whose ``consume()`` had not handed them out. Each loss is also
    reported with a :class:`~conduit_srl.errors.SamplesLostWarning`.
    """
    out = {"unsent": 0, "unreturned": 0}
    for kind, n in list(_LOST):
        out[kind] += n
    return out


def _report_lost(held: deque[Any], kind: str, what: str, fix: str) -> None:
    """Finalizer of a stream end: count and report the samples it still held (it holds no reference to the end)."""
    n = len(held)
    if not n:
        return
    held.clear()
    _LOST.append((kind, n))
    warnings.warn(f"A {what} was garbage-collected without close() while it held {n} samples; they are lost. "
                  f"{fix}", SamplesLostWarning, stacklevel=2)


@dataclass(frozen=True)
class StreamPolicy:
    """How a claimed stream routes and coalesces.

    Args:
        route: ``"rank"``, ``"round_robin"`` or ``"least_sent"``; None (default): the claimed stream's own SRL rule
            (``"round_robin"`` for a ``NAME_ROUND_ROBIN`` stream, ``"rank"`` otherwise).
        coalesce: samples per message (1: one message per sample, as SRL does).
        max_delay_s: the longest a posted sample waits for partners before it is sent anyway.
    """

    route: str | None = None
    coalesce: int = 1
    max_delay_s: float = 0.05

    def __post_init__(self) -> None:
        if self.route is not None and self.route not in ROUTES:
            raise ConfigurationError(f"route must be one of {ROUTES} (or None: the stream's own rule), got "
                                     f"{self.route!r}.")
        if not isinstance(self.coalesce, int) or isinstance(self.coalesce, bool) or self.coalesce < 1:
            raise ConfigurationError(f"coalesce must be an int >= 1, got {self.coalesce!r}.")
        if (not isinstance(self.max_delay_s, (int, float)) or isinstance(self.max_delay_s, bool)
                or not self.max_delay_s >= 0):
            raise ConfigurationError(f"max_delay_s must be >= 0, got {self.max_delay_s!r}.")


def _signature(rec: Any) -> tuple[Any, ...] | None:
    """Class, field names, dtypes and shapes of a record; None if it cannot be stacked on the batch axis.

    A field without a time axis (a scalar such as ``policy_name="default"``, which a Conduit buffer
    drops) has no axis 1 to stack on, so such a record is sent alone; so is one with a field that is
    not one array (ragged lists, tensors that require grad or carry view bits): the buffer that
    receives it decides whether it can store it.
    """
    out: list[Any] = [type(rec)]
    for k, v in rec.items():
        if v is None:
            out.append((k, None))
        elif hasattr(v, "items") and not isinstance(v, np.ndarray):
            sub = _signature(v)
            if sub is None:
                return None
            out.append((k, sub))
        else:
            try:
                a = np.asarray(v)
            except (TypeError, ValueError, RuntimeError):
                return None
            if a.ndim == 0:
                return None
            out.append((k, a.dtype.str, a.shape))
    return tuple(out)


def _stack(recs: Sequence[Any]) -> Any:
    first = recs[0]
    fields: dict[str, Any] = {}
    for k, v in first.items():
        if v is None:
            fields[k] = None
        elif hasattr(v, "items") and not isinstance(v, np.ndarray):
            fields[k] = _stack([r[k] for r in recs])
        else:
            fields[k] = np.stack([np.asarray(r[k]) for r in recs], axis=1)
    return type(first)(**fields)


def pack(samples: Sequence[Any]) -> Any:
    """``k`` ``[T, ...]`` samples of one structure as one ``[T, k, ...]`` record marked as coalesced.

    Metadata keys without a value (SRL's ``SampleBatch`` registers ``sampling_weight=None`` in every instance) are
    kept on the message; the producer stacks only samples whose metadata holds no value (:meth:`ConduitSampleProducer
    ._groups`), so nothing of it is lost.
    """
    msg = _stack(samples)
    keys = getattr(samples[0], "metadata", None) or {}
    msg.register_metadata(**{k: None for k in keys if k not in msg.metadata and k != COALESCED_KEY},
                          **{COALESCED_KEY: len(samples)})
    return msg


class ConduitSampleProducer:
    """An SRL sample producer that routes and coalesces (``post`` is thread-safe; one thread flushes).

    Args:
        targets: one native producer per trainer (index ``i`` reaches trainer ``i``).

    Keyword Args:
        policy: routing and coalescing.
        rank: this actor's rank (``"rank"`` routing, and where rotation starts).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, targets: Sequence[SampleProducerLike], *, policy: StreamPolicy | None = None, rank: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(targets, Sequence) or not targets:
            raise ConfigurationError(f"A Conduit sample producer needs a non-empty list of target producers (one per "
                                     f"trainer), got {type(targets).__name__}; pass [producer].")
        bad = [i for i, t in enumerate(targets) if not isinstance(t, SampleProducerLike)]
        if bad:
            raise ConfigurationError(f"Targets {bad} have no post()/flush(); every target is a sample producer.")
        if policy is not None and not isinstance(policy, StreamPolicy):
            raise ConfigurationError(f"policy must be a StreamPolicy, got {type(policy).__name__}; write "
                                     f"policy=StreamPolicy(route=..., coalesce=..., max_delay_s=...).")
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 0:
            raise ConfigurationError(f"rank must be an int >= 0 (the actor's worker index), got {rank!r}.")
        self.targets = list(targets)
        self.policy = policy or StreamPolicy()
        self.rank = int(rank)
        self._clock = clock
        self._lock = threading.Lock()  # guards _pending and _closed (post)
        self._send_lock = threading.Lock()  # one send at a time: flush and close never overlap on the targets
        self._closed = False
        self._pending: deque[tuple[Any, float]] = deque()
        self._next = self.rank % len(self.targets)
        #: samples sent to each target
        self.sent = [0] * len(self.targets)
        #: messages sent to each target
        self.messages = [0] * len(self.targets)
        #: targets given messages since their last flush that returned (a flush that raised is tried again)
        self._unflushed: set[int] = set()
        weakref.finalize(self, _report_lost, self._pending, "unsent", "Conduit sample producer",
                         "Call close() when an actor stops: it sends what is pending.")

    def post(self, sample: Any) -> None:
        """Queue ``sample`` for the next flush (thread-safe).

        Raises:
            ConfigurationError: the producer is closed (the sample would never be sent).
        """
        with self._lock:
            if self._closed:
                raise ConfigurationError("This Conduit sample producer is closed, so the sample would never be sent; "
                                         "post to a producer that is still open (build a new one).")
            self._pending.append((sample, self._clock()))

    def flush(self) -> None:
        """Send every full group of ``coalesce`` samples, and the rest once the oldest waited ``max_delay_s``.

        Every target given messages is flushed, also when another one's flush raises (the first error
        propagates); a target whose flush raised is flushed again by the next call, even if nothing new goes
        to it. A no-op once the producer is closed (``close`` sent everything).
        """
        with self._send_lock:
            if not self._closed:
                self._send(force=False)

    def close(self) -> None:
        """Refuse further posts, send everything still pending, then close the targets (idempotent).

        A flush running in another thread finishes first, so no sample it took is cut off. If a
        target refuses a message (its ``post`` raises), that error propagates from here or from
        :meth:`flush`, and every sample no target took stays pending, in order, for the next try
        (the producer stays open). Once everything is sent, every target is closed even if one's
        ``close()`` raises; the first such error is raised after (the producer is then closed).
        """
        with self._send_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            try:
                self._send(force=True)
            except BaseException:
                with self._lock:  # still open: what was not sent is pending, and close() can be tried again
                    self._closed = False
                raise
            error: BaseException | None = None
            for t in self.targets:  # one target that fails to close leaves none of the others open
                close = getattr(t, "close", None)
                if close is not None:
                    try:
                        close()
                    except BaseException as e:  # noqa: BLE001 - the first is raised once every target was tried
                        error = error or e
            if error is not None:
                raise error

    def init_monitor(self, monitor: Any) -> None:
        for t in self.targets:
            init = getattr(t, "init_monitor", None)
            if init is not None:
                init(monitor)

    # -- internals ---------------------------------------------------------------------------
    def _send(self, *, force: bool) -> None:
        k = self.policy.coalesce
        with self._lock:
            take = (len(self._pending) // k) * k
            if self._pending and (force or self.policy.max_delay_s == 0
                                  or self._clock() - self._pending[0][1] >= self.policy.max_delay_s):
                take = len(self._pending)
            taken = [self._pending.popleft() for _ in range(take)]
        touched: set[int] = set()
        done = 0  # samples handed to a target
        try:
            for group in self._groups([sample for sample, _ in taken], k):
                i = self._route(len(group))
                self.targets[i].post(group[0] if len(group) == 1 else pack(group))
                self.sent[i] += len(group)
                self.messages[i] += 1
                touched.add(i)
                done += len(group)
        except BaseException:
            with self._lock:  # what no target took is first in line again, in order (sends never overlap)
                self._pending.extendleft(reversed(taken[done:]))
            with contextlib.suppress(Exception):  # what the targets took goes out as it would have
                self._flush_targets(touched)
            raise
        self._flush_targets(touched)

    def _flush_targets(self, touched: set[int]) -> None:
        """Flush the targets ``touched`` and every one whose flush raised before (the caller holds ``_send_lock``).

        Each is tried even if another raises (the first error is raised after), and one that raised is tried
        again at the next flush, also when nothing new goes to it: what a target took is sent once it can be.
        """
        self._unflushed |= touched
        error: Exception | None = None
        for i in sorted(self._unflushed):
            try:
                self.targets[i].flush()
            except Exception as e:  # noqa: BLE001 - the first is raised once every target was tried
                error = error or e
            else:
                self._unflushed.discard(i)
        if error is not None:
            raise error

    @staticmethod
    def _groups(samples: list[Any], k: int) -> list[list[Any]]:
        """Runs of up to ``k`` samples of one structure, in order.

        Records that cannot carry metadata go alone, and so do records whose metadata holds a value
        (stacking would drop it) and records with a field that has no time axis (nothing to stack it on).
        Metadata keys without a value, such as the ``sampling_weight=None`` every SRL ``SampleBatch``
        registers, carry nothing to drop: such records are stacked with records of the same keys.
        """
        groups: list[list[Any]] = []
        sig: tuple[Any, ...] | None = None
        for s in samples:
            meta = getattr(s, "metadata", None) or {}
            can = k > 1 and hasattr(s, "register_metadata") and all(v is None for v in meta.values())
            structure = _signature(s) if can else None
            this = None if structure is None else (structure, tuple(sorted(meta)))
            can = this is not None
            if groups and can and this == sig and len(groups[-1]) < k:
                groups[-1].append(s)
            else:
                groups.append([s])
                sig = this
        return groups

    def _route(self, n: int) -> int:
        route, m = self.policy.route or "rank", len(self.targets)
        if route == "rank":
            return self.rank % m
        if route == "round_robin":
            i = self._next
            self._next = (self._next + 1) % m
            return i
        start = self.rank % m
        order = [(start + j) % m for j in range(m)]
        return min(order, key=lambda i: self.sent[i])


def _capacity(buffer: Any) -> int | None:
    """The most samples one ``put_batch`` of a Conduit buffer takes (None: not a Conduit buffer)."""
    return buffer.config.resolved_capacity if isinstance(buffer, ConduitBuffer) else None


def _batched_puts(buffer: Any) -> bool:
    """Whether ``buffer.put`` takes ``[T, B, ...]`` samples (a Conduit buffer with ``batched_puts=True``).

    A coalesced message of such samples is ``[T, k, B, ...]``: ``put_batch`` would read its ``k`` axis as the
    batch axis and ``B`` as part of every sample, so each of its ``k`` samples goes to its own ``put``.
    """
    return isinstance(buffer, ConduitBuffer) and buffer.config.batched_puts


def _unstored(sample: Any, e: BaseException, batched: bool) -> Any:
    """What of ``sample`` a refused ``put`` did not store: all of it, or (a batched put that a Conduit buffer took
    in part, saying so in ``samples_stored``) the columns after the stored ones."""
    part = getattr(e, "samples_stored", 0) if batched else 0
    if not isinstance(part, int) or isinstance(part, bool) or part <= 0:
        return sample
    try:  # (a Conduit put refused part way stored fewer than all of its columns)
        return sample[:, part:]
    except Exception:  # noqa: BLE001 - a record that cannot be sliced is carried whole (the error says how much
        return sample  # was stored: samples_stored of its cause)


def _coalesced_width_is(x: Any, k: Any) -> bool:
    """Whether the coalesced message ``x`` holds ``k`` samples: ``k`` an int >= 1, every field ``k`` wide on axis 1."""
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        return False

    def fits(rec: Any) -> bool:
        for _, v in rec.items():
            if v is None:
                continue
            if hasattr(v, "items") and not isinstance(v, np.ndarray):
                if not fits(v):
                    return False
                continue
            shape = getattr(v, "shape", None)
            if shape is None or len(shape) < 2 or shape[1] != k:
                return False
        return True

    try:
        return fits(x)
    except Exception:  # noqa: BLE001 - a message that cannot be read field by field is not a coalesced one
        return False


class _Unpacker:
    """What a native consumer puts into: forwards samples to the real buffer, unpacking coalesced ones."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.count = 0

    def put(self, x: Any) -> None:
        """Store one message: a sample, or a coalesced ``[T, k, ...]`` one as ``k`` samples in order.

        A Conduit buffer gets ``put_batch`` calls of at most its capacity each (so a message larger
        than the capacity is stored as ``k`` single puts would be); any other buffer, and a Conduit
        buffer with ``batched_puts=True`` (its samples are ``[T, B, ...]``), ``k`` ``put`` calls. If one
        raises, :class:`UnstoredSamplesError` names how many were stored and carries the rest (a message of
        one sample too: what the producer sent alone is not lost where a coalesced one is kept; of a batched
        sample the buffer took in part, only its columns not stored).
        """
        meta = getattr(x, "metadata", None)
        k = meta.get(COALESCED_KEY) if meta is not None else None
        batched = _batched_puts(self.buffer)
        if k is not None and not _coalesced_width_is(x, k):  # a malformed frame: refused whole, nothing of it put
            cause = SchemaError(f"A received message says it coalesces {k!r} samples, but its fields do not hold that "
                                f"many along the batch axis (1); it was not put. Its sender is not a Conduit sample "
                                f"producer of this version, or the message was altered on the way.")
            raise UnstoredSamplesError(stored=0, total=1, samples=[x], cause=cause) from cause
        if k is None:  # a message of one sample: refused, it is carried by the error as a coalesced one's would be
            try:
                self.buffer.put(x)
            except Exception as e:  # noqa: BLE001 - re-raised, typed, with the sample not stored
                raise UnstoredSamplesError(stored=0, total=1, samples=[_unstored(x, e, batched)], cause=e) from e
            self.count += 1
            return
        x.pop_metadata(COALESCED_KEY)
        k = int(k)
        # (only a Conduit buffer's put_batch takes a [T, k, ...] record as k samples: another buffer's method of that
        # name may mean something else, e.g. a list of samples, so any other buffer gets k put calls)
        put_batch = self.buffer.put_batch if isinstance(self.buffer, ConduitBuffer) and not batched else None
        step = 1 if put_batch is None else min(k, _capacity(self.buffer) or k)
        lo = 0
        while lo < k:
            hi = min(lo + step, k)
            try:
                if put_batch is None:
                    self.buffer.put(x[:, lo])
                else:
                    put_batch(x if hi - lo == k else x[:, lo:hi])
            except Exception as e:  # noqa: BLE001 - re-raised, typed, with what was not stored
                # (a Conduit buffer's put_batch that stored part of a chunk before it raised says how much)
                part = getattr(e, "samples_stored", 0) if put_batch is not None else 0
                part = part if isinstance(part, int) and 0 < part < hi - lo else 0
                self.count += part
                lo += part
                rest = [x[:, i] for i in range(lo, k)]
                rest[0] = _unstored(rest[0], e, batched)
                raise UnstoredSamplesError(stored=lo, total=k, samples=rest, cause=e) from e
            self.count += hi - lo
            lo = hi


class _Collector:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, x: Any) -> None:
        self.items.append(x)


class ConduitSampleConsumer:
    """An SRL sample consumer over a native one, unpacking coalesced messages.

    ``consume_to(buffer, max_iter)`` receives up to ``max_iter`` messages and returns the number of
    *samples* put into ``buffer``, as posted: a coalesced message counts its ``k``, and a ``[T, B, ...]``
    sample put into a ``batched_puts=True`` buffer counts 1 (see :meth:`consume_to`). ``consume()``
    returns one sample at a time; what it has not yet
    returned of a coalesced message is handed out by the next ``consume``/``consume_to``, or by ``close()``.
    Samples a full ``on_full="raise"`` Conduit buffer refused are kept the same way (put first next time).
    """

    def __init__(self, inner: SampleConsumerLike) -> None:
        self.inner = inner
        self._backlog: deque[Any] = deque()
        self._closed = False
        weakref.finalize(self, _report_lost, self._backlog, "unreturned", "Conduit sample consumer",
                         "Call close() (it returns them) or consume_to() before dropping a consumer that consume() "
                         "read part of a coalesced message from, or that keeps samples a full buffer refused.")

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("This Conduit sample consumer is closed; build a new consumer to receive more.")

    def consume_to(self, buffer: Any, max_iter: int = 16) -> int:
        """Put what has arrived (up to ``max_iter`` messages) into ``buffer``; returns the number of samples.

        Samples are counted as posted (a coalesced message counts its ``k`` samples): a ``[T, B, ...]`` sample
        put into a ``batched_puts=True`` buffer counts 1, not ``B`` (its ``stats()["samples_put"]`` counts the
        ``B`` columns), once its put completes (one a full buffer took in part counts on the call that puts its
        rest). That is the unit of every count of this stream (the producer's ``sent``, the ``stored``,
        ``total`` and ``put_by_call`` of :class:`~conduit_srl.errors.UnstoredSamplesError`, ``put_by_call`` of
        :class:`~conduit_srl.errors.ReceiveError`) and of SRL's own consumers, which count a batched
        shared-memory read once (SRL's workers do not use the count).

        Samples left over from a coalesced message that ``consume()`` returned in part are put first.

        A Conduit buffer with ``on_full="raise"`` (a host that puts and gets on one thread, such as SRL's
        buffer worker) that has no room raises :class:`~conduit_srl.errors.BufferFullError`; then the
        samples it refused are kept here, in order, and the call returns what was put: the next call puts
        them first (after the host's ``get()`` made room), messages not received yet stay with the
        transport, and ``close()`` returns whatever is still kept.

        Raises:
            ConfigurationError: the consumer is closed.
            UnstoredSamplesError: ``buffer`` refused a sample of a message (also of a message of one
                sample, or of the left-over samples) for another reason than a full buffer; the samples not
                stored are in the error, the ones before are stored, and its ``put_by_call`` is the count
                this call would have returned.
            ReceiveError: the native consumer raised while receiving (e.g. bytes that do not unpickle); its
                error is the ``__cause__``, and ``put_by_call`` counts the samples this call had put (they
                stay stored).
        """
        self._check_open()
        shim = _Unpacker(buffer)
        total = len(self._backlog)
        while self._backlog:
            try:
                shim.put(self._backlog[0])
            except UnstoredSamplesError as e:  # (one sample, refused) the rest of the left-over samples with it
                if isinstance(e.__cause__, BufferFullError):  # still no room: kept, first in line
                    self._backlog[0] = e.samples[0]
                    return shim.count
                # (of the refused one, only what was not stored: a batched sample the buffer took in part is cut)
                rest = [e.samples[0], *list(self._backlog)[1:]]
                self._backlog.clear()
                cause = e.__cause__ if isinstance(e.__cause__, Exception) else e
                raise UnstoredSamplesError(stored=total - len(rest), total=total, samples=rest,
                                           cause=cause) from cause
            self._backlog.popleft()
        try:
            self.inner.consume_to(shim, max_iter)
        except UnstoredSamplesError as e:
            if isinstance(e.__cause__, BufferFullError):  # held back until deliveries make room; later messages
                self._backlog.extend(e.samples)  # stay with the transport
                return shim.count
            e.put_by_call = shim.count  # (the count this call would have returned)
            raise
        except Exception as e:  # noqa: BLE001 - the transport's error, typed, with what this call put (chained)
            raise ReceiveError(put_by_call=shim.count, cause=e) from e
        return shim.count

    def consume(self) -> Any:
        """One sample (a coalesced message is returned one sample at a time).

        Raises:
            ConfigurationError: the consumer is closed.
        """
        self._check_open()
        if not self._backlog:
            msg = self.inner.consume()  # type: ignore[attr-defined]
            sink = _Collector()
            _Unpacker(sink).put(msg)
            self._backlog.extend(sink.items)
        return self._backlog.popleft()

    def init_monitor(self, monitor: Any) -> None:
        init = getattr(self.inner, "init_monitor", None)
        if init is not None:
            init(monitor)

    def close(self) -> list[Any]:
        """Close the native consumer (idempotent); returns the received samples not handed out: those ``consume()``
        had not returned, or that a full ``on_full="raise"`` buffer refused in ``consume_to``.

        A coalesced message arrives whole, and ``consume()`` returns it one sample at a time, so
        after a ``consume()`` the rest of its message has already been received: ``close()`` returns
        those samples (``[T, ...]`` each, in order) rather than drop them. The list is empty when
        nothing is left over, and on a second ``close()``. (SRL's workers ignore what ``close()``
        returns; a caller that mixes ``consume()`` with shutdown should keep the list.) If the native
        consumer's ``close()`` raises, the error propagates and this consumer stays open, still holding
        those samples, so ``close()`` can be tried again.
        """
        if self._closed:
            return []
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()  # if it raises, the consumer stays open with its left-over samples (close() can be tried again)
        self._closed = True
        left = list(self._backlog)
        self._backlog.clear()
        return left

    def __getattr__(self, name: str) -> Any:
        # native consumers expose extra attributes (e.g. ``address``); reach them through the wrapper
        if name in ("inner", "_closed", "_backlog"):
            raise AttributeError(name)
        return getattr(self.inner, name)
