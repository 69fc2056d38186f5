"""The Conduit buffer against SRL's trainer-side contract, semantics by semantics."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    EmptyBufferError,
    PriorityError,
    SchemaError,
    StaleExperienceError,
)
from conduit_srl import ConduitBuffer
from conduit_srl.testing import Record, entry_ids, make_sample


class Sample(Record):
    """A subclass, as SRL's SampleBatch subclasses its record type."""


def sample(i: int, *, t: int = 4, version: int = 0, **extra: object) -> Sample:
    base = make_sample([i], time_steps=t, version=version)
    return Sample(**dict(base.items()), **extra)


def ids_of(b: ConduitBuffer) -> list[int]:
    return entry_ids(b.get()).tolist()


# -- the delivered entry ----------------------------------------------------------------------------
def test_entry_is_a_T_B_record_of_the_put_class_with_owned_host_arrays(closing) -> None:
    b = closing(batch_size=3, capacity=16)
    names = np.array(["policy-a"] * 4)
    for i in range(3):
        b.put(sample(i, version=7, policy_name=names))
    e = b.get()
    s = e.sample
    assert type(s) is Sample and type(s.policy_state) is Record
    assert s.obs.shape == (4, 3, 3) and s.id.shape == (4, 3) and s.policy_state.hx.shape == (4, 3, 2)
    assert s.policy_version_steps.shape == (4, 3, 1) and s.min_of("policy_version_steps") == 7
    assert s.length(0) * s.length(1) == 12
    assert s.info is None and s.policy_name is None  # None stays None; non-numeric policy_name is dropped
    assert np.array_equal(s.reward[:, 1, 0], np.arange(4) + 1.0)  # time order kept per sample
    for a in (s.obs, s.id, s.reward, s.policy_state.hx):
        assert isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable
    assert e.sampling_indices.tolist() == [0, 1, 2] and e.reuses == 0 and e.reuses_left == 0
    assert not torch.from_numpy(s.obs).is_pinned()  # no CUDA here: plain host memory
    s.obs[:] = -1  # the entry owns its memory: storage is not touched


@pytest.mark.gpu
def test_delivered_arrays_are_page_locked_with_cuda(closing) -> None:
    b = closing(batch_size=2, capacity=8)
    b.put(sample(0))
    b.put(sample(1))
    s = b.get().sample
    assert torch.from_numpy(s.obs).is_pinned() and torch.from_numpy(s.policy_state.hx).is_pinned()
    assert torch.from_numpy(s.obs).cuda(non_blocking=True).shape == (4, 2, 3)


def test_pin_memory_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; pinning is allowed")
    with pytest.raises(ConfigurationError, match="CUDA"):
        ConduitBuffer(batch_size=1, pin_memory=True)


# -- queue semantics ----------------------------------------------------------------------------------
def test_queue_batches_in_arrival_order_each_delivered_reuses_times(closing) -> None:
    b = closing(batch_size=2, capacity=32, reuses=3)
    assert b.empty() and b.qsize() == 0
    b.put(sample(0))
    assert b.empty(), "half a batch is not deliverable"
    with pytest.raises(EmptyBufferError):
        b.get()
    for i in range(1, 5):
        b.put(sample(i))
    assert not b.empty() and b.qsize() == 5
    seen = []
    while not b.empty():
        e = b.get()
        seen.append((entry_ids(e).tolist(), e.reuses, e.reuses_left))
    assert seen == [([0, 1], 0, 2), ([0, 1], 1, 1), ([0, 1], 2, 0),
                    ([2, 3], 0, 2), ([2, 3], 1, 1), ([2, 3], 2, 0)]
    assert b.qsize() == 1  # sample 4 waits for a partner


def test_queue_overflow_drops_oldest_undelivered_and_counts_them(closing) -> None:
    b = closing(batch_size=2, capacity=6, prefetch=0)
    for i in range(10):
        b.put(sample(i))
    b.flush()
    got = [ids_of(b) for _ in range(3)]
    assert got == [[4, 5], [6, 7], [8, 9]]  # the newest 6 fit; order kept
    assert b.stats()["queue_dropped"] == 4
    assert b.empty()


def test_queue_checkpoint_loses_and_repeats_nothing(closing) -> None:
    """Conduit discards batches it prepared ahead when a checkpoint is taken; the queue selects them again."""
    b = closing(batch_size=2, capacity=64, reuses=2)
    for i in range(20):
        b.put(sample(i))
    seen = [ids_of(b) for _ in range(3)]
    time.sleep(0.05)  # let both prefetch levels fill
    state = pickle.dumps(b)
    rest = []
    while not b.empty():
        rest.append(ids_of(b))
    restored = pickle.loads(state)
    again = []
    while not restored.empty():
        again.append(ids_of(restored))
    restored.close()
    expected = [[i, i + 1] for i in range(0, 20, 2) for _ in range(2)]
    assert seen + rest == expected
    assert seen + again == expected


# -- put checks ---------------------------------------------------------------------------------------
def test_bad_samples_raise_schema_errors_and_store_nothing(closing) -> None:
    b = closing(batch_size=1, capacity=8)
    b.put(sample(0))
    b.flush()
    bad = [
        sample(1, t=5),  # another T
        Sample(**{**dict(sample(1).items()), "reward": np.zeros((4, 1), np.float64)}),  # dtype
        Sample(**{**dict(sample(1).items()), "obs": np.zeros((4, 4), np.float32)}),  # step shape
        Sample(**{k: v for k, v in sample(1).items() if k != "reward"}),  # field set
        Sample(**{**dict(sample(1).items()), "info": np.zeros((4, 1), np.float32)}),  # None before
        make_sample(np.arange(3), batched=True),  # a batched sample through put
    ]
    for x in bad:
        with pytest.raises(SchemaError):
            b.put(x)
    assert len(b) == 1 and b.stats()["samples_put"] == 1


def test_put_batch_and_batched_puts(closing) -> None:
    b = closing(batch_size=4, capacity=16, batched_puts=True)
    b.put(make_sample(np.arange(3), batched=True))
    b.put_batch(make_sample(np.arange(3, 6), batched=True))
    assert ids_of(b) == [0, 1, 2, 3]
    with pytest.raises(CapacityError):
        b.put(make_sample(np.arange(17), batched=True))


def test_first_sample_must_be_storable(closing) -> None:
    b = closing(batch_size=1)
    with pytest.raises(SchemaError, match="drop_fields"):
        b.put(Sample(obs=np.zeros((2, 3), np.float32), tag=np.array([["x"]] * 2, dtype=object)))
    assert b.edp is None and b.empty()
    c = closing(batch_size=1, drop_fields=("tag",))
    c.put(Sample(obs=np.ones((2, 3), np.float32), tag=np.array([["x"]] * 2, dtype=object)))
    assert c.get().sample.tag is None


def test_configuration_errors_say_what_to_write() -> None:
    with pytest.raises(ConfigurationError, match=r"capacity=\.\.\."):
        ConduitBuffer(batch_size=4, max_size=16)
    with pytest.raises(ConfigurationError, match="warmup="):
        ConduitBuffer(semantics="replay", batch_size=4, capacity=8, warmup_transitions=100)
    with pytest.raises(ConfigurationError, match="batch_size"):
        ConduitBuffer()
    with pytest.raises(ConfigurationError, match="capacity"):
        ConduitBuffer(semantics="replay", batch_size=4)
    with pytest.raises(ConfigurationError, match="semantics"):
        ConduitBuffer(semantics="lifo", batch_size=4)
    with pytest.raises(ConfigurationError, match="prefetch=0"):
        ConduitBuffer(semantics="on_policy", capacity=8, num_minibatches=2, on_stale="raise", prefetch=1)
    with pytest.raises(ConfigurationError, match="larger than capacity"):
        ConduitBuffer(batch_size=8, capacity=4)


def test_closed_buffer_refuses_calls() -> None:
    b = ConduitBuffer(batch_size=1, capacity=4)
    b.put(sample(0))
    b.close()
    with pytest.raises(ConfigurationError, match="closed"):
        b.put(sample(1))
    with pytest.raises(ConfigurationError, match="closed"):
        b.get()
    p = ConduitBuffer(semantics="prioritized", batch_size=1, capacity=4)
    p.put(sample(0))
    entry = p.get()
    p.close()
    with pytest.raises(ConfigurationError, match="closed"):
        p.update_priorities(entry.sampling_indices, [1.0])
    o = ConduitBuffer(semantics="on_policy", capacity=8, num_minibatches=1, prefetch=0)
    o.close()
    for call in (o.seal, lambda: o.set_policy_version(1)):
        with pytest.raises(ConfigurationError, match="closed"):
            call()


# -- replay ---------------------------------------------------------------------------------------------
def test_replay_warmup_reuses_and_batch_size(closing) -> None:
    b = closing(semantics="replay", batch_size=8, capacity=32, warmup=5, seed=1)
    for i in range(4):
        b.put(sample(i))
    assert b.empty()
    b.put(sample(4))
    assert not b.empty()
    draws = [b.get() for _ in range(50)]
    assert all(set(entry_ids(e)) <= set(range(5)) and e.reuses_left == -1 for e in draws)
    assert draws[0].reuses == 0 and draws[-1].reuses > 50 * 8 / 5 - 20  # ~ draws so far per sample
    assert len(entry_ids(b.get(3))) == 3  # another size: prepared draws are redrawn


def test_prioritized_weights_metadata_and_priority_checks(closing) -> None:
    b = closing(semantics="prioritized", batch_size=16, capacity=8, alpha=1.0, beta=0.5, seed=2)
    assert b.priority_staleness >= 0
    for i in range(8):
        b.put(sample(i))
    e = b.get()
    assert e.weights is not None and np.array_equal(e.sample.metadata["sampling_weight"], e.weights)
    with pytest.raises(PriorityError):
        b.update_priorities(e.sampling_indices, np.full(16, np.nan))
    with pytest.raises(PriorityError):
        b.update_priorities(e.sampling_indices[:3], np.ones(2))
    prio = np.where(entry_ids(e) == 3, 1000.0, 1e-3)
    assert b.update_priorities(e.sampling_indices, prio) == 16
    for _ in range(b.priority_staleness):
        b.get()
    later = np.concatenate([entry_ids(b.get()) for _ in range(5)])
    assert (later == 3).mean() > 0.9, "a draw after the declared staleness must follow the new priorities"
    q = closing(batch_size=1, capacity=4)
    q.put(sample(0))
    with pytest.raises(ConfigurationError):
        q.update_priorities(np.zeros(1, np.int64), np.ones(1))


# -- on-policy -----------------------------------------------------------------------------------------
def on_policy(closing, **kw: object) -> ConduitBuffer:
    args = dict(semantics="on_policy", capacity=64, num_minibatches=2, num_epochs=2, seed=0)
    args.update(kw)
    return closing(**args)


def test_on_policy_rollouts_epochs_and_versions(closing) -> None:
    b = on_policy(closing, rollout_size=4)
    for i in range(4):
        b.put(sample(i, version=3))
    mbs = []
    while not b.empty():
        e = b.get()
        assert e.sample.min_of("policy_version_steps") == e.sample.max_of("policy_version_steps") == 3
        mbs.append((sorted(entry_ids(e).tolist()), e.reuses, e.reuses_left))
    assert len(mbs) == 4 and [m[1] for m in mbs] == [0, 0, 1, 1] and [m[2] for m in mbs] == [1, 1, 0, 0]
    for epoch in (0, 1):
        assert sorted(sum((m[0] for m in mbs if m[1] == epoch), [])) == [0, 1, 2, 3]


def test_on_policy_late_samples_are_dropped_or_refused(closing) -> None:
    b = on_policy(closing)
    b.put(sample(0, version=5))
    b.put(sample(1, version=4))  # older than the open rollout: dropped, counted
    assert b.stats()["late_dropped"] == 1
    r = on_policy(closing, on_stale="raise")
    r.put(sample(0, version=5))
    with pytest.raises(StaleExperienceError):
        r.put_batch(Sample(**dict(make_sample(np.arange(1, 3), batched=True, version=4).items())))
    r.flush()
    assert len(r) == 1
    with pytest.raises(SchemaError, match="no policy version"):
        r.put(sample(9, version=-1))


def test_on_policy_needs_the_version_field_and_room(closing) -> None:
    b = on_policy(closing)
    with pytest.raises(SchemaError, match="version_field"):
        b.put(Sample(obs=np.zeros((2, 3), np.float32)))
    small = on_policy(closing, capacity=4)
    small.put_batch(make_sample(np.arange(4), batched=True))
    with pytest.raises(CapacityError, match="seal"):
        small.put(make_sample([4]))  # the open rollout fills the buffer and nothing can be delivered


def test_on_policy_entry_prepared_ahead_is_dropped_when_the_version_moves(closing) -> None:
    b = on_policy(closing, num_minibatches=4, num_epochs=1, max_staleness=0)
    b.put_batch(make_sample(np.arange(8), batched=True, version=0))
    b.seal()
    first = b.get()
    assert len(entry_ids(first)) == 2
    deadline = time.monotonic() + 30  # (a wait for the assembler thread, only reached when it never prepares)
    while b.qsize() and not b._a._ready and time.monotonic() < deadline:  # the next minibatch is assembled
        time.sleep(0.005)
    assert b._a._ready, "the assembler did not prepare the next minibatch"
    b.set_policy_version(1)
    with pytest.raises(EmptyBufferError):
        b.get()
    stats = b.stats()
    # the prepared minibatch counts as stale, the rest of the rollout as dropped, each sample once:
    # 2 delivered + 2 stale + 4 dropped = the 8 put
    assert stats["samples_delivered"] == 2 and stats["stale_dropped"] == 2 and stats["rollout_dropped"] == 4, stats


def test_on_policy_pickle_mid_rollout_continues_identically(closing) -> None:
    b = on_policy(closing, num_minibatches=3, num_epochs=2)
    b.put_batch(make_sample(np.arange(9), batched=True, version=1))
    b.seal()
    head = [sorted(entry_ids(b.get()).tolist()) for _ in range(2)]
    time.sleep(0.05)
    restored = pickle.loads(pickle.dumps(b))
    tail = [sorted(entry_ids(b.get()).tolist()) for _ in range(4)]
    again = [sorted(entry_ids(restored.get()).tolist()) for _ in range(4)]
    restored.close()
    assert again == tail and len(head) == 2
    assert b.empty()
