"""The assembler: a refused first put fixes no layout, replay ``reuses`` counts only delivered draws, and
coalescing keeps each sample's metadata."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
from conduit import CapacityError, SchemaError
from conduit_srl import ConduitBuffer
from conduit_srl.testing import Record, entry_ids, make_sample


def _wait_prepared(b: ConduitBuffer) -> None:
    deadline = time.monotonic() + 30  # (a wait for the assembler thread, only reached when it never prepares)
    while not b._a._ready and time.monotonic() < deadline:
        time.sleep(0.002)
    assert b._a._ready, "the assembler did not prepare the next draw"


# -- a refused first put changes nothing (not even the layout) ------------------------------------------
def test_first_put_refused_for_capacity_does_not_fix_the_layout(closing) -> None:
    b = closing(batch_size=1, capacity=4, batched_puts=True)
    with pytest.raises(CapacityError):
        b.put(make_sample(np.arange(5), batched=True, time_steps=4))
    assert b.edp is None and b.empty() and b.qsize() == 0
    b.put(make_sample(np.arange(2), batched=True, time_steps=2))  # another T: the refused sample fixed nothing
    assert sorted(entry_ids(b.get()).tolist()) == [0]


def test_first_put_with_inconsistent_batch_does_not_fix_the_layout(closing) -> None:
    b = closing(batch_size=1, capacity=8, batched_puts=True)
    bad = make_sample(np.arange(3), batched=True)
    bad = Record(**{**dict(bad.items()), "reward": np.zeros((4, 2, 1), np.float32)})  # B=2 against B=3
    with pytest.raises(SchemaError):
        b.put(bad)
    assert b.edp is None
    b.put(make_sample(np.arange(2), batched=True, time_steps=3))
    assert b.qsize() == 2


def test_on_policy_first_put_without_a_version_does_not_fix_the_layout(closing) -> None:
    b = closing(semantics="on_policy", capacity=16, num_minibatches=1, num_epochs=1)
    with pytest.raises(SchemaError, match="no policy version"):
        b.put(make_sample([0], version=-1, time_steps=4))
    assert b.edp is None
    b.put(make_sample([1], version=0, time_steps=2))
    b.seal()
    assert entry_ids(b.get()).tolist() == [1]


# -- replay: reuses counts deliveries, not draws prepared and discarded ----------------------------------
def test_replay_reuses_do_not_count_draws_discarded_by_a_checkpoint(closing) -> None:
    b = closing(semantics="replay", batch_size=1, capacity=1, warmup=1, seed=0)
    b.put(make_sample([7]))
    assert b.get().reuses == 0
    _wait_prepared(b)  # a second draw of sample 7 is assembled ahead ...
    restored = pickle.loads(pickle.dumps(b))  # ... and discarded by the checkpoint (draws are not data)
    try:
        assert b.get().reuses == 1  # delivered once before, not twice
        assert restored.get().reuses == 1
    finally:
        restored.close()


def test_replay_reuses_do_not_count_draws_discarded_by_a_batch_size_change(closing) -> None:
    b = closing(semantics="replay", batch_size=1, capacity=1, warmup=1, seed=0)
    b.put(make_sample([7]))
    assert b.get().reuses == 0
    _wait_prepared(b)
    e = b.get(2)  # the prepared draw of 1 is discarded; sample 7 twice, delivered once before
    assert entry_ids(e).tolist() == [7, 7] and e.reuses == 1
    assert b.stats()["redrawn"] >= 1


# -- streams: coalescing keeps what a sample carries -------------------------------------------------------
def test_coalescing_keeps_each_samples_metadata() -> None:
    from conduit_srl import ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy

    class Inline:
        def __init__(self) -> None:
            self.cache: list[object] = []
            self.flushed: list[object] = []

        def post(self, s: object) -> None:
            self.cache.append(s)

        def flush(self) -> None:
            self.flushed.extend(self.cache)
            self.cache.clear()

        def consume_to(self, buffer: object, max_iter: int = 16) -> int:
            n = 0
            while self.flushed and n < max_iter:
                buffer.put(self.flushed.pop(0))  # type: ignore[attr-defined]
                n += 1
            return n

    class Plain:  # a buffer without put_batch (SRL's own)
        def __init__(self) -> None:
            self.got: list[Record] = []

        def put(self, x: Record) -> None:
            self.got.append(x)

    target = Inline()
    p = ConduitSampleProducer([target], policy=StreamPolicy(coalesce=2, max_delay_s=0.0))
    tagged = [make_sample([i]) for i in range(4)]
    tagged[1].register_metadata(tag="b")
    for s in tagged:
        p.post(s)
    p.close()
    plain = Plain()
    assert ConduitSampleConsumer(target).consume_to(plain) == 4
    assert [int(np.asarray(s.id)[0]) for s in plain.got] == [0, 1, 2, 3]
    assert [dict(s.metadata) for s in plain.got] == [{}, {"tag": "b"}, {}, {}]
