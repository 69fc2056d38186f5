"""PPO: a stopped iteration's prefetch of its rollout's last minibatch counts as waiting (configure and a
second module are refused while it is out), an iteration finalised by the garbage collector on the prefetch thread
itself does not hang, and a learner state whose RLlib part is refused leaves Conduit's part as it was."""

from __future__ import annotations

import gc
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import ConfigurationError
from conduit_rllib import MinibatchFeed, UnsupportedConfigError
from conduit_rllib.learner import ON_POLICY_COMPONENT
from ray.rllib.core import DEFAULT_MODULE_ID

sys.path.insert(0, str(Path(__file__).parent))
from test_ppo_feed_close_shutdown_and_restore import ROW, build_learner, learner_minibatch_sizes, rollout, rows_of  # noqa: E402


def test_a_prefetch_of_the_last_minibatch_still_out_keeps_the_feed_busy() -> None:
    feed = MinibatchFeed(minibatch_size=2, num_epochs=1, seed=0)
    feed.ingest("m", rollout(0, 6), version=0)
    feed.seal()
    it = feed.minibatches()
    assert [next(it).policy_batches["m"][ROW].tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    # the last minibatch, [4, 5], is being prefetched: once the plane is empty the rollout is still not delivered
    # (the caller's training raised; its traceback still holds the iterator)
    assert feed.edp is not None
    deadline = time.monotonic() + 30
    while (feed.semantics.pending_rollouts or len(feed.edp)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert feed.semantics.pending_rollouts == 0 and len(feed.edp) == 0, "the prefetch did not take the last rows"
    with pytest.raises(ConfigurationError, match="waiting for delivery"):
        feed.configure(minibatch_size=3, num_epochs=1, shuffle=False)
    with pytest.raises(UnsupportedConfigError, match="serves module 'm'"):
        feed.ingest("other", rollout(10, 13), version=0)
    assert rows_of(feed) == [[4, 5]], "the prefetched minibatch, still cut and labelled as its rollout was"
    feed.configure(minibatch_size=3, num_epochs=1, shuffle=False)  # delivered: now the change is taken
    feed.ingest("other", rollout(10, 16), version=0)
    feed.seal()
    assert [(list(mb.policy_batches), mb.policy_batches["other"][ROW].tolist()) for mb in feed.minibatches()] == \
        [(["other"], [10, 11, 12]), (["other"], [13, 14, 15])]
    del it
    feed.close()


def test_an_iteration_the_garbage_collector_finalises_on_the_prefetch_thread_does_not_hang() -> None:
    feed = MinibatchFeed(minibatch_size=2, num_epochs=1, seed=0)
    feed.ingest("m", rollout(0, 6), version=0)
    feed.seal()
    assert feed.edp is not None
    deliver, dropped, collected = feed.edp.deliver, threading.Event(), threading.Event()

    def deliver_after_a_collection() -> Any:  # the real delivery; the cyclic GC happens to run first on this thread
        if threading.current_thread().name == "conduit-minibatch" and not collected.is_set():
            dropped.wait(10)
            gc.collect()
            collected.set()
        return deliver()

    feed.edp.deliver = deliver_after_a_collection  # type: ignore[method-assign]
    gc.disable()  # only the prefetch thread's collection finds the cycle below
    try:
        it = feed.minibatches()
        assert next(it).policy_batches["m"][ROW].tolist() == [0, 1]  # [2, 3] is being prefetched
        cycle: list[Any] = [it]
        cycle.append(cycle)  # e.g. a traceback's frames: only the cyclic collector frees the iteration
        del it, cycle
        dropped.set()
        assert collected.wait(30), "the prefetch thread waits for itself: the iteration's finaliser hung it"
        got: list[list[list[int]]] = []
        reader = threading.Thread(target=lambda: got.append(rows_of(feed)), daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "the next iteration waits for a prefetch that never ends"
    finally:
        gc.enable()
    assert got == [[[2, 3], [4, 5]]], "the rest of the rollout, once each, in order"
    feed.close()


def test_a_learner_state_whose_rllib_part_is_refused_leaves_conduits_part_as_it_was() -> None:
    saved_from, learner = build_learner(), build_learner()
    try:
        learner_minibatch_sizes(saved_from, 40, minibatch_size=16, num_epochs=2)
        state = saved_from.get_state()
        for _ in range(3):
            learner_minibatch_sizes(learner, 40, minibatch_size=16, num_epochs=2)
        version, feed_state = learner.conduit_version, learner.conduit_feed.state_dict()
        module = learner.module[DEFAULT_MODULE_ID]
        weights = [p.detach().clone() for p in module.parameters()]
        assert state[ON_POLICY_COMPONENT]["version"] == 1 != version
        name = next(iter(state["rl_module"][DEFAULT_MODULE_ID]))  # a weight, saved with a shape this module lacks
        damaged = {ON_POLICY_COMPONENT: state[ON_POLICY_COMPONENT],
                   "rl_module": {DEFAULT_MODULE_ID: {name: torch.zeros(3, 1, 1)}}}  # RLlib refuses it
        with pytest.raises(RuntimeError, match=f"size mismatch for {name}"):
            learner.set_state(damaged)
        assert all(torch.equal(a, b) for a, b in zip(weights, module.parameters(), strict=True)), \
            "RLlib's part changed"
        assert learner.conduit_version == version, "a refused state changed Conduit's update count"
        after = learner.conduit_feed.state_dict()
        assert after["policy_version"] == feed_state["policy_version"] and \
            torch.equal(after["rng"], feed_state["rng"]), "a refused state changed the feed's state"
        learner_minibatch_sizes(learner, 40, minibatch_size=16, num_epochs=2)
        assert {int(i.version) for i in learner.conduit_feed.delivered} == {version}, \
            "the next update must continue the learner's own versions"
        learner.set_state(state)  # undamaged: both parts restored
        assert learner.conduit_version == 1 and learner.conduit_feed.state_dict()["policy_version"] == \
            saved_from.conduit_feed.state_dict()["policy_version"]
    finally:
        saved_from.conduit_feed.close()
        learner.conduit_feed.close()
