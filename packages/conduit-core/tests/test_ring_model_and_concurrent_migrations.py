"""The ring storage against a model, the disk and sharded tiers and online migration.

Bugs found: a migration into ragged pools too small for the live items raised a CapacityError telling the caller to
"split the batch" (migrate documents a PlacementError: the new placement cannot hold the buffer), and a checkpoint
loaded while a migration copied left the buffer holding the items copied before the load under the checkpoint's
handles. Guards: a model of the ring with two ragged fields (refused appends change nothing, evictions are exactly
the oldest, checkpoints move between host, sharded and disk storage of any shard count), and migrations while real
threads ingest and deliver (replay and on-policy, a failing migration among them)."""

from __future__ import annotations

import copy
import random
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import (
    CapacityError,
    EmptyBufferError,
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PlacementError,
    PrioritizedSampler,
    Replay,
    SchemaError,
)
from conduit.batch import Ragged
from conduit.placement import DiskPlacement, HostPlacement, Placement, ShardedPlacement
from conduit.placement.migration import migrate
from conduit.storage import ColumnarStorage, DiskStorage, ShardedStorage, Storage

SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((3,), torch.float32),
                          tok=Field((), torch.int64, ragged=True))


def items(ids: list[int]) -> dict[str, Any]:
    """Item ``i``: obs ``(i, i + 1, -i)`` and ``i % 7`` tokens ``100 * i + j``."""
    t = torch.tensor(ids, dtype=torch.int64)
    return {"id": t, "obs": torch.stack([t.float(), t.float() + 1, -t.float()], 1),
            "tok": [torch.arange(i % 7, dtype=torch.int64) + 100 * i for i in ids]}


def check_items(b: ExperienceBatch) -> None:
    ids, obs = b.tensor("id"), b.tensor("obs")
    assert torch.equal(obs[:, 0], ids.float()) and torch.equal(obs[:, 2], -ids.float()), "obs corrupted"
    tok = b["tok"]
    assert isinstance(tok, Ragged)
    for j, i in enumerate(ids.tolist()):
        assert tok[j].tolist() == [100 * i + k for k in range(i % 7)], f"tokens of item {i} corrupted"


def live_ids(edp: ExperienceDataPlane) -> list[int]:
    return edp.state_dict()["storage"]["data"]["id"].tolist()


# -- bug: a migration into pools too small is a CapacityError ("split the batch") -----------------------------------
@pytest.mark.parametrize("target", ["host", "sharded", "disk"])
def test_a_migration_into_pools_too_small_for_the_live_items_is_a_placement_error_and_changes_nothing(
        target: str, tmp_path: Path) -> None:
    """``migrate`` documents PlacementError when the new placement cannot hold the buffer; a chunk of live items
    with more elements than the new pools raised CapacityError ("split the batch"), which a caller falling back to
    another placement on PlacementError does not catch."""
    placements: dict[str, Placement] = {"host": HostPlacement(), "sharded": ShardedPlacement(["cpu"] * 2),
                                        "disk": DiskPlacement(directory=tmp_path)}
    edp = ExperienceDataPlane(SCHEMA, capacity=30, ragged_capacity=200, semantics=Replay(seed=3))
    edp.ingest(items(list(range(24))))  # 72 tokens live
    storage, before = edp.storage, live_ids(edp)
    with pytest.raises(PlacementError, match="ragged_capacity"):
        edp.migrate(placements[target], ragged_capacity=50)
    assert edp.storage is storage and live_ids(edp) == before
    assert list(tmp_path.iterdir()) == [], "the abandoned disk storage left its files"
    b, _ = edp.deliver(8)
    check_items(b)
    report = edp.migrate(placements[target], ragged_capacity=72)  # exactly the live tokens: it fits
    assert report.items == 24 and live_ids(edp) == before


# -- bug: a checkpoint loaded while a migration copies --------------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 10])
def test_a_checkpoint_loaded_while_a_migration_copies_is_what_the_buffer_holds_after_it(offset: int) -> None:
    """Another thread loads a checkpoint between two chunks. Its handles overlapped those copied already, so the
    migration went on from where it was: the buffer then held the pre-load items of the first chunks under the
    checkpoint's handles (lost checkpoint items, resurrected old ones)."""
    def buffer() -> ExperienceDataPlane:
        return ExperienceDataPlane(SCHEMA, capacity=100, ragged_capacity=1000,
                                   semantics=Replay(PrioritizedSampler(alpha=0.6), seed=5))

    edp = buffer()
    edp.ingest(items(list(range(100))))
    other = buffer()
    other.ingest(items(list(range(1000, 1000 + offset))))
    other.ingest(items(list(range(1000 + offset, 1100 + offset))))  # live: handles [offset, 100 + offset)
    other.update_priorities(torch.arange(offset, 100 + offset), torch.arange(1, 101, dtype=torch.float32))
    ckpt = other.state_dict()
    loaded: list[int] = []

    def progress(chunks: int, copied: int) -> None:
        if chunks == 3 and not loaded:  # a copy is under way: items [0, copied) are in the new storage
            loaded.append(copied)
            t = threading.Thread(target=edp.load_state_dict, args=(ckpt,))
            t.start()
            t.join()

    migrate(edp, ShardedPlacement(["cpu"] * 3), chunk_bytes=400, progress=progress)
    assert loaded and loaded[0] > offset, "the load came after the first chunks, as meant"
    assert live_ids(edp) == ckpt["storage"]["data"]["id"].tolist(), "items copied before the load survived it"
    twin = buffer()
    twin.load_state_dict(ckpt)
    for _ in range(3):  # the same draws as the checkpoint's buffer: contents, priorities and RNG all its own
        (b1, i1), (b2, i2) = edp.deliver(16, beta=0.4), twin.deliver(16, beta=0.4)
        check_items(b1)
        assert torch.equal(i1.handles, i2.handles) and torch.equal(b1.tensor("id"), b2.tensor("id"))


# -- guard: the ring against a model --------------------------------------------------------------------------------
TWO = ExperienceSchema(x=Field((2,), torch.float32), tok=Field((), torch.int64, ragged=True),
                       pix=Field((3,), torch.int16, ragged=True))


def _pix_len(n: int) -> int:
    return (n * 7) % 4


def _two_batch(first: int, lengths: list[int]) -> ExperienceBatch:
    hs = range(first, first + len(lengths))
    tok = [torch.arange(n, dtype=torch.int64) + 1000 * h for h, n in zip(hs, lengths, strict=True)]
    pix = [torch.full((_pix_len(n), 3), h % 30000, dtype=torch.int16) for h, n in zip(hs, lengths, strict=True)]
    return ExperienceBatch({"x": torch.tensor([[float(h), -float(h)] for h in hs]).reshape(-1, 2),
                            "tok": Ragged.from_sequences(tok) if tok else Ragged(torch.empty(0, dtype=torch.int64),
                                                                                  torch.empty(0, dtype=torch.int64)),
                            "pix": Ragged.from_sequences(pix) if pix else Ragged(torch.empty(0, 3, dtype=torch.int16),
                                                                                  torch.empty(0, dtype=torch.int64))},
                           len(lengths))


class _Pool:
    """One ragged pool as the documented rule has it: a block goes at the head, or at the start when it does not fit
    before the end; the items with elements in what it sweeps from the head go, with every older item."""

    def __init__(self, size: int) -> None:
        self.size, self.head = size, 0
        self.items: dict[int, tuple[int, int]] = {}

    def evictions(self, oldest: int, nxt: int, lengths: list[int]) -> int:
        total = sum(lengths)
        if not total:
            return 0
        span = total if self.head + total <= self.size else self.size - self.head + total
        hit = [i + 1 for i, h in enumerate(range(oldest, nxt))
               if self.items[h][1] and (self.items[h][0] - self.head) % self.size < span]
        return max(hit, default=0)

    def place(self, first: int, lengths: list[int]) -> None:
        pos = self.head if self.head + sum(lengths) <= self.size else 0
        for i, n in enumerate(lengths):
            self.items[first + i] = (pos, n)
            pos += n
        self.head = pos


def _readback(st: Storage) -> dict[int, tuple[list[int], list[list[int]]]]:
    """Handle -> (tokens, pixels) of every live item, read into ``out`` buffers; the fixed rows name the handles."""
    hs = list(range(st.oldest, st.next_handle))
    out = {"x": torch.full((len(hs), 2), -1.0)}
    g = st.gather(torch.tensor([h % st.capacity for h in hs], dtype=torch.int64), out)
    assert out["x"][:, 0].tolist() == [float(h) for h in hs], "a fixed row is not its handle's"
    tok, pix = g["tok"], g["pix"]
    assert isinstance(tok, Ragged) and isinstance(pix, Ragged)
    return {h: (tok[j].tolist(), pix[j].tolist()) for j, h in enumerate(hs)}


@pytest.mark.parametrize("seed", range(3))
def test_the_ring_with_two_ragged_fields_follows_the_model_across_tiers_and_checkpoints(seed: int,
                                                                                          tmp_path: Path) -> None:
    rng = random.Random(seed)
    capacity, pool = rng.choice([(7, 20), (16, 40), (10, 64)])

    def build(kind: str) -> Storage:
        if kind == "disk":
            return DiskStorage(TWO, capacity, directory=tmp_path, ragged_capacity=pool)
        if kind == "host":
            return ColumnarStorage(TWO, capacity, ragged_capacity=pool)
        return ShardedStorage(TWO, capacity, ["cpu"] * int(kind[-1]), ragged_capacity=pool)

    kind = "host"
    st = build(kind)
    oldest = nxt = 0
    pools = {"tok": _Pool(pool), "pix": _Pool(pool)}
    for _ in range(200):
        op = rng.random()
        if op < 0.75:
            lengths = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(0, capacity + 1))]
            per = {"tok": lengths, "pix": [_pix_len(n) for n in lengths]}
            fits = len(lengths) <= capacity and all(sum(v) <= pool for v in per.values())
            want = max([max(0, nxt - oldest + len(lengths) - capacity)]
                       + [pools[f].evictions(oldest, nxt, per[f]) for f in pools]) if fits else -1
            evict = rng.random() < 0.7
            before = (st.oldest, st.next_handle, _readback(st), str(st.ragged_layout()))
            try:
                res = st.append(_two_batch(nxt, lengths), evict=evict)
            except CapacityError:
                assert not fits or (want and not evict), "an append that fits was refused"
                assert (st.oldest, st.next_handle, _readback(st), str(st.ragged_layout())) == before, \
                    "a refused append changed the storage"
                continue
            assert fits and (evict or not want), "an append that needs evictions went ahead without them"
            assert (res.first, res.evicted_from, res.evicted_to) == (nxt, oldest, oldest + want), "not the oldest"
            oldest += want
            for f, p in pools.items():
                p.place(nxt, per[f])
            nxt += len(lengths)
        elif op < 0.85:
            upto = rng.randint(oldest, nxt)
            st.release(upto)
            oldest = max(oldest, upto)
        else:  # a checkpoint, through torch's copy of it, into another tier (any shard count): the ring goes on
            state = copy.deepcopy(st.state_dict())
            kind = rng.choice(["host", "sharded1", "sharded2", "sharded3", "disk"])
            if isinstance(st, DiskStorage):
                st.close()
            st = build(kind)
            st.load_state_dict(state)
        assert (st.oldest, st.next_handle) == (oldest, nxt)
        for h, (tok, pix) in _readback(st).items():
            n = pools["tok"].items[h][1]
            assert tok == [1000 * h + j for j in range(n)] and pix == [[h % 30000] * 3] * _pix_len(n), \
                f"item {h} is not as written"
    if isinstance(st, DiskStorage):
        st.close()


# -- guard: migrations while real threads ingest and deliver --------------------------------------------------------
def test_replay_migrations_under_two_producers_and_a_learner_lose_duplicate_and_reorder_nothing(
        tmp_path: Path) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=300, ragged_capacity=1200,
                              semantics=Replay(PrioritizedSampler(alpha=0.6), seed=0))
    first = edp.ingest(items(list(range(-300, 0))))
    assert first is not None
    named = dict(zip(first.tolist(), range(-300, 0), strict=True))  # handle -> item id, as ingest returned it
    guard = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    delivered: list[tuple[list[int], list[int]]] = []

    def producer(p: int) -> None:
        try:
            s = 0
            while not stop.is_set():
                ids = [p * 1_000_000 + s + j for j in range(5)]
                hs = edp.ingest(items(ids))
                assert hs is not None
                with guard:
                    for h, i in zip(hs.tolist(), ids, strict=True):
                        assert h not in named, f"handle {h} given twice"
                        named[h] = i
                s += 5
        except BaseException as e:  # reported below
            errors.append(e)

    def learner() -> None:
        try:
            while not stop.is_set():
                b, info = edp.deliver(32, beta=0.4)
                check_items(b)
                delivered.append((info.handles.tolist(), b.tensor("id").tolist()))
                edp.update_priorities(info.handles, torch.rand(32) + 0.1)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(p,)) for p in (1, 2)] + [threading.Thread(target=learner)]
    for t in threads:
        t.start()
    try:
        for placement in [ShardedPlacement(["cpu"] * 3), DiskPlacement(directory=tmp_path),
                          ShardedPlacement(["cpu"] * 2), HostPlacement()]:
            report = migrate(edp, placement, chunk_bytes=600)
            assert report.items == 300 and report.chunks > 1
        with pytest.raises(SchemaError):  # a migration to a grown schema failing part way, while the others go on
            calls = iter(range(1000))
            grown = ExperienceSchema(**dict(SCHEMA), flag=Field((), torch.int64))

            def grow(b: ExperienceBatch) -> dict[str, Any]:
                if next(calls) >= 4:
                    return {"id": b["id"]}  # (the fifth chunk: fields missing)
                return {**{k: b[k] for k in SCHEMA}, "flag": torch.zeros(b.batch_size, dtype=torch.int64)}

            migrate(edp, ShardedPlacement(["cpu"] * 2), chunk_bytes=600, schema=grown, transform=grow)
        assert isinstance(edp.storage, ColumnarStorage) and edp.storage.tier == "host"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    state = edp.state_dict()["storage"]
    assert [named[h] for h in range(state["oldest"], state["next"])] == state["data"]["id"].tolist(), \
        "a live item is not the one its handle was given to"
    assert sorted(named) == list(range(max(named) + 1)), "handles skipped or repeated"
    assert delivered and all([named[h] for h in hs] == ids for hs, ids in delivered), "a delivery mixed up items"


def test_on_policy_migrations_while_rollouts_are_ingested_and_delivered_keep_every_epoch_exact(
        tmp_path: Path) -> None:
    rollouts, m, e = 25, 4, 2
    edp = ExperienceDataPlane(SCHEMA, capacity=100, ragged_capacity=300,
                              semantics=OnPolicy(num_minibatches=m, num_epochs=e))
    errors: list[BaseException] = []
    done, stop = threading.Event(), threading.Event()  # stop: the test failed, the threads give up
    got: dict[int, list[list[int]]] = defaultdict(list)

    def producer() -> None:
        try:
            for v in range(rollouts):
                for piece in range(4):
                    ids = [v * 1000 + piece * 10 + j for j in range(10)]
                    while not stop.is_set():
                        try:
                            edp.ingest(items(ids), version=v)
                            break
                        except CapacityError:  # the buffer is full of unconsumed rollouts: refused, unchanged
                            time.sleep(0.0005)
                edp.seal()
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            done.set()

    def learner() -> None:
        try:
            n = 0
            while n < rollouts * m * e and not stop.is_set():
                try:
                    b, _ = edp.deliver()
                except EmptyBufferError:
                    time.sleep(0.0005)
                    continue
                check_items(b)
                ids = b.tensor("id").tolist()
                got[ids[0] // 1000].append(ids)
                n += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=producer), threading.Thread(target=learner)]
    for t in threads:
        t.start()
    targets = [ShardedPlacement(["cpu"] * 3), DiskPlacement(directory=tmp_path), HostPlacement()]
    moves = 0
    try:
        while (not done.is_set() or moves < 3) and not errors:
            migrate(edp, targets[moves % 3], chunk_bytes=300)
            moves += 1
    finally:
        if errors or not done.is_set():
            stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    for v in range(rollouts):
        rollout = sorted(v * 1000 + p * 10 + j for p in range(4) for j in range(10))
        assert len(got[v]) == m * e, f"rollout {v}: {len(got[v])} minibatches"
        for epoch in range(e):
            assert sorted(i for mb in got[v][epoch * m:(epoch + 1) * m] for i in mb) == rollout, \
                f"rollout {v} epoch {epoch} lost or repeated items"
    assert len(edp) == 0
