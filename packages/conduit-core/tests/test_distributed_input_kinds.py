"""What callers hand to a DistributedDataPlane, of every kind: it comes back exactly (across shards, over the wire),
or it is refused with a typed error before anything is stored anywhere.

The shard servers are real :class:`~conduit.distributed.server.ShardServer` bodies called in-process through the
stand-in for Ray of ``test_distributed_bookkeeping``; here every object put into the "object store" and every row a
shard sends back is pickled and comes back as read-only NumPy, as Ray's object store hands it over.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceSchema, Field, OnPolicy, PrioritizedSampler, Replay
from conduit.batch import ExperienceBatch, Ragged
from conduit.distributed import experience as experience_mod
from conduit.distributed.plane import DistributedDataPlane
from conduit.distributed.wire import from_wire, pack_rows, packed_nbytes, ragged_lengths, to_wire, unpack_rows
from conduit.errors import PriorityError, SchemaError
from conduit.scheduling import Overlapped

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import _Actor, _FakeRay, _Ref, _servers, patch_ray  # noqa: E402, I001

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]


def _read_only(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        x.setflags(write=False)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _read_only(y)
    elif isinstance(x, dict):
        for y in x.values():
            _read_only(y)
    return x


def _through_store(x: Any) -> Any:
    """What a reader gets from Ray's object store: a copy, its arrays read-only."""
    return _read_only(pickle.loads(pickle.dumps(x)))


class _StoreRay(_FakeRay):
    @staticmethod
    def put(x: Any) -> Any:
        return _Ref(_through_store(x))


@pytest.fixture
def ray_like(monkeypatch: pytest.MonkeyPatch) -> Any:
    threads = torch.get_num_threads()
    call = _Actor.call

    def call_through_store(self: _Actor, name: str, args: tuple[Any, ...]) -> _Ref:
        out = call(self, name, args)
        if out.error is None and out.value is not None:
            out.value = _through_store(out.value)
        return out

    monkeypatch.setattr(_Actor, "call", call_through_store)
    patch_ray(monkeypatch, _StoreRay)
    monkeypatch.setattr(experience_mod, "ray_module", lambda **_: _StoreRay)
    monkeypatch.setattr(experience_mod, "current_node_id", lambda: "b")
    yield _StoreRay
    torch.set_num_threads(threads)


def _plane(schema: ExperienceSchema, *, capacity: int = 7, **kw: Any) -> DistributedDataPlane:
    """Two shards, on nodes ``a`` (the learner's) and ``b``; each node's ingestions go to its own shard."""
    kw.setdefault("shard_capacity", capacity)
    return DistributedDataPlane(schema, capacity=capacity, servers=_servers(["a", "b"]), learner_node="a",
                                measure=False, health_period=None, transport="object_store", **kw)


def _shards_holding(p: DistributedDataPlane) -> set[int]:
    return {s for r in p.index.live_rows() for s, _ in p.index.segment(r)[2] if p.index.segment(r)[1] > 0}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().contiguous().view(torch.uint8)


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, ingested {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, ingested {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{what}: values differ from what was ingested\n{got}\n!=\n{want}"


#: name -> (dtype, how the caller's tensor is made from plain float values)
SOURCES: dict[str, tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor]]] = {
    "contiguous": (torch.float32, lambda v: v.clone()),
    "column_slice": (torch.float32, lambda v: torch.cat([v, v], dim=1)[:, ::2]),
    "transposed": (torch.float32, lambda v: v.t().contiguous().t()),
    "offset_view": (torch.float32, lambda v: torch.cat([torch.zeros(3, v.shape[1]), v])[3:]),
    # the imaginary part of a conjugate view: a real tensor whose negative bit is set (strided)
    "negative_view": (torch.float32, lambda v: torch.complex(torch.zeros_like(v), -v).conj().imag),
    # a contiguous tensor whose negative bit is set (what .contiguous() leaves as it is)
    "negative_bit_contiguous": (torch.float32, lambda v: torch._neg_view(-v)),
    "conjugate": (torch.complex64, lambda v: torch.complex(v, 2 * v).conj()),
    "complex32": (torch.complex32, lambda v: torch.complex(v, -v).to(torch.complex32)),
    "requires_grad": (torch.float32, lambda v: v.clone().requires_grad_(True)),
    "parameter": (torch.float32, lambda v: torch.nn.Parameter(v.clone())),
    "bfloat16": (torch.bfloat16, lambda v: v.to(torch.bfloat16)),
    "float16": (torch.float16, lambda v: v.to(torch.float16)),
    "float8_e4m3fn": (torch.float8_e4m3fn, lambda v: v.to(torch.float8_e4m3fn)),
    "float8_e5m2": (torch.float8_e5m2, lambda v: v.to(torch.float8_e5m2)),
    "bool": (torch.bool, lambda v: v > 0),
    "uint8": (torch.uint8, lambda v: (v.abs() * 10).to(torch.uint8)),
    "int64": (torch.int64, lambda v: (v * 100).to(torch.int64)),
}


@pytest.mark.usefixtures("ray_like")
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_kind_of_source_comes_back_exactly_from_two_shards(kind: str) -> None:
    """15 rows into 7 slots from two producer nodes (one shard each): read and delivered rows equal the source's
    values, dtype and shape. A conjugate or contiguous negative-bit tensor raised a raw RuntimeError from NumPy;
    float8 rows were stored and then every read and delivery raised NotImplementedError (index_copy_)."""
    dtype, make = SOURCES[kind]
    p = _plane(ExperienceSchema(x=Field((3,), dtype)), semantics=Replay(seed=0))
    gen = torch.Generator().manual_seed(1)
    kept: list[torch.Tensor] = []
    for i, n in enumerate((3, 2, 4, 1, 5)):
        values = torch.randn(n, 3, generator=gen)
        handles = p.ingest({"x": make(values)}, node="ab"[i % 2])
        assert handles is not None and handles.shape == (n,)
        kept.append(make(values).detach().resolve_conj().resolve_neg().clone())
    assert _shards_holding(p) == {0, 1}, "the test needs rows on both shards"
    every = torch.cat(kept)
    live = p.live_handles()
    _assert_same(p.read(live)["x"], every[torch.from_numpy(live)], f"{kind}: read")
    batch, info = p.deliver(9)
    _assert_same(batch["x"], every[info.handles], f"{kind}: delivered")


@pytest.mark.usefixtures("ray_like")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64],
                         ids=str)
def test_ragged_fields_with_empty_sequences_and_zero_row_batches_come_back_exactly(dtype: torch.dtype) -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), f=Field((2,), dtype), tok=Field((2,), dtype, ragged=True))
    p = _plane(schema, semantics=Replay(seed=0), ragged_capacity=64)
    gen = torch.Generator().manual_seed(0)
    seqs: list[torch.Tensor] = []
    fixed: list[torch.Tensor] = []

    def values(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 4).to(dtype)

    i = 0
    for n, node, lengths in ((3, "a", [0, 2, 0]), (2, "b", [0, 0]), (0, "a", []), (4, "b", [1, 0, 3, 0]),
                             (3, "a", [0, 1, 2])):
        s = [values(k, 2) for k in lengths]
        f = values(n, 2)
        tok: Any = s if n else []
        if n and not any(lengths):
            tok = [[] for _ in range(n)]  # sequences with no elements carry no dtype: the schema's is taken
        got = p.ingest({"id": torch.arange(i, i + n), "f": f, "tok": tok}, node=node)
        assert got is not None and got.tolist() == list(range(i, i + n))
        seqs += s
        fixed += list(f)
        i += n
    assert _shards_holding(p) == {0, 1}

    def check(batch: ExperienceBatch, handles: list[int], what: str) -> None:
        _assert_same(batch.tensor("id"), torch.tensor(handles, dtype=torch.int64), f"{what}: ids")
        _assert_same(batch.tensor("f"), torch.stack([fixed[h] for h in handles]), f"{what}: fixed field")
        r = batch["tok"]
        assert isinstance(r, Ragged)
        assert r.lengths.tolist() == [seqs[h].shape[0] for h in handles], f"{what}: lengths"
        _assert_same(r.values, torch.cat([seqs[h] for h in handles]), f"{what}: ragged values")

    live = p.live_handles().tolist()
    check(p.read(live), live, "read")
    batch, info = p.deliver(8)
    check(batch, info.handles.tolist(), "delivered")


@pytest.mark.usefixtures("ray_like")
def test_numpy_sources_come_back_exactly_a_foreign_byte_order_by_value() -> None:
    p = _plane(ExperienceSchema(x=Field((3,))), capacity=6, semantics=Replay(seed=0))
    base = np.arange(18, dtype=np.float32).reshape(6, 3)
    read_only = base[:2].copy()
    read_only.setflags(write=False)
    sources = [read_only, base[2:4][::-1], base[4:6][:, ::-1]]
    for src, node in zip(sources, "aba", strict=True):
        p.ingest({"x": src}, node=node)
    assert _shards_holding(p) == {0, 1}
    want = torch.from_numpy(np.concatenate([np.ascontiguousarray(s) for s in sources]))
    _assert_same(p.read(p.live_handles())["x"], want, "numpy sources")
    p.ingest({"x": base[:2].astype(">f4")}, node="b")  # a foreign byte order: stored by value, evicting two items
    _assert_same(p.read(p.live_handles())["x"], torch.cat([want[2:], torch.from_numpy(base[:2])]), "big-endian")


@pytest.mark.usefixtures("ray_like")
@pytest.mark.parametrize("kind", ["sparse", "meta", "ragged_sparse"])
def test_tensors_without_dense_values_are_refused_before_any_shard_changes(kind: str) -> None:
    schema = ExperienceSchema(x=Field((2,)), t=Field((), torch.int64, ragged=True))
    p = _plane(schema, capacity=4, semantics=Replay(seed=0), ragged_capacity=32)

    def batch(x: torch.Tensor, tokens: torch.Tensor | None = None) -> dict[str, object]:
        return {"x": x, "t": Ragged(tokens if tokens is not None else torch.arange(4), torch.tensor([1, 3]))}

    p.ingest(batch(torch.ones(2, 2)), node="a")
    p.ingest(batch(torch.full((2, 2), 2.0)), node="b")  # full: a stored batch would evict two items
    spans = [s.actor.server.span(p.buffer_id) for s in p.servers.servers]
    before = (p.index.oldest, p.index.next_handle, list(p._local_next), spans, p.read(p.live_handles())["x"])
    bad = {"sparse": batch(torch.eye(2).to_sparse()), "meta": batch(torch.empty(2, 2, device="meta")),
           "ragged_sparse": batch(torch.zeros(2, 2), torch.arange(4).to_sparse())}[kind]
    with pytest.raises(SchemaError, match="dense|meta"):
        p.ingest(bad, node="b")
    spans = [s.actor.server.span(p.buffer_id) for s in p.servers.servers]
    after = (p.index.oldest, p.index.next_handle, list(p._local_next), spans)
    assert after == before[:4], f"{kind}: a refused ingestion changed the index or a shard"
    assert torch.equal(p.read(p.live_handles())["x"], before[4])


@pytest.mark.usefixtures("ray_like")
def test_read_takes_handles_with_a_view_bit() -> None:
    """A handle tensor with its negative bit set raised a raw RuntimeError from NumPy."""
    p = _plane(ExperienceSchema(x=Field((1,))), semantics=Replay(seed=0))
    p.ingest({"x": torch.tensor([[0.0], [1.0]])}, node="a")
    p.ingest({"x": torch.tensor([[2.0], [3.0]])}, node="b")
    handles = torch._neg_view(torch.tensor([-3, -0, -2]))
    assert handles.is_neg() and handles.tolist() == [3, 0, 2]
    assert p.read(handles)["x"].flatten().tolist() == [3.0, 0.0, 2.0]


def _prioritized(capacity: int = 8) -> DistributedDataPlane:
    return _plane(ExperienceSchema(x=Field((1,))), capacity=capacity,
                  semantics=Replay(sampler=PrioritizedSampler(alpha=1.0, beta=1.0), seed=0))


def _negative_bit(values: list[float]) -> torch.Tensor:
    t = torch.complex(torch.zeros(len(values), dtype=torch.float64),
                      -torch.tensor(values, dtype=torch.float64)).conj().imag
    assert t.is_neg() and t.tolist() == values
    return t


@pytest.mark.usefixtures("ray_like")
def test_update_priorities_takes_arrays_running_backwards_for_items_on_both_shards() -> None:
    """NumPy handles and priorities with negative strides (``a[::-1]``) raised a raw ValueError from torch."""
    p = _prioritized()
    h = torch.cat([p.ingest({"x": torch.zeros(2, 1)}, node="a"), p.ingest({"x": torch.ones(2, 1)}, node="b")])
    assert _shards_holding(p) == {0, 1}
    handles = h.numpy()[::-1]
    priorities = np.array([1.0, 2.0, 3.0, 4.0])[::-1]
    assert handles.strides[0] < 0 and priorities.strides[0] < 0
    assert p.update_priorities(handles, priorities) == 4
    tree = p.semantics.sampler._tree  # type: ignore[attr-defined]
    assert tree.get(np.arange(4)).tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.usefixtures("ray_like")
def test_update_priorities_across_shards_after_one_is_lost_skips_its_items_and_keeps_weights_finite() -> None:
    p = _prioritized()
    f64 = torch.float64
    h = torch.cat([p.ingest({"x": torch.zeros(2, 1)}, priorities=torch.tensor([1e-300, 1.0], dtype=f64), node="a"),
                   p.ingest({"x": torch.ones(2, 1)}, priorities=torch.tensor([5e-324, 1e300], dtype=f64), node="b")])
    p._lose(1, "lost for the test")
    tree = p.semantics.sampler._tree  # type: ignore[attr-defined]
    assert tree.get(np.arange(4)).tolist() == [1e-300, 1.0, 0.0, 0.0], "lost items leave the global total"
    assert p.update_priorities(h.numpy()[::-1], np.array([1.0, 2.0, 1e-300, 3.0])[::-1]) == 2
    assert tree.get(np.arange(4)).tolist() == [1.0, 2.0, 0.0, 0.0], "a lost item's priority came back"
    batch, info = p.deliver(64)
    assert info.weights is not None and set(info.handles.tolist()) <= {0, 1}
    assert torch.equal(batch["x"].flatten(), torch.zeros(64))
    w = info.weights
    assert bool(torch.isfinite(w).all()) and float(w.min()) >= 0 and float(w.max()) == 1.0, w


@pytest.mark.usefixtures("ray_like")
def test_priorities_and_handles_with_view_bits_or_grad_are_read_by_value_on_both_shards() -> None:
    p = _prioritized()
    h1 = p.ingest({"x": torch.zeros(2, 1)}, priorities=_negative_bit([1.0, 3.0]), node="a")
    h2 = p.ingest({"x": torch.ones(2, 1)}, priorities=torch.tensor([5.0, 7.0], requires_grad=True), node="b")
    assert h1 is not None and h2 is not None and _shards_holding(p) == {0, 1}
    tree = p.semantics.sampler._tree  # type: ignore[attr-defined]
    assert tree.get(np.arange(4)).tolist() == [1.0, 3.0, 5.0, 7.0]
    handles = torch._neg_view(-torch.cat([h2, h1]))
    assert p.update_priorities(handles, torch.tensor([2.0, 4.0, 6.0, 8.0], requires_grad=True)) == 4
    assert tree.get(np.arange(4)).tolist() == [6.0, 8.0, 2.0, 4.0]
    before = tree.get(np.arange(4)).tolist()
    for bad in (torch.tensor([1 + 2j, 3j, 1j, 2j]), np.array([1 + 2j, 3j, 1j, 2j])):
        with pytest.raises(PriorityError, match="real numbers"):
            p.update_priorities(handles, bad)
        with pytest.raises(PriorityError, match="real numbers"):
            p.ingest({"x": torch.zeros(4, 1)}, priorities=bad, node="b")
    assert tree.get(np.arange(4)).tolist() == before and len(p) == 4 and p.index.next_handle == 4


@pytest.mark.usefixtures("ray_like")
@pytest.mark.parametrize("priorities", [[1e-300, 1e300], [5e-324, 1.0], [1e-200, 1.0], [0.0, 1.0]])
def test_priorities_far_apart_on_two_shards_give_finite_weights(priorities: list[float]) -> None:
    """The global total over both shards: every weight in [0, 1], the rarest item's exactly 1 when drawn."""
    p = _prioritized(capacity=2)
    p.ingest({"x": torch.tensor([[0.0]])}, priorities=torch.tensor(priorities[:1], dtype=torch.float64), node="a")
    p.ingest({"x": torch.tensor([[1.0]])}, priorities=torch.tensor(priorities[1:], dtype=torch.float64), node="b")
    assert _shards_holding(p) == {0, 1}
    for update in (False, True):
        if update:  # the same priorities again, by update, for the items on both shards
            assert p.update_priorities(torch.tensor([1, 0]), torch.tensor(priorities[::-1], dtype=torch.float64)) == 2
        for _ in range(4):
            batch, info = p.deliver(64)
            w = info.weights
            assert w is not None
            assert bool(torch.isfinite(w).all()) and float(w.min()) >= 0 and float(w.max()) <= 1, w
            assert torch.equal(batch["x"].flatten(), info.handles.to(torch.float32)), "rows are the drawn items"
            rare = info.handles == 0
            if priorities[0] > 0 and bool(rare.any()):
                assert bool((w[rare] == 1).all()), w
            if priorities[0] == 0:
                assert not bool(rare.any()), "an item of priority 0 was drawn"


@pytest.mark.usefixtures("ray_like")
@pytest.mark.parametrize("kind", ["conjugate", "negative_bit_contiguous", "float8_e4m3fn"])
@pytest.mark.parametrize("on_policy", [False, True], ids=["replay", "on_policy"])
def test_an_overlapped_scheduler_delivers_every_kind_exactly(kind: str, on_policy: bool) -> None:
    dtype, make = SOURCES[kind]
    sem: Any = OnPolicy(num_minibatches=2, num_epochs=1) if on_policy else Replay(seed=0)
    p = _plane(ExperienceSchema(x=Field((2,), dtype)), capacity=8, semantics=sem,
               scheduler=Overlapped(g_ing=1 if on_policy else 2, g_del=1 if on_policy else 2))
    try:
        values = torch.arange(16.0).reshape(8, 2)
        version = 0 if on_policy else None
        p.ingest({"x": make(values[:4])}, node="a", version=version)
        p.ingest({"x": make(values[4:])}, node="b", version=version)
        if on_policy:
            p.seal()
        else:
            p.flush()
        want = make(values).detach().resolve_conj().resolve_neg()
        for i in range(2):
            batch, info = p.deliver(None if on_policy else 6)
            _assert_same(batch["x"], want[info.handles], f"{kind}: delivery {i}")
        assert _shards_holding(p) == {0, 1} or on_policy
    finally:
        p.close()


@pytest.mark.usefixtures("ray_like")
@pytest.mark.parametrize("kind", ["conjugate", "float8_e4m3fn", "bfloat16"])
def test_a_checkpoint_of_every_kind_round_trips_exactly(kind: str) -> None:
    """float8 buffers could not be checkpointed (state_dict reads the rows: NotImplementedError)."""
    dtype, make = SOURCES[kind]
    schema = ExperienceSchema(x=Field((2,), dtype), t=Field((), dtype, ragged=True))
    p = _plane(schema, capacity=6, semantics=Replay(seed=0), ragged_capacity=32)
    values = torch.arange(12.0).reshape(6, 2)
    for a, node in ((0, "a"), (3, "b")):
        p.ingest({"x": make(values[a:a + 3]), "t": Ragged(make(values[a:a + 3].reshape(-1))[:3],
                                                          torch.tensor([0, 3, 0]))}, node=node)
    state = p.state_dict()
    q = _plane(schema, capacity=6, semantics=Replay(seed=0), ragged_capacity=32)
    q.load_state_dict(state)
    got, want = q.read(q.live_handles()), p.read(p.live_handles())
    _assert_same(got.tensor("x"), make(values).detach().resolve_conj().resolve_neg(), f"{kind}: restored rows")
    gr, wr = got["t"], want["t"]
    assert isinstance(gr, Ragged) and isinstance(wr, Ragged)
    _assert_same(gr.values, wr.values, f"{kind}: restored ragged values")
    assert gr.lengths.tolist() == wr.lengths.tolist() == [0, 3, 0] * 2


@pytest.mark.usefixtures("ray_like")
def test_a_staged_batch_with_view_bits_is_ingested_by_value() -> None:
    """stage() put a conjugate batch through NumPy: a raw RuntimeError on the producer."""
    schema = ExperienceSchema(z=Field((2,), torch.complex64), y=Field((2,)))
    z = torch.tensor([[1 + 2j, 3 - 1j], [0 + 1j, 2 + 0j]], dtype=torch.complex64)
    y = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    ref = experience_mod.stage({"z": z.conj(), "y": torch._neg_view(-y)}, schema)
    p = _plane(schema, semantics=Replay(seed=0))
    assert p.ingest(ref).tolist() == [0, 1]
    assert _shards_holding(p) == {1}, "a staged batch goes to its producer's node"
    got = p.read([0, 1])
    _assert_same(got.tensor("z"), z.conj().resolve_conj(), "staged conjugate")
    _assert_same(got.tensor("y"), y, "staged negative bit")


def test_the_wire_formats_carry_values_not_view_bits() -> None:
    """to_wire (object store) and pack_rows (torch.distributed) raised raw RuntimeErrors for a tensor with a
    conjugate or negative view bit."""
    schema = ExperienceSchema(z=Field((2,), torch.complex64), y=Field((2,)), r=Field((), ragged=True))
    z = torch.tensor([[1 + 2j, 3 - 1j], [0 + 1j, 2 + 0j]], dtype=torch.complex64)
    y = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    r = torch.tensor([5.0, -6.0, 7.0])
    batch = ExperienceBatch({"z": z.conj(), "y": torch._neg_view(-y),
                             "r": Ragged(torch._neg_view(-r), torch.tensor([1, 2]))}, 2)
    lengths = ragged_lengths(batch, schema)
    packed = pack_rows(batch, schema)
    assert packed.numel() == packed_nbytes(2, lengths, schema)
    for what, back in (("object store", from_wire(_through_store(to_wire(batch, schema)), schema)),
                       ("torch.distributed", unpack_rows(packed, 2, lengths, schema))):
        _assert_same(back.tensor("z"), z.conj().resolve_conj(), f"{what}: conjugate")
        _assert_same(back.tensor("y"), y, f"{what}: negative bit")
        rr = back["r"]
        assert isinstance(rr, Ragged)
        _assert_same(rr.values, r, f"{what}: ragged values with a negative bit")
        assert rr.lengths.tolist() == [1, 2]


# -- the same on a real local Ray cluster (the module's 2-node cluster of conftest.py) ---------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["object_store", "torch"])
def test_view_bits_and_float8_come_back_exactly_through_ray(servers: Any, transport: str) -> None:
    schema = ExperienceSchema(z=Field((2,), torch.complex64), y=Field((2,)), f8=Field((2,), torch.float8_e4m3fn),
                              tok=Field((), torch.bfloat16, ragged=True))
    values = torch.arange(12.0).reshape(6, 2)
    z = torch.complex(values, -2 * values)
    tokens = torch.arange(6.0).to(torch.bfloat16)
    lengths = torch.tensor([0, 2, 0, 1, 3, 0])
    with DistributedDataPlane(schema, capacity=6, servers=servers, measure=False, health_period=None,
                              transport=transport, semantics=Replay(seed=0)) as p:
        offsets = [0, 0, 2, 2, 3, 6, 6]
        for a, node in ((0, servers.nodes[0]), (3, servers.nodes[1])):
            rows = slice(a, a + 3)
            p.ingest({"z": z[rows].conj(), "y": torch._neg_view(-values[rows]),
                      "f8": values[rows].to(torch.float8_e4m3fn),
                      "tok": Ragged(tokens[offsets[a]:offsets[a + 3]], lengths[rows])}, node=node)
        assert _shards_holding(p) == {0, 1} and p.transports == [transport] * 2
        batch, info = p.deliver(12)
        h = info.handles
        _assert_same(batch.tensor("z"), z.conj().resolve_conj()[h], "conjugate")
        _assert_same(batch.tensor("y"), values[h], "negative bit")
        _assert_same(batch.tensor("f8"), values.to(torch.float8_e4m3fn)[h], "float8")
        r = batch["tok"]
        assert isinstance(r, Ragged) and r.lengths.tolist() == lengths[h].tolist()
        _assert_same(r.values, torch.cat([tokens[offsets[i]:offsets[i + 1]] for i in h.tolist()]), "bfloat16 ragged")
