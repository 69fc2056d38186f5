"""Exposed-latency accounting: how much experience-path time the training loop actually waited for.

Per iteration of a loop, from the spans in a :class:`~conduit.Telemetry`:

* **exposed** -- experience-path time on the *critical path*: the union of the caller's
  ``ingest``/``deliver`` calls (``ingest_wait``/``deliver_wait``: validation, the work
  itself or the hand-over to background work, and any wait for it; a call that raised after
  it reached the scheduler counts too, with no items), of its waits for background writes
  (``flush_wait``: ``flush``, and ``seal``, ``state_dict`` and ``migrate``, which flush first) and of the work spans,
  on the threads that run the loop (those that record ``rollout``, ``update`` or
  ``iteration`` spans, unless the loop's threads are given: ``loop_threads``);
* **hidden** -- experience-path work that other threads (the scheduler's workers) did
  while the loop was doing something else: the union of their ingest/deliver/stage
  spans (a write or gather that raised counts too, with no items), minus the part that
  coincided with the loop waiting for it;
* **total** -- exposed + hidden: the experience path's time in this iteration.

All measures are unions of intervals clipped to the iteration, so overlapping spans are
never counted twice. A span is recorded when it ends, so a worker's span still running when an
iteration ends (or recorded a moment after it ended) is not there yet when :class:`ExposureLog` measures
that iteration: the log revises its newest entry when it measures the next iteration (or on
:meth:`ExposureLog.settle`), adding the part of such spans within it. Only the newest entry is
revised: a worker span that runs on past the end of the next iteration too is counted in the last
two iterations it overlaps, not in those before (a worker's hidden time can be under-counted then,
never exposed time: the loop's own calls end within the iteration that makes them). A synchronous
scheduler does everything on the loop's thread, so its experience path is all exposed; an
overlapped one leaves the hand-over exposed.

:class:`ExposureLog` reads the telemetry's bounded ring of recent calls (``Telemetry(maxlen=...)``):
an iteration that records more calls than the ring holds would lose its earliest ones, so it
refuses to account for it (:class:`~conduit.errors.CapacityError`) rather than under-count it.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from conduit.checks import is_int, is_real
from conduit.errors import CapacityError, ConfigurationError
from conduit.telemetry import CallRecord, Telemetry

__all__ = ["IterationExposure", "ExposureLog", "measure_iteration", "EXPERIENCE_KINDS", "WORK_KINDS",
           "LOOP_KINDS"]

#: spans that belong to the experience path (work, or the caller's wait for it)
EXPERIENCE_KINDS = frozenset({"ingest", "deliver", "stage", "ingest_wait", "deliver_wait", "flush_wait"})
#: experience-path work itself, wherever it runs
WORK_KINDS = frozenset({"ingest", "deliver", "stage"})
#: spans the training loop records on its own thread(s)
LOOP_KINDS = frozenset({"rollout", "update", "iteration"})

_Interval = tuple[float, float]


def _union(intervals: Iterable[_Interval]) -> list[_Interval]:
    out: list[_Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _thread_ids(loop_threads: object) -> frozenset[int] | None:
    """``loop_threads`` as a set of thread ids (:func:`conduit.telemetry.thread_id`), or None when it is no collection
    of them: not iterable, a str or bytes (whose characters or bytes would pass for ids), or holding anything but ints
    (a bool included)."""
    if isinstance(loop_threads, (str, bytes, bytearray)):
        return None
    try:
        threads = frozenset(loop_threads)  # type: ignore[call-overload]
    except TypeError:  # not iterable, or of unhashable things
        return None
    return threads if all(is_int(t) for t in threads) else None


def _length(intervals: Sequence[_Interval]) -> float:
    return sum((b - a for a, b in intervals), 0.0)  # (a float also for none)


def _intersection(x: Sequence[_Interval], y: Sequence[_Interval]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclass(frozen=True)
class IterationExposure:
    """Where one iteration's time went (seconds; every field a float, 0.0 for a part with no spans)."""

    start: float
    end: float
    #: experience-path time: exposed + hidden
    total_s: float
    #: experience-path time on the critical path
    exposed_s: float
    #: experience-path work done off the critical path while the loop did something else
    hidden_s: float
    rollout_s: float
    update_s: float

    @property
    def iteration_s(self) -> float:
        return self.end - self.start

    @property
    def hidden_share(self) -> float:
        """Share of the experience path hidden (0 when there was none)."""
        return self.hidden_s / self.total_s if self.total_s > 0 else 0.0


def measure_iteration(records: Iterable[CallRecord], start: float, end: float,
                      loop_threads: Iterable[int] | None = None) -> IterationExposure:
    """Exposed / hidden / total experience-path time in ``[start, end)``.

    Args:
        records: telemetry records (any order; only those overlapping the window count).
        start: the iteration's start (``time.perf_counter()``).
        end: its end.
        loop_threads: the loop's thread ids, as in :attr:`CallRecord.thread` (:func:`conduit.telemetry.thread_id`;
            default: those with rollout/update/iteration spans; an empty collection: none, so all of it is hidden).

    A span whose end is before its start (a malformed record) adds no time, never negative time.

    Raises:
        ConfigurationError: ``start`` or ``end`` is not a number, ``end`` is before ``start`` (or either is NaN):
            no window to account for; ``loop_threads`` is not a collection of thread ids.
    """
    for t in (start, end):
        if not is_real(t):
            raise ConfigurationError(f"The iteration window's start and end are time.perf_counter() readings: pass "
                                     f"two numbers, got [{start!r}, {end!r}).")
    if not start <= end:
        raise ConfigurationError(f"The iteration window [{start!r}, {end!r}) ends before it starts; pass its start "
                                 f"and then its end (time.perf_counter() readings).")
    recs = [r for r in records if r.end > start and r.start < end]
    if loop_threads is None:
        loop = {r.thread for r in recs if r.kind in LOOP_KINDS}
    else:
        given = _thread_ids(loop_threads)
        if given is None:
            raise ConfigurationError(f"measure_iteration(loop_threads=...) is a collection of the loop's thread ids "
                                     f"(conduit.telemetry.thread_id(), ints), got {loop_threads!r}.")
        loop = set(given)

    def clipped(kinds: frozenset[str] | set[str], on_loop: bool | None = None) -> list[_Interval]:
        """The union of the spans of ``kinds`` (on the loop's threads, off them, or anywhere), clipped to the
        window; a span that ends before it starts is none."""
        out = []
        for r in recs:
            if r.kind in kinds and (on_loop is None or (r.thread in loop) == on_loop):
                a, b = max(r.start, start), min(r.end, end)
                if a < b:
                    out.append((a, b))
        return _union(out)

    exposed = clipped(EXPERIENCE_KINDS, on_loop=True)
    background = clipped(WORK_KINDS, on_loop=False)
    e = _length(exposed)
    h = _length(background) - _intersection(background, exposed)
    rollout = _length(clipped({"rollout"}))
    update = _length(clipped({"update"}))
    return IterationExposure(float(start), float(end), e + h, e, h, rollout, update)


class ExposureLog:
    """Per-iteration exposure of a loop that records its rollout and update spans in ``telemetry``.

    Args:
        telemetry: where the loop's spans are recorded.
        keep: how many of the newest iterations :attr:`iterations` holds (the oldest go first, so a
            long run's log stays bounded; ``None`` keeps them all). :attr:`accounted` counts them all.
        loop_threads: the ids of the threads that run this loop (:func:`conduit.telemetry.thread_id`, called on
            each of them). Default: every thread that records a ``rollout``, ``update`` or ``iteration`` span
            during the iteration -- which takes in another loop's threads when two loops record into one
            telemetry, so that each log counts the other loop's calls as its own exposed time. Two loops sharing
            a telemetry give each log its own loop's threads (e.g. ``ExposureLog(tel, loop_threads={thread_id()})``
            on the loop's thread), or each loop its own :class:`~conduit.Telemetry`.

    Raises:
        ConfigurationError: ``telemetry`` is not a :class:`~conduit.Telemetry`, ``keep`` not an int >= 1
            (or None), or ``loop_threads`` not a non-empty collection of thread ids (or None).

    Examples:
        >>> import time
        >>> from conduit import Telemetry
        >>> from conduit.exposure import ExposureLog
        >>> tel = Telemetry()
        >>> log = ExposureLog(tel)
        >>> with log.iteration():
        ...     with tel.span("rollout"):
        ...         time.sleep(0.002)
        ...     with tel.span("deliver"):
        ...         time.sleep(0.001)
        >>> it = log.iterations[-1]
        >>> it.exposed_s > 0 and it.hidden_s == 0 and it.total_s == it.exposed_s
        True
    """

    def __init__(self, telemetry: Telemetry, *, keep: int | None = 100_000,
                 loop_threads: Iterable[int] | None = None) -> None:
        if not isinstance(telemetry, Telemetry):
            raise ConfigurationError(f"ExposureLog(telemetry) reads the spans of a conduit.Telemetry (e.g. the "
                                     f"buffer's `edp.telemetry`), got {telemetry!r}.")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigurationError(f"ExposureLog(keep=...) is how many recent iterations to hold: pass an int >= 1 "
                                     f"or None (all of them), got {keep!r}.")
        threads: frozenset[int] | None = None
        if loop_threads is not None:
            threads = _thread_ids(loop_threads)
            if not threads:
                raise ConfigurationError(f"ExposureLog(loop_threads=...) is the ids of the threads that run the loop "
                                         f"(conduit.telemetry.thread_id() on each), or None for the threads that "
                                         f"record rollout/update/iteration spans; got {loop_threads!r}.")
        self.telemetry = telemetry
        #: the loop's threads given (None: those that record rollout/update/iteration spans, see the class)
        self.loop_threads = threads
        #: the newest accounted iterations, oldest first (at most ``keep``)
        self.iterations: deque[IterationExposure] = deque(maxlen=keep)
        #: iterations accounted so far, including those :attr:`iterations` no longer holds
        self.accounted = 0
        #: the newest entry, the calls it was measured from and the mark just past them (what was recorded after
        #: it was measured starts there): what :meth:`_revise` needs; None when there is nothing to revise
        self._newest: tuple[IterationExposure, list[CallRecord], int] | None = None
        self._lock = threading.Lock()

    @contextmanager
    def iteration(self) -> Iterator[None]:
        """Time the body as one iteration (recorded as an ``iteration`` span) and account for it.

        While it is open, :meth:`Telemetry.reset() <conduit.Telemetry.reset>` on the telemetry (from any thread)
        is refused with :class:`~conduit.errors.ConfigurationError`, so the iteration always counts every call
        it spanned.

        The previous entry is revised first (see :meth:`settle`) with what the workers recorded since it was
        measured: their spans still running when it ended.

        Raises:
            CapacityError: the telemetry's ring (``Telemetry(maxlen=...)``) dropped calls recorded during
                the iteration before it was measured, so it would be under-counted; nothing is appended to
                :attr:`iterations`. If the body raised, its exception propagates instead, with this as a note.
        """
        mark = self.telemetry._open_window()  # every call recorded from here on comes at or after it
        t0 = time.perf_counter()
        failed = True
        try:
            yield
            failed = False
        finally:
            t1 = time.perf_counter()
            try:
                self.telemetry.record("iteration", 0, 0, t0, t1)
                with self._lock:
                    newest = self._newest
                # one read for the previous entry's late calls and this iteration's (not the whole ring: it may hold
                # 64k calls); an iteration that opened before the previous one was measured (one inside another, or
                # on another thread) revises nothing
                since, revise = mark, False
                if newest is not None and newest[2] <= mark:
                    since, revise = newest[2], True
                records, dropped, read = self.telemetry._calls_since(since)
                if dropped and revise:  # maybe only calls before this iteration: read its own, revise nothing
                    records, dropped, read = self.telemetry._calls_since(mark)
                    revise = False
            finally:
                self.telemetry._close_window()
            if dropped:
                msg = (f"The iteration recorded more calls than the telemetry keeps: its ring "
                       f"(Telemetry(maxlen={self.telemetry.maxlen})) dropped {dropped} of them before the "
                       f"iteration was measured, so it would be under-counted. Raise the Telemetry's maxlen "
                       f"above the calls one iteration records, or measure shorter iterations.")
                if not failed:
                    raise CapacityError(msg)
                add_note = getattr(sys.exc_info()[1], "add_note", None)  # Python 3.11+
                if add_note is not None:
                    add_note(msg)
            else:
                # every span overlapping the iteration, however long before it started (a span is recorded when
                # it ends, so one ending after t0 was folded after the mark)
                own = records[len(records) - (read - mark):]  # (those folded at or after the mark)
                recs = [r for r in own if r.end > t0]
                entry = measure_iteration(recs, t0, t1, self.loop_threads)
                with self._lock:
                    if revise and self._newest is newest:
                        self._revise(records, read)
                    self.iterations.append(entry)
                    self.accounted += 1
                    self._newest = (entry, recs, read)

    def settle(self) -> None:
        """Revise the newest entry of :attr:`iterations` with the calls recorded since it was measured.

        A span is recorded when it ends: a worker's span still running when an iteration ended (or recorded a
        moment after it ended) was not there when the iteration was measured. Its part within the iteration is
        added here (hidden time, as it ran on a worker), and the entry replaced; :attr:`accounted` stays. The next
        :meth:`iteration` does this itself, so call it after the last iteration of a run, once the scheduler's
        work is done (e.g. after ``edp.flush()``). Does nothing when there is no entry, when the newest one is
        gone from :attr:`iterations`, or when the telemetry's ring dropped calls recorded since.
        """
        with self._lock:
            newest = self._newest
            if newest is None:
                return
            records, dropped, read = self.telemetry._calls_since(newest[2])
            if not dropped:
                self._revise(records, read)

    def _revise(self, late: list[CallRecord], read: int) -> None:
        """Measure the newest entry again with ``late`` (the calls recorded since it was measured, up to the mark
        ``read``) added, and replace it in :attr:`iterations` if it is still there (caller holds ``_lock``)."""
        assert self._newest is not None
        entry, recs, _ = self._newest
        extra = [r for r in late if r.start < entry.end and r.end > entry.start]
        if extra:
            recs = recs + extra
            revised = measure_iteration(recs, entry.start, entry.end, self.loop_threads)
            if self.iterations and self.iterations[-1] is entry:
                self.iterations[-1] = revised
            entry = revised
        self._newest = (entry, recs, read)

    def summary(self, skip: int = 0) -> dict[str, float]:
        """Median seconds per iteration of each part, over the iterations after the first ``skip`` accounted
        (over all of them when no more than ``skip`` ran, so a short run still reports; {} for none), of
        those :attr:`iterations` still holds.

        Raises:
            ConfigurationError: ``skip`` is not an int >= 0.
        """
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ConfigurationError(f"ExposureLog.summary(skip=...) is how many first iterations (warm-up) to leave "
                                     f"out: pass an int >= 0, got {skip!r}.")
        with self._lock:  # (read together: an iteration being accounted appends, then counts)
            held = list(self.iterations)
            gone = self.accounted - len(held)  # the first iterations, no longer held
        its = held[max(0, skip - gone):] or held
        if not its:
            return {}
        keys = ("iteration_s", "rollout_s", "update_s", "total_s", "hidden_s", "exposed_s")
        return {k: statistics.median(getattr(i, k) for i in its) for k in keys}
