"""On-policy: what ``get()`` delivers does not depend on ``prefetch`` when a version change makes a prepared
minibatch stale.

The assembler selects the next minibatch for real ahead of ``get()``; when that selection ends an epoch it
draws the next epoch's permutation. If a version change then makes the rollout stale, the prepared entry is
discarded at ``get()``; its permutation draw must be given back, or every rollout ordered afterwards is shuffled
from another generator state than a buffer without prefetch (or a slower assembler) shuffles it from.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
from conduit_srl import ConduitBuffer
from conduit_srl.testing import entry_ids, make_sample


def _wait_prepared(b: ConduitBuffer, k: int, timeout_s: float = 30.0) -> None:
    """Wait until the assembler thread holds ``k`` entries assembled ahead (pins the timing: drawn ahead)."""
    deadline = time.monotonic() + timeout_s
    while len(b._a._ready) < k and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(b._a._ready) == k, f"the assembler prepared {len(b._a._ready)} entries ahead, expected {k}"


def _run(closing, prefetch: int) -> tuple[list[tuple[int, int, int, list[int]]], dict[str, int]]:
    """One seeded script of puts, version changes and gets; the deliveries (version, epoch, minibatch, ids)."""
    b = closing(semantics="on_policy", capacity=64, num_minibatches=2, num_epochs=2, max_staleness=0,
                seed=7, prefetch=prefetch)
    b.put_batch(make_sample(list(range(0, 4)), batched=True, version=0))  # rollout A
    b.put_batch(make_sample(list(range(4, 12)), batched=True, version=1))  # rollout B (seals A)
    b.put_batch(make_sample(list(range(12, 20)), batched=True, version=2))  # rollout C (seals B)
    b.seal()
    out: list[tuple[int, int, int, list[int]]] = []

    def get() -> None:
        e = b.get()
        out.append((e.info.version, e.info.epoch, e.info.minibatch, entry_ids(e).tolist()))

    get()  # A, epoch 0, minibatch 0
    if prefetch:  # the assembler selected A's last minibatch of epoch 0 (drawing epoch 1's order), and more
        _wait_prepared(b, prefetch)
    b.set_policy_version(1)  # A is stale: what was prepared from it is discarded, A is dropped
    for _ in range(3):  # B: epoch 0 and the first minibatch of epoch 1
        get()
    if prefetch:  # B's last minibatch is prepared ahead (it draws nothing); then a version change drops it
        _wait_prepared(b, 1)
    b.set_policy_version(2)
    for _ in range(4):  # C, both epochs
        get()
    stats = b.stats()
    return out, {k: stats[k] for k in ("samples_put", "samples_delivered", "entries_delivered")} | {
        "dropped": stats["stale_dropped"] + stats["rollout_dropped"]}


@pytest.mark.parametrize("prefetch", [1, 2])
def test_on_policy_deliveries_do_not_depend_on_prefetch_when_a_prepared_minibatch_goes_stale(
        closing, prefetch: int) -> None:
    without, counts_without = _run(closing, 0)
    ahead, counts_ahead = _run(closing, prefetch)
    assert [d[:3] for d in without] == [(0, 0, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0),
                                        (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)], without
    assert ahead == without, (f"prefetch={prefetch} delivered another order than prefetch=0 after a prepared "
                              f"minibatch went stale:\n{ahead}\n{without}")
    # nothing lost or repeated either way: each delivered epoch covers its rollout exactly once
    for version, epoch in ((1, 0), (2, 0), (2, 1)):
        ids = sorted(i for v, e, _, got in ahead if (v, e) == (version, epoch) for i in got)
        assert ids == list(range(4, 12) if version == 1 else range(12, 20)), (version, epoch, ids)
    assert counts_ahead == counts_without, (counts_ahead, counts_without)


def test_a_version_change_while_the_assembler_selects_ahead_leaves_the_stale_rollout_to_get(closing) -> None:
    """The version moves on between two selections the assembler makes ahead: the second one must not drop the
    stale rollout and order the next one (from a generator the first, discarded selection advanced); ``get()``
    drops it, as without prefetch."""
    without, _ = _run_version_change_between_ahead_selections(closing, 0)
    ahead, _ = _run_version_change_between_ahead_selections(closing, 2)
    assert [d[:3] for d in without] == [(0, 0, 0), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)], without
    assert ahead == without, f"prefetch=2 delivered\n{ahead}\nprefetch=0 delivered\n{without}"


def _run_version_change_between_ahead_selections(
        closing, prefetch: int) -> tuple[list[tuple[int, int, int, list[int]]], dict[str, int]]:
    b = closing(semantics="on_policy", capacity=64, num_minibatches=2, num_epochs=2, max_staleness=0,
                seed=11, prefetch=prefetch)
    b.put_batch(make_sample(list(range(0, 4)), batched=True, version=0))  # rollout A
    b.put_batch(make_sample(list(range(4, 12)), batched=True, version=1))  # rollout B (seals A)
    b.seal()
    moved = threading.Event()
    assemble = b._a._assemble

    def assemble_then_move_version(batch, info):  # (the assembler thread, between its two selections ahead)
        entry = assemble(batch, info)
        if threading.current_thread() is not threading.main_thread() and (info.version, info.epoch,
                                                                           info.minibatch) == (0, 0, 1):
            b.set_policy_version(1)
            moved.set()
        return entry

    b._a._assemble = assemble_then_move_version
    out: list[tuple[int, int, int, list[int]]] = []

    def get() -> None:
        e = b.get()
        out.append((e.info.version, e.info.epoch, e.info.minibatch, entry_ids(e).tolist()))

    get()  # A, epoch 0, minibatch 0
    if prefetch:
        assert moved.wait(30), "the assembler did not select A's next minibatch ahead"
        deadline = time.monotonic() + 30  # its next selection ahead has run (found A stale, or selected)
        while not (b._a._starved or len(b._a._ready) == prefetch) and time.monotonic() < deadline:
            time.sleep(0.005)
    else:
        b.set_policy_version(1)
    for _ in range(4):  # B, both epochs
        get()
    return out, b.stats()


def test_a_checkpoint_after_a_stale_prepared_entry_was_discarded_orders_as_without_prefetch(closing) -> None:
    """``empty()`` discards the stale prepared entry; a checkpoint taken before the next selection saves the
    generator with that entry's draws given back, so the restored buffer delivers what ``prefetch=0`` does."""
    def script(prefetch: int, checkpoint: bool) -> list[list[int]]:
        b = closing(semantics="on_policy", capacity=64, num_minibatches=2, num_epochs=2, max_staleness=0,
                    seed=5, prefetch=prefetch)
        b.put_batch(make_sample(list(range(0, 4)), batched=True, version=0))
        b.put_batch(make_sample(list(range(4, 12)), batched=True, version=1))
        b.seal()
        first = entry_ids(b.get()).tolist()
        if prefetch:
            _wait_prepared(b, prefetch)
        b.set_policy_version(1)
        assert not b.empty()  # (drops the stale prepared entry; B is deliverable)
        if checkpoint:
            c = copy.copy(b)  # (a snapshot and a restore, as pickling does)
            b.close()
            b = c
        try:
            return [first] + [entry_ids(b.get()).tolist() for _ in range(4)]
        finally:
            b.close()

    expected = script(0, checkpoint=False)
    assert script(1, checkpoint=True) == expected
    assert script(1, checkpoint=False) == expected
