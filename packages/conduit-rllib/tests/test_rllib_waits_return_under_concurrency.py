"""Liveness: the adapter's waits return under legitimate concurrent use and after failures.

Each call under test runs on its own thread, bounded by a join that is only reached on a hang.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conduit import EmptyBufferError
from conduit_rllib import ConduitEpisodeReplayBuffer, MinibatchFeed
from conduit_rllib.testing import id_episode
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import SampleBatch

BOUND = 60.0  # seconds: reached only on a hang


def bounded(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread; assert it returned (or raised) within BOUND seconds; return or re-raise its outcome."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(BOUND)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {BOUND} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def rollout(lo: int, hi: int) -> SampleBatch:
    ids = torch.arange(lo, hi)
    return SampleBatch({Columns.OBS: ids.float()[:, None].repeat(1, 3), Columns.ACTIONS: ids})


def ingest(feed: MinibatchFeed, lo: int, hi: int, version: int) -> None:
    feed.set_policy_version(version)
    feed.drop_leftovers()
    feed.ingest("default_policy", rollout(lo, hi), version=version)
    feed.seal()


def all_rows(feed: MinibatchFeed) -> list[int]:
    return [r for mab in feed.minibatches() for r in mab.policy_batches["default_policy"][Columns.ACTIONS].tolist()]


def test_a_learner_that_stops_part_way_can_checkpoint_restore_and_go_on() -> None:
    """A stopped iteration leaves its prefetch in flight: state_dict, drop_leftovers, load_state_dict and the next
    update wait for that gather only (it never waits for data), so each returns."""
    feed = MinibatchFeed(num_minibatches=4, num_epochs=2, seed=1, prefetch=True)
    ingest(feed, 0, 64, version=0)
    it = feed.minibatches()
    next(it)  # minibatch 0 trains; minibatch 1 is being gathered
    del it  # the learner stopped iterating
    state = bounded(lambda: feed.state_dict(drop_pending=True))
    assert state["dropped_items"] == 64, "the waiting rollout is counted as dropped"
    ingest(feed, 100, 132, version=1)  # drops the leftover, which stays in flight until here
    assert sorted(bounded(lambda: all_rows(feed))) == sorted(list(range(100, 132)) * 2)
    bounded(lambda: feed.load_state_dict(state))
    ingest(feed, 200, 216, version=2)
    assert sorted(bounded(lambda: all_rows(feed))) == sorted(list(range(200, 216)) * 2)
    bounded(feed.close)


def test_an_exception_in_the_update_leaves_a_feed_whose_next_update_returns() -> None:
    feed = MinibatchFeed(num_minibatches=3, num_epochs=2, seed=2, prefetch=True)
    ingest(feed, 0, 30, version=0)

    def failing_update() -> None:
        for k, _ in enumerate(feed.minibatches()):
            if k == 2:
                raise RuntimeError("the learner's update failed")

    try:
        bounded(failing_update)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the update's failure was not raised")
    ingest(feed, 50, 80, version=1)
    assert sorted(bounded(lambda: all_rows(feed))) == sorted(list(range(50, 80)) * 2)
    try:
        bounded(lambda: next(iter(feed.minibatches())))
    except EmptyBufferError:
        pass
    else:
        raise AssertionError("an exhausted feed delivered again")
    bounded(feed.close)


def test_a_feed_dropped_while_its_prefetch_thread_waits_ends_that_thread() -> None:
    before = set(threading.enumerate())
    feed = MinibatchFeed(num_minibatches=4, num_epochs=1, seed=3, prefetch=True)
    ingest(feed, 0, 40, version=0)
    it = feed.minibatches()
    next(it)
    workers = [t for t in set(threading.enumerate()) - before if t.name == "conduit-minibatch"]
    assert len(workers) == 1, "the prefetch thread was not started"
    del it, feed
    gc.collect()
    workers[0].join(BOUND)
    assert not workers[0].is_alive(), "the prefetch thread of a garbage-collected feed kept waiting"


def test_replay_adds_from_a_runner_thread_while_the_learner_samples_and_checkpoints() -> None:
    """RLlib may add from one thread while the learner samples and checkpoints from another: every call returns,
    and nothing added is lost."""
    buf = ConduitEpisodeReplayBuffer(capacity=4096, seed=0)
    buf.add([id_episode(np.arange(8), terminated=True)])
    adds, rounds = 200, 200
    start = threading.Barrier(3)

    def runner() -> None:
        start.wait()
        for i in range(adds):
            buf.add([id_episode(np.arange(1000 + 8 * i, 1008 + 8 * i), terminated=True)])

    sampled: list[int] = []

    def learner() -> None:
        start.wait()
        for _ in range(rounds):
            sampled.append(len(buf.sample(16)))

    states: list[dict[str, Any]] = []

    def checkpointer() -> None:
        start.wait()
        for _ in range(rounds // 10):
            states.append(buf.get_state())

    threads = [threading.Thread(target=f, daemon=True) for f in (runner, learner, checkpointer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    assert not any(t.is_alive() for t in threads), "an add, sample or get_state did not return"
    assert len(sampled) == rounds and len(states) == rounds // 10
    assert buf.get_num_timesteps() == 8 * (adds + 1), "an add was lost"
    restored = ConduitEpisodeReplayBuffer(capacity=4096, seed=0)
    bounded(lambda: restored.set_state(states[-1]))
    assert restored.get_num_timesteps() == states[-1]["next"]
    buf.close()
    restored.close()


@pytest.mark.parametrize("call", ["drop_leftovers", "load_state_dict"])
def test_drop_leftovers_and_load_state_dict_return_when_a_close_on_another_thread_stops_the_worker(call: str) -> None:
    """drop_leftovers and load_state_dict waited for the in-flight gather by submitting a no-op to the prefetch worker
    and waiting for it: a close() on another thread that stopped the worker between their read of it and their submit
    left the no-op unrun, and them waiting forever. (A proxy of the worker closes the feed at that moment.)"""
    feed = MinibatchFeed(num_minibatches=4, num_epochs=1, seed=4, prefetch=True)
    ingest(feed, 0, 40, version=0)
    state = feed.state_dict(drop_pending=True)
    it = feed.minibatches()
    next(it)  # a gather is in flight
    del it
    real = feed._pool
    assert real is not None

    class ClosedMeanwhile:
        """The worker, with a close() on another thread landing just before a submit reaches it."""

        def submit(self, *args: Any) -> Any:
            closer = threading.Thread(target=feed.close, daemon=True)
            closer.start()
            closer.join(BOUND)
            assert not closer.is_alive(), "close() did not return"
            assert real is not None
            return real.submit(*args)

        def shutdown(self) -> None:
            assert real is not None
            real.shutdown()

        def stop(self) -> None:
            assert real is not None
            real.stop()

    feed._pool = ClosedMeanwhile()  # type: ignore[assignment]
    feed.set_policy_version(1)
    if call == "drop_leftovers":
        bounded(feed.drop_leftovers)
    else:
        bounded(lambda: feed.load_state_dict(state))
    bounded(feed.close)
    ingest(feed, 100, 120, version=1)  # the feed goes on: a new worker and data plane
    assert sorted(bounded(lambda: all_rows(feed))) == list(range(100, 120))
    feed.close()
