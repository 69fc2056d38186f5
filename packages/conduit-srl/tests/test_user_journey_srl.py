"""An SRL user's on-policy journeys: rollouts closed by a policy-version change when storage is full.

SRL's actors stamp each sample with the policy version that produced it, and without ``rollout_size`` a
Conduit on-policy buffer closes a rollout when samples of a newer version arrive. The configuration allows
``capacity`` of one rollout's worth; then the rollout of version ``v`` fills storage and the first put of
version ``v + 1`` must seal it (so it can be delivered) and wait, be kept or be refused with
``BufferFullError`` as ``on_full`` says, not fail with "nothing can be delivered".
"""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
from conduit.testing.lifecycle import eventually
from conduit_srl import BufferFullError
from conduit_srl.testing import make_sample
from conduit_srl.testing.driver import SrlDriver


def _ids(entry: object) -> list[int]:
    return np.asarray(entry.sample.id)[0].tolist()  # type: ignore[attr-defined]


def test_version_change_seals_a_full_rollout_through_the_driver(closing) -> None:
    """One actor over ZMQ, versions 0..3 in blocks of 10, capacity 10: each rollout fills storage, and the next
    version's first sample seals it and waits (``on_full="wait"``) for the training thread to deliver it."""
    block = 10
    b = closing(semantics="on_policy", capacity=block, num_minibatches=2, num_epochs=2)
    r = SrlDriver(b, actors=1, samples_per_actor=4 * block, per_poll=3,
                  make_sample_fn=lambda i, v: make_sample([i], version=i // block)).run(timeout_s=60)
    assert r.received == 4 * block
    counts = Counter(r.delivered_ids.tolist())
    # the rollouts of versions 0..2 were sealed by the next version; version 3's is still open
    assert set(counts) == set(range(3 * block)) and set(counts.values()) == {2}, counts
    for d in r.deliveries:
        assert len({int(i) // block for i in d.ids}) == 1, f"a minibatch mixes policy versions: {d.ids}"
    stats = b.stats()
    assert stats["samples_put"] == 4 * block and stats["samples_waiting"] == block, stats


@pytest.mark.parametrize("mode", ["wait", "keep", "raise"])
def test_new_version_put_into_full_storage_seals_the_open_rollout(closing, mode: str) -> None:
    """8 samples of version 0 in capacity 10, then a coalesced put of 3 samples of version 1 (an SRL stream
    carrying ``[T, 3, ...]``): version 0's rollout is complete and becomes deliverable; the new samples wait,
    are kept, or are refused with BufferFullError (put again after the gets), and nothing is lost."""
    b = closing(semantics="on_policy", capacity=10, num_minibatches=2, on_full=mode)
    for i in range(8):
        b.put(make_sample([i], version=0))
    new = make_sample([100, 101, 102], version=1, batched=True)
    outcome: dict[str, object] = {}

    def put_new() -> None:
        try:
            b.put_batch(new)
            outcome["returned"] = True
        except BaseException as e:  # noqa: BLE001 - asserted below
            outcome["error"] = e

    putter = threading.Thread(target=put_new, daemon=True)
    putter.start()
    if mode == "wait":  # it waits for the training thread's deliveries (main thread here)
        assert eventually(lambda: not b.empty(), timeout=30.0), (outcome, b.stats())
        assert putter.is_alive(), outcome
    else:  # never waits
        putter.join(timeout=30.0)
        assert not putter.is_alive(), "the put waited for a delivery"
    if mode == "raise":
        err = outcome.get("error")
        assert isinstance(err, BufferFullError), outcome
        assert getattr(err, "samples_stored", None) == 0 and err.sample is new
    else:
        assert "error" not in outcome, outcome
    got: list[list[int]] = []
    while not b.empty():
        got.append(_ids(b.get()))
    assert sorted(i for g in got for i in g) == list(range(8)), got
    if mode == "raise":
        b.put_batch(new)  # room was freed: the host puts the refused sample again
    putter.join(timeout=30.0)
    assert not putter.is_alive(), "the waiting put never returned after the rollout was delivered"
    b.flush()
    stats = b.stats()
    assert stats["samples_put"] == 11 and stats["samples_held"] == 0, stats
    assert stats["samples_delivered"] == 8 and stats["samples_waiting"] == 3, stats
    b.seal()
    rest = []
    while not b.empty():
        rest += _ids(b.get())
    assert sorted(rest) == [100, 101, 102]


def test_put_spanning_a_version_change_stores_the_old_rollouts_end_first(closing) -> None:
    """One put ``[v0, v0, v1]`` onto 8 samples of version 0 in capacity 10 (``on_full="raise"``): the two version-0
    samples complete that rollout and are stored, the rollout is sealed, and only the version-1 sample is refused
    (``samples_stored == 2``)."""
    b = closing(semantics="on_policy", capacity=10, num_minibatches=2, on_full="raise")
    for i in range(8):
        b.put(make_sample([i], version=0))
    mixed = make_sample([8, 9, 10], version=0, batched=True)
    mixed["policy_version_steps"][:, 2] = 1
    with pytest.raises(BufferFullError) as info:
        b.put_batch(mixed)
    assert info.value.samples_stored == 2  # type: ignore[attr-defined]
    assert b.stats()["samples_put"] == 10
    got = []
    while not b.empty():
        got += _ids(b.get())
    assert sorted(got) == list(range(10))
    b.put_batch(mixed[:, 2:])
    b.seal()
    assert _ids(b.get()) == [10]


def test_max_staleness_counts_from_the_version_set_policy_version_gives(closing) -> None:
    """What the README says about staleness under SRL's stock trainer: it never calls ``set_policy_version``, so the
    learner's version stays 0 and no rollout is stale; once the host sets it, ``max_staleness`` drops old rollouts."""
    for host_sets_version in (False, True):
        b = closing(semantics="on_policy", capacity=16, rollout_size=4, num_minibatches=1, max_staleness=0)
        for v in range(3):
            for i in range(4):
                b.put(make_sample([10 * v + i], version=v))
        if host_sets_version:
            b.set_policy_version(2)
        got = []
        while not b.empty():
            got.append(sorted(_ids(b.get())))
        if host_sets_version:
            assert got == [[20, 21, 22, 23]] and b.stats()["rollout_dropped"] == 8, (got, b.stats())
        else:
            assert got == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]], got
            assert b.stats()["rollout_dropped"] == 0
