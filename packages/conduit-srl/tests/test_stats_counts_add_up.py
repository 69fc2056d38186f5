"""``stats()`` counts that must account for every sample put, exactly once.

* every documented ``stats()`` key is there from construction, with 0 (not only after the first put);
* ``rollout_dropped`` counts only samples of a dropped rollout that were never handed out: with several
  minibatches or epochs, the ones delivered before the drop are in ``samples_delivered`` only;
* one ``stats()`` call is one consistent view: ``samples_waiting`` and ``qsize`` are read in the same hold of the
  buffer's locks as the counters, so the identity holds for every snapshot, also while threads put and get.

The identity (on-policy and queue; ``queue_dropped`` and ``rollout_dropped``/``stale_dropped`` are 0 for the other):
``samples_put == samples_delivered + late_dropped + stale_dropped + rollout_dropped + queue_dropped +
samples_waiting``, and every sample a put accepted is either in ``samples_put`` or in ``samples_held``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest
from conduit import CapacityError, EmptyBufferError
from conduit_srl import ConduitBuffer
from conduit_srl.testing import entry_ids, make_sample

JOIN_S = 60.0
KEYS = ("samples_put", "entries_delivered", "samples_delivered", "samples_waiting", "samples_held", "late_dropped",
        "stale_dropped", "rollout_dropped", "queue_dropped", "queue_abandoned", "redrawn", "qsize")


def accounted(s: dict[str, Any]) -> int:
    """Where ``stats()`` says the stored-or-dropped samples are (each in exactly one place)."""
    return (s["samples_delivered"] + s["late_dropped"] + s["stale_dropped"] + s["rollout_dropped"]
            + s["queue_dropped"] + s["samples_waiting"])


def batch(ids: list[int], version: int = 0) -> Any:
    return make_sample(np.asarray(ids), batched=True, version=version)


# -- 1. every key from construction ---------------------------------------------------------------------------
@pytest.mark.parametrize("semantics", ["queue", "replay", "prioritized", "on_policy"])
def test_stats_has_every_documented_key_before_the_first_put(closing, semantics: str) -> None:
    extra: dict[str, Any] = {"num_minibatches": 2} if semantics == "on_policy" else {"batch_size": 2}
    b = closing(semantics=semantics, capacity=16, **extra)
    s = b.stats()
    missing = [k for k in KEYS if k not in s]
    assert not missing, f"stats() before the first put has no {missing}: {s}"
    assert all(s[k] == 0 for k in KEYS), s
    b.put_batch(batch([0, 1], version=0))
    b.flush()
    after = b.stats()
    assert set(after) == set(s), f"the first put changed stats()'s keys: {set(after) ^ set(s)}"
    assert after["samples_put"] == 2 and after["qsize"] == b.qsize() == 2


# -- 2. rollout_dropped does not overlap with what was delivered ----------------------------------------------
def test_rollout_dropped_counts_only_samples_never_handed_out(closing) -> None:
    b = closing(semantics="on_policy", capacity=32, num_minibatches=2, num_epochs=2, max_staleness=0, prefetch=0,
                seed=0)
    b.put_batch(batch(list(range(8)), version=0))
    b.seal()
    first = entry_ids(b.get()).tolist()  # epoch 0, minibatch 0: 4 samples handed out
    second = entry_ids(b.get()).tolist()  # epoch 0, minibatch 1: the other 4
    third = entry_ids(b.get()).tolist()  # epoch 1, minibatch 0: 4 of the same samples again
    assert sorted(first + second) == list(range(8)) and set(third) <= set(range(8))
    b.put_batch(batch(list(range(8, 16)), version=0))
    b.seal()
    b.set_policy_version(1)  # both rollouts are too stale now
    with pytest.raises(EmptyBufferError):
        b.get()
    s = b.stats()
    assert s["samples_delivered"] == 8, s
    assert s["rollout_dropped"] == 8, (f"rollout_dropped={s['rollout_dropped']}: the first rollout's 8 samples were "
                                       f"all delivered before the drop, only the second's 8 were never handed out")
    assert accounted(s) == s["samples_put"] == 16, s


def wait_until_prepared(b: ConduitBuffer) -> None:
    """Until the assembler thread holds the next entry (it prepares one after each get with prefetch=1)."""
    deadline = time.monotonic() + JOIN_S
    while not b._a._ready and time.monotonic() < deadline:
        time.sleep(0.002)
    assert b._a._ready, "the assembler did not prepare the next minibatch"


@pytest.mark.parametrize("epochs_before", [0, 1])
def test_a_stale_prepared_minibatch_and_the_rest_of_its_rollout_are_counted_once(closing, epochs_before: int) -> None:
    """A minibatch assembled ahead goes stale: its samples count in stale_dropped only if they were never handed
    out (first epoch), and the rest of the rollout in rollout_dropped, never both."""
    b = closing(semantics="on_policy", capacity=32, num_minibatches=4, num_epochs=2, max_staleness=0, prefetch=1,
                seed=0)
    b.put_batch(batch(list(range(8)), version=0))
    b.seal()
    for _ in range(4 * epochs_before + 1):  # (epochs_before=1: the whole first epoch, then one of the second)
        assert len(entry_ids(b.get())) == 2
    wait_until_prepared(b)
    b.set_policy_version(1)
    with pytest.raises(EmptyBufferError):
        b.get()
    s = b.stats()
    if epochs_before:
        assert (s["samples_delivered"], s["stale_dropped"], s["rollout_dropped"]) == (8, 0, 0), s
    else:
        assert (s["samples_delivered"], s["stale_dropped"], s["rollout_dropped"]) == (2, 2, 4), s
    assert accounted(s) == s["samples_put"] == 8 and s["samples_waiting"] == 0, s


# -- 2. the identity over random sequences --------------------------------------------------------------------
def check(b: ConduitBuffer, accepted: int, handed: set[int], step: str) -> None:
    b.flush()  # (no background storing runs now)
    s = b.stats()
    assert s["samples_put"] + s["samples_held"] == accepted, f"after {step}: {accepted} accepted, {s}"
    assert s["samples_delivered"] == len(handed), f"after {step}: {len(handed)} distinct samples handed out, {s}"
    assert accounted(s) == s["samples_put"], f"after {step}: {s['samples_put'] - accounted(s)} unaccounted, {s}"
    assert s["qsize"] == b.qsize(), f"after {step}: stats()['qsize']={s['qsize']}, qsize()={b.qsize()}"


def on_policy_config(rng: random.Random) -> dict[str, Any]:
    cfg: dict[str, Any] = dict(semantics="on_policy", num_minibatches=rng.choice([1, 2, 3]),
                               num_epochs=rng.choice([1, 2, 3]), max_staleness=rng.choice([0, 1]),
                               seed=rng.randrange(9))
    if rng.random() < 0.5:  # puts may not fit: kept (one thread puts and gets here, so a waiting put would hang)
        cfg.update(capacity=12, on_full="keep", prefetch=0)
    else:
        cfg.update(capacity=4096, prefetch=rng.choice([0, 1, 2]))
    if rng.random() < 0.5:
        cfg["rollout_size"] = rng.choice([3, 5, 6])
    return cfg


@pytest.mark.parametrize("seed", range(12))
def test_on_policy_counts_add_up_after_every_step_of_a_random_sequence(closing, seed: int) -> None:
    rng = random.Random(seed)
    cfg = on_policy_config(rng)
    b = closing(**cfg)
    accepted, next_id, version = 0, 0, 0
    handed: set[int] = set()
    for step in range(60):
        op = rng.choices(["put", "seal", "get", "version"], weights=[5, 2, 5, 1])[0]
        if op == "put":
            k = rng.randint(1, 4)
            v = max(0, version - rng.choice([0, 0, 0, 1]))  # sometimes a late one (older than the newest rollout)
            try:
                b.put_batch(batch(list(range(next_id, next_id + k)), version=v))
                accepted += k
            except CapacityError as e:  # (the open rollout fills a small capacity: the put says what it took)
                accepted += getattr(e, "samples_stored", 0)
            next_id += k
        elif op == "seal":
            b.seal()
        elif op == "get":
            if not b.empty():
                handed.update(entry_ids(b.get()).tolist())
        else:
            version += 1
            b.set_policy_version(version)
        check(b, accepted, handed, f"step {step} ({op}) of {cfg}")


@pytest.mark.parametrize("seed", range(6))
def test_queue_counts_add_up_after_every_step_of_a_random_sequence(closing, seed: int) -> None:
    rng = random.Random(100 + seed)
    cfg = dict(semantics="queue", batch_size=rng.choice([2, 3]), reuses=rng.choice([1, 2]), capacity=8,
               prefetch=rng.choice([0, 1]))
    b = closing(**cfg)
    accepted, next_id = 0, 0
    handed: set[int] = set()
    for step in range(60):
        if rng.random() < 0.55:
            k = rng.randint(1, 5)
            b.put_batch(batch(list(range(next_id, next_id + k))))
            next_id += k
            accepted += k
        elif not b.empty():
            handed.update(entry_ids(b.get()).tolist())
        check(b, accepted, handed, f"step {step} of {cfg}")


# -- 3. one consistent view while threads put and get ---------------------------------------------------------
@pytest.mark.parametrize("semantics", ["on_policy", "queue"])
def test_every_stats_snapshot_taken_during_concurrent_puts_and_gets_adds_up(closing, semantics: str) -> None:
    if semantics == "on_policy":
        b = closing(semantics="on_policy", capacity=64, rollout_size=8, num_minibatches=2, num_epochs=2,
                    max_staleness=1, prefetch=1)
    else:
        b = closing(semantics="queue", capacity=16, batch_size=4, reuses=2, prefetch=1)
    total = 400
    done = threading.Event()
    watching = threading.Event()  # the monitor took its first snapshot: the puts start only then
    errors: list[BaseException] = []
    snapshots: list[dict[str, Any]] = []
    handed: set[int] = set()

    def producer() -> None:
        try:
            assert watching.wait(JOIN_S), "the monitor thread never took a snapshot"
            for i in range(0, total, 4):
                b.put_batch(batch(list(range(i, i + 4)), version=i // 40))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            done.set()

    def trainer() -> None:
        try:
            step = 0
            while not done.is_set() or not b.empty():
                if not b.empty():
                    handed.update(entry_ids(b.get()).tolist())
                    step += 1
                    if semantics == "on_policy" and step % 5 == 0:
                        b.set_policy_version(step // 5)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def monitor() -> None:
        try:
            while not done.is_set():
                snapshots.append(b.stats())
                watching.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            watching.set()

    threads = [threading.Thread(target=f) for f in (producer, trainer, monitor)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, errors
    b.flush()
    snapshots.append(b.stats())
    assert len(snapshots) > 1
    bad = [s for s in snapshots if accounted(s) != s["samples_put"]]
    assert not bad, f"{len(bad)} of {len(snapshots)} snapshots did not add up, e.g. {bad[0]}"
    final = snapshots[-1]
    assert final["samples_put"] + final["samples_held"] == total, final
    assert final["samples_delivered"] == len(handed), f"{len(handed)} distinct samples were handed out: {final}"
    assert final["qsize"] == b.qsize(), final
