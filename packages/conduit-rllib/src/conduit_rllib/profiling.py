"""Where an RLlib iteration's experience-path time goes, measured the same way for native RLlib and Conduit.

:class:`ExperiencePathProbe` wraps, on one built ``Algorithm`` instance (measurement only;
nothing in RLlib's classes changes), the calls that make up the experience path:

* ``add`` -- replay-buffer ``add`` (off-policy);
* ``sample`` -- replay-buffer ``sample``, ``get_metrics`` and folding those metrics into the
  algorithm's (what RLlib's own ``replay_buffer_sampling_timer`` covers; off-policy);
* ``priorities`` -- replay-buffer ``update_priorities`` (prioritized);
* ``batch`` -- the learner turning what it was handed into a train batch
  (``Learner._make_batch_if_necessary``: RLlib's learner connector, or Conduit's ready batch);
* ``minibatch`` -- producing the minibatches the learner trains on (building the iterator
  and each ``next()`` on it; for PPO that is RLlib's slicing or Conduit's delivery).

Time inside these calls is *exposed*: the training loop waits for it. Conduit may also run
experience-path work on its own threads (background ingestion, staging, prefetch); that time
comes from the data planes' telemetry and is reported as ``background``, the *hidden* time of
:mod:`conduit.exposure`: the union of the workers' ``ingest``/``deliver``/``stage`` spans,
clipped to the window between two :meth:`~ExperiencePathProbe.take` calls, minus the part
during which the loop sat in one of the wrapped calls (waiting for that work, which is then
exposed already). So ``exposed + background`` never counts a moment twice, and a span that
started before the window counts for the part inside it. Times are exclusive: a wrapped call
nested in another counts once. A wrapped call still running when a window closes (on another
thread, or one inside which ``take()`` is called) counts in each window for its part inside it,
and the loop's wait in it hides no worker span in either.

The rest of an iteration is timed too, as *context* (not experience path), so a difference
in iteration time can be placed: ``env`` (the local EnvRunner's ``sample``), ``weights``
(``sync_weights`` to the EnvRunners) and ``update`` (the learner's ``update`` without the
experience-path calls nested in it: forward, loss, backward, optimizer step).

With remote learners (``num_learners >= 1``, off-policy), the probe times what runs in this
process: ``add``, ``sample`` and ``priorities`` are the experience path, and ``update`` is the
learner group's whole ``update`` call, which now holds turning the sample into each learner's
batch (RLlib: sharding the episodes here and its learner connector in the actor; Conduit:
slicing the sample's columns) and shipping it; ``batch`` and ``minibatch`` are not reported.

``gc`` is the time Python's cyclic garbage collector ran in between (any thread). It is not
a part of its own: a collection runs inside whichever call allocated when it fell due, and
stops every thread while it walks all tracked objects of the process, so a buffer that keeps
one Python object per transition makes every collection longer, whoever triggers it.

``background`` is read from each data plane's bounded ring of recent calls (``Telemetry(maxlen=...)``): a
window that records more calls than the ring holds would lose its earliest ones, so :meth:`~ExperiencePathProbe.take`
refuses to report it (:class:`~conduit.errors.CapacityError`) rather than under-count it, as
:class:`~conduit.exposure.ExposureLog` does for an iteration.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from functools import wraps
from typing import Any

from conduit.errors import CapacityError
from conduit.exposure import measure_iteration
from conduit.telemetry import CallRecord, Telemetry, thread_id

from conduit_rllib.errors import UnsupportedConfigError

__all__ = ["ExperiencePathProbe", "PARTS", "CONTEXT"]

PARTS = ("add", "sample", "priorities", "batch", "minibatch")
CONTEXT = ("env", "weights", "update")


class _Frame:
    """A wrapped call under way: its part, when it began, and (since ``start``: when it began, or when the last
    :meth:`ExperiencePathProbe.take` closed a window it ran in) the seconds spent in wrapped calls nested in it."""

    __slots__ = ("part", "began", "start", "inner")

    def __init__(self, part: str, began: float) -> None:
        self.part, self.began, self.start, self.inner = part, began, began, 0.0


class _TimedIterator:
    def __init__(self, it: Iterable[Any], probe: ExperiencePathProbe) -> None:
        self._it: Iterator[Any] = iter(it)
        self._probe = probe

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        return self._probe._timed("minibatch", self._it.__next__)


class ExperiencePathProbe:
    """Accumulates exposed experience-path time per part; :meth:`take` returns and resets it.

    Args:
        algo: a built RLlib ``Algorithm``: a local learner (``num_learners=0``), or remote learners with a
            replay buffer in this process (DQN, SAC; see the module docstring for what is timed then).

    Raises:
        UnsupportedConfigError: the learners run in remote actors and there is no replay buffer here (PPO): the
            whole experience path runs in the actors, where it could not be timed (nothing is wrapped then).
    """

    def __init__(self, algo: Any) -> None:
        remote = not getattr(algo.learner_group, "is_local", True)
        rb = getattr(algo, "local_replay_buffer", None)
        if remote and rb is None:
            raise UnsupportedConfigError(
                "ExperiencePathProbe times the experience path in this process, but this algorithm's learners run "
                "in remote actors (num_learners >= 1) and it has no replay buffer here: its batch and minibatch "
                "work runs in the actors, could not be measured and would read 0. Build the algorithm to measure "
                "with config.learners(num_learners=0).")
        self.algo = algo
        #: the experience-path parts this probe times (the learner's own are not in this process when remote)
        self.parts: tuple[str, ...] = tuple(p for p in PARTS if p not in ("batch", "minibatch")) if remote else PARTS
        self._acc: dict[str, float] = defaultdict(float)
        #: the wrapped calls under way, per thread (thread_id()), outermost first; with _acc, _waits and
        #: _loop_threads under _lock (wrapped calls may run on several threads, take() on yet another); reentrant:
        #: a finalizer or garbage-collector callback run inside a locked part that times or takes must not hang
        self._stacks: dict[int, list[_Frame]] = {}
        self._lock = threading.RLock()
        self._main = thread_id()
        #: threads that ran wrapped calls (the training loop's), and the wrapped experience-path calls' spans
        self._loop_threads: set[int] = {self._main}
        self._waits: list[CallRecord] = []  # until the next take() (not kept after close())
        self._closed = False
        #: each data plane's telemetry -> its mark (Telemetry.mark()) at the start of the window (see background)
        self._marks: dict[Telemetry, int] = {}
        self._t0 = time.perf_counter()
        self._gc_start = 0.0
        self._gc_callback = _gc_callback(weakref.ref(self))
        gc.callbacks.append(self._gc_callback)
        weakref.finalize(self, _remove_callback, self._gc_callback)
        self.buffer = rb
        if rb is not None:
            for name, part in (("add", "add"), ("sample", "sample"), ("get_metrics", "sample"),
                               ("update_priorities", "priorities")):
                if hasattr(rb, name):
                    self._wrap(rb, name, part)
        if rb is not None:
            self._wrap_metrics_aggregation(algo)
        runners = getattr(algo, "env_runner_group", None)
        local = getattr(runners, "local_env_runner", None)
        if local is not None:
            self._wrap(local, "sample", "env")
        if runners is not None:
            self._wrap(runners, "sync_weights", "weights")
        #: the local learner (None when the learners are remote)
        self.learner: Any = None
        if remote:
            self._wrap(algo.learner_group, "update", "update")
        else:
            self._wrap_local_learner(list(algo.learner_group.foreach_learner(lambda learner: learner))[0].get())
        self._marks = self._marks_now()
        self._t0 = time.perf_counter()

    def _wrap_local_learner(self, learner: Any) -> None:
        self.learner = learner
        self._wrap(learner, "_make_batch_if_necessary", "batch")
        self._wrap(learner, "update", "update")
        orig = learner._create_iterator_if_necessary

        @wraps(orig)
        def create_iterator(*args: Any, **kwargs: Any) -> Any:
            return _TimedIterator(self._timed("minibatch", orig, *args, **kwargs), self)

        learner._create_iterator_if_necessary = create_iterator

    def _wrap(self, obj: Any, name: str, part: str) -> None:
        orig = getattr(obj, name)

        @wraps(orig)
        def timed(*args: Any, **kwargs: Any) -> Any:
            return self._timed(part, orig, *args, **kwargs)

        setattr(obj, name, timed)

    def _wrap_metrics_aggregation(self, algo: Any) -> None:
        from ray.rllib.utils.metrics import REPLAY_BUFFER_RESULTS

        orig = algo.metrics.aggregate

        @wraps(orig)
        def aggregate(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("key") == REPLAY_BUFFER_RESULTS:
                return self._timed("sample", orig, *args, **kwargs)
            return orig(*args, **kwargs)

        algo.metrics.aggregate = aggregate

    def _timed(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        ident = thread_id()
        with self._lock:
            frame = _Frame(part, time.perf_counter())
            stack = self._stacks.setdefault(ident, [])
            stack.append(frame)
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                t1 = time.perf_counter()
                stack.pop()  # (this frame: the calls nested in it have ended)
                dt = t1 - frame.start  # (since it began, or since the window it began in closed)
                self._acc[part] += dt - frame.inner
                if stack:
                    stack[-1].inner += dt
                else:
                    del self._stacks[ident]
                self._loop_threads.add(ident)
                if part in PARTS and not self._closed:  # the loop waits here: background work meanwhile is not hidden
                    self._waits.append(CallRecord("deliver_wait", 0, 0, frame.began, t1, ident))

    def _close_window(self, now: float) -> tuple[list[CallRecord], set[int]]:
        """Credit the wrapped calls under way with their time up to ``now`` (exclusive, as when they end) and
        start their time in the next window there; return the loop's waits in them so far and the threads they
        run on (what :meth:`_hidden` needs for this window). Caller holds ``_lock``."""
        waits: list[CallRecord] = []
        for ident, stack in list(self._stacks.items()):
            for i, f in enumerate(stack):
                upto = stack[i + 1].start if i + 1 < len(stack) else now
                self._acc[f.part] += (upto - f.start) - f.inner
                if f.part in PARTS:
                    waits.append(CallRecord("deliver_wait", 0, 0, f.began, now, ident))
            for f in stack:
                f.start, f.inner = now, 0.0
        return waits, set(self._stacks)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        with self._lock:  # (take() may close a window on another thread while this collection runs)
            if phase == "start":
                self._gc_start = time.perf_counter()
            elif self._gc_start:
                self._acc["gc"] += time.perf_counter() - self._gc_start
                self._gc_start = 0.0

    def close(self) -> None:
        """Stop timing the garbage collector and keeping the calls' spans (the wrapped calls stay timed
        while the algorithm lives)."""
        _remove_callback(self._gc_callback)
        with self._lock:
            self._closed = True
            self._waits.clear()

    def _planes(self) -> list[Any]:
        planes = []
        if self.buffer is not None and getattr(self.buffer, "edp", None) is not None:
            planes.append(self.buffer.edp)
        for feed in getattr(self.learner, "conduit_feeds", {}).values():
            if feed.edp is not None:
                planes.append(feed.edp)
        return planes

    def _marks_now(self) -> dict[Telemetry, int]:
        """Each data plane's telemetry and its mark (:meth:`Telemetry.mark() <conduit.Telemetry.mark>`): a call
        that ends after a clock reading taken after this is folded after the mark."""
        return {edp.telemetry: edp.telemetry.mark() for edp in self._planes()}

    def background(self, since: float, until: float | None = None) -> float:
        """Hidden seconds in ``[since, until)`` (``until``: now): experience-path work on Conduit's worker
        threads (the union of their ingest/deliver/stage spans, clipped to the window) while the loop was
        not inside a wrapped experience-path call; see :func:`conduit.exposure.measure_iteration`.

        A span counts once it has ended, so one still running at ``until`` is not in this window. Spans are
        read from the calls recorded since the last :meth:`take` (or the probe's creation), so ``since`` is
        no earlier than that.

        Raises:
            CapacityError: a data plane's telemetry ring (``Telemetry(maxlen=...)``) dropped calls recorded
                since the last :meth:`take`, so the hidden time would be under-counted.
        """
        end = time.perf_counter() if until is None else until
        with self._lock:
            waits = list(self._waits)
            threads = set(self._loop_threads) | set(self._stacks)
            waits += [CallRecord("deliver_wait", 0, 0, f.began, end, ident)
                      for ident, stack in self._stacks.items() for f in stack if f.part in PARTS]
        return self._hidden(since, end, self._marks, waits, threads)

    def _hidden(self, since: float, end: float, marks: dict[Telemetry, int], waits: list[CallRecord],
                loop_threads: set[int]) -> float:
        """:meth:`background` from the calls recorded after ``marks``, the loop's ``waits`` in wrapped calls and
        the threads that make them."""
        recs: list[CallRecord] = []
        for edp in self._planes():
            tel = edp.telemetry
            # a plane that appeared since the window began: all its calls count (from its first mark, 0)
            calls, dropped = tel.calls_since(marks.get(tel, 0))
            if dropped:
                raise CapacityError(
                    f"The data plane's telemetry ring (Telemetry(maxlen={tel.maxlen})) dropped {dropped} calls "
                    f"recorded since the probe's last take(), so its background (hidden) time would be "
                    f"under-counted. Raise the Telemetry's maxlen above the calls one window records, or call "
                    f"take() more often.")
            recs += [r for r in calls if r.end > since and r.start < end]
        recs += [w for w in waits if w.end > since and w.start < end]
        return measure_iteration(recs, since, end, loop_threads=loop_threads).hidden_s

    def take(self) -> dict[str, float]:
        """Seconds per part (:attr:`parts`) and context part since the last call, plus ``exposed``,
        ``background`` (hidden work on Conduit's threads, see :meth:`background`), ``total`` (exposed +
        background) and ``gc`` (garbage collection, overlapping the parts).

        Raises:
            CapacityError: as :meth:`background`: the window's background time cannot be measured. The window
                is over all the same (the next call reports the one after it).
        """
        since, marks = self._t0, self._marks
        self._marks = self._marks_now()  # before the clock: the next window's calls all come after it
        with self._lock:
            now = time.perf_counter()
            running, threads = self._close_window(now)
            if self._gc_start:  # a collection under way (on another thread): its part so far is this window's
                self._acc["gc"] += now - self._gc_start
                self._gc_start = now
            out = {p: self._acc.get(p, 0.0) for p in self.parts + CONTEXT}
            out["gc"] = self._acc.get("gc", 0.0)
            self._acc.clear()
            # all ended by now (appended under the lock); those that end later belong to the next window
            waits, self._waits = self._waits + running, []
            threads |= self._loop_threads
            self._t0 = now
        out["exposed"] = sum(out[p] for p in self.parts)
        out["background"] = self._hidden(since, now, marks, waits, threads)
        out["total"] = out["exposed"] + out["background"]
        return out


def _gc_callback(probe: weakref.ref[ExperiencePathProbe]) -> Callable[[str, dict[str, int]], None]:
    """A ``gc.callbacks`` entry that does not keep the probe (and its algorithm) alive."""
    def on_gc(phase: str, info: dict[str, int]) -> None:
        p = probe()
        if p is not None:
            p._on_gc(phase, info)
    return on_gc


def _remove_callback(callback: Callable[[str, dict[str, int]], None]) -> None:
    if callback in gc.callbacks:
        gc.callbacks.remove(callback)
