"""The record type (SRL's array-of-fields behaviour) and the layout that maps samples to Conduit items."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conduit import SchemaError
from conduit_srl.records import RecordLayout
from conduit_srl.testing import Record, make_sample, stack


class Batch(Record):
    pass


def test_record_indexes_every_field_and_keeps_its_class() -> None:
    r = Batch(a=np.arange(12).reshape(4, 3), b=None, c=Record(d=np.ones((4, 3, 2))))
    assert list(r.keys()) == ["a", "b", "c"] and "a" in r and len(r) == 3
    col = r[:, 1]
    assert type(col) is Batch and col.a.tolist() == [1, 4, 7, 10] and col.b is None and col.c.d.shape == (4, 2)
    assert r[1:3].a.shape == (2, 3) and r["a"] is r.a
    assert r.length(0) == 4 and r.length(1) == 3
    with pytest.raises(IndexError):
        r.length(2)


def test_record_statistics_skip_negative_values() -> None:
    r = Record(v=np.array([[3], [-1], [5]]))
    assert r.min_of("v") == 3 and r.max_of("v") == 5 and r.average_of("v") == 4
    assert r.min_of("v", ignore_negative=False) == -1
    assert Record(v=np.array([-1, -1])).min_of("v") is None


def test_record_metadata_survives_pickling_and_guards_field_names() -> None:
    r = Batch(a=np.zeros(2))
    r.register_metadata(w=np.ones(2))
    with pytest.raises(KeyError):
        r.register_metadata(a=1)
    back = pickle.loads(pickle.dumps(r))
    assert type(back) is Batch and np.array_equal(back.metadata["w"], np.ones(2))
    assert back.pop_metadata("w") is not None and dict(back.metadata) == {}


def test_stack_builds_the_batch_axis() -> None:
    s = stack([make_sample([i]) for i in range(3)], axis=1)
    assert s.obs.shape == (4, 3, 3) and s.id[0].tolist() == [0, 1, 2] and s.info is None
    assert s.policy_state.hx.shape == (4, 3, 2)


def test_layout_schema_split_and_build() -> None:
    one = make_sample([7], time_steps=5, dim=4)
    lay = RecordLayout(one, batched=False)
    schema = lay.schema()
    assert schema["obs"].shape == (5, 4) and schema["obs"].dtype == torch.float32
    assert schema["policy_state.hx"].shape == (5, 2) and schema["done"].dtype == torch.bool
    assert "info" not in schema  # None fields are not stored
    arrays, n = lay.split(one, batched=False)
    assert n == 1 and arrays["obs"].shape == (1, 5, 4)
    assert np.shares_memory(arrays["obs"], one.obs), "a single sample is split without copying"
    batched = make_sample(np.arange(3), time_steps=5, dim=4, batched=True)
    arrays, n = lay.split(batched, batched=True)
    assert n == 3 and arrays["id"].shape == (3, 5) and arrays["id"][2].tolist() == [2] * 5
    rebuilt = lay.build({p: np.swapaxes(a, 0, 1) for p, a in arrays.items()})
    assert type(rebuilt) is Record and rebuilt.info is None and rebuilt.policy_state.hx.shape == (5, 3, 2)


def test_layout_refuses_what_it_cannot_store() -> None:
    with pytest.raises(SchemaError, match="items"):
        RecordLayout(np.zeros(3), batched=False)
    with pytest.raises(SchemaError, match="T"):
        RecordLayout(Record(a=np.zeros((4, 2)), b=np.zeros((5, 2))), batched=False)
    with pytest.raises(SchemaError, match="no array"):
        RecordLayout(Record(a=None), batched=False)
    with pytest.raises(SchemaError, match=r"\[T, B"):
        RecordLayout(Record(a=np.zeros(4)), batched=True)
    lay = RecordLayout(Record(a=np.zeros((4, 2)), s=Record(x=np.zeros(4))), batched=False)
    with pytest.raises(SchemaError, match="record"):
        lay.split(Record(a=np.zeros((4, 2)), s=None), batched=False)
    with pytest.raises(SchemaError, match="batch size"):
        lay.split(Record(a=np.zeros((4, 2, 2)), s=Record(x=np.zeros((4, 3)))), batched=True)


def test_a_sample_of_another_record_class_is_refused_and_nothing_of_it_stored() -> None:
    # the first sample fixes the record classes (README): deliveries are built with them, so a later sample of
    # another class (at the top or nested) would come back as the first one's class
    from conduit_srl import ConduitBuffer

    first = make_sample([1], time_steps=3)
    layout = RecordLayout(first, batched=False)
    with pytest.raises(SchemaError, match="Batch record, the first sample's was a Record"):
        layout.split(Batch(**dict(first.items())), batched=False)
    nested = RecordLayout(Record(a=np.zeros((3, 2)), c=Record(d=np.ones((3, 1)))), batched=False)
    with pytest.raises(SchemaError, match="Field 'c' is a Batch record"):
        nested.split(Record(a=np.zeros((3, 2)), c=Batch(d=np.ones((3, 1)))), batched=False)
    buf = ConduitBuffer(batch_size=1, capacity=8)
    try:
        buf.put(first)
        with pytest.raises(SchemaError):
            buf.put(Batch(**dict(make_sample([2], time_steps=3).items())))
        assert buf.qsize() == 1 and buf.stats()["samples_put"] == 1
        entry = buf.get()
        assert type(entry.sample) is Record and entry.sample.length(1) == 1
    finally:
        buf.close()
