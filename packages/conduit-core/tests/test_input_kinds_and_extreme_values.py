"""What callers hand in, of every kind: source tensors with odd layouts or view bits (host ingestion writes
contiguous ones by ``memmove``, others through NumPy or ``copy_``; all must land exactly, across the wrap),
tensors without dense values (refused before anything changes), and priorities of any real value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay
from conduit.batch import ExperienceBatch, Ragged
from conduit.errors import ConfigurationError, PriorityError, SchemaError
from conduit.storage import ColumnarStorage

CAPACITY = 7

#: name -> (dtype, how the caller's tensor is made from plain values)
SOURCES: dict[str, tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor]]] = {
    "contiguous": (torch.float32, lambda v: v.clone()),
    "column_slice": (torch.float32, lambda v: torch.cat([v, v], dim=1)[:, ::2]),  # non-contiguous rows
    "transposed": (torch.float32, lambda v: v.t().contiguous().t()),
    "offset_view": (torch.float32, lambda v: torch.cat([torch.zeros(3, v.shape[1]), v])[3:]),
    # the imaginary part of a conjugate view: a real tensor whose neg bit is set (NumPy cannot take it)
    "negative_view": (torch.float32, lambda v: torch.complex(torch.zeros_like(v), -v).conj().imag),
    "requires_grad": (torch.float32, lambda v: v.clone().requires_grad_(True)),
    "bfloat16": (torch.bfloat16, lambda v: v.to(torch.bfloat16)),
    "int64": (torch.int64, lambda v: (v * 100).to(torch.int64)),
    "bool": (torch.bool, lambda v: v > 0),
    "parameter": (torch.float32, lambda v: torch.nn.Parameter(v.clone())),
}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_kind_of_source_lands_exactly_across_the_wrap(kind: str) -> None:
    dtype, make = SOURCES[kind]
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((3,), dtype)), capacity=CAPACITY, semantics=Replay(seed=0))
    gen = torch.Generator().manual_seed(1)
    kept: list[torch.Tensor] = []
    for n in (3, 2, 4, 1, 5):  # 15 rows into 7 slots: the ring wraps in the middle of a batch twice
        values = torch.randn(n, 3, generator=gen)
        src = make(values)
        expected = make(values).detach().resolve_neg().clone()
        edp.ingest({"x": src})
        kept.append(expected)
    rows = torch.cat(kept)[-CAPACITY:]  # the newest CAPACITY rows, oldest first
    st = edp.storage
    assert isinstance(st, ColumnarStorage)
    slots = torch.arange(st.oldest, st.next_handle) % CAPACITY
    got = st._cols["x"][slots]
    assert torch.equal(got, rows), f"{kind}: stored rows differ from the source\n{got}\n!=\n{rows}"


def test_a_source_is_never_written_to_and_keeps_its_bits() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((2,))), capacity=4, semantics=Replay(seed=0))
    src = torch.complex(torch.zeros(2, 2), torch.tensor([[1.0, -2.0], [3.0, 4.0]])).conj().imag
    before = src.resolve_neg().clone()
    edp.ingest({"x": src})
    assert src.is_neg(), "ingestion must not resolve the caller's view in place"
    assert torch.equal(src.resolve_neg(), before)


def test_rows_sized_unlike_the_column_are_not_copied_raw() -> None:
    """The raw copy moves exactly ``n`` rows of the column's row size; a column of another byte size (a batch built
    without validation, e.g. by internal callers) goes the checked path and cannot write past the ring."""
    st = ColumnarStorage(ExperienceSchema(x=Field((4,))), 4)
    wide = torch.ones(2, 8)  # twice the row bytes: a raw copy of its size would overrun slots 2-3 into slot 4+
    with pytest.raises((RuntimeError, ValueError)):
        st.append(ExperienceBatch({"x": wide}, 2))
    assert torch.equal(st._cols["x"][2:], torch.zeros(2, 4)), "rows beyond the batch were written"


def _negative_bit(values: list[float]) -> torch.Tensor:
    """A real tensor holding ``values`` with its negative view bit set (the imaginary part of a conjugate)."""
    t = torch.complex(torch.zeros(len(values)), -torch.tensor(values)).conj().imag
    assert t.is_neg() and t.tolist() == values
    return t


def test_priorities_and_handles_with_a_view_bit_are_read_by_value() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((1,))), capacity=8,
                              semantics=Replay(sampler=PrioritizedSampler(alpha=1.0), seed=0))
    handles = edp.ingest({"x": torch.ones(2, 1)}, priorities=_negative_bit([1.0, 3.0]))
    assert handles is not None
    tree = edp.semantics.sampler._tree
    assert tree.get(np.array([0, 1])).tolist() == [1.0, 3.0]
    assert edp.update_priorities(handles, _negative_bit([2.0, 5.0])) == 2
    assert tree.get(np.array([0, 1])).tolist() == [2.0, 5.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_priorities_of_every_float_width_are_read_by_value(dtype: torch.dtype) -> None:
    """bfloat16 and float8, which NumPy has no type for, were a PriorityError ("real numbers") at ingest and update."""
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((1,))), capacity=8,
                              semantics=Replay(sampler=PrioritizedSampler(alpha=1.0), seed=0))
    handles = edp.ingest({"x": torch.ones(2, 1)}, priorities=torch.tensor([1.0, 3.0]).to(dtype))
    assert handles is not None
    tree = edp.semantics.sampler._tree
    assert tree.get(np.array([0, 1])).tolist() == [1.0, 3.0]
    assert edp.update_priorities(handles, torch.tensor([2.0, 0.5], requires_grad=True).to(dtype)) == 2
    assert tree.get(np.array([0, 1])).tolist() == [2.0, 0.5]
    with pytest.raises(PriorityError, match="NaN, infinite or negative"):
        edp.update_priorities(handles, torch.tensor([1.0, float("nan")]).to(dtype))
    assert tree.get(np.array([0, 1])).tolist() == [2.0, 0.5]


def test_complex_priorities_are_refused_not_truncated() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((1,))), capacity=8,
                              semantics=Replay(sampler=PrioritizedSampler(), seed=0))
    for bad in (torch.tensor([1 + 2j, 3j]), np.array([1 + 2j, 3j])):
        with pytest.raises(PriorityError, match="real numbers"):
            edp.ingest({"x": torch.ones(2, 1)}, priorities=bad)
    assert len(edp) == 0


def test_a_conjugate_view_is_stored_by_value() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(z=Field((2,), torch.complex64)), capacity=4, semantics=Replay(seed=0))
    z = torch.tensor([[1 + 2j, 3 - 1j], [0 + 1j, 2 + 0j]], dtype=torch.complex64)
    edp.ingest({"z": z.conj()})
    assert torch.equal(edp.storage._cols["z"][:2], z.conj().resolve_conj())


@pytest.mark.parametrize("kind", ["sparse", "meta", "ragged_sparse"])
def test_tensors_without_dense_values_are_refused_before_anything_changes(kind: str) -> None:
    ragged = kind.startswith("ragged")
    schema = ExperienceSchema(x=Field((2,)), t=Field((), torch.int64, ragged=True)) if ragged else \
        ExperienceSchema(x=Field((2,)))
    edp = ExperienceDataPlane(schema, capacity=2, semantics=Replay(seed=0))

    def batch(x: torch.Tensor, tokens: torch.Tensor | None = None) -> dict[str, object]:
        if not ragged:
            return {"x": x}
        values = tokens if tokens is not None else torch.arange(4)
        return {"x": x, "t": Ragged(values, torch.tensor([1, 3]))}

    edp.ingest(batch(torch.ones(2, 2)))  # full: a stored batch would evict both items
    before = (edp.storage.oldest, edp.storage.next_handle, edp.storage._cols["x"].clone())
    bad = {"sparse": batch(torch.eye(2).to_sparse()), "meta": batch(torch.empty(2, 2, device="meta")),
           "ragged_sparse": batch(torch.zeros(2, 2), torch.arange(4).to_sparse())}[kind]
    with pytest.raises(SchemaError, match="dense|meta"):
        edp.ingest(bad)
    after = (edp.storage.oldest, edp.storage.next_handle, edp.storage._cols["x"])
    assert after[:2] == before[:2] and torch.equal(after[2], before[2]), f"{kind}: a refused ingest changed the ring"


@pytest.mark.parametrize("priorities", [[1e-300, 1e300], [5e-324, 1.0], [1e-200, 1.0], [0.0, 1.0]])
def test_priorities_far_apart_give_finite_weights(priorities: list[float]) -> None:
    """Valid priorities however far apart: every draw gets a weight in [0, 1], the rarest item's being 1."""
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((1,))), capacity=2,
                              semantics=Replay(sampler=PrioritizedSampler(alpha=1.0, beta=1.0), seed=0))
    edp.ingest({"x": torch.tensor([[0.0], [1.0]])}, priorities=torch.tensor(priorities, dtype=torch.float64))
    for _ in range(4):
        batch, info = edp.deliver(64)
        assert info.weights is not None
        w = info.weights
        assert bool(torch.isfinite(w).all()) and float(w.min()) >= 0 and float(w.max()) <= 1, w
        rare = batch["x"].flatten() == 0  # the item of the smallest positive priority, if drawn, weighs exactly 1
        if priorities[0] > 0 and bool(rare.any()):
            assert bool((w[rare] == 1).all()), w


@pytest.mark.parametrize("n", [2**31, 10**20])
@pytest.mark.parametrize("prioritized", [False, True])
def test_a_delivery_larger_than_one_call_draws_is_refused_typed(n: int, prioritized: bool) -> None:
    sampler = PrioritizedSampler() if prioritized else None
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((1,))), capacity=7, semantics=Replay(sampler=sampler, seed=0))
    edp.ingest({"x": torch.arange(6.0).view(6, 1)})
    reference = ExperienceDataPlane(ExperienceSchema(x=Field((1,))), capacity=7,
                                    semantics=Replay(sampler=PrioritizedSampler() if prioritized else None, seed=0))
    reference.ingest({"x": torch.arange(6.0).view(6, 1)})
    with pytest.raises(ConfigurationError, match="ask for fewer"):
        edp.deliver(n)
    assert torch.equal(edp.deliver(5)[0]["x"], reference.deliver(5)[0]["x"]), "the refused call drew from the RNG"


@pytest.mark.parametrize(("alpha", "priority"), [(2.0, 1e300), (1.0, 1e308)])
def test_priorities_whose_power_overflows_are_refused_and_change_nothing(alpha: float, priority: float) -> None:
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((1,))), capacity=4,
                              semantics=Replay(sampler=PrioritizedSampler(alpha=alpha), seed=0))
    handles = edp.ingest({"x": torch.ones(2, 1)}, priorities=torch.tensor([1.0, 2.0]))
    assert handles is not None
    tree = edp.semantics.sampler._tree
    with pytest.raises(PriorityError, match="too large"):
        edp.ingest({"x": torch.ones(1, 1)}, priorities=torch.tensor([priority], dtype=torch.float64))
    with pytest.raises(PriorityError, match="too large"):
        edp.update_priorities(handles, torch.tensor([1.0, priority], dtype=torch.float64))
    assert len(edp) == 2 and tree.get(np.array([0, 1])).tolist() == [1.0, 2.0**alpha]
    assert np.isfinite(tree.total)


@pytest.mark.parametrize("semantics", ["uniform", "prioritized", "on_policy"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_checkpoint_loads_with_torch_loads_default_weights_only(semantics: str, tier: str, tmp_path: Any) -> None:
    """``torch.save(edp.state_dict(), f)`` then ``torch.load(f)`` (weights_only=True by default): tensors and
    plain Python values only, and the loaded buffer continues exactly as the saved one."""
    from conduit import DiskPlacement, OnPolicy

    def build() -> ExperienceDataPlane:
        sem = {"uniform": lambda: Replay(seed=3), "prioritized": lambda: Replay(sampler=PrioritizedSampler(), seed=3),
               "on_policy": lambda: OnPolicy(num_minibatches=2, seed=3)}[semantics]()
        schema = ExperienceSchema(x=Field((2,), torch.bfloat16), t=Field((), torch.int64, ragged=True))
        placement = DiskPlacement(directory=str(tmp_path)) if tier == "disk" else None
        return ExperienceDataPlane(schema, capacity=8, semantics=sem, placement=placement)

    edp = build()
    kw: dict[str, Any] = {"version": 0} if semantics == "on_policy" else {}
    edp.ingest({"x": torch.randn(5, 2).to(torch.bfloat16), "t": [[1], [2, 3], [], [4], [5, 6, 7]]}, **kw)
    if semantics == "on_policy":
        edp.seal()
    path = tmp_path / "ckpt.pt"
    torch.save(edp.state_dict(), path)
    restored = build()
    restored.load_state_dict(torch.load(path))  # weights_only=True: the default since torch 2.6
    for _ in range(2):
        a, _ = edp.deliver(3) if semantics != "on_policy" else edp.deliver()
        b, _ = restored.deliver(3) if semantics != "on_policy" else restored.deliver()
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["t"].values, b["t"].values)
    edp.close()
    restored.close()


def test_numpy_in_a_foreign_byte_order_is_stored_by_value() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((2,)), a=Field((), torch.int64)), capacity=4,
                              semantics=Replay(seed=0))
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    edp.ingest({"x": x.astype(">f4"), "a": np.array([7, 8, 9], dtype=">i8")})
    assert torch.equal(edp.storage._cols["x"][:3], torch.from_numpy(x))
    assert edp.storage._cols["a"][:3].tolist() == [7, 8, 9]
