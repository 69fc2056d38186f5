"""The SRL adapter: empty() and get() agree (reuses, eviction, stale rollouts), typed refusals, batch sizes."""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest
from conduit import ConfigurationError, EmptyBufferError, PriorityError, SchemaError
from conduit_srl import ConduitBuffer, StreamPolicy
from conduit_srl.testing import entry_ids, make_sample


# -- queue: a reused batch that eviction took -----------------------------------------------------------
def test_queue_empty_is_true_when_eviction_abandoned_the_reused_batch(closing) -> None:
    b = closing(batch_size=3, capacity=4, reuses=2, prefetch=0, overlap=False)
    for i in range(3):
        b.put(make_sample([i]))
    first = b.get()
    assert entry_ids(first).tolist() == [0, 1, 2] and first.reuses_left == 1
    b.put(make_sample([3]))
    b.put(make_sample([4]))  # evicts sample 0: the batch's second delivery is abandoned
    b.flush()
    assert b.stats()["queue_abandoned"] == 1
    # only 2 new samples wait and a batch needs 3: empty() must say so, since get() cannot deliver
    assert b.empty(), "empty() is False although get() has nothing to deliver"
    with pytest.raises(EmptyBufferError):
        b.get()
    b.put(make_sample([5]))
    assert not b.empty()
    assert entry_ids(b.get()).tolist() == [3, 4, 5]



def test_queue_empty_counts_the_eviction_by_a_put_still_on_its_way(closing) -> None:
    # g_ing=2 stores puts in pairs, so a single put stays on its way until the next put or flush
    b = closing(batch_size=3, capacity=3, reuses=2, prefetch=0, overlap=False, g_ing=2)
    for i in range(3):
        b.put(make_sample([i]))
    assert entry_ids(b.get()).tolist() == [0, 1, 2]
    b.put(make_sample([3]))  # once stored, it evicts sample 0 and the batch's second delivery is abandoned
    if not b.empty():  # SRL's training thread; the put lands before get() runs
        b.flush()
        b.get()  # must not raise after empty() said False
    assert b.stats()["queue_abandoned"] == 1


@pytest.mark.parametrize("overlap", [True, False])
def test_queue_get_delivers_the_reuse_empty_reported_when_a_put_on_another_thread_evicts_it(closing,
                                                                                          overlap: bool) -> None:
    # SRL's training thread calls empty() then get() while its main thread puts: a put landing between the two
    # that evicted the batch owed a reuse made the get() raise EmptyBufferError, which stops SRL's training thread
    b = closing(batch_size=2, capacity=2, reuses=2, prefetch=0, overlap=overlap)
    b.put(make_sample([0]))
    b.put(make_sample([1]))
    assert entry_ids(b.get()).tolist() == [0, 1]
    assert not b.empty()  # the batch's second delivery is waiting
    main = threading.Thread(target=b.put, args=(make_sample([2]),))  # evicts sample 0
    main.start()
    main.join()
    again = b.get()  # before the fix: EmptyBufferError ("1 new samples wait, a batch needs 2")
    assert entry_ids(again).tolist() == [0, 1] and again.reuses == 1 and again.reuses_left == 0
    b.put(make_sample([3]))
    assert entry_ids(b.get()).tolist() == [2, 3]
    s = b.stats()
    assert (s["queue_abandoned"], s["queue_dropped"], s["samples_delivered"]) == (0, 0, 4), s


def test_queue_refuses_g_del_above_one_instead_of_losing_samples() -> None:
    # a chunk of g_del batches cannot be selected from fewer waiting batches: the first one was lost
    with pytest.raises(ConfigurationError, match="g_del"):
        ConduitBuffer(batch_size=1, capacity=8, g_del=2)
    b = ConduitBuffer(semantics="replay", batch_size=1, capacity=8, g_del=2)  # replay draws can always fill a chunk
    try:
        b.put(make_sample([0]))
        assert entry_ids(b.get()).tolist() == [0]
    finally:
        b.close()



def test_queue_checkpoint_forgets_the_reuse_prepared_ahead_that_it_dropped(closing) -> None:
    b = closing(batch_size=3, capacity=4, reuses=2, prefetch=0, overlap=True)
    for i in range(3):
        b.put(make_sample([i]))
    assert entry_ids(b.get()).tolist() == [0, 1, 2]  # Conduit prepares the second delivery ahead
    pickle.dumps(b)  # a checkpoint drops what was prepared ahead
    b.put(make_sample([3]))
    b.put(make_sample([4]))  # evicts sample 0: the second delivery is abandoned
    b.flush()
    assert b.empty(), "empty() still counts a prepared reuse that the checkpoint dropped"
    b.put(make_sample([5]))
    assert entry_ids(b.get()).tolist() == [3, 4, 5]


# -- on-policy: empty() after a version change made what is pending too stale ---------------------------
@pytest.mark.parametrize("prefetch", [0, 1])
def test_on_policy_empty_is_true_when_every_pending_rollout_is_stale(closing, prefetch: int) -> None:
    b = closing(semantics="on_policy", capacity=8, num_minibatches=4, rollout_size=4, max_staleness=0,
                prefetch=prefetch)
    for i in range(4):
        b.put(make_sample([i], version=0))
    assert len(entry_ids(b.get())) == 1  # first minibatch of the version-0 rollout
    time.sleep(0.05)  # let the assembler prepare the next minibatch (prefetch=1)
    b.set_policy_version(1)  # the rest of the version-0 rollout is now too stale
    # SRL's training thread does `if not buffer.empty(): buffer.get()`: empty() must not promise a delivery
    assert b.empty(), "empty() is False although every pending rollout is too stale to deliver"
    with pytest.raises(EmptyBufferError):
        b.get()
    for i in range(4, 8):
        b.put(make_sample([i], version=1))
    assert not b.empty()
    assert set(entry_ids(b.get()).tolist()) <= {4, 5, 6, 7}


def test_on_policy_stale_rollout_ahead_of_a_fresh_one_does_not_hide_it(closing) -> None:
    b = closing(semantics="on_policy", capacity=16, num_minibatches=1, rollout_size=2, max_staleness=0)
    for i in range(2):
        b.put(make_sample([i], version=0))
    for i in range(2, 4):
        b.put(make_sample([i], version=1))
    b.set_policy_version(1)
    assert not b.empty()
    assert sorted(entry_ids(b.get()).tolist()) == [2, 3]
    assert b.empty()


# -- prioritized: unreadable priorities get the typed error -------------------------------------------
@pytest.mark.parametrize(("idxes", "priorities"),
                         [(None, None), ([0, 1], ["high", "low"]), ([[0], [1, 2]], [1.0, 2.0])])
def test_update_priorities_with_unreadable_input_raises_priority_error(closing, idxes: object,
                                                                        priorities: object) -> None:
    b = closing(semantics="prioritized", batch_size=2, capacity=4)
    for i in range(3):
        b.put(make_sample([i]))
    b.get()
    with pytest.raises(PriorityError, match="sampling_indices"):
        b.update_priorities(idxes, priorities)
    assert b.update_priorities([0, 1], [2.0, 3.0]) == 2  # the buffer still takes good updates


# -- records: empty axes are refused by field name ------------------------------------------------------
@pytest.mark.parametrize("batched", [False, True])
def test_first_sample_with_zero_time_steps_raises_schema_error_naming_a_field(closing, batched: bool) -> None:
    b = closing(batch_size=1, capacity=4, batched_puts=batched)
    with pytest.raises(SchemaError, match="empty time or per-step axis"):
        b.put(make_sample([0], time_steps=0, batched=batched))
    assert b.edp is None  # nothing was fixed by the refused sample
    b.put(make_sample([1], batched=batched))
    assert entry_ids(b.get()).tolist() == [1]


def test_first_sample_with_an_empty_per_step_axis_raises_schema_error(closing) -> None:
    b = closing(batch_size=1, capacity=4)
    with pytest.raises(SchemaError, match="'obs'"):
        b.put(make_sample([0], dim=0))
    b.put(make_sample([1]))
    assert entry_ids(b.get()).tolist() == [1]


# -- replay: get(batch_size) is for that call only --------------------------------------------------------
@pytest.mark.parametrize("semantics", ["replay", "prioritized"])
def test_get_with_a_batch_size_does_not_change_the_configured_one(closing, semantics: str) -> None:
    b = closing(semantics=semantics, batch_size=2, capacity=8)
    for i in range(4):
        b.put(make_sample([i]))
    assert len(entry_ids(b.get())) == 2
    assert len(entry_ids(b.get(5))) == 5
    assert len(entry_ids(b.get())) == 2, "get() after get(5) must draw the configured batch_size again"
    assert len(entry_ids(b.get(2.0))) == 2  # the configured size, spelled as a float, is still accepted


def test_on_policy_stale_rollouts_filling_storage_are_dropped_so_a_waiting_put_proceeds(closing) -> None:
    b = closing(semantics="on_policy", capacity=8, num_minibatches=1, rollout_size=4, max_staleness=0)
    for i in range(8):
        b.put(make_sample([i], version=0))  # two sealed rollouts fill the storage
    b.set_policy_version(1)  # both are too stale now
    done = threading.Event()
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            b.put(make_sample([8], version=1))  # waits for room
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        done.set()

    threading.Thread(target=producer, daemon=True).start()
    deadline = time.monotonic() + 30  # (a wait for the producer thread, only reached when its put never returns)
    while not done.is_set() and time.monotonic() < deadline:  # SRL's training loop
        if not b.empty():
            b.get()
        time.sleep(0.005)
    assert done.is_set(), "put() still waits for room held by stale rollouts that no get() will ever drop"
    assert not errors, errors
    assert b.stats()["rollout_dropped"] == 8
    b.seal()
    assert entry_ids(b.get()).tolist() == [8]



# -- streams: a bad max_delay_s gets the typed error ------------------------------------------------------
@pytest.mark.parametrize("bad", [None, "0.1", True])
def test_stream_policy_max_delay_of_the_wrong_type_raises_configuration_error(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="max_delay_s"):
        StreamPolicy(coalesce=2, max_delay_s=bad)  # type: ignore[arg-type]



# -- config: drop_fields given as one name ----------------------------------------------------------------
def test_drop_fields_given_as_one_string_drops_that_field(closing) -> None:
    b = closing(batch_size=1, capacity=4, drop_fields="tag")
    assert b.config.drop_fields == ("tag",)
    s = make_sample([0])
    b.put(type(s)(**dict(s.items()), tag=np.array(["x"] * 4)))  # non-numeric: stored only if not dropped
    assert b.get().sample.tag is None


def test_drop_fields_none_drops_nothing(closing) -> None:
    """``drop_fields=None`` raised a raw TypeError; it means: keep every field."""
    b = closing(batch_size=1, capacity=4, drop_fields=None)
    assert b.config.drop_fields == ()
    b.put(make_sample([0]))
    assert b.get().sample is not None
