"""A driver that reproduces SRL's call pattern around a buffer, with real threads and ZMQ sockets.

Written from how SRL's workers use their streams and buffers (not from their code):

* **actors** build ``[T, ...]`` samples, ``post`` each to a sample producer and ``flush`` the
  producer once per poll (SRL flushes every producer on every actor poll);
* the **trainer's main thread** calls ``consumer.consume_to(buffer, max_iter=...)`` in a loop;
* the trainer's **training thread** loops ``if not buffer.empty(): entry = buffer.get()`` (else a
  5 ms sleep), reads ``entry.sample.average_of`` / ``min_of("policy_version_steps")`` for staleness,
  sets ``entry.sample.policy_name = None`` before the step, reads ``length(0) * length(1)`` for the
  sample count and ``entry.reuses``, sends priorities back for prioritized buffers, and advances the
  learner's version once per step;
* a **buffer worker** loop consumes into its own buffer and, if it is not empty, takes one
  ``get().sample`` per poll and re-posts it unpacked along the batch axis (``sample[:, i]``) to the
  next stream.

The transport mirrors SRL's IP sample stream: ZMQ PUSH/PULL over TCP, pickled samples, consumer
bound to a free port on 127.0.0.1. Each socket is used by one thread at a time and closed after
its last use, every loop is bounded (a timeout raises), every thread is joined.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from conduit import ConfigurationError

from conduit_srl.streams import ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy
from conduit_srl.testing.records import make_sample

__all__ = ["NothingToConsume", "ZmqSampleProducer", "ZmqSampleConsumer", "Delivery", "DriverReport", "SrlDriver",
           "run_buffer_worker", "LOCALHOST"]

LOCALHOST = "127.0.0.1"

#: how long the threads of :meth:`SrlDriver.run` and :func:`run_buffer_worker` get to finish once told to stop (after
#: ``timeout_s``, or at once on a failure) before they are left running as daemon threads and a TimeoutError says so
STOP_GRACE_S = 2.0


class NothingToConsume(Exception):
    """``consume()`` found nothing (SRL's consumers raise an exception of this name)."""


def _zmq() -> Any:
    import zmq  # the 'testing' extra

    return zmq


class ZmqSampleProducer:
    """An IP sample producer: ``post`` caches under a lock (thread-safe), ``flush`` sends.

    Unlike SRL's, it waits up to ``send_timeout_ms`` for a slow consumer instead of dropping at once;
    whatever it still cannot send is counted in :attr:`dropped`. Sends are serialised (the socket is
    used by one thread at a time): a ``close`` from another thread waits for a flush in flight, so
    every sample posted before it is sent or counted in :attr:`dropped`; ``post`` after ``close``
    raises.
    """

    def __init__(self, address: str, *, hwm: int = 1000, send_timeout_ms: int = 10_000) -> None:
        zmq = _zmq()
        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        self._socket.setsockopt(zmq.LINGER, 5_000)
        self._socket.connect(f"tcp://{address}")
        self._lock = threading.Lock()  # guards _pending and _closed
        self._send_lock = threading.Lock()  # the socket: one sending (or closing) thread at a time
        self._closed = False
        self._pending: list[Any] = []
        self.sent = 0
        self.dropped = 0

    def post(self, sample: Any) -> None:
        with self._lock:
            if self._closed:
                raise ConfigurationError("This sample producer is closed, so the sample would never be sent; post "
                                         "to an open producer.")
            self._pending.append(sample)

    def flush(self) -> None:
        with self._send_lock:
            self._flush()

    def _flush(self) -> None:
        """Send every pending sample. One that cannot be pickled is counted in :attr:`dropped`, the others are
        still sent, and then a ConfigurationError says how many were not; a socket error puts the samples not
        sent yet back in front of the pending ones and propagates."""
        with self._lock:
            pending, self._pending = self._pending, []
        unpicklable: list[str] = []
        for i, sample in enumerate(pending):
            try:
                data = pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - whatever pickling raises: counted, and reported below
                self.dropped += 1
                unpicklable.append(f"{type(e).__name__}: {e}")
                continue
            try:
                self._socket.send(data, copy=False)
                self.sent += 1
            except self._zmq.Again:
                self.dropped += 1
            except BaseException:
                with self._lock:
                    self._pending[:0] = pending[i:]
                raise
        if unpicklable:
            raise ConfigurationError(f"{len(unpicklable)} posted sample(s) could not be pickled and were dropped "
                                     f"(counted in dropped; the others were sent): {unpicklable[0]}. Post picklable "
                                     f"samples (NumPy arrays and plain Python values).")

    def close(self) -> None:
        """Send what is pending and close the socket (idempotent; waits for a flush in flight; the socket is closed
        also when the flush raises, and the samples it did not send are then counted in :attr:`dropped` before the
        error propagates: a closed producer never sends them)."""
        with self._send_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            try:
                self._flush()
            finally:
                with self._lock:  # (a socket error put the samples it did not send back in front of the pending)
                    self.dropped += len(self._pending)
                    self._pending = []
                self._socket.close()


class ZmqSampleConsumer:
    """An IP sample consumer bound to a free port on 127.0.0.1; ``consume_to`` never blocks.

    :attr:`received` counts the messages taken off the socket, also when ``consume_to`` raises because
    the buffer refused one (that message is counted: it left the socket).
    """

    def __init__(self, host: str = LOCALHOST, *, hwm: int = 1000) -> None:
        zmq = _zmq()
        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"{host}:{port}"
        self.received = 0

    def consume_to(self, buffer: Any, max_iter: int = 16) -> int:
        """Put up to ``max_iter`` received messages into ``buffer``; returns how many were put.

        A ``put`` that raises propagates; the messages put before it in this call stay put.
        """
        count = 0
        for _ in range(max_iter):
            try:
                data = self._socket.recv(self._zmq.NOBLOCK, copy=False)
            except self._zmq.Again:
                break
            self.received += 1  # (counted as it leaves the socket: a refused put raises past the loop)
            buffer.put(pickle.loads(data.buffer))
            count += 1
        return count

    def consume(self) -> Any:
        try:
            data = self._socket.recv(self._zmq.NOBLOCK, copy=False)
        except self._zmq.Again:
            raise NothingToConsume() from None
        self.received += 1
        return pickle.loads(data.buffer)

    def close(self) -> None:
        self._socket.close()


@dataclass
class Delivery:
    """What the training thread saw in one entry."""

    ids: np.ndarray  # the sample ids of the batch (time step 0), in batch order
    reuses: float
    staleness: float  # learner version - smallest policy version in the entry
    samples: int  # length(0) * length(1)
    time_steps: int
    get_seconds: float


@dataclass
class DriverReport:
    """The outcome of one run."""

    deliveries: list[Delivery] = field(default_factory=list)
    #: messages the actors' sockets sent (samples, unless the stream coalesces)
    sent: int = 0
    #: samples the trainer's consumer put into the buffer
    received: int = 0
    dropped: int = 0
    seconds: float = 0.0
    #: time the trainer's main thread spent inside ``consume_to`` (receiving and ``put``)
    consume_seconds: float = 0.0
    #: ids of every posted sample
    posted: list[int] = field(default_factory=list)
    #: samples the trainer's Conduit consumer had received but not put when it stopped (its ``close()`` returned
    #: them: the left-overs of a refusal by a full ``on_full="raise"`` buffer); 0 when every sample arrived
    unput: int = 0

    @property
    def delivered_ids(self) -> np.ndarray:
        return np.concatenate([d.ids for d in self.deliveries]) if self.deliveries else np.empty(0, np.int64)

    @property
    def get_latencies(self) -> np.ndarray:
        return np.array([d.get_seconds for d in self.deliveries])


class SrlDriver:
    """Actors -> ZMQ -> a trainer (main thread ``consume_to``, training thread ``empty``/``get``) around ``buffer``.

    Args:
        buffer: the trainer's buffer (a Conduit buffer, or any object with SRL's buffer calls).

    Keyword Args:
        actors: actor threads, each with its own producer socket.
        samples_per_actor: samples each actor posts (ids ``actor * samples_per_actor + i``).
        per_poll: samples an actor posts between flushes.
        time_steps, dim: sample shape (``[T, ...]``, observation width ``dim``).
        max_steps: training steps before the training thread stops (None: until the buffer
            runs dry after every sample arrived).
        step_seconds: simulated duration of one training step (the learner's update).
        priorities: prioritized buffers: ``priorities(entry) -> array`` sent with ``update_priorities``.
        max_iter: ``consume_to``'s ``max_iter`` (SRL's trainer uses 1024, its buffer worker 64).
        make_sample_fn: ``(ids, version) -> sample``; default :func:`make_sample`.
        stream_policy: carry the stream through Conduit's producer and consumer
            (:class:`~conduit_srl.ConduitSampleProducer` over each actor's socket, coalescing as the
            policy says; :class:`~conduit_srl.ConduitSampleConsumer` on the trainer). None: plain.
    """

    def __init__(self, buffer: Any, *, actors: int = 2, samples_per_actor: int = 32, per_poll: int = 4,
                 time_steps: int = 4, dim: int = 3, max_steps: int | None = None, step_seconds: float = 0.0,
                 priorities: Callable[[Any], np.ndarray] | None = None, max_iter: int = 1024,
                 make_sample_fn: Callable[[int, int], Any] | None = None,
                 stream_policy: StreamPolicy | None = None) -> None:
        self.buffer = buffer
        self.actors = actors
        self.samples_per_actor = samples_per_actor
        self.per_poll = per_poll
        self.max_steps = max_steps
        self.step_seconds = step_seconds
        self.priorities = priorities
        self.max_iter = max_iter
        self.stream_policy = stream_policy
        self.make = make_sample_fn or (lambda i, v: make_sample([i], time_steps=time_steps, dim=dim, version=v))
        self.version = 0  # the learner's policy version (actors read it, the training thread advances it)

    def run(self, timeout_s: float = 60.0) -> DriverReport:
        """Run actors, the training thread and the consuming loop until done.

        Every thread is joined: within ``timeout_s``, then :data:`STOP_GRACE_S` once told to stop (a thread still
        running then, e.g. a training step longer than the time left, is left behind as a daemon thread). The
        trainer's main thread (``consume_to``) runs in a thread of its own, so a ``put`` that waits for room nobody
        makes (an on-policy buffer whose training thread stopped) ends ``run`` with a TimeoutError too.

        Raises:
            TimeoutError: not every sample arrived, or a thread did not finish, in time.
        """
        report = DriverReport()
        socket = ZmqSampleConsumer()
        consumer: Any = socket if self.stream_policy is None else ConduitSampleConsumer(socket)
        stop = threading.Event()
        arrived = threading.Event()
        errors: list[BaseException] = []
        producers: list[ZmqSampleProducer] = []
        lock = threading.Lock()

        def close_consumer() -> None:  # (a Conduit consumer closes its socket and returns what it still holds)
            if consumer is socket:
                socket.close()
            else:
                report.unput += len(consumer.close())

        def actor(a: int) -> None:
            try:
                sender = ZmqSampleProducer(socket.address)
                with lock:
                    producers.append(sender)
                producer: Any = sender
                if self.stream_policy is not None:
                    producer = ConduitSampleProducer([sender], policy=self.stream_policy, rank=a)
                ids = range(a * self.samples_per_actor, (a + 1) * self.samples_per_actor)
                try:
                    for start in range(0, len(ids), self.per_poll):
                        if stop.is_set():
                            return
                        for i in ids[start:start + self.per_poll]:
                            producer.post(self.make(i, self.version))
                            with lock:
                                report.posted.append(i)
                        producer.flush()
                finally:
                    producer.close()
            except BaseException as e:  # noqa: BLE001 - reported by run()
                errors.append(e)

        def training() -> None:
            try:
                steps = 0
                while not stop.is_set():
                    if self.max_steps is not None and steps >= self.max_steps:
                        return
                    if self.buffer.empty():
                        if arrived.is_set() and self.max_steps is None:
                            return  # everything arrived and nothing is left to deliver
                        time.sleep(0.005)
                        continue
                    t0 = time.perf_counter()
                    entry = self.buffer.get()
                    dt = time.perf_counter() - t0
                    s = entry.sample
                    s.average_of("policy_version_steps")  # (SRL's trainer reads both)
                    version_min = s.min_of("policy_version_steps")
                    report.deliveries.append(Delivery(
                        ids=np.asarray(s.id)[0].copy(), reuses=float(entry.reuses),
                        staleness=float(self.version - version_min), samples=s.length(0) * s.length(1),
                        time_steps=s.length(0), get_seconds=dt))
                    s.policy_name = None  # (SRL's trainer overwrites this non-numeric field before its step)
                    if self.step_seconds:
                        time.sleep(self.step_seconds)
                    if self.priorities is not None:
                        self.buffer.update_priorities(entry.sampling_indices, self.priorities(entry))
                    self.version += 1
                    steps += 1
            except BaseException as e:  # noqa: BLE001 - reported by run()
                errors.append(e)

        expected = self.actors * self.samples_per_actor

        def consuming() -> None:  # the trainer's main thread (its own thread here, so a put that blocks is bounded)
            try:
                while report.received < expected and not errors and not stop.is_set():
                    c0 = time.perf_counter()
                    got = consumer.consume_to(self.buffer, max_iter=self.max_iter)
                    report.consume_seconds += time.perf_counter() - c0
                    report.received += got
                    if not got:
                        time.sleep(0.001)
            except BaseException as e:  # noqa: BLE001 - reported by run()
                errors.append(e)
            finally:
                close_consumer()  # (this thread is its only user; one that run() gave up on closes it when it ends)

        threads = [threading.Thread(target=actor, args=(a,), name=f"actor-{a}", daemon=True)
                   for a in range(self.actors)]
        trainer = threading.Thread(target=training, name="training-thread", daemon=True)
        main = threading.Thread(target=consuming, name="trainer-main-thread", daemon=True)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        late: str | None = None
        try:
            trainer.start()
            for t in threads:
                t.start()
            main.start()
            main.join(timeout=max(0.0, deadline - time.monotonic()))
            if main.is_alive():
                late = f"only {report.received} of {expected} samples arrived in {timeout_s} s"
            else:
                arrived.set()
                trainer.join(timeout=max(0.0, deadline - time.monotonic()))
                if trainer.is_alive():
                    late = "the training thread did not finish in time"
        finally:
            stop.set()
            arrived.set()
            # every join is bounded: the threads were told to stop
            stuck = _join_within([*threads, trainer, main], time.monotonic() + STOP_GRACE_S)
            if main.ident is None:
                close_consumer()  # (the consuming thread never started; otherwise it closes the consumer itself)
        report.seconds = time.perf_counter() - t0
        report.sent = sum(p.sent for p in producers)
        report.dropped = sum(p.dropped for p in producers)
        if errors:
            raise errors[0]
        if late is not None or stuck:
            why = late or f"SrlDriver.run: thread(s) {stuck} did not finish {STOP_GRACE_S} s after being told to stop"
            if report.unput:
                why += (f"; {report.unput} more samples were received, and refused by the full buffer, and not put "
                        f"(the consumer's close() returned them)")
            if stuck:
                why += f"; thread(s) {stuck} left running as daemon threads"
            if main.name in stuck:
                why += (" (the trainer's main thread is inside consume_to: a buffer.put that waits for room nobody "
                        "makes, e.g. an on-policy buffer whose training thread stopped at max_steps; raise its "
                        "capacity or deliver from it)")
            raise TimeoutError(why + ".")
        return report


def _join_within(threads: Sequence[threading.Thread], end: float) -> list[str]:
    """Join each of ``threads`` until the monotonic time ``end`` at the latest; the names of those still running."""
    for thread in threads:
        thread.join(timeout=max(0.0, end - time.monotonic()))
    return [thread.name for thread in threads if thread.is_alive()]


def run_buffer_worker(upstream: Sequence[Any], buffer: Any, downstream_buffer: Any, *, max_iter: int = 64,
                      timeout_s: float = 30.0) -> tuple[int, int]:
    """SRL's buffer-worker pattern between two real streams.

    ``upstream`` samples are posted by an actor thread to stream 1; the buffer worker (a thread
    of its own) loops ``consume_to(buffer, max_iter)`` then, if the buffer is not empty, takes one
    ``get().sample`` (``[T, B, ...]``) per poll, as SRL's buffer worker does, and posts ``sample[:, i]``
    for each ``i`` to stream 2, then flushes; a trainer thread consumes stream 2 into ``downstream_buffer``.

    Every thread is joined within ``timeout_s`` plus :data:`STOP_GRACE_S` (once the worker fails, or the time is up,
    the threads are told to stop); one still running then (e.g. the trainer inside a ``downstream_buffer.put`` that
    waits for room nobody makes, or the worker inside a ``buffer.put`` that waits for room only its own ``get``
    could make) is left behind as a daemon thread, and a TimeoutError names it.

    Returns:
        (samples the buffer worker re-posted, samples that reached ``downstream_buffer``).

    Raises:
        TimeoutError: the worker did not re-post every sample, or a thread did not finish, in time.
    """
    stream1 = ZmqSampleConsumer()
    stream2 = ZmqSampleConsumer()
    errors: list[BaseException] = []
    done = threading.Event()  # the worker re-posted everything: the trainer takes what is left, then ends
    stop = threading.Event()  # the threads give up (the worker failed, or the time is up)
    reached = [0]

    def actor() -> None:
        try:
            p = ZmqSampleProducer(stream1.address)
            try:
                for s in upstream:
                    if stop.is_set():
                        return
                    p.post(s)
                    p.flush()
            finally:
                p.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def trainer() -> None:
        try:
            while not stop.is_set() and (not done.is_set() or reached[0] < reposted):
                got = stream2.consume_to(downstream_buffer, max_iter=1024)
                reached[0] += got
                if not got:
                    if done.is_set() and reached[0] >= reposted:
                        break
                    time.sleep(0.001)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    reposted = 0
    expected = len(upstream)
    def worker() -> None:  # SRL's buffer worker: its own thread, so a put into ``buffer`` that never returns is bounded
        nonlocal reposted
        finished = False
        try:
            out = ZmqSampleProducer(stream2.address)
            try:
                consumed = 0
                while not errors and not stop.is_set():
                    consumed += stream1.consume_to(buffer, max_iter=max_iter)
                    moved = False
                    if not buffer.empty():
                        sample = buffer.get().sample
                        for i in range(sample.length(1)):
                            out.post(sample[:, i])
                            reposted += 1
                        out.flush()
                        moved = True
                    if consumed >= expected and buffer.empty():
                        break
                    if not moved:
                        time.sleep(0.001)
            finally:
                out.close()
            finished = not stop.is_set()
        except BaseException as e:  # noqa: BLE001 - reported by run_buffer_worker
            errors.append(e)
        finally:
            stream1.close()  # (this thread is its only user; one that was given up on closes it when it ends)
            if not finished:
                stop.set()
            done.set()

    a = threading.Thread(target=actor, name="actor", daemon=True)
    t = threading.Thread(target=trainer, name="trainer", daemon=True)
    w = threading.Thread(target=worker, name="buffer-worker", daemon=True)
    deadline = time.monotonic() + timeout_s
    late: str | None = None
    try:
        a.start()
        t.start()
        w.start()
        w.join(timeout=max(0.0, deadline - time.monotonic()))
        if w.is_alive():
            late = f"buffer worker re-posted {reposted} of {expected} samples in {timeout_s} s"
            stop.set()
        _join_within((a, t), deadline)  # every join is bounded: until the deadline, then a grace once told to stop
    finally:
        stop.set()
        stuck = _join_within((a, t, w), time.monotonic() + STOP_GRACE_S)
        if w.ident is None:
            stream1.close()  # (the worker never started; otherwise it closes stream 1 itself)
        if not t.is_alive():  # (a socket is used by one thread at a time: a trainer still running keeps stream 2)
            stream2.close()
    if late is not None:
        if w.name in stuck:
            late += (f"; the buffer worker is still inside consume_to or get, left running as a daemon thread: a "
                     f"buffer.put that waits for room only this same thread could make by get() never returns (an "
                     f"on-policy buffer in a buffer worker needs capacity for what one consume_to(max_iter="
                     f"{max_iter}) receives, or on_full='keep' to keep what does not fit until a get() frees room)")
        raise TimeoutError(late + ".")
    if stuck:
        raise TimeoutError(f"run_buffer_worker: thread(s) {stuck} did not finish within timeout_s={timeout_s} s "
                           f"(and {STOP_GRACE_S} s once told to stop), left running as daemon threads; the trainer "
                           f"took {stream2.received} of {reposted} re-posted samples off stream 2 (the last may be "
                           f"inside downstream_buffer.put). A downstream buffer whose put waits for room (on-policy) "
                           f"needs deliveries taken from it, or a larger capacity.")
    if errors:
        raise errors[0]
    return reposted, reached[0]
