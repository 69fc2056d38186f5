"""Storage and schema: the ragged eviction walk (which items go, checked against a model, with
the ring invariant a checkpoint must keep), sharded gathers straight into the caller's buffers, and a schema field
given twice."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit.batch import ExperienceBatch, Ragged
from conduit.errors import CapacityError, ConduitError, ConfigurationError
from conduit.schema import ExperienceSchema, Field
from conduit.storage import columnar
from conduit.storage.base import ring_ordered
from conduit.storage.columnar import ColumnarStorage
from conduit.storage.sharded import ShardedStorage

sys.path.insert(0, str(Path(__file__).parent))
from test_schema_storage_refusals_and_disk_names import TOK, _tok_batch  # noqa: E402, I001


def _live(st: ColumnarStorage) -> dict[int, list[int]]:
    """Handle -> tokens of every live item (the fixed field names the handle: no row lost or moved)."""
    hs = list(range(st.oldest, st.next_handle))
    g = st.gather(torch.tensor([h % st.capacity for h in hs], dtype=torch.int64))
    assert g.tensor("x").tolist() == [float(h) for h in hs], "fixed field rows are not the live handles"
    tok = g["tok"]
    assert isinstance(tok, Ragged)
    return {h: tok[j].tolist() for j, h in enumerate(hs)}


class _PoolModel:
    """One ragged field's pool and the item ring, item by item: which items an append evicts.

    ``rule="sweep"`` is the documented rule (the items with elements in what the block sweeps from the head,
    a skipped pool end included, go with every older item); ``rule="overlap"`` is the rule the storage had
    before (the items whose elements overlap the block go with every older item).
    """

    def __init__(self, capacity: int, pool: int) -> None:
        self.capacity, self.pool = capacity, pool
        self.items: dict[int, tuple[int, int]] = {}  # handle -> (start, length)
        self.oldest = self.next = self.head = 0

    def evictions(self, lengths: list[int], rule: str) -> int:
        total = sum(lengths)
        k = max(0, self.next - self.oldest + len(lengths) - self.capacity)
        if not total:
            return k
        start = self.head if self.head + total <= self.pool else 0
        for i, h in enumerate(range(self.oldest, self.next)):
            s, ln = self.items[h]
            if not ln:
                continue
            if rule == "overlap":
                hit = s < start + total and s + ln > start
            else:
                span = total if start == self.head else self.pool - self.head + total
                hit = (s - self.head) % self.pool < span
            if hit:
                k = max(k, i + 1)
        return k

    def append(self, lengths: list[int]) -> int:
        k = self.evictions(lengths, "sweep")
        for h in range(self.oldest, self.oldest + k):
            del self.items[h]
        self.oldest += k
        total = sum(lengths)
        pos = self.head if self.head + total <= self.pool else 0
        for ln in lengths:
            self.items[self.next] = (pos, ln)
            self.next += 1
            pos += ln
        self.head = pos
        return k

    def release(self, upto: int) -> None:
        while self.oldest < min(upto, self.next):
            del self.items[self.oldest]
            self.oldest += 1

    def truncate(self, upto: int) -> None:
        """As if the items from ``upto`` on had never been appended: the head goes back to the newest live item's
        end (what follows it in the pool is free)."""
        while self.next > max(upto, self.oldest):
            self.next -= 1
            del self.items[self.next]
        if self.next > self.oldest:
            s, ln = self.items[self.next - 1]
            self.head = s + ln


def _check_against_model(st: ColumnarStorage, model: _PoolModel) -> None:
    assert (st.oldest, st.next_handle) == (model.oldest, model.next)
    assert _live(st) == {h: [1000 * h + j for j in range(ln)] for h, (_, ln) in model.items.items()}
    layout = st.ragged_layout()
    assert layout is not None
    lens = torch.tensor([model.items[h][1] for h in range(model.oldest, model.next)], dtype=torch.int64)
    assert ring_ordered(layout["starts"]["tok"], lens, layout["heads"]["tok"], model.pool), "ring invariant broken"


def _random_lengths(rng: random.Random, n: int) -> list[int]:
    return [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_ragged_evictions_follow_the_model_and_lose_nothing_else(seed: int) -> None:
    """Appends, releases and truncates in any order: each append evicts exactly the model's items, every other item
    keeps its tokens, and the pool keeps the ring invariant the eviction walk relies on. Without truncates the
    sweep rule evicts what the former overlap rule evicted."""
    rng = random.Random(seed)
    capacity, pool = rng.choice([(7, 20), (16, 40), (40, 64)])
    st = ColumnarStorage(TOK, capacity, ragged_capacity=pool)
    model = _PoolModel(capacity, pool)
    truncates = seed % 2 == 1
    for _ in range(300):
        op = rng.random()
        if op < 0.75:
            lengths = _random_lengths(rng, rng.randint(0, min(capacity, 6)))
            if sum(lengths) > pool:
                continue
            if not truncates:
                assert model.evictions(lengths, "overlap") == model.evictions(lengths, "sweep")
            want = model.append(lengths)
            res = st.append(_tok_batch(res_first := st.next_handle, lengths))
            assert res.first == res_first and (res.evicted_to - res.evicted_from) == want
        elif op < 0.9:
            upto = rng.randint(st.oldest, st.next_handle)
            st.release(upto)
            model.release(upto)
        elif truncates:
            upto = rng.randint(st.oldest, st.next_handle)
            st.truncate(upto)
            model.truncate(upto)
        _check_against_model(st, model)


def test_a_truncate_leaves_no_forgotten_elements_behind_the_head_so_no_block_sweeps_past_a_live_item() -> None:
    """A truncate forgets the newest items as if they had never been appended. The head used to stay past the
    forgotten elements, so a later block wrapped to the pool's start, sweeping the skipped pool end and evicting
    item 1 (5 elements in a pool with room for it); the head now goes back to item 1's end."""
    st = ColumnarStorage(TOK, 10, ragged_capacity=100)
    st.append(_tok_batch(0, [95]))
    st.append(_tok_batch(1, [5]))  # item 1 at [95, 100)
    st.append(_tok_batch(2, [50]))  # wraps: [0, 50), item 0 goes
    st.truncate(2)  # forget item 2: the head goes back to 100 (item 1's end)
    res = st.append(_tok_batch(2, [10]))  # wraps to [0, 10): it sweeps no live item
    assert (res.evicted_from, res.evicted_to) == (1, 1)
    res = st.append(_tok_batch(3, [45]))  # [10, 55)
    assert (res.evicted_from, res.evicted_to) == (1, 1)
    assert _live(st) == {1: [1000 + j for j in range(5)], 2: [2000 + j for j in range(10)],
                         3: [3000 + j for j in range(45)]}
    res = st.append(_tok_batch(4, [45]))  # [55, 100): over item 1, the oldest (FIFO)
    assert (res.evicted_from, res.evicted_to) == (1, 2)
    assert _live(st) == {2: [2000 + j for j in range(10)], 3: [3000 + j for j in range(45)],
                         4: [4000 + j for j in range(45)]}


def _count_walk(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many items each step of the ragged eviction walk reads (the list fills as appends run)."""
    read: list[int] = []
    rows = columnar._ring_rows

    def counting(starts: np.ndarray, lengths: np.ndarray, first: int, end: int,
                 capacity: int) -> tuple[np.ndarray, np.ndarray]:
        read.append(end - first)
        return rows(starts, lengths, first, end, capacity)

    monkeypatch.setattr(columnar, "_ring_rows", counting)
    return read


def test_the_eviction_walk_reads_about_the_items_it_evicts_not_every_live_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard against the scan over every live item coming back: with 20000 live items, 100 one-item appends read
    the bookkeeping of a few dozen items each (the former scan read all 20000 per append)."""
    st = ColumnarStorage(TOK, 20_000, ragged_capacity=80_000, prefault=False)
    for first in range(0, 20_000, 5_000):
        st.append(_tok_batch(first, [4] * 5_000))
    read = _count_walk(monkeypatch)
    for h in range(20_000, 20_100):
        res = st.append(_tok_batch(h, [4]))
        assert (res.evicted_from, res.evicted_to) == (h - 20_000, h - 20_000 + 1)
    assert read and sum(read) <= 100 * 64, f"the walk read {sum(read)} rows for 100 appends"
    live = _live(st)
    assert len(live) == 20_000 and live[20_099] == [20_099_000 + j for j in range(4)]


def test_the_walk_passes_leading_empty_items_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Items whose ragged field is empty are never evicted for pool room; the walk remembers that they hold
    nothing instead of reading them again on every append."""
    st = ColumnarStorage(TOK, 10_000, ragged_capacity=100)
    st.append(_tok_batch(0, [0] * 9_000))
    read = _count_walk(monkeypatch)
    st.append(_tok_batch(9_000, [50]))  # [0, 50): nothing to evict, but 9000 empty items to pass once
    first_walk = sum(read)
    assert first_walk >= 9_000
    for h in range(9_001, 9_022):  # [50, 60), then one element each
        st.append(_tok_batch(h, [10] if h == 9_001 else [1]))
    assert sum(read) - first_walk <= 21 * 64
    res = st.append(_tok_batch(9_022, [40]))  # 80 + 40 > 100: at [0, 40), over item 9000: every older item goes
    assert (res.evicted_from, res.evicted_to) == (0, 9_001)
    assert _live(st)[9_001] == [9_001_000 + j for j in range(10)]


def test_the_walk_does_not_skip_items_when_the_oldest_is_moved_back_after_a_refused_append() -> None:
    """A shard server undoes a release when the append after it is refused (``conduit.distributed.server`` sets
    ``_oldest`` back): the items it brings back hold elements, and the next walk must see them again."""
    st = ColumnarStorage(TOK, 10, ragged_capacity=20)
    st.append(_tok_batch(0, [5, 5, 5]))  # [0, 5), [5, 10), [10, 15)
    before = st.oldest
    st.release(2)
    with pytest.raises(CapacityError, match="may not evict"):
        st.append(_tok_batch(3, [20]), evict=False)  # the whole pool: item 2 would go
    st._oldest = before  # what the server's undo does
    st.append(_tok_batch(3, [5]))  # [15, 20)
    res = st.append(_tok_batch(4, [3]))  # wraps to [0, 3): over item 0
    assert (res.evicted_from, res.evicted_to) == (0, 1)
    assert _live(st) == {1: [1000 + j for j in range(5)], 2: [2000 + j for j in range(5)],
                         3: [3000 + j for j in range(5)], 4: [4000, 4001, 4002]}


def test_a_checkpoint_continues_with_the_same_evictions() -> None:
    rng = random.Random(7)
    st = ColumnarStorage(TOK, 16, ragged_capacity=80)
    for _ in range(40):
        st.append(_tok_batch(st.next_handle, _random_lengths(rng, rng.randint(1, 5))))
    loaded = ColumnarStorage(TOK, 16, ragged_capacity=80)
    loaded.load_state_dict(st.state_dict())
    assert loaded.ragged_layout() is not None and st.ragged_layout() is not None
    assert torch.equal(loaded.ragged_layout()["starts"]["tok"], st.ragged_layout()["starts"]["tok"])  # type: ignore[index]
    for _ in range(40):
        lengths = _random_lengths(rng, rng.randint(1, 5))
        assert st.append(_tok_batch(st.next_handle, lengths)) == loaded.append(_tok_batch(loaded.next_handle, lengths))
        assert _live(st) == _live(loaded)


def test_a_checkpoint_layout_out_of_ring_order_is_packed_and_nothing_is_overwritten() -> None:
    """A layout whose items are apart but not in ring order (what the former overlap rule could leave after a
    truncate) would let the walk miss an item; it is loaded packed, and later blocks land on no live item."""
    st = ColumnarStorage(TOK, 10, ragged_capacity=100)
    st.append(_tok_batch(0, [5, 10, 45]))
    state = st.state_dict()
    # items 0, 1, 2 at [95, 100), [50, 60), [0, 45) with the head at 45: out of ring order read from the head
    state["ragged_layout"]["starts"]["tok"] = torch.tensor([95, 50, 0], dtype=torch.int64)
    state["ragged_layout"]["heads"]["tok"] = 45
    assert not ring_ordered(torch.tensor([95, 50, 0]), torch.tensor([5, 10, 45]), 45, 100)
    loaded = ColumnarStorage(TOK, 10, ragged_capacity=100)
    loaded.load_state_dict(state)
    layout = loaded.ragged_layout()
    assert layout is not None and layout["starts"]["tok"].tolist() == [0, 5, 15] and layout["heads"]["tok"] == 60
    before = _live(loaded)
    assert before == {0: [j for j in range(5)], 1: [1000 + j for j in range(10)], 2: [2000 + j for j in range(45)]}
    loaded.append(_tok_batch(3, [10]))  # [60, 70): room, nothing evicted, nothing overwritten
    assert _live(loaded) == {**before, 3: [3000 + j for j in range(10)]}
    # a damaged layout is still refused, and leaves the storage as it was
    state["ragged_layout"]["starts"]["tok"] = torch.tensor([95, 50, 40], dtype=torch.int64)  # overlapping items
    with pytest.raises(ConfigurationError, match="damaged"):
        loaded.load_state_dict(state)
    assert 3 in _live(loaded)


def test_sharded_storage_evicts_like_columnar_storage() -> None:
    rng = random.Random(3)
    col = ColumnarStorage(TOK, 12, ragged_capacity=30)
    sh = ShardedStorage(TOK, 12, ["cpu"] * 3, ragged_capacity=30)
    for _ in range(60):
        lengths = _random_lengths(rng, rng.randint(1, 4))
        assert col.append(_tok_batch(col.next_handle, lengths)) == sh.append(_tok_batch(sh.next_handle, lengths))
    slots = torch.arange(col.oldest, col.next_handle) % 12
    a, b = col.gather(slots), sh.gather(slots)
    assert torch.equal(a.tensor("x"), b.tensor("x"))
    ra, rb = a["tok"], b["tok"]
    assert isinstance(ra, Ragged) and isinstance(rb, Ragged)
    assert torch.equal(ra.values, rb.values) and torch.equal(ra.lengths, rb.lengths)


# -- sharded gather into the caller's buffers -----------------------------------------------------------
MIXED = ExperienceSchema(obs=Field((3,), torch.float32), act=Field((), torch.int64),
                         f8=Field((2,), torch.float8_e4m3fn), done=Field((), torch.bool),
                         tok=Field((2,), torch.bfloat16, ragged=True))


def _mixed_batch(first: int, n: int) -> ExperienceBatch:
    """Rows that name their item, with float bit patterns a value comparison would miss (-0.0, NaN payloads)."""
    h = torch.arange(first, first + n)
    obs = torch.stack([h.float(), -h.float() * 0.0, torch.full((n,), float("nan"))], dim=1)
    obs.view(torch.int32)[:, 2] += h.to(torch.int32)  # a different NaN payload per item
    lengths = h % 4
    tok = torch.arange(int(lengths.sum()) * 2, dtype=torch.float32).reshape(-1, 2) + first
    return ExperienceBatch({"obs": obs, "act": h * 7, "f8": (h % 9).float().repeat(2, 1).T.to(torch.float8_e4m3fn),
                            "done": h % 3 == 0, "tok": Ragged(tok.to(torch.bfloat16), lengths)}, n)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (bool as is)."""
    return t if t.dtype == torch.bool else t.view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                                                   8: torch.int64}[t.element_size()])


def _filled(storage: ColumnarStorage | ShardedStorage) -> ColumnarStorage | ShardedStorage:
    for first in (0, 6, 12):  # 18 items into 10 slots: the ring wraps, the oldest 8 are gone
        storage.append(_mixed_batch(first, 6))
    return storage


def _out(n: int) -> dict[str, torch.Tensor]:
    return {name: torch.full((n, *MIXED[name].shape), 5, dtype=MIXED[name].dtype) for name in MIXED.fixed}


@pytest.mark.parametrize("shards", [1, 3, 4])
@pytest.mark.parametrize("slots", [[3, 1, 4, 1, 5, 9, 2, 6], list(range(8, 10)) + list(range(0, 6)),
                                   [2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5], [7], list(range(10))])
def test_a_sharded_gather_into_out_is_the_unsharded_gather_bit_for_bit(shards: int, slots: list[int]) -> None:
    """Random, consecutive, wrapping, descending and single slots, over one and several shards, fixed fields (a
    float8 one included) and a ragged one: the caller's buffers get exactly the unsharded rows, and are returned."""
    plain = _filled(ColumnarStorage(MIXED, 10, ragged_capacity=200))
    sharded = _filled(ShardedStorage(MIXED, 10, ["cpu"] * shards, ragged_capacity=200))
    idx = torch.tensor(slots, dtype=torch.int64)
    want = plain.gather(idx)
    out = _out(len(slots))
    got = sharded.gather(idx, out=out)
    for name in MIXED.fixed:
        assert got[name] is out[name], f"{name}: not delivered in the caller's buffer"
        assert torch.equal(_bits(out[name]), _bits(want.tensor(name))), f"{name} differs from the unsharded gather"
    rw, rg = want["tok"], got["tok"]
    assert isinstance(rw, Ragged) and isinstance(rg, Ragged)
    assert torch.equal(_bits(rg.values), _bits(rw.values)) and torch.equal(rg.lengths, rw.lengths)


class _Calls(torch.overrides.TorchFunctionMode):
    """Records the names of the torch functions called, and whether each was given ``out=``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.calls.append((getattr(func, "__name__", str(func)), kwargs.get("out") is not None))
        return func(*args, **kwargs)


def test_a_sharded_gather_of_consecutive_slots_selects_straight_into_out() -> None:
    """Consecutive slots give every shard evenly spaced positions of the batch: each shard's rows are selected
    into a view of the caller's buffer, with no rows gathered aside and copied over (``index_copy_``)."""
    sharded = _filled(ShardedStorage(MIXED, 12, ["cpu"] * 3, ragged_capacity=200))
    idx = torch.arange(2, 11)
    out = _out(9)
    with _Calls() as mode:
        sharded.gather(idx, out=out)
    selects = [with_out for name, with_out in mode.calls if name == "index_select"]
    assert len(selects) >= 3 * len(MIXED.fixed) and all(selects), mode.calls
    assert not any(name == "index_copy_" for name, _ in mode.calls), mode.calls
    assert out["act"].tolist() == [7 * (s + 12 if s < 6 else s) for s in range(2, 11)]  # items 12-17 took slots 0-5


# -- schema: a field given twice ----------------------------------------------------------------------------
def test_a_field_given_in_fields_and_as_a_keyword_is_refused_with_its_name() -> None:
    with pytest.raises(ConfigurationError, match="'obs'.*given both") as err:
        ExperienceSchema({"obs": Field((4,)), "act": Field((), torch.int64)}, obs=Field((8,)), rew=Field(()))
    assert isinstance(err.value, ConduitError) and "'act'" not in str(err.value) and "'rew'" not in str(err.value)
    with pytest.raises(ConfigurationError, match="'b', 'a' given both"):
        ExperienceSchema({"a": Field(()), "b": Field(())}, b=Field(()), a=Field(()))
    # each name once, from either side: built, fields first and keywords after
    schema = ExperienceSchema({"obs": Field((4,))}, act=Field((), torch.int64))
    assert list(schema) == ["obs", "act"] and schema["obs"].shape == (4,)
