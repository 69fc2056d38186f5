"""Liveness: SRL buffer calls that must return while other threads keep working.

``get()`` made its own delivery and then checked whether that entry had aged: a prioritized one past the
priority updates made since it was assembled, an on-policy one past ``max_staleness`` since the plane
delivered it. Another thread that kept updating priorities (or kept moving the policy version while
fresh rollouts arrived) inside that window made ``get()`` discard its own delivery and draw again,
for as long as that thread ran. The window is widened here by a hand-shake with the other thread
right after the entry is assembled, so every delivery ages before ``get()`` looks at it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from conduit_srl import ConduitBuffer
from conduit_srl.testing import make_sample

#: a join bound reached only when the call under test hangs
HANG_S = 30.0


Race = tuple[threading.Event, threading.Thread, list[BaseException]]


def _race_after_assembly(buf: ConduitBuffer, other: Callable[[], None]) -> Race:
    """Make each entry ``buf`` assembles wait until another thread ran ``other()`` once (until the returned stop
    event is set); returns that event, the other thread (started) and the errors it met."""
    a = buf._a
    asked, answered, stop = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    assemble = a._assemble

    def assemble_then_race(batch: Any, info: Any) -> Any:
        entry = assemble(batch, info)
        if not stop.is_set():
            answered.clear()
            asked.set()
            answered.wait(timeout=HANG_S)
        return entry

    def serve() -> None:
        try:
            while not stop.is_set():
                if asked.wait(timeout=0.05):
                    asked.clear()
                    other()
                    answered.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            stop.set()
        finally:
            answered.set()

    a._assemble = assemble_then_race  # type: ignore[method-assign]
    t = threading.Thread(target=serve, name="other-thread", daemon=True)
    t.start()
    return stop, t, errors


def _get_within_bound(buf: ConduitBuffer, race: Race) -> Any:
    stop, other, errors = race
    got: list[Any] = []
    failed: list[BaseException] = []

    def getter() -> None:
        try:
            got.append(buf.get())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failed.append(e)

    t = threading.Thread(target=getter, name="training-thread", daemon=True)
    t.start()
    t.join(timeout=HANG_S)
    hung = t.is_alive()
    stop.set()  # (on a hang: lets the get() go on, so the test ends and the buffer closes)
    t.join(timeout=HANG_S)
    other.join(timeout=HANG_S)
    assert not errors, errors
    assert not hung, "get() kept discarding its own delivery while another thread worked"
    assert not failed, failed
    assert not t.is_alive() and not other.is_alive()
    return got[0]


def test_prioritized_get_returns_while_another_thread_keeps_updating_priorities() -> None:
    with ConduitBuffer(semantics="prioritized", batch_size=2, capacity=16, pin_memory=False) as buf:
        for i in range(8):
            buf.put(make_sample([i]))
        buf.flush()
        idx = buf.get().sampling_indices
        updates = [0]

        def update() -> None:
            buf.update_priorities(idx, np.full(idx.shape[0], 2.0))
            updates[0] += 1

        entry = _get_within_bound(buf, _race_after_assembly(buf, update))
        assert entry.sampling_indices.shape == (2,)
        assert set(np.asarray(entry.sample.id)[0].tolist()) <= set(range(8))
        assert updates[0] >= 1  # the update did land between the assembly and the hand-out
        assert buf.stats()["redrawn"] == 0  # a delivery made for this get() is not discarded by it


def test_on_policy_get_returns_while_versions_move_and_fresh_rollouts_arrive() -> None:
    with ConduitBuffer(semantics="on_policy", capacity=64, rollout_size=2, num_minibatches=1, max_staleness=0,
                       prefetch=0, pin_memory=False) as buf:
        version = [0]
        buf.put_batch(make_sample([0, 1], version=0, batched=True))
        buf.flush()

        def learner_and_actors() -> None:  # the version moves, and a rollout of the new version arrives
            version[0] += 1
            v = version[0]
            buf.set_policy_version(v)
            buf.put_batch(make_sample([2 * v, 2 * v + 1], version=v, batched=True))
            buf.flush()

        entry = _get_within_bound(buf, _race_after_assembly(buf, learner_and_actors))
        assert version[0] >= 1  # the version did move between the plane's delivery and the hand-out
        ids = sorted(np.asarray(entry.sample.id)[0].tolist())
        assert ids == [0, 1]  # the rollout the plane delivered, fresh when delivered, is handed out
        assert entry.info is not None and entry.info.staleness == 0  # (as of its delivery)
        s = buf.stats()
        assert s["stale_dropped"] == 0 and s["samples_delivered"] == 2
        assert s["samples_put"] == s["samples_delivered"] + s["late_dropped"] + s["stale_dropped"] + \
            s["rollout_dropped"] + s["queue_dropped"] + s["samples_waiting"]
