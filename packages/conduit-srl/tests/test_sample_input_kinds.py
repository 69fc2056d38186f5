"""The SRL adapter: what kinds of sample data an actor can put, and priorities a trainer can send.

Each kind is either stored exactly (``get()`` returns equal values of the first sample's dtype, in
fresh memory) or refused with a typed error that leaves the buffer as it was.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from conduit import CapacityError, PriorityError, SchemaError
from conduit_srl import ConduitBuffer
from conduit_srl.testing import Record


def _x(seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    return (np.arange(12, dtype=np.float64).reshape(4, 3) + 10 * seed).astype(dtype)


def _make(closing: Any, **kw: Any) -> ConduitBuffer:
    kw.setdefault("batch_size", 1)
    kw.setdefault("capacity", 4)
    kw.setdefault("pin_memory", False)
    kw.setdefault("prefetch", 0)
    return closing(**kw)  # type: ignore[no-any-return]


def _only(b: ConduitBuffer, name: str = "x") -> np.ndarray:
    """The field ``name`` of the next delivery, as the one put sample's ``[T, ...]``."""
    arr = getattr(b.get().sample, name)
    assert arr.shape[1] == 1
    return arr[:, 0]  # type: ignore[no-any-return]


# -- NumPy layouts that are stored exactly ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["readonly", "fortran", "negative_stride", "float16", "bool", "int32", "complex"])
def test_numpy_layouts_are_stored_exactly(closing: Any, kind: str) -> None:
    base = _x()
    arr = {
        "readonly": base.copy(),
        "fortran": np.asfortranarray(base),
        "negative_stride": base[::-1],
        "float16": base.astype(np.float16),
        "bool": base > 5,
        "int32": base.astype(np.int32),
        "complex": base.astype(np.complex64) * (1 - 2j),
    }[kind]
    if kind == "readonly":
        arr.flags.writeable = False
    want = arr.copy()
    b = _make(closing)
    b.put(Record(x=arr))
    got = _only(b)
    assert got.dtype == want.dtype and np.array_equal(got, want), f"{kind}: got {got!r}, put {want!r}"


def test_nan_and_inf_sample_values_are_stored_as_they_are(closing: Any) -> None:
    x = np.array([[np.nan, np.inf], [-np.inf, -0.0], [1.0, 2.0]], dtype=np.float32)
    b = _make(closing)
    b.put(Record(x=x))
    got = _only(b)
    assert np.array_equal(got, x, equal_nan=True) and np.signbit(got[1, 1])


# -- byte order ---------------------------------------------------------------------------------------------
def test_big_endian_samples_are_stored_and_delivered_in_native_order(closing: Any) -> None:
    b = _make(closing, capacity=8, batch_size=3)
    big = _x(0).astype(">f4")
    b.put(Record(x=big))  # the first sample: it used to fail with a raw ValueError from torch
    b.put(Record(x=_x(1)))  # native float32 is the same field
    b.put(Record(x=_x(2).astype(">f4")))
    x = b.get().sample.x
    assert x.dtype == np.dtype(np.float32) and x.dtype.isnative
    for i in range(3):
        assert np.array_equal(x[:, i], _x(i)), f"sample {i} came back as {x[:, i]!r}"
    with pytest.raises(SchemaError, match="float64"):
        b.put(Record(x=_x(3).astype(">f8")))  # another dtype is still refused, with its native name


def test_big_endian_batched_put_with_negative_stride(closing: Any) -> None:
    b = _make(closing, capacity=8, batch_size=2)
    tb = np.stack([_x(0), _x(1)], axis=1).astype(">i8")[:, ::-1]  # [T, B=2, 3], columns swapped
    b.put_batch(Record(x=tb))
    x = b.get().sample.x
    assert x.dtype == np.dtype(np.int64) and np.array_equal(x[:, 0], _x(1)) and np.array_equal(x[:, 1], _x(0))


def test_big_endian_buffer_pickles(closing: Any) -> None:
    b = _make(closing, capacity=4)
    b.put(Record(x=_x(5).astype(">f8")))
    b.flush()
    back = pickle.loads(pickle.dumps(b))
    try:
        back.put(Record(x=_x(6).astype(">f8")))
        assert np.array_equal(_only(back), _x(5, np.float64))
    finally:
        back.close()


# -- dtype mismatches after the first sample ---------------------------------------------------------------
@pytest.mark.parametrize(("first", "later"), [(np.float32, np.float64), (np.float64, np.float32),
                                              (np.int32, np.int64), (np.int64, np.int32), (np.float32, np.float16),
                                              (np.float32, bool)])
def test_another_dtype_is_refused_and_changes_nothing(closing: Any, first: Any, later: Any) -> None:
    b = _make(closing)
    b.put(Record(x=_x(0, first)))
    with pytest.raises(SchemaError, match="send one dtype per field"):
        b.put(Record(x=_x(1, later)))
    assert len(b) == 1 and b.stats()["samples_put"] == 1
    got = _only(b)
    assert got.dtype == np.dtype(first) and np.array_equal(got, _x(0, first))


# -- kinds that are refused (typed, nothing stored) ----------------------------------------------------------
@pytest.mark.parametrize("kind", ["zero_d", "zero_T", "object", "structured", "unicode", "ragged_list",
                                  "torch_bfloat16"])
def test_unstorable_kinds_are_refused_before_anything_is_stored(closing: Any, kind: str) -> None:
    bad = {
        "zero_d": np.float32(3.0),
        "zero_T": np.zeros((0, 3), np.float32),
        "object": np.array([[1], [None], [2], [3]], dtype=object),
        "structured": np.zeros(4, dtype=[("a", "f4"), ("b", "i4")]),
        "unicode": np.array(["a", "b", "c", "d"]),
        "ragged_list": [[1.0, 2.0], [3.0]],
        "torch_bfloat16": torch.ones(4, 3, dtype=torch.bfloat16),
    }[kind]
    b = _make(closing)
    with pytest.raises(SchemaError, match="drop_fields"):
        b.put(Record(y=bad) if kind == "zero_T" else Record(x=_x(), y=bad))
    assert b.edp is None and b.stats()["samples_put"] == 0 and b.empty()
    b.put(Record(x=_x(), y=None))  # the buffer still takes a first sample of another layout
    assert _only(b).dtype == np.float32


def test_a_refused_later_sample_of_a_bad_kind_changes_nothing(closing: Any) -> None:
    b = _make(closing, capacity=4)
    b.put(Record(x=_x(0)))
    for bad in ([[1.0, 2.0], [3.0]], torch.ones(4, 3, dtype=torch.bfloat16), np.zeros(4, "f4,i4")):
        with pytest.raises(SchemaError):
            b.put(Record(x=bad))
    assert len(b) == 1 and b.stats()["samples_put"] == 1



class _UnreadableArray:
    """An array-like whose ``__array__`` raises an error of its own kind (not TypeError/ValueError/RuntimeError)."""

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise KeyError("no such column")


def test_an_array_like_whose_conversion_raises_any_error_is_refused_typed_and_changes_nothing(closing: Any) -> None:
    """A field whose ``__array__`` raises, e.g., a KeyError escaped ``put`` as that raw KeyError (only TypeError,
    ValueError and RuntimeError were turned into the adapter's SchemaError), as a first sample and as a later one."""
    b = _make(closing, capacity=4)
    with pytest.raises(SchemaError, match="'y'.*drop_fields"):
        b.put(Record(x=_x(0), y=_UnreadableArray()))
    assert b.edp is None and b.stats()["samples_put"] == 0 and b.empty()
    b.put(Record(x=_x(0)))
    with pytest.raises(SchemaError, match="'x'.*drop_fields"):
        b.put(Record(x=_UnreadableArray()))
    assert len(b) == 1 and b.stats()["samples_put"] == 1
    assert np.array_equal(_only(b), _x(0))


def test_a_dict_valued_field_is_refused_saying_to_send_a_record(closing: Any) -> None:
    """A field holding a dict of ``[T, ...]`` arrays (which a coalescing producer stacks as it would a nested
    record) was refused as "has shape ()" (the dict read as a 0-d object array), and as a later sample's field
    as "has dtype object": neither says that nested fields are records, not mappings."""
    b = _make(closing, capacity=4)
    for bad in (Record(x=_x(0), info={"a": _x(1)}), Record(x={"a": _x(1)})):
        with pytest.raises(SchemaError, match="'(info|x)' is a dict.*record.*drop_fields") as err:
            b.put(bad)
        assert "shape ()" not in str(err.value) and "dtype object" not in str(err.value), str(err.value)
        assert b.stats()["samples_put"] == (0 if b.edp is None else 1)
        if b.edp is None:
            b.put(Record(x=_x(0)))
    assert len(b) == 1 and np.array_equal(_only(b), _x(0))
    b2 = _make(closing, capacity=4)
    b2.put(Record(x=_x(0), info=Record(a=_x(1))))  # the same entries as a nested record are stored
    assert np.array_equal(b2.get().sample.info.a[:, 0], _x(1))

# -- torch tensors -------------------------------------------------------------------------------------------
def test_torch_tensors_with_view_bits_or_grad_are_stored_by_value(closing: Any) -> None:
    z = torch.tensor([[1 + 2j, 3 - 4j, 5 + 6j]] * 4, dtype=torch.complex64)
    neg = z.conj().imag  # a real float32 tensor with the negative bit set
    assert neg.is_neg()
    grad = torch.arange(12.0).reshape(4, 3).requires_grad_()
    b = _make(closing, capacity=4, batch_size=2)
    b.put(Record(a=neg, c=z.conj(), g=grad))
    b.put(Record(a=neg.resolve_neg().numpy(), c=z.conj().resolve_conj().numpy(), g=grad.detach().numpy() + 1))
    s = b.get().sample
    assert s.a.dtype == np.float32 and np.array_equal(s.a[:, 0], [[-2.0, 4.0, -6.0]] * 4)
    assert s.c.dtype == np.complex64 and np.array_equal(s.c[:, 0], z.conj().resolve_conj().numpy())
    assert s.g.dtype == np.float32 and np.array_equal(s.g[:, 0], np.arange(12.0).reshape(4, 3))
    assert np.array_equal(s.g[:, 1], np.arange(12.0).reshape(4, 3) + 1)


def test_torch_tensor_of_another_dtype_is_refused(closing: Any) -> None:
    b = _make(closing)
    b.put(Record(x=torch.zeros(4, 3)))
    with pytest.raises(SchemaError, match="float64"):
        b.put(Record(x=torch.zeros(4, 3, dtype=torch.float64)))
    assert len(b) == 1


# -- nested records and None ---------------------------------------------------------------------------------
def test_nested_record_with_none_fields_round_trips(closing: Any) -> None:
    b = _make(closing)
    b.put(Record(x=_x(0), state=Record(h=None, c=_x(1, np.int64), deep=Record(z=None, w=_x(2, bool)))))
    with pytest.raises(SchemaError, match="always None"):
        b.put(Record(x=_x(0), state=Record(h=_x(), c=_x(1, np.int64), deep=Record(z=None, w=_x(2, bool)))))
    with pytest.raises(SchemaError, match="was a record"):
        b.put(Record(x=_x(0), state=None))
    s = b.get().sample
    assert s.state.h is None and s.state.deep.z is None
    assert np.array_equal(s.state.c[:, 0], _x(1, np.int64)) and np.array_equal(s.state.deep.w[:, 0], _x(2, bool))
    assert len(b) == 1


# -- very large T ---------------------------------------------------------------------------------------------
def test_storage_that_cannot_be_allocated_is_a_capacity_error(closing: Any) -> None:
    t = 1 << 50  # capacity 4 x T x 4 bytes: far past any machine's memory, refused by the allocator at once
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(t, 1), strides=(0, 0))
    b = _make(closing, capacity=4)
    with pytest.raises(CapacityError, match="lower capacity"):
        b.put(Record(x=huge))  # used to be a raw ValueError / MemoryError from the allocator
    assert b.edp is None and b.stats()["samples_put"] == 0
    b.put(Record(x=_x()))  # a first sample that fits is still taken
    assert np.array_equal(_only(b), _x())


def test_long_samples_round_trip(closing: Any) -> None:
    t = 50_000
    b = _make(closing, capacity=2)
    x = np.random.default_rng(0).standard_normal((t, 2)).astype(np.float32)
    b.put(Record(x=x))
    assert np.array_equal(_only(b), x)


# -- what get() returns owns its memory ------------------------------------------------------------------
@pytest.mark.parametrize("semantics", ["queue", "replay"])
def test_delivered_arrays_survive_later_puts_and_writes(closing: Any, semantics: str) -> None:
    extra = {"reuses": 1} if semantics == "queue" else {}
    b = _make(closing, capacity=2, semantics=semantics, prefetch=1, **extra)
    src = _x(0)
    b.put(Record(x=src))
    got = _only(b)
    src[:] = -1  # the caller reuses its array after the sample was stored
    for i in range(1, 6):
        b.put(Record(x=_x(i)))  # the ring wraps over the delivered sample's slot
    b.flush()
    assert np.array_equal(got, _x(0)), "a delivered array changed after later puts"
    got[:] = 7  # the trainer writes into its delivery: storage must not change
    later = _only(b)  # (an entry prepared ahead may hold an older sample, a copy of what was put)
    assert any(np.array_equal(later, _x(i)) for i in range(6)), f"storage was written: {later!r}"


def test_delivered_copies_do_not_alias_each_other(closing: Any) -> None:
    b = _make(closing, capacity=4, semantics="replay", batch_size=2)
    b.put(Record(x=_x(0)))
    b.put(Record(x=_x(1)))
    first = b.get().sample.x
    second = b.get().sample.x
    assert not np.shares_memory(first, second)


# -- on-policy versions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [np.inf, 1e30, 1.5, np.nan])
def test_on_policy_float_version_that_is_not_a_whole_number_is_refused(closing: Any, value: float) -> None:
    b = closing(semantics="on_policy", capacity=8, num_minibatches=1, pin_memory=False, version_field="v")
    b.put(Record(x=_x(), v=np.full(4, 2.0)))
    b.flush()
    with pytest.raises(SchemaError, match="not a policy version"):
        b.put(Record(x=_x(), v=np.array([value, 3.0, 3.0, 3.0])))
    assert len(b) == 1 and b.stats()["samples_put"] == 1
    b.seal()
    e = b.get()
    assert e.info is not None and e.info.version == 2 and e.sampling_indices.shape == (1,)


def test_on_policy_float_version_all_negative_is_refused_as_missing(closing: Any) -> None:
    b = closing(semantics="on_policy", capacity=8, num_minibatches=1, pin_memory=False, version_field="v")
    with pytest.raises(SchemaError, match="carries no policy version"):
        b.put(Record(x=_x(), v=np.full(4, -1.0)))  # used to be stored under version -2**63
    assert b.edp is None and b.stats()["samples_put"] == 0
    b.put(Record(x=_x(), v=np.array([-1.0, 4.0, 3.0, 3.0])))  # the smallest non-negative value: 3
    b.seal()
    e = b.get()
    assert e.info is not None and e.info.version == 3


def test_on_policy_version_field_of_bool_dtype_is_refused(closing: Any) -> None:
    b = closing(semantics="on_policy", capacity=8, num_minibatches=1, pin_memory=False, version_field="v")
    with pytest.raises(SchemaError, match="integer versions"):
        b.put(Record(x=_x(), v=np.ones(4, bool)))
    assert b.edp is None


# -- update_priorities with odd inputs ------------------------------------------------------------------
def _prioritized(closing: Any) -> tuple[ConduitBuffer, np.ndarray]:
    b = _make(closing, semantics="prioritized", capacity=4, batch_size=2, overlap=False)
    for i in range(2):
        b.put(Record(x=_x(i)))
    return b, np.array([0, 1], dtype=np.int64)


def _tree(b: ConduitBuffer) -> np.ndarray:
    assert b.edp is not None
    return np.array(b.edp.semantics.sampler.state_dict()["leaves"][:2])  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["big_endian", "float16", "lists", "torch", "torch_grad", "torch_bfloat16",
                                  "torch_neg_bit", "big_endian_handles"])
def test_update_priorities_accepts_any_real_numbers(closing: Any, kind: str) -> None:
    b, h = _prioritized(closing)
    want = np.array([2.0, 0.5])
    z = torch.tensor([1 - 2.0j, 3 - 0.5j])
    handles, prios = {
        "big_endian": (h, want.astype(">f4")),
        "float16": (h, want.astype(np.float16)),
        "lists": (h.tolist(), want.tolist()),
        "torch": (torch.from_numpy(h), torch.from_numpy(want)),
        "torch_grad": (torch.from_numpy(h), torch.tensor(want, requires_grad=True) * 1),
        "torch_bfloat16": (h, torch.tensor(want, dtype=torch.bfloat16)),
        "torch_neg_bit": (h, z.conj().imag),  # [2.0, 0.5] as a view with the negative bit set
        "big_endian_handles": (h.astype(">i8"), want),
    }[kind]
    assert b.update_priorities(handles, prios) == 2
    leaves = _tree(b)
    alpha = b.config.alpha
    assert np.allclose(leaves, want ** alpha), f"{kind}: tree leaves {leaves}, expected {want ** alpha}"


@pytest.mark.parametrize("prios", [[np.nan, 1.0], [np.inf, 1.0], [-1.0, 1.0], [1.0], [1.0, 2.0, 3.0],
                                   np.array([1 + 1j, 2.0]), ["a", "b"]])
def test_bad_priorities_are_refused_and_change_nothing(closing: Any, prios: Any) -> None:
    b, h = _prioritized(closing)
    before = _tree(b)
    with pytest.raises(PriorityError):
        b.update_priorities(h, prios)
    assert np.array_equal(_tree(b), before)
    assert b.update_priorities(h, [1.0, 1.0]) == 2


def test_update_priorities_with_a_zero_d_handle(closing: Any) -> None:
    b, h = _prioritized(closing)
    assert b.update_priorities(np.int64(1), np.float32(3.0)) == 1
    assert np.isclose(_tree(b)[1], 3.0 ** b.config.alpha)


# -- claimed streams: a sample that cannot be stacked travels alone ----------------------------------------
class _Inline:
    """An in-process transport: what the producer flushes, the consumer receives in order."""

    def __init__(self) -> None:
        self.flushed: list[Any] = []
        self._cache: list[Any] = []

    def post(self, sample: Any) -> None:
        self._cache.append(sample)

    def flush(self) -> None:
        self.flushed.extend(self._cache)
        self._cache.clear()

    def consume_to(self, buffer: Any, max_iter: int = 16) -> int:
        n = 0
        while self.flushed and n < max_iter:
            buffer.put(self.flushed.pop(0))
            n += 1
        return n


@pytest.mark.parametrize("kind", ["torch_grad", "torch_neg_bit"])
def test_coalescing_producer_sends_unstackable_samples_alone_and_loses_none(closing: Any, kind: str) -> None:
    from conduit_srl import ConduitSampleConsumer, ConduitSampleProducer, StreamPolicy

    if kind == "torch_grad":
        odd = torch.from_numpy(_x(1)).requires_grad_()
    else:  # values _x(1), as a view with the negative bit set
        odd = torch.complex(torch.zeros(4, 3), torch.from_numpy(-_x(1))).conj().imag
        assert odd.is_neg()
    wire = _Inline()
    producer = ConduitSampleProducer([wire], policy=StreamPolicy(coalesce=2, max_delay_s=0))
    for s in (Record(x=_x(0)), Record(x=odd), Record(x=_x(2)), Record(x=_x(3))):
        producer.post(s)
    producer.flush()  # used to raise a raw RuntimeError here, with all four samples gone
    assert len(wire.flushed) == 3, f"expected 1 + 1 + 2 messages, got {len(wire.flushed)}"
    b = _make(closing, capacity=8, batch_size=4)
    assert ConduitSampleConsumer(wire).consume_to(b) == 4
    x = b.get().sample.x
    for i in range(4):
        assert np.array_equal(x[:, i], _x(i)), f"sample {i}: {x[:, i]!r}"


def test_on_policy_reads_big_endian_and_tensor_versions_in_nested_fields(closing: Any) -> None:
    b = closing(semantics="on_policy", capacity=8, num_minibatches=1, pin_memory=False, version_field="s.v")
    b.put(Record(x=_x(0), s=Record(v=np.full((4, 1), 2, ">i8"))))  # a raw ValueError before
    b.put(Record(x=torch.from_numpy(_x(1)), s=Record(v=torch.full((4, 1), 2))))
    b.seal()
    e = b.get()
    assert e.info is not None and e.info.version == 2
    assert e.sample.s.v.dtype == np.int64 and (e.sample.s.v == 2).all()
    assert np.array_equal(e.sample.x[:, np.argsort(e.sampling_indices)[0]], _x(0))
