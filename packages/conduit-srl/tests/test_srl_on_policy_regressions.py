"""The SRL adapter: on-policy late samples, room and staleness; checkpoints; qsize; dtypes; config."""

from __future__ import annotations

import copy
import pickle
import sys
import threading
import time

import numpy as np
import pytest
from conduit import ConfigurationError, SchemaError, StaleExperienceError
from conduit.testing.lifecycle import eventually
from conduit_srl import ConduitBuffer
from conduit_srl.testing import Record, entry_ids, make_sample


def _wait_prepared(b: ConduitBuffer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not b._a._ready and time.monotonic() < deadline:
        time.sleep(0.005)
    assert b._a._ready, "the assembler did not prepare the next entry"


# -- on-policy: a sample older than a rollout sealed with seal() is late, as before the seal ----------------
def test_late_sample_after_explicit_seal_is_dropped_and_counted(closing) -> None:
    b = closing(semantics="on_policy", capacity=16, num_minibatches=1)
    b.put(make_sample([0], version=1))
    b.put(make_sample([1], version=1))
    b.seal()
    b.put(make_sample([2], version=0))  # an actor's late sample: was a ConfigurationError from Conduit's core
    assert b.stats()["late_dropped"] == 1, b.stats()
    assert sorted(entry_ids(b.get()).tolist()) == [0, 1]
    b.put(make_sample([3], version=1))  # the same version after a seal starts the next rollout
    b.seal()
    assert entry_ids(b.get()).tolist() == [3]


def test_late_sample_after_explicit_seal_raises_stale_and_stores_nothing(closing) -> None:
    b = closing(semantics="on_policy", capacity=16, num_minibatches=1, on_stale="raise")
    b.put(make_sample([0], version=1))
    b.seal()
    with pytest.raises(StaleExperienceError, match="version 0"):
        b.put(make_sample([1], version=0))
    b.flush()
    assert len(b) == 1 and b.stats()["late_dropped"] == 0
    assert entry_ids(b.get()).tolist() == [0]
    b.put(make_sample([2], version=2))  # the refused put left nothing behind that refuses the next one
    b.seal()
    assert entry_ids(b.get()).tolist() == [2]


# -- on-policy: an entry assembled ahead reports its staleness as of its delivery ---------------------------
def test_prepared_on_policy_entry_reports_staleness_at_delivery(closing) -> None:
    b = closing(semantics="on_policy", capacity=16, num_minibatches=2, max_staleness=1, prefetch=1)
    b.put_batch(make_sample(list(range(4)), batched=True, version=0))
    b.seal()
    first = b.get()
    assert first.info.staleness == 0
    _wait_prepared(b)
    b.set_policy_version(1)  # at the boundary: still fresh enough to deliver
    second = b.get()
    assert second.info.version == 0
    assert second.info.staleness == 1, f"delivered at policy 1, reported staleness {second.info.staleness}"


# -- records: a dtype torch has but Conduit's storage cannot gather is a SchemaError naming the field -------
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_unsigned_wide_field_is_a_schema_error_naming_it_and_fixes_nothing(closing, dtype) -> None:
    b = closing(batch_size=1, capacity=4)
    fields = dict(make_sample([0]).items())
    with pytest.raises(SchemaError, match="'counts'.*drop_fields"):
        b.put(Record(**fields, counts=np.zeros((4, 2), dtype=dtype)))
    assert b.edp is None, "a refused first put fixed the layout"
    b.put(make_sample([1]))  # the layout is still free: a storable sample is the first one
    assert entry_ids(b.get()).tolist() == [1]


# -- checkpoint: the counters saved are those of the contents saved ----------------------------------------
def test_copied_buffer_does_not_share_counters_with_the_original(closing) -> None:
    b = closing(batch_size=1, capacity=8)
    b.put(make_sample([0]))
    b.put(make_sample([1]))
    c = copy.copy(b)  # through __reduce__, as pickle, without the byte round trip
    try:
        b.put(make_sample([2]))
        b.get()
        assert c.stats()["samples_put"] == 2 and c.stats()["entries_delivered"] == 0, c.stats()
        assert len(c) == 2
    finally:
        c.close()


def test_checkpoint_taken_while_puts_run_counts_exactly_the_samples_it_holds(closing) -> None:
    b = closing(batch_size=1, capacity=100_000)
    b.put(make_sample([0]))
    stop = threading.Event()
    errors: list[BaseException] = []

    def putter() -> None:
        i = 1
        try:
            while not stop.is_set():
                b.put(make_sample([i]))
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so a checkpoint lands between a put's store and its count
    t = threading.Thread(target=putter)
    t.start()
    mismatches = []
    try:
        for _ in range(40):
            restored = pickle.loads(pickle.dumps(b))
            try:
                if restored.stats()["samples_put"] != len(restored):
                    mismatches.append((restored.stats()["samples_put"], len(restored)))
            finally:
                restored.close()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert not errors, errors
    assert not mismatches, f"(samples_put, samples held) of checkpoints: {mismatches[:5]}"


# -- on-policy room: a put that completes a rollout and starts the next -------------------------------------
def test_put_crossing_the_end_of_a_full_capacity_rollout_waits_for_its_delivery(closing) -> None:
    b = closing(semantics="on_policy", capacity=4, rollout_size=4, num_minibatches=1)
    for i in range(3):
        b.put(make_sample([i]))
    delivered: list[list[int]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def training() -> None:  # SRL's training thread: empty()/get() while the main thread puts
        try:
            while not done.is_set() and not delivered:
                if not b.empty():
                    delivered.append(sorted(entry_ids(b.get()).tolist()))
                time.sleep(0.005)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=training)
    t.start()
    try:
        # sample 3 completes the rollout (which fills the capacity), sample 4 starts the next one
        b.put_batch(make_sample([3, 4], batched=True))
    finally:
        done.set()
        t.join()
    assert not errors, errors
    assert delivered == [[0, 1, 2, 3]]
    b.flush()
    assert len(b) == 1 and b.stats()["samples_put"] == 5, (len(b), b.stats())


def test_rollout_size_larger_than_capacity_is_refused_when_the_buffer_is_built() -> None:
    with pytest.raises(ConfigurationError, match="rollout_size 8 is larger than capacity 4"):
        ConduitBuffer(semantics="on_policy", capacity=4, rollout_size=8, num_minibatches=1)


@pytest.mark.parametrize("args", [
    dict(semantics="on_policy", capacity=4),  # neither num_minibatches nor minibatch_size
    dict(semantics="on_policy", capacity=4, num_minibatches=0),
    dict(semantics="on_policy", capacity=4, num_minibatches=1, num_epochs=0),
    dict(semantics="on_policy", capacity=4, num_minibatches=1, max_staleness=-1),
    dict(semantics="prioritized", batch_size=2, capacity=4, alpha=-1.0),
])
def test_semantics_arguments_are_refused_when_the_buffer_is_built(args) -> None:
    with pytest.raises(ConfigurationError):
        ConduitBuffer(**args).close()  # (was built, and refused at the first put)


# -- queue qsize: samples a prepared delivery holds count even once eviction took them from storage ---------
def _await_prepared(b: ConduitBuffer) -> None:
    """Wait until Conduit's scheduler has prepared the next batch ahead (selected, not yet confirmed)."""
    fifo = b._a._fifo()
    assert eventually(lambda: fifo._selected > fifo._confirmed, timeout=30), \
        "Conduit's scheduler did not prepare the next batch"


def test_a_prepared_batch_whose_samples_were_evicted_is_dropped_as_without_prefetch(closing) -> None:
    """Prefetch never changes what a queue delivers: a batch prepared ahead whose samples eviction took is
    dropped (counted), as a queue that did not prepare ahead drops them; qsize() does not count it."""
    b = closing(batch_size=1, capacity=2, prefetch=0, overlap=True)  # (Conduit prepares ahead)
    b.put(make_sample([0]))
    b.put(make_sample([1]))
    b.flush()  # (else the prefetch after the get may look before 1 is stored, find no batch, and prepare nothing)
    assert entry_ids(b.get()).tolist() == [0]
    _await_prepared(b)
    b.put(make_sample([2]))
    b.put(make_sample([3]))  # evicts 1 from storage (the prepared batch held it)
    b.flush()
    q = b.qsize()
    delivered = []
    while not b.empty():
        delivered += entry_ids(b.get()).tolist()
    assert delivered == [2, 3] and b.stats()["queue_dropped"] == 1
    assert q == 2, f"qsize() said {q} with 2 samples still to deliver"


# -- on-policy: the assembler reads the rollouts under Conduit's lock (its prefetch peeks under it) ---------
def test_assembler_always_prepares_the_next_minibatch_of_the_rollout() -> None:
    starved = 0
    for _ in range(200):  # the race was hit in about 3% of the runs
        b = ConduitBuffer(semantics="on_policy", capacity=16, num_minibatches=2, prefetch=1)
        try:
            b.put_batch(make_sample(list(range(4)), batched=True))
            b.seal()
            b.get()
            # (a wait for the assembler, not a speed bound: one that stopped never prepares the entry, while a
            # loaded machine may take seconds to run it)
            deadline = time.monotonic() + 30
            while not b._a._ready and time.monotonic() < deadline:
                time.sleep(0.001)
            starved += not b._a._ready
        finally:
            b.close()
    assert starved == 0, f"in {starved} of 200 runs the assembler found nothing to prepare and stopped"


def test_qsize_leaves_out_a_prepared_batch_that_puts_on_their_way_will_evict(closing) -> None:
    b = closing(batch_size=1, capacity=2, prefetch=0, g_ing=3, overlap=True)  # (stored three at a time, ahead)
    b.put(make_sample([0]))
    b.put(make_sample([1]))
    assert entry_ids(b.get()).tolist() == [0]  # (get stores what was put first)
    _await_prepared(b)
    b.put(make_sample([2]))
    b.put(make_sample([3]))  # on their way: storing them evicts 1, which the prepared batch holds
    assert b._a._pending_samples() == 2
    q = b.qsize()
    delivered = []
    while not b.empty():
        delivered += entry_ids(b.get()).tolist()
    assert delivered == [2, 3] and b.stats()["queue_dropped"] == 1
    assert q == 2, f"qsize() said {q} with 2 samples still to deliver"


def test_a_put_refused_before_anything_was_stored_leaves_the_rollout_count_as_it_was(closing, monkeypatch) -> None:
    """A put whose ingestion Conduit refused (e.g. reporting an earlier background write's failure) still
    counted its samples into the open rollout: the rollout was then sealed early, short of rollout_size."""
    b = closing(semantics="on_policy", capacity=16, rollout_size=4, num_minibatches=1)
    b.put_batch(make_sample([0, 1], batched=True))
    edp = b._a.edp
    real = edp.ingest

    def refuse_once(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(edp, "ingest", real)
        raise OSError("an earlier background write failed")

    monkeypatch.setattr(edp, "ingest", refuse_once)
    with pytest.raises(OSError, match="background write"):
        b.put_batch(make_sample([90, 91], batched=True))
    assert b._a._open_count == 2, "the refused samples were counted into the open rollout"
    b.put_batch(make_sample([2, 3], batched=True))  # completes the rollout: 4 samples
    b.put_batch(make_sample([4], batched=True))  # starts the next
    b.flush()
    assert sorted(entry_ids(b.get()).tolist()) == [0, 1, 2, 3]
    assert b.stats()["samples_put"] == 5
