"""Storage and batches: zero-length sequences, failed checkpoint loads, and a
randomized differential test of the ring (FIFO eviction, ragged pool wrap, release, round trips)."""

from __future__ import annotations

import random

import pytest
import torch
from conduit.batch import ExperienceBatch, Ragged
from conduit.errors import CapacityError
from conduit.schema import ExperienceSchema, Field
from conduit.storage.columnar import ColumnarStorage
from conduit.storage.sharded import ShardedStorage


def test_from_sequences_empty_list_keeps_dtype() -> None:
    r = Ragged.from_sequences([[1, 2], [], [3]])
    assert r.values.dtype == torch.int64
    assert r.lengths.tolist() == [2, 0, 1] and r.values.tolist() == [1, 2, 3]
    b = Ragged.from_sequences([[True], []])
    assert b.values.dtype == torch.bool
    v = Ragged.from_sequences([torch.ones(2, 3, dtype=torch.float64), []])
    assert v.values.dtype == torch.float64 and v.values.shape == (2, 3)


def test_ingest_lists_with_zero_length_sequence() -> None:
    schema = ExperienceSchema({"tok": Field((), torch.int64, ragged=True), "x": Field((), torch.float32)})
    batch = ExperienceBatch.checked({"tok": [[7, 8], []], "x": torch.zeros(2)}, schema)
    st = ColumnarStorage(schema, 4, ragged_capacity=8)
    st.append(batch)
    g = st.gather(torch.tensor([1, 0]))
    assert g["tok"].lengths.tolist() == [0, 2] and g["tok"].values.tolist() == [7, 8]


@pytest.mark.parametrize("sharded", [False, True])
def test_failed_load_of_oversized_ragged_checkpoint_changes_nothing(sharded: bool) -> None:
    schema = ExperienceSchema({"tok": Field((), torch.int64, ragged=True), "x": Field((), torch.float32)})

    def make(rcap: int) -> ColumnarStorage | ShardedStorage:
        if sharded:
            return ShardedStorage(schema, 4, ["cpu", "cpu"], ragged_capacity=rcap)
        return ColumnarStorage(schema, 4, ragged_capacity=rcap)

    big = make(100)
    big.append(ExperienceBatch({"tok": Ragged(torch.arange(40), torch.tensor([20, 20])), "x": torch.zeros(2)}, 2))
    small = make(30)
    small.append(ExperienceBatch({"tok": Ragged(torch.arange(5), torch.tensor([5])), "x": torch.ones(1)}, 1))
    with pytest.raises(CapacityError):
        small.load_state_dict(big.state_dict())
    assert (small.oldest, small.next_handle) == (0, 1)
    g = small.gather(torch.tensor([0]))
    assert g["tok"].values.tolist() == [0, 1, 2, 3, 4] and g["x"].tolist() == [1.0]


_SCHEMA = ExperienceSchema({"x": Field((2,), torch.float32), "b": Field((), torch.bool),
                            "h": Field((), torch.bfloat16), "tok": Field((), torch.int64, ragged=True),
                            "v": Field((3,), torch.float32, ragged=True)})


def _items(rng: random.Random, h0: int, n: int, maxlen: int) -> tuple[ExperienceBatch, list[dict[str, torch.Tensor]]]:
    items = []
    for h in range(h0, h0 + n):
        l1, l2 = rng.choice([0, 1, rng.randint(0, maxlen)]), rng.choice([0, rng.randint(0, maxlen)])
        items.append({"x": torch.tensor([h, -h], dtype=torch.float32), "b": torch.tensor(h % 3 == 0),
                      "h": torch.tensor(float(h % 200), dtype=torch.bfloat16),
                      "tok": torch.arange(l1, dtype=torch.int64) + 1000 * h,
                      "v": torch.full((l2, 3), float(h)) + torch.arange(l2)[:, None].float()})
    cols: dict[str, torch.Tensor | Ragged] = {}
    for k, shape, dt in (("x", (0, 2), torch.float32), ("b", (0,), torch.bool), ("h", (0,), torch.bfloat16)):
        cols[k] = torch.stack([i[k] for i in items]) if items else torch.empty(shape, dtype=dt)
    for k, shape in (("tok", (0,)), ("v", (0, 3))):
        dt = torch.int64 if k == "tok" else torch.float32
        vals = torch.cat([i[k] for i in items]) if items else torch.empty(shape, dtype=dt)
        cols[k] = Ragged(vals, torch.tensor([i[k].shape[0] for i in items], dtype=torch.int64))
    return ExperienceBatch(cols, n), items


@pytest.mark.parametrize("kind", ["columnar", "sharded"])
@pytest.mark.parametrize("seed", range(12))
def test_ring_matches_fifo_reference(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    cap, rcap = rng.randint(3, 12), rng.randint(1, 40)
    maxlen = rng.randint(0, min(rcap, 15))

    def make() -> ColumnarStorage | ShardedStorage:
        if kind == "sharded":
            return ShardedStorage(_SCHEMA, cap, ["cpu"] * 3, ragged_capacity=rcap)
        return ColumnarStorage(_SCHEMA, cap, ragged_capacity=rcap)

    st, ref = make(), {}
    for _ in range(150):
        op = rng.random()
        if op < 0.1:
            st.release(rng.randint(st.oldest - 1, st.next_handle + 1))
        elif op < 0.15:
            fresh = make()
            fresh.load_state_dict(st.state_dict())
            st = fresh
        else:
            batch, items = _items(rng, st.next_handle, rng.randint(0, cap), maxlen)
            if max(batch["tok"].values.shape[0], batch["v"].values.shape[0]) > rcap:  # type: ignore[union-attr]
                continue
            before = (st.oldest, st.next_handle)
            evict = rng.random() < 0.8
            try:
                res = st.append(batch, evict=evict)
            except CapacityError:
                assert not evict and (st.oldest, st.next_handle) == before
                continue
            assert (res.first, res.evicted_from, res.evicted_to) == (before[1], before[0], st.oldest)
            ref.update({res.first + j: it for j, it in enumerate(items)})
        ref = {h: it for h, it in ref.items() if h >= st.oldest}
        assert sorted(ref) == list(range(st.oldest, st.next_handle))
        if not ref:
            continue
        hs = sorted(ref)
        pick = [rng.choice(hs) for _ in range(2 * len(hs))]
        slots = torch.tensor([h % cap for h in pick])
        assert st.handles_of(slots).tolist() == pick
        g = st.gather(slots)
        for j, h in enumerate(pick):
            for k in ("x", "b", "h", "tok", "v"):
                assert torch.equal(g[k][j], ref[h][k]), (k, h)
