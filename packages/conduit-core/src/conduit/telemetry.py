"""Per-call accounting of the experience path, cheap enough to leave on.

Every ingest and deliver call records ``(kind, items, bytes, start, end)``: a lock-free
append, folded later into a bounded ring of recent calls plus running totals. Spans from
outside the EDP (rollout, update) can be recorded too, which is what exposed-latency
accounting and traces are built from.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import numbers
import operator
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple, SupportsIndex

from conduit.checks import is_int, is_real
from conduit.errors import ConfigurationError

__all__ = ["Telemetry", "CallRecord", "Totals", "thread_id"]


class CallRecord(NamedTuple):
    """One recorded call or span. Times are ``time.perf_counter()`` seconds; ``thread`` is the recording
    thread's :func:`thread_id` (never shared with another thread of the process, also after one exited)."""

    kind: str
    items: int
    nbytes: int
    start: float
    end: float
    thread: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Totals:
    """Running totals for one kind of call.

    ``seconds`` sums the calls' durations; a call recorded with a NaN time, its end before its start or an
    infinite duration (a misused clock) adds no seconds, as it adds no time to an iteration's exposure, but
    still counts in ``calls``, ``items`` and ``nbytes``. A buffer's ``ingest``/``deliver`` call that raised is
    recorded with no items and no bytes: it counts in ``calls`` and ``seconds`` (the time was spent all the same).
    """

    calls: int = 0
    items: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def bandwidth(self) -> float:
        """Bytes per second over all calls (0 when nothing was timed)."""
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_call(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0


class Telemetry:
    """Recent calls and totals per kind ("ingest", "deliver", "rollout", "update", ...).

    Recording is on every experience-path call, so it only appends a tuple to a queue
    (atomic, no lock); the queue is folded into :attr:`records` and :attr:`totals` when
    it grows past ``fold_every`` (unless a fold is under way: that one or the next takes the
    call, so a record never waits, also not one made by a garbage-collector callback or a
    signal handler that interrupted this thread's own fold) and whenever they are read.

    A reader called on a thread that is inside a fold or a read of this telemetry already (a
    garbage-collector callback, a finalizer or a signal handler that interrupted it) neither folds
    nor waits: it returns what the folds completed before that one left (the calls being folded
    show in the next read), and :meth:`reset` there is refused.

    The ring drops its oldest calls once more than ``maxlen`` were folded into it; :meth:`mark`
    and :meth:`snapshot` tell whether calls folded after a point have been dropped (what an
    :class:`~conduit.exposure.ExposureLog` checks so an iteration is never silently under-counted).
    That bookkeeping is an integer sum per fold, plus the latest end among the calls dropped (what
    :meth:`chrome_trace` needs to say whether its window misses any); :meth:`record` does none of it.

    Args:
        maxlen: how many recent calls :attr:`records` keeps.
        fold_every: recorded calls held before they are folded.
    """

    def __init__(self, maxlen: int = 65536, fold_every: int = 1024) -> None:
        if isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 0:
            raise ConfigurationError(f"Telemetry(maxlen=...) is how many recent calls the ring keeps: pass an "
                                     f"int >= 0, got {maxlen!r}.")
        if isinstance(fold_every, bool) or not isinstance(fold_every, int) or fold_every < 0:
            raise ConfigurationError(f"Telemetry(fold_every=...) is how many recorded calls are held before they are "
                                     f"folded: pass an int >= 0, got {fold_every!r}.")
        self.maxlen = maxlen
        #: the ring and the queue hold plain tuples in CallRecord's field order: the collector stops tracking a
        #: tuple of numbers and a str, never a CallRecord (a tuple subclass), so 64k CallRecords kept alive would
        #: make every full collection walk them (readers make CallRecords of what they return)
        self._records: deque[_Raw] = deque(maxlen=maxlen)
        #: kind -> (calls, items, bytes, seconds): replaced, never changed in place (see _fold_locked)
        self._totals: dict[str, tuple[int, int, int, float]] = {}
        self._new: deque[_Raw] = deque()
        self._fold_every = fold_every
        #: reentrant (a reader re-entered on the thread that holds it must not wait for itself); its ``depth``
        #: tells a re-entered call not to fold
        self._lock = _DepthLock()
        #: thread_id() -> its name when it first recorded (a trace written after a worker exited still names it);
        #: names of exited threads with no call in the ring are forgotten past ``_names_limit`` (see _forget_names)
        self._names: dict[int, str] = {}
        self._names_limit = _NAMES_SLACK
        #: ExposureLog iterations open on this telemetry (reset() is refused meanwhile)
        self._open = 0
        #: calls folded into the ring so far; a call's position in that sequence is its mark
        self._folded = 0
        #: the mark of the oldest call still in the ring (calls before it were dropped or reset)
        self._first = 0
        #: the marks of the calls the ring dropped to make room before the last reset, as ascending [from, to) ranges
        #: (the drops since the last reset are [_reset_at, _first): two ints a fold moves, no list). reset() closes
        #: that range here, so this grows by one range per reset that removed calls and followed drops (what reset
        #: removes counts not, so two such ranges stay apart: a mark between them gets only the later drops). The
        #: newest _DROPS_KEPT ranges are kept; older ones are summed into _old_drops
        self._drops: list[tuple[int, int]] = []
        #: the ranges forgotten from _drops, as (lowest mark, highest mark + 1, calls dropped in them): exact for a
        #: mark at or before the lowest (or past the highest); for one among them, an upper bound (never fewer)
        self._old_drops = (0, 0, 0)
        #: the mark at the last reset (calls dropped since are _first - _reset_at), and the latest end of those
        self._reset_at = 0
        self._dropped_end = -math.inf

    def record(self, kind: str, items: int, nbytes: int, start: float, end: float) -> None:
        """Record one call (thread-safe).

        ``items`` and ``nbytes`` are counts (a NumPy integer or an integer tensor of one element is recorded as a
        Python int), ``start`` and ``end`` ``time.perf_counter()`` readings (a NaN or an end before the start is
        recorded, and adds no time: see :class:`Totals`).

        Raises:
            ConfigurationError: ``kind`` is not a str, ``items`` or ``nbytes`` not an integer, ``start`` or ``end``
                not a real number; nothing is recorded (such a call would fail the fold that took it, losing the
                calls other threads recorded with it).
        """
        if type(kind) is not str or type(items) is not int or type(nbytes) is not int or type(start) is not float \
                or type(end) is not float:  # (the common case checked by type alone: record() is on every call)
            kind, items, nbytes, start, end = _checked_call(kind, items, nbytes, start, end)
        new = self._new
        try:
            tid = _local.tid
        except AttributeError:  # this thread's first call
            tid = _new_thread_id()
        new.append((kind, items, nbytes, start, end, tid))
        if tid not in self._names:
            self._names[tid] = threading.current_thread().name
        if len(new) >= self._fold_every:
            self._fold(wait=False)

    def _fold(self, *, wait: bool = True) -> None:
        """Fold the recorded calls into the ring and the totals.

        ``wait=False`` (from :meth:`record`): while a fold is under way, leave the calls to it or to the next
        one instead of waiting for it. A call re-entered on the thread that holds the lock (a garbage-collector
        callback, a finalizer or a signal handler that interrupted this thread's fold or read, and records)
        does not fold either: that fold, or the next one, takes the calls.
        """
        if not self._lock.acquire(blocking=wait):
            return
        try:
            self._fold_outermost()
        finally:
            self._lock.release()

    def _fold_outermost(self) -> None:
        """Fold unless this thread was inside a fold or a read already (caller holds the lock): a call re-entered
        there (see :meth:`_fold`) reads what the completed folds left instead."""
        if self._lock.depth == 1:
            self._fold_locked()

    def _fold_locked(self) -> None:
        """:meth:`_fold` (caller holds the lock).

        Works everything out first without changing what a reader sees, then commits it with plain assignments
        of the objects already built and, last, one ``extend`` of the ring. Nothing in the commit allocates or
        calls before that extend, so a reader re-entered on this thread (a collector callback, a finalizer or a
        signal handler that interrupted the fold) sees the state the previous fold left, never part of this one.
        """
        new = self._new
        n = len(new)
        batch = [new.popleft() for _ in range(n)]  # what other threads append meanwhile waits for the next fold
        # the totals of the kinds in this fold, summed on from the old ones call by call, in the order recorded
        old = self._totals
        changed: dict[str, list[Any]] = {}
        for kind, items, nbytes, start, end, _ in batch:
            t = changed.get(kind)
            if t is None:
                t = changed[kind] = list(old.get(kind, _NO_CALLS))
            t[0] += 1
            t[1] += items
            t[2] += nbytes
            d = end - start
            if 0.0 < d < math.inf:  # a misused clock's NaN, negative or infinite duration adds no time (see Totals)
                t[3] += d
        totals = old.copy() if changed else old
        for k, t in changed.items():
            totals[k] = (t[0], t[1], t[2], t[3])
        # the ring pushes out its oldest calls once it is full: account for them once per fold
        over = len(self._records) + n - self.maxlen
        first, dropped_end = self._first, self._dropped_end
        if over > 0:
            # the calls pushed out: the ring's oldest, then (more folded at once than it holds) the first new ones
            # (they extend the drops since the last reset, [_reset_at, first): nothing more to keep)
            through = max(0, n - self.maxlen)
            first += over
            # (the running latest first: max() then passes over a NaN end)
            dropped_end = max(itertools.chain(
                (dropped_end,), (r[_END] for r in itertools.islice(self._records, over - through)),
                (r[_END] for r in itertools.islice(batch, through))))
        folded = self._folded + n
        # the commit (see above: no allocation or call before the extend)
        self._totals = totals
        self._first = first
        self._dropped_end = dropped_end
        self._folded = folded
        self._records.extend(batch)
        if len(self._names) > self._names_limit:
            self._forget_names()

    def _forget_names(self) -> None:
        """Forget the names of exited threads that no call in the ring (or waiting to be folded) comes from
        (caller holds the lock): a trace never shows them, and a process that starts many short-lived
        threads would otherwise keep one name per thread for its whole life.

        Runs when the names outgrow twice those kept last time (plus a slack), so its cost, one pass over
        the ring, is spread over the threads that recorded since.
        """
        # live threads first, then the queue: a thread that exits after this has queued all its calls
        keep: set[int | None] = {_thread_ids.get(t) for t in threading.enumerate()}
        try:
            keep.update(r[_THREAD] for r in tuple(self._new))
        except RuntimeError:  # the queue changed while it was copied: try again at the next fold
            return
        keep.update(r[_THREAD] for r in self._records)
        for tid in [tid for tid in list(self._names) if tid not in keep]:
            self._names.pop(tid, None)
        self._names_limit = 2 * len(self._names) + _NAMES_SLACK

    @property
    def records(self) -> tuple[CallRecord, ...]:
        """The most recent calls, oldest first (at most ``maxlen``): a snapshot, safe to iterate while
        other threads record."""
        with self._lock:
            self._fold_outermost()
            return tuple(map(_new_record, self._records))

    def mark(self) -> int:
        """A point in the stream of calls: how many have been folded into :attr:`records` so far, after
        folding those pending. Every call recorded after this returns gets a later position; pass the mark
        to :meth:`snapshot` to learn whether the ring has dropped any of them since."""
        with self._lock:
            self._fold_outermost()
            return self._folded

    def snapshot(self, since: int) -> tuple[tuple[CallRecord, ...], int]:
        """:attr:`records` and, read together with them, how many calls folded at or after the mark
        ``since`` (from :meth:`mark`) the ring has already dropped to make room (0 while all of them are
        still in the snapshot; calls removed by :meth:`reset` do not count). Exact for every mark but one older
        than the 1024 newest resets that each removed calls and followed drops: for such a mark, an upper bound
        (never fewer than were dropped), so that the drop record stays bounded over a long run.

        Raises:
            ConfigurationError: ``since`` is not a mark (an int >= 0).
        """
        _check_mark("snapshot", since)
        with self._lock:
            self._fold_outermost()
            return tuple(map(_new_record, self._records)), self._dropped_since(since)

    def calls_since(self, since: int) -> tuple[list[CallRecord], int]:
        """The calls folded at or after the mark ``since`` (from :meth:`mark`) that the ring still holds,
        oldest first, and how many of them it has already dropped (as :meth:`snapshot` counts them). Reads
        only those calls, however full the ring is.

        Raises:
            ConfigurationError: ``since`` is not a mark (an int >= 0).
        """
        _check_mark("calls_since", since)
        records, dropped, _ = self._calls_since(since)
        return records, dropped

    def _calls_since(self, since: int) -> tuple[list[CallRecord], int, int]:
        """:meth:`calls_since`, and the mark just past the calls it returns (:meth:`mark` read with them)."""
        with self._lock:
            self._fold_outermost()
            # read from the newest end: skipping the older calls from the left would walk the whole deque
            newer = itertools.islice(reversed(self._records), max(0, self._folded - max(since, self._first)))
            return list(map(_new_record, newer))[::-1], self._dropped_since(since), self._folded

    def _dropped_since(self, since: int) -> int:
        """Calls folded at or after the mark ``since`` that the ring dropped to make room (caller holds the lock)."""
        dropped = max(0, self._first - max(self._reset_at, since))  # since the last reset
        for a, b in reversed(self._drops):
            if b <= since:
                return dropped
            dropped += b - max(a, since)
        lo, hi, count = self._old_drops
        if since <= lo:
            return dropped + count
        return dropped + min(count, max(0, hi - since))  # (a mark among forgotten ranges: never fewer than dropped)

    def recent(self, kind: str, n: int) -> list[CallRecord]:
        """The newest ``n`` calls of ``kind``, oldest first (read from the newest end, without a full copy).

        Raises:
            ConfigurationError: ``n`` is not an int >= 0.
        """
        if not is_int(n) or n < 0:
            raise ConfigurationError(f"Telemetry.recent(kind, n=...) is how many of the newest calls to return: "
                                     f"pass an int >= 0, got {n!r}.")
        out: list[CallRecord] = []
        with self._lock:
            self._fold_outermost()
            for r in reversed(self._records):
                if len(out) >= n:
                    break
                if r[_KIND] == kind:
                    out.append(_new_record(r))
        return out[::-1]

    @property
    def totals(self) -> dict[str, Totals]:
        """Running totals per kind, over every call recorded: a consistent snapshot, safe to iterate while
        other threads record."""
        with self._lock:
            self._fold_outermost()
            return {k: Totals(*t) for k, t in self._totals.items()}

    def span(self, kind: str, items: SupportsIndex = 0, nbytes: SupportsIndex = 0) -> _Span:
        """A context manager that records its body as one call of ``kind``.

        ``items`` and ``nbytes`` are counts: any integer (a NumPy integer or an integer tensor of one element
        too) is recorded as a Python int, so totals stay ints and a trace stays JSON.

        Raises:
            ConfigurationError: ``kind`` is not a str, or ``items`` or ``nbytes`` not an integer; nothing is
                recorded.
        """
        if not isinstance(kind, str):
            raise ConfigurationError(f"Telemetry.span(kind=...) names the span (e.g. 'rollout'): pass a str, got "
                                     f"{kind!r}.")
        return _Span(self, kind, _count("items", items), _count("nbytes", nbytes))

    def since(self, t0: float) -> list[CallRecord]:
        """Records that started at or after ``t0``.

        Raises:
            ConfigurationError: ``t0`` is not a number (a ``time.perf_counter()`` reading), or NaN.
        """
        _check_time("Telemetry.since(t0=...)", t0)
        with self._lock:
            self._fold_outermost()
            return [_new_record(r) for r in self._records if r[_START] >= t0]

    def during(self, t0: float, t1: float) -> list[CallRecord]:
        """Records of the calls that overlap the window ``[t0, t1)``: ended after ``t0`` and started before ``t1``
        (a call still running is not recorded yet), oldest first.

        Raises:
            ConfigurationError: ``t0`` or ``t1`` is not a number (a ``time.perf_counter()`` reading), or NaN.
        """
        _check_time("Telemetry.during(t0=...)", t0)
        _check_time("Telemetry.during(t1=...)", t1)
        with self._lock:
            self._fold_outermost()
            return [_new_record(r) for r in self._records if r[_END] > t0 and r[_START] < t1]

    def reset(self) -> None:
        """Forget the recent calls and the totals. Marks go on counting (a later call still gets a later
        position), and calls removed here never count as dropped in :meth:`snapshot`.

        Raises:
            ConfigurationError: an :meth:`ExposureLog.iteration() <conduit.exposure.ExposureLog.iteration>` on
                this telemetry is open: it is accounted from the calls reset would forget, so it would be
                under-counted. Or it was called on a thread inside a fold or a read of this telemetry (from a
                garbage-collector callback, a finalizer or a signal handler that interrupted it): that fold
                would bring back what reset forgot. Nothing is reset; reset outside them.
        """
        with self._lock:
            if self._lock.depth > 1:
                raise ConfigurationError(
                    "Telemetry.reset() was called while this thread was inside a fold or a read of this telemetry "
                    "(from a garbage-collector callback, a finalizer or a signal handler that interrupted it): "
                    "that fold would bring back what reset forgot. Nothing was reset; call reset outside them "
                    "(not from such a callback).")
            self._fold_locked()
            if self._open:
                raise ConfigurationError(
                    f"Telemetry.reset() was called while {self._open} ExposureLog.iteration() on this telemetry "
                    f"is open: it would forget calls that iteration spanned and under-count it. Nothing was reset; "
                    f"reset between iterations (after the `with log.iteration():` block ends).")
            drops, old = self._drops, self._old_drops
            if self._first > self._reset_at:  # close the range dropped since the last reset
                if drops and drops[-1][1] == self._reset_at:  # that reset removed nothing: one range with the last
                    drops = [*drops[:-1], (drops[-1][0], self._first)]
                else:
                    drops = [*drops, (self._reset_at, self._first)]
                if len(drops) > _DROPS_KEPT:
                    (a, b), drops = drops[0], drops[1:]
                    old = (a, b, b - a) if not old[2] else (old[0], b, old[2] + b - a)
            self._records.clear()
            self._totals = {}
            self._drops, self._old_drops = drops, old
            self._first = self._reset_at = self._folded
            self._dropped_end = -math.inf

    def _open_window(self) -> int:
        """:meth:`mark`, and refuse :meth:`reset` until the matching :meth:`_close_window` (an open iteration)."""
        with self._lock:
            self._fold_outermost()
            self._open += 1
            return self._folded

    def _close_window(self) -> None:
        with self._lock:
            self._open -= 1

    def summary(self) -> dict[str, dict[str, float]]:
        """Totals per kind as plain numbers."""
        with self._lock:
            self._fold_outermost()
            return {k: {"calls": c, "items": i, "bytes": b, "seconds": t} for k, (c, i, b, t) in self._totals.items()}

    def chrome_trace(self, path: str | Path | None = None, *, since: float | None = None) -> dict[str, Any]:
        """The recorded calls as a Chrome trace (``chrome://tracing``, Perfetto); written to ``path`` if given.

        ``since`` keeps only the calls that ended after that ``time.perf_counter()`` time. A call with a
        non-finite start or end, a start or end beyond +-1e300 s (no clock reads that: its microseconds on the
        timeline would overflow to infinity), or an end before its start (recorded so by a caller of
        :meth:`record`), cannot be placed on the timeline and is left out (JSON has no NaN or infinity: the file
        would open in no viewer). Each thread is one lane (``tid``, see :func:`thread_id`), named by a
        ``thread_name`` event; ``pid`` is this process's. The file is written atomically: a write that fails
        (disk full, file-size limit) leaves ``path`` as it was.

        ``otherData.dropped_calls`` says how many calls the trace misses because the ring (``maxlen``) dropped
        them to make room since the last :meth:`reset`: 0 when it holds every call. With ``since``, 0 when every
        dropped call ended by then; else all of those dropped (the ring keeps only the latest end of what it
        dropped, so some may have ended before ``since``).

        Raises:
            ConfigurationError: ``path`` is not a file name (str or path), or ``since`` not a number or NaN;
                nothing is written.
        """
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ConfigurationError(f"Telemetry.chrome_trace(path=...) is the file to write the trace to: pass a "
                                     f"str or a pathlib.Path (or None to only return it), got {path!r}.")
        if since is not None:
            _check_time("Telemetry.chrome_trace(since=...)", since)
        with self._lock:
            self._fold_outermost()
            # (abs() < limit is False for NaN and the infinities too)
            recs = [r for r in map(_new_record, self._records) if (since is None or r.end > since)
                    and abs(r.start) < _TRACE_TIME_LIMIT and abs(r.end) < _TRACE_TIME_LIMIT and r.start <= r.end]
            # read with the records: a fold on another thread may forget an exited thread's name once its calls
            # have left the ring, and these calls may be its last
            names = dict(self._names)
            dropped = self._first - self._reset_at
            if since is not None and not self._dropped_end > since:
                dropped = 0
        t0 = min((r.start for r in recs), default=0.0)
        lanes = _lanes({r.thread for r in recs})
        pid = os.getpid()
        events = [{"name": r.kind, "ph": "X", "ts": (r.start - t0) * 1e6, "dur": r.seconds * 1e6, "pid": pid,
                   "tid": lanes[r.thread], "args": {"items": _json_count(r.items), "bytes": _json_count(r.nbytes)}}
                  for r in recs]
        # the loop's thread vs the scheduler's workers: live threads by their name now, exited ones as they recorded
        for t in threading.enumerate():
            tid = _thread_ids.get(t)
            if tid is not None:
                names[tid] = t.name
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": lane,
                    "args": {"name": names.get(tid, f"thread {tid}")}} for tid, lane in sorted(lanes.items())]
        trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"dropped_calls": dropped}}
        if path is not None:
            write_atomically(Path(path), json.dumps(trace))
        return trace


class _DepthLock:
    """A reentrant lock that counts how deep its holder is in it: a call re-entered on the thread that holds it
    (a garbage-collector callback, a finalizer or a signal handler that interrupted a fold or a read) takes it
    at once instead of waiting for itself, and sees ``depth > 1``. Only the holder changes ``depth``."""

    __slots__ = ("_rlock", "depth")

    def __init__(self) -> None:
        self._rlock = threading.RLock()
        #: how many times the holding thread has taken the lock (0: free)
        self.depth = 0

    def acquire(self, blocking: bool = True) -> bool:
        if not self._rlock.acquire(blocking):
            return False
        self.depth += 1
        return True

    def release(self) -> None:
        self.depth -= 1
        self._rlock.release()

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return self.depth > 0

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


#: a Chrome trace's pid and tid are read as 32-bit ints (Perfetto puts a larger tid on the lane of tid 0, the idle
#: thread); thread ids from this one up (the main thread's threading.get_ident()) get lanes counted down from it
_LANE_LIMIT = 2**31
#: a call placed on a trace's timeline starts and ends within +-this many seconds: then its ts and dur, differences
#: of two such times in microseconds, stay finite (below 2e306; a float holds up to 1.8e308)
_TRACE_TIME_LIMIT = 1e300


def _lanes(tids: set[int]) -> dict[int, int]:
    """Each thread id -> its lane (``tid``) in a Chrome trace: the id itself (a small number) unless it does not
    fit a 32-bit tid, or is 0 (the idle thread); then a lane of its own just below ``_LANE_LIMIT`` (far above
    any fresh number :func:`thread_id` hands out)."""
    big = sorted(t for t in tids if not 0 < t < _LANE_LIMIT)
    lanes = {t: t for t in tids if 0 < t < _LANE_LIMIT}
    lanes.update((t, _LANE_LIMIT - 1 - i) for i, t in enumerate(big))
    return lanes


def _count(name: str, v: object, method: str = "span") -> int:
    """``v``, an integer count (a NumPy integer, a one-element integer tensor), as a Python int.

    Raises:
        ConfigurationError: ``v`` is not an integer (a float, a bool, a string, a tensor of several elements).
    """
    if not isinstance(v, bool):
        try:
            return operator.index(v)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ConfigurationError(f"Telemetry.{method}({name}=...) is a count: pass an int, got {v!r}.")


def _checked_call(kind: object, items: object, nbytes: object, start: object,
                  end: object) -> tuple[str, int, int, float, float]:
    """:meth:`Telemetry.record`'s arguments checked, counts as Python ints and times as floats.

    Raises:
        ConfigurationError: as :meth:`Telemetry.record` says.
    """
    if not isinstance(kind, str):
        raise ConfigurationError(f"Telemetry.record(kind=...) names the call (e.g. 'deliver'): pass a str, got "
                                 f"{kind!r}.")
    counts = _count("items", items, "record"), _count("nbytes", nbytes, "record")
    times = []
    for name, t in (("start", start), ("end", end)):
        if not is_real(t):
            raise ConfigurationError(f"Telemetry.record({name}=...) is a time.perf_counter() reading: pass a number, "
                                     f"got {t!r}.")
        try:
            times.append(float(t))
        except OverflowError:  # (an int beyond a float's range: no clock reads that)
            raise ConfigurationError(f"Telemetry.record({name}=...) is a time.perf_counter() reading: {t!r} is "
                                     f"beyond a float's range.") from None
    return kind, counts[0], counts[1], times[0], times[1]


def _json_count(v: object) -> int | float | str:
    """A recorded count as JSON holds it (a caller of :meth:`Telemetry.record` may have passed a NumPy or
    tensor count, which ``json`` cannot write)."""
    try:
        return operator.index(v)  # type: ignore[arg-type]
    except TypeError:
        pass
    if isinstance(v, numbers.Real) and math.isfinite(v):
        return float(v)
    return str(v)


def _check_mark(method: str, since: object) -> None:
    """Refuse a ``since`` that is not a mark from :meth:`Telemetry.mark` (an int >= 0)."""
    if not is_int(since) or since < 0:
        raise ConfigurationError(f"Telemetry.{method}(since=...) is a mark from Telemetry.mark() (an int >= 0), "
                                 f"got {since!r}.")


def _check_time(what: str, t: object) -> None:
    """Refuse a time that is not a real number (a ``time.perf_counter()`` reading), or is NaN. (NaN is the one number
    unequal to itself: ``math.isnan`` would convert an int to a float first, which overflows past 1.8e308.)"""
    if not is_real(t) or t != t:
        raise ConfigurationError(f"{what} is a time.perf_counter() reading: pass a number (not NaN), got {t!r}.")


def probe_writable(path: Path) -> None:
    """Check now that ``path`` can be written later (opened for appending), leaving it as it was.

    Raises:
        OSError: it is a directory, its folder is missing, or it cannot be written.
    """
    path = Path(os.path.realpath(path))  # (a dangling link: the file it would create goes, not the link)
    existed = path.exists()
    with open(path, "a"):
        pass
    if not existed:
        path.unlink(missing_ok=True)


#: the bytes of a file's name (as the file system stores it) that :func:`write_atomically`'s temporary name keeps
#: at most (with the dot, the process id, the thread ident and ``.tmp``, within a file name's 255 bytes)
_TMP_NAME_KEPT = 200


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path`` (never half a file).

    A ``path`` that is a symbolic link (or lies in a linked folder) is written through: the file it points to is
    replaced (created, for a dangling link), and the link stays, as a plain write would leave it.
    """
    path = Path(os.path.realpath(path))  # (a rename over the link would replace it by a file, leaving its target)
    # a name of this process and thread, created exclusively (and with the umask's permissions, as a plain write);
    # the start of a long name only, so that the temporary name stays within a file name's 255 bytes wherever
    # ``path``'s does (with the whole name, a name of 220 bytes or more could not be written at all). Counted in
    # bytes: a character outside ASCII takes several (80 CJK characters are 240 bytes, a valid name).
    kept = path.name[:_TMP_NAME_KEPT]
    while len(os.fsencode(kept)) > _TMP_NAME_KEPT:
        kept = kept[:-1]
    tmp = path.with_name(f".{kept}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        f = open(tmp, "x")  # noqa: SIM115 - closed below, before the rename
    except FileExistsError:
        # no other writer uses this name now (it is this thread's): a killed writer of the same pid and thread
        # ident left it behind
        os.unlink(tmp)
        f = open(tmp, "x")  # noqa: SIM115
    try:
        with f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_new_record = functools.partial(tuple.__new__, CallRecord)
#: a call as the ring and the queue hold it: CallRecord's fields, as a plain tuple
_Raw = tuple[str, int, int, float, float, int]
#: positions in a _Raw
_KIND: Final = 0
_START: Final = 3
_END: Final = 4
_THREAD: Final = 5
#: the totals of a kind never recorded: (calls, items, bytes, seconds)
_NO_CALLS = (0, 0, 0, 0.0)
#: ranges of dropped calls a Telemetry keeps apart, one per reset that removed calls and followed drops (see
#: Telemetry._drops): a mark from before the older ones gets an upper bound of the calls dropped since
_DROPS_KEPT = 1024
#: thread names a Telemetry keeps beyond twice those it needs before it forgets the unneeded ones
_NAMES_SLACK = 64

#: this thread's thread_id() once it has one
_local = threading.local()
#: reentrant: a garbage-collector callback that records while a thread gets its id comes back in on that thread
_ids_lock = threading.RLock()
#: every ``threading.get_ident()`` handed out as the main thread's thread_id() in this process (never handed out
#: again: one per process, and one more in a child forked from another thread)
_taken: set[int] = set()
#: the fresh numbers handed out are 1.._last_fresh, minus those in _taken (kept here, not in _taken: one more
#: entry per short-lived thread would grow it for the life of the process)
_last_fresh = 0
#: live (and not yet collected) threads -> their thread_id(): the record of which id a thread has (``_local`` only
#: caches it), and what names a trace's lanes by a thread's current name
_thread_ids: weakref.WeakKeyDictionary[threading.Thread, int] = weakref.WeakKeyDictionary()


def thread_id() -> int:
    """The calling thread's id in :attr:`CallRecord.thread` (and a Chrome trace's ``tid``): never given to
    another thread of this process, unlike ``threading.get_ident()``, which the OS reuses once a thread exits
    (two exited workers would merge into one lane, under one name). The main thread's is its
    ``threading.get_ident()`` (callers may pass that as :func:`~conduit.exposure.measure_iteration`'s
    ``loop_threads``; a trace shows it on a lane of its own just below 2**31, as trace viewers read 32-bit
    tids); every other thread's is a fresh small number (1, 2, ...), which is also its ``tid`` in a trace."""
    try:
        return _local.tid
    except AttributeError:
        return _new_thread_id()


def _new_thread_id() -> int:
    """This thread's id, handed out on its first call (and cached in ``_local``).

    The collector may run a callback at any allocation in here (creating ``_local``'s storage for this thread
    included), and a callback that records calls this again on the same thread before the first call is done.
    A thread started by :mod:`threading` runs once, so an id registered for its :class:`~threading.Thread` in
    ``_thread_ids`` is its own: whichever call registers it first decides it (``setdefault``: no allocation
    between looking and storing) and the other takes it, so a thread never gets two ids (two lanes in a
    trace). (A thread started outside :mod:`threading` is seen as a ``_DummyThread``, which may be a stale one
    of an exited thread whose OS ident it reuses: it gets a fresh id as before.)
    """
    global _last_fresh
    ident = threading.get_ident()
    current = threading.current_thread()
    with _ids_lock:
        foreign = isinstance(current, threading._DummyThread)
        tid = None if foreign else _thread_ids.get(current)
        if tid is None:
            main = current is threading.main_thread() and ident not in _taken and ident > _last_fresh
            if main:
                tid = ident
            else:  # another thread (a trace viewer reads 32-bit tids: an ident, an address, does not fit)
                tid = _last_fresh + 1
                while tid in _taken:
                    tid += 1
            if foreign:
                _thread_ids[current] = tid
            elif _thread_ids.setdefault(current, tid) != tid:  # a callback's record registered it meanwhile
                tid = _thread_ids[current]
            if main:
                _taken.add(tid)
            else:
                _last_fresh = max(_last_fresh, tid)
    _local.tid = tid
    return tid


class _Span:
    __slots__ = ("_tel", "_kind", "_items", "_nbytes", "_t0")

    def __init__(self, tel: Telemetry, kind: str, items: int, nbytes: int) -> None:
        self._tel, self._kind, self._items, self._nbytes = tel, kind, items, nbytes

    def __enter__(self) -> _Span:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._tel.record(self._kind, self._items, self._nbytes, self._t0, time.perf_counter())
