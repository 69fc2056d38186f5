"""Replay and on-policy semantics beyond the conformance suite: edge cases and error paths."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    PriorityError,
    Replay,
)
from conduit.semantics.sumtree import COMPILED, CompiledSumTree, SumTree

#: every sum tree kind: NumPy's two (leaves only, two levels) and the compiled one (where this install has it)
TREES = ["leaves-only", "two-level",
         pytest.param("compiled", marks=pytest.mark.skipif(not COMPILED, reason="no compiled kernels in this install "
                                                                                "(test_the_compiled_tree_is_built "
                                                                                "says whether that is expected)"))]


def make_tree(kind: str, capacity: int) -> SumTree | CompiledSumTree:
    return CompiledSumTree(capacity) if kind == "compiled" else SumTree(capacity, flat=kind == "leaves-only")

SCHEMA = ExperienceSchema(id=Field((), torch.int64))


def ids(a: int, b: int) -> dict[str, torch.Tensor]:
    return {"id": torch.arange(a, b)}


@pytest.mark.parametrize("kind", TREES)
def test_sumtree_sums_and_finds(kind: str) -> None:
    t = make_tree(kind, 5)
    t.set(np.arange(5), np.array([1.0, 0.0, 2.0, 3.0, 4.0]))
    assert t.total == 10.0 and t.min == 1.0
    assert t.find(np.array([0.0, 0.99, 1.0, 2.99, 3.0, 5.99, 6.0, 9.99])).tolist() == [0, 0, 2, 2, 3, 3, 4, 4]
    t.set(np.array([4, 4]), np.array([7.0, 0.5]))  # a repeated slot: the last value wins
    assert t.total == 6.5 and t.min == 0.5


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("capacity", [5, 100, 20_000])
def test_sumtree_searches_past_the_total_stay_inside_the_capacity(capacity: int, kind: str) -> None:
    """Values at, past or beyond the total (rounding, inf, NaN) land on a slot below the capacity: never on the
    padding past it (the two-level tree's last block ran into it)."""
    t = make_tree(kind, capacity)
    t.set(np.array([1, 3]), np.array([1.0, 2.0]))
    found = t.find(np.array([3.0, 4.0, np.inf, np.nan, np.nextafter(3.0, 4.0)]))
    assert 0 <= found.min() and found.max() < capacity, found.tolist()


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("write", ["set_one(10, 5.0)", "set_one(-1, 5.0)",
                                   "set(np.array([-1, 2]), np.array([5.0, 1.0]))",
                                   "set(np.array([10, 2]), np.array([5.0, 1.0]))"])
def test_sumtree_refuses_slots_outside_the_capacity(kind: str, write: str) -> None:
    """A slot past the capacity or negative is an IndexError that changes nothing, on every tree (NumPy's wrote
    the padding: its total counted weights no slot holds)."""
    t = make_tree(kind, 10)
    t.set(np.arange(10), np.ones(10))
    with pytest.raises(IndexError):
        eval(f"t.{write}")  # noqa: S307 - one of the literal calls above
    assert t.total == t.state().sum() == 10.0


@pytest.mark.parametrize("kind", TREES)
def test_sumtree_searches_keep_the_shape_of_their_values(kind: str) -> None:
    t = make_tree(kind, 10)
    t.set(np.arange(10), np.ones(10))
    for u in (np.float64(3.5), np.array([[1.5, 2.5], [3.5, 4.5]])):
        assert np.shape(t.find(u)) == np.shape(u)
    assert t.find(np.array([[1.5, 2.5], [3.5, 4.5]])).tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("capacity", [1, 17, 1000, 70_001])
def test_sumtree_matches_a_brute_force_prefix_search(capacity: int, kind: str) -> None:
    """Several blocks, zero weights, repeated and one-slot updates: totals, minima and searches agree with NumPy.

    Some rounds read nothing (updates pile up between two reads) and the first read alternates
    between a search and the total (either one brings stale blocks up to date).
    """
    rng = np.random.default_rng(capacity)
    t = make_tree(kind, capacity)
    w = np.zeros(capacity)
    for i in range(12):
        k = 1 if i % 2 else int(rng.integers(1, min(capacity, 600) + 1))  # odd rounds: the one-slot path
        slots = rng.integers(0, capacity, k)
        vals = rng.random(k) * (rng.random(k) > 0.3)  # about 30% zeros
        t.set(slots, vals)
        for s_, v in zip(slots, vals, strict=True):  # the last value wins for a repeated slot
            w[s_] = v
        if i % 3 == 1:
            continue  # no read: the next round's updates land on top of this one's
        cum = np.cumsum(w)
        if cum[-1] > 0 and i % 2 == 0:
            u = rng.random(512) * cum[-1]
            found = t.find(u)
            assert (w[found] > 0).all(), "a zero weight was found"
            assert np.array_equal(found, np.searchsorted(cum, u, side="right"))
        assert t.total == pytest.approx(cum[-1], rel=1e-12)
        assert t.min == (w[w > 0].min() if (w > 0).any() else np.inf)
        if cum[-1] > 0:
            u = rng.random(512) * cum[-1]
            found = t.find(u)
            assert (w[found] > 0).all(), "a zero weight was found"
            assert np.array_equal(found, np.searchsorted(cum, u, side="right"))
    t2 = make_tree(kind, capacity)
    t2.find(np.zeros(1))  # (a search before the load: what it keeps must not outlive the load)
    t2.load(t.state())
    assert np.array_equal(t2.state(), w) and t2.total == t.total and t2.min == t.min
    if t.total > 0:
        u = rng.random(64) * t.total
        assert np.array_equal(t2.find(u), t.find(u)), "a loaded tree searches other weights than the saved one"


@pytest.mark.parametrize("kind", TREES)
def test_sumtree_total_and_minimum_follow_every_write(kind: str) -> None:
    """The total and the smallest positive weight are kept between reads: each kind of write (several slots, one
    slot, a load) changes them, including a full buffer of positive weights (read without a zero mask) that gets a
    zero weight."""
    t = make_tree(kind, 200)
    w = np.arange(1.0, 201.0)
    t.set(np.arange(200), w)
    assert (t.total, t.min) == (w.sum(), 1.0)
    t.set_one(7, 0.25)
    w[7] = 0.25
    assert (t.total, t.min) == (w.sum(), 0.25)
    t.set(np.array([7, 150]), np.array([0.0, 0.5]))  # a zero weight: not the smallest positive one
    w[7], w[150] = 0.0, 0.5
    assert (t.total, t.min) == (w.sum(), 0.5)
    t.load(np.full(200, 3.0))
    assert (t.total, t.min) == (600.0, 3.0)
    t.set(np.arange(200), np.zeros(200))
    assert (t.total, t.min) == (0.0, np.inf)


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_copied_sumtree_searches_its_own_weights(kind: str, copy_of: str) -> None:
    """A deep copy or an unpickled tree (SRL's checkpoints pickle the buffer) is independent of the original: writes
    to either change only its own searches, totals and minima. (The two-level tree's blocks are a view of its leaves:
    copied as an array of their own, the copy's searches read the leaves as they were at the copy.)"""
    import copy
    import pickle

    t = make_tree(kind, 100)
    t.set(np.arange(100), np.ones(100))
    assert t.total == 100.0  # (read once: the kept total is copied too)
    c = copy.deepcopy(t) if copy_of == "deepcopy" else pickle.loads(pickle.dumps(t))
    c.set(np.arange(100), np.zeros(100))
    c.set(np.array([5]), np.array([2.0]))
    assert c.find(np.array([0.0, 1.0, 1.99])).tolist() == [5, 5, 5]
    assert (c.total, c.min) == (2.0, 2.0)
    assert t.find(np.array([0.5, 99.5])).tolist() == [0, 99] and (t.total, t.min) == (100.0, 1.0)


def test_sampling_errors() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8)
    with pytest.raises(EmptyBufferError, match="empty"):
        edp.deliver(4)
    edp.ingest(ids(0, 3))
    with pytest.raises(CapacityError, match="distinct"):
        edp.deliver(4, replace=False)
    with pytest.raises(ConfigurationError, match="positive batch size"):
        edp.deliver(0)
    batch, _ = edp.deliver(3, replace=False)
    assert sorted(batch["id"].tolist()) == [0, 1, 2]


def test_priority_update_errors_leave_priorities_unchanged() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=0))
    edp.ingest(ids(0, 4))
    _, info = edp.deliver(4)
    edp.update_priorities(info.handles, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    sampler = edp.semantics.sampler  # type: ignore[attr-defined]
    before = sampler.state_dict()["leaves"].clone()
    for bad in (torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.tensor([1.0, -2.0, 1.0, 1.0]),
                torch.tensor([1.0, float("inf"), 1.0, 1.0])):
        with pytest.raises(PriorityError):
            edp.update_priorities(info.handles, bad)
    with pytest.raises(PriorityError, match="one priority per handle"):
        edp.update_priorities(info.handles, torch.ones(3))
    np.testing.assert_array_equal(sampler.state_dict()["leaves"], before)


def test_all_zero_priorities_cannot_be_sampled() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=4, semantics=Replay(PrioritizedSampler()))
    edp.ingest(ids(0, 2), priorities=torch.zeros(2))
    with pytest.raises(EmptyBufferError, match="priority 0"):
        edp.deliver(2)


def test_priorities_whose_power_underflows_are_named_in_the_refusal() -> None:
    """Positive priorities so small that ``p ** alpha`` is 0 in float64 weigh nothing in the tree: the refusal said
    "Every live item has priority 0", which the caller could not find in its priorities; it names the underflow."""
    edp = ExperienceDataPlane(SCHEMA, capacity=4, semantics=Replay(PrioritizedSampler(alpha=2.0)))
    edp.ingest(ids(0, 2), priorities=torch.full((2,), 1e-200, dtype=torch.float64))
    with pytest.raises(EmptyBufferError, match=r"underflows float64 to 0: below about 2\.22e-162 at alpha=2"):
        edp.deliver(2)


def test_new_items_get_the_largest_priority_seen() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(PrioritizedSampler(alpha=1.0)))
    edp.ingest(ids(0, 2), priorities=torch.tensor([5.0, 1.0]))
    edp.ingest(ids(2, 3))
    leaves = edp.semantics.sampler.state_dict()["leaves"]  # type: ignore[attr-defined]
    assert leaves[:3].tolist() == [5.0, 1.0, 5.0]


def test_update_priorities_reports_how_many_were_live() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=4, semantics=Replay(PrioritizedSampler()))
    edp.ingest(ids(0, 4))
    _, info = edp.deliver(16)
    edp.ingest(ids(4, 6))  # handles 0 and 1 evicted
    live = int((info.handles >= 2).sum())
    assert edp.update_priorities(info.handles, torch.ones(16)) == live


def test_on_policy_minibatch_size_mode_and_release() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=32, semantics=OnPolicy(minibatch_size=4, num_epochs=2, seed=3))
    edp.ingest(ids(0, 10), version=0)
    with pytest.raises(EmptyBufferError, match="seal"):
        edp.deliver()
    edp.seal()
    sizes, seen = [], []
    for _ in range(6):
        b, info = edp.deliver()
        sizes.append(b.batch_size)
        seen.extend(b["id"].tolist())
        assert info.num_minibatches == 3
    assert sizes == [4, 4, 2, 4, 4, 2]
    assert sorted(seen) == sorted(list(range(10)) * 2)
    assert info.last and len(edp) == 0  # storage released after the last minibatch
    with pytest.raises(ConfigurationError, match="without n"):
        edp.deliver(4)


def test_on_policy_versions_seal_automatically_and_count_drops() -> None:
    sem = OnPolicy(num_minibatches=1, max_staleness=0)
    edp = ExperienceDataPlane(SCHEMA, capacity=32, semantics=sem)
    edp.ingest(ids(0, 3), version=0)
    edp.ingest(ids(3, 5), version=1)  # version 0's rollout is sealed by the new version
    edp.seal()
    edp.set_policy_version(1)
    b, info = edp.deliver()
    assert info.version == 1 and sorted(b["id"].tolist()) == [3, 4]
    assert sem.dropped_items == 3 and len(edp) == 0


def test_constructor_errors_explain() -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        OnPolicy()
    with pytest.raises(ConfigurationError, match="on_stale"):
        OnPolicy(num_minibatches=2, on_stale="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="alpha"):
        PrioritizedSampler(alpha=-1)


def test_state_dict_round_trip_on_policy_mid_epoch() -> None:
    def make() -> ExperienceDataPlane:
        return ExperienceDataPlane(SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=4, num_epochs=3, seed=1))

    a = make()
    a.ingest(ids(0, 20), version=0)
    a.seal()
    a.deliver()
    a.deliver()
    state = a.state_dict()
    rest_a = [a.deliver()[0]["id"].tolist() for _ in range(10)]
    b = make()
    b.load_state_dict(state)
    rest_b = [b.deliver()[0]["id"].tolist() for _ in range(10)]
    assert rest_a == rest_b


def test_telemetry_records_bytes_and_seconds_per_call(tmp_path) -> None:  # noqa: ANN001
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((8,))), capacity=16)
    edp.ingest({"obs": torch.zeros(4, 8)})
    edp.deliver(2)
    tot = edp.telemetry.totals
    assert tot["ingest"].calls == 1 and tot["ingest"].nbytes == 4 * 8 * 4 and tot["ingest"].items == 4
    assert tot["deliver"].calls == 1 and tot["deliver"].nbytes == 2 * 8 * 4
    assert tot["ingest"].seconds > 0 and tot["deliver"].seconds > 0
    # the caller's whole call ("*_wait") is recorded around the work it did
    assert tot["ingest_wait"].calls == 1 and tot["ingest_wait"].items == 4 and tot["deliver_wait"].items == 2
    spans = {r.kind: r for r in edp.telemetry.records}
    for kind in ("ingest", "deliver"):
        outer, inner = spans[f"{kind}_wait"], spans[kind]
        assert outer.start <= inner.start and inner.end <= outer.end, (outer, inner)
    trace = edp.telemetry.chrome_trace(tmp_path / "t.json")
    assert sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X") == [
        "deliver", "deliver_wait", "ingest", "ingest_wait"]
    assert (tmp_path / "t.json").read_text().startswith("{")


def test_delivered_buffers_are_reused_after_output_depth() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8)
    edp.ingest(ids(0, 8))
    first, _ = edp.deliver(4)
    keep = first.clone()
    second, _ = edp.deliver(4)
    third, _ = edp.deliver(4)
    assert second["id"].data_ptr() != first["id"].data_ptr()
    assert third["id"].data_ptr() == first["id"].data_ptr()  # depth 2: the third reuses the first's buffer
    assert keep["id"].data_ptr() != first["id"].data_ptr()


def test_an_unreferenced_host_batch_buffer_is_reused_and_a_referenced_one_never() -> None:
    rows = 64  # 64 x 4096 float32 = 1 MiB: large enough for the reuse (smaller batches just rotate)
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((4096,))), capacity=256)
    edp.ingest({"x": torch.randn(256, 4096)})

    def ptr() -> int:  # deliver, drop the batch, return where it was written
        return edp.deliver(rows)[0]["x"].data_ptr()

    assert len({ptr() for _ in range(4)}) == 1  # dropped each time: one cache-warm buffer
    small = ExperienceDataPlane(SCHEMA, capacity=8)
    small.ingest(ids(0, 8))
    assert len({small.deliver(4)[0]["id"].data_ptr() for _ in range(4)}) == 2  # below 1 MiB: plain rotation
    holders = {  # a way to keep a delivered tensor's memory -> reading it back as rows of the batch
        "tensor": (lambda t: t, lambda h: h),
        "view": (lambda t: t[1:], lambda h: h),  # rows 1.. of the batch
        "numpy": (lambda t: t.numpy(), torch.from_numpy),
        "storage": (lambda t: t.untyped_storage(), lambda h: torch.empty(0).set_(h)[: rows * 4096].view(rows, 4096)),
    }
    for name, (keep, read) in holders.items():
        batch, _ = edp.deliver(rows)
        held, where, before = keep(batch["x"]), batch["x"].data_ptr(), batch["x"].clone()
        del batch  # only ``held`` still refers to the buffer
        for _ in range(3):
            assert edp.deliver(rows)[0]["x"].data_ptr() != where, f"{name}: a held buffer was reused"
        got = read(held)
        assert torch.equal(got, before[-got.shape[0]:]), f"{name}: a referenced batch was overwritten"
        del held, got

    # a C++ owner only: autograd saved the delivered tensor for the backward pass
    batch, _ = edp.deliver(rows)
    w = torch.ones(4096, requires_grad=True)
    loss = (batch["x"] * w).sum()
    where, expected = batch["x"].data_ptr(), batch["x"].sum(0)
    del batch
    for _ in range(3):
        assert edp.deliver(rows)[0]["x"].data_ptr() != where
    loss.backward()
    assert w.grad is not None and torch.allclose(w.grad, expected), "a tensor autograd saved was overwritten"


def test_without_torchs_owner_counts_delivery_buffers_rotate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reuse reads private torch counters; a torch without them must still deliver correctly."""
    import conduit.edp as edp_mod

    assert edp_mod._owner_counts_work(), "this torch has the counters: the reuse is on in the tests above"

    def renamed(buf: object) -> tuple[int, ...]:
        raise AttributeError("'Tensor' object has no attribute '_use_count'")

    monkeypatch.setattr(edp_mod, "_owners", renamed)
    assert not edp_mod._owner_counts_work()
    monkeypatch.setattr(edp_mod, "_OWNER_COUNTS", edp_mod._owner_counts_work())
    edp = ExperienceDataPlane(ExperienceSchema(x=Field((4096,))), capacity=256)
    edp.ingest({"x": torch.arange(256, dtype=torch.float32)[:, None].expand(256, 4096).contiguous()})
    ptrs = {edp.deliver(64)[0]["x"].data_ptr() for _ in range(4)}
    assert len(ptrs) == 2, "without the counters, deliveries rotate over the two output buffers"
    first, _ = edp.deliver(64)
    before = first["x"].clone()
    second, _ = edp.deliver(64)
    assert first["x"].data_ptr() != second["x"].data_ptr()
    assert torch.equal(first["x"], before), "a batch was overwritten before the second delivery after it"


def test_on_policy_epoch_order_hook_is_followed_and_checked() -> None:
    """An adapter's own per-epoch order is delivered as given; one that skips or repeats an item is refused."""

    class Reversed(OnPolicy):
        def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
            return torch.arange(n - 1, -1, -1) if epoch == 0 else torch.arange(n)

    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Reversed(num_minibatches=2, num_epochs=2))
    edp.ingest(ids(0, 6), version=0)
    edp.seal()
    got = [edp.deliver()[0]["id"].tolist() for _ in range(4)]
    assert got == [[5, 4, 3], [2, 1, 0], [0, 1, 2], [3, 4, 5]]

    class Repeats(OnPolicy):
        def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64)

    bad = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Repeats(num_minibatches=2))
    bad.ingest(ids(0, 4), version=0)
    bad.seal()
    for _ in range(2):  # the rollout stays pending: the error repeats, nothing is consumed
        with pytest.raises(ConfigurationError, match="not a permutation"):
            bad.deliver()
    assert len(bad) == 4 and bad.semantics.pending_rollouts == 1  # type: ignore[attr-defined]


def test_prioritized_never_draws_items_a_ragged_pool_evicted() -> None:
    """A long sequence evicts more items than it adds: the vacated slots get weight 0 and are never drawn."""
    from conduit import Ragged

    schema = ExperienceSchema(id=Field((), torch.int64), tokens=Field((), torch.int64, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=8, ragged_capacity=32,
                              semantics=Replay(PrioritizedSampler(alpha=1.0), seed=0))
    for i in range(8):  # eight items of 4 tokens fill the pool
        edp.ingest({"id": torch.tensor([i]), "tokens": Ragged(torch.full((4,), i), torch.tensor([4]))})
    edp.ingest({"id": torch.tensor([8]), "tokens": Ragged(torch.full((20,), 8), torch.tensor([20]))})
    live = set(edp.deliver(4096)[0]["id"].tolist())
    oldest = edp.storage.oldest
    assert oldest > 1, "the 20-token item should evict more than one item"
    assert live <= set(range(oldest, 9)), f"drew evicted ids {sorted(live - set(range(oldest, 9)))}"
    assert live == set(range(oldest, 9)), "every live item should be drawn at least once in 4096 draws"


def test_telemetry_can_be_read_while_other_threads_record() -> None:
    """``records`` is a snapshot and ``recent`` reads under the lock: iterating either while worker threads
    record (and fold) never sees the queue change under it; ``recent`` gives the newest calls of a kind."""
    from conduit.telemetry import Telemetry

    tel = Telemetry(maxlen=500, fold_every=4)
    stop = threading.Event()

    def work(k: int) -> None:
        i = 0
        while not stop.is_set():
            tel.record(f"kind{k}", 1, 8, float(i), float(i) + 1.0)
            i += 1

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so the workers fold while the reader iterates
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            snap = tel.records
            assert all(r.end > r.start for r in snap) and len(snap) <= 500
            last = tel.recent("kind0", 5)
            assert len(last) <= 5 and all(r.kind == "kind0" for r in last)
            assert [r.start for r in last] == sorted(r.start for r in last)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    newest = [r for r in tel.records if r.kind == "kind1"][-3:]
    assert tel.recent("kind1", 3) == newest


def test_telemetry_folds_concurrent_records_without_losing_any() -> None:
    """Records from several threads cross the fold threshold many times; totals and recent records stay exact."""
    from conduit.telemetry import Telemetry

    tel = Telemetry(maxlen=100, fold_every=8)
    per_thread = 2000

    def work(k: int) -> None:
        for i in range(per_thread):
            tel.record(f"kind{k % 2}", 1, k, float(i), float(i) + 0.5)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tot = tel.totals
    assert {k: (t.calls, t.items, t.nbytes) for k, t in tot.items()} == {
        "kind0": (2 * per_thread, 2 * per_thread, per_thread * (0 + 2)),
        "kind1": (2 * per_thread, 2 * per_thread, per_thread * (1 + 3)),
    }
    assert tot["kind0"].seconds == pytest.approx(2 * per_thread * 0.5)
    recs = list(tel.records)
    assert len(recs) == 100
    for thread in {r.thread for r in recs}:  # each thread's records stay in the order it made them
        starts = [r.start for r in recs if r.thread == thread]
        assert starts == sorted(starts)


@pytest.mark.parametrize("replace", [True, False])
def test_a_full_ring_draws_slots_and_their_handles_are_those_at_the_draw(replace: bool) -> None:
    """A full, wrapped ring draws slots directly (handles computed when read): each handle names the item
    delivered, and reading it after later ingestions (which evict) still gives the handle at the draw."""
    cap = 8
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field(())), capacity=cap, semantics=Replay(seed=3))
    edp.ingest({"obs": torch.arange(8, dtype=torch.float32)})
    edp.ingest({"obs": torch.arange(8, 13, dtype=torch.float32)})  # handles 5..12 live, the ring has wrapped
    batch, info = edp.deliver(6, replace=replace)
    edp.ingest({"obs": torch.arange(13, 17, dtype=torch.float32)})  # evicts handles 5..8
    assert torch.equal(info.handles, batch["obs"].long()), (info.handles, batch["obs"])
    assert info.handles.dtype == torch.int64 and bool(((info.handles >= 5) & (info.handles <= 12)).all())
    if not replace:
        assert len(set(info.handles.tolist())) == 6
    # the draws cover every live item (uniform over the union of slots, not a subset)
    seen = set()
    for _ in range(200):
        _, i = edp.deliver(4, replace=replace)
        seen |= set(i.handles.tolist())
    assert seen == set(range(9, 17))
