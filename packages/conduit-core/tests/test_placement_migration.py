"""Online migration: nothing lost, duplicated or re-prioritised; handles and sampler state kept; the
buffer stays available while it moves; a placement map drives it without re-profiling."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conduit import (
    ConfigurationError,
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PlacementError,
    PrioritizedSampler,
    Replay,
    SchemaError,
    UniformSampler,
)
from conduit.placement import (
    AdaptivePlacement,
    BandwidthProfile,
    DiskPlacement,
    HostPlacement,
    LinkCost,
    Placement,
    PlacementSpec,
    Planner,
    ShardedPlacement,
    Topology,
    Workload,
)
from conduit.placement import profile as profile_module
from conduit.placement.migration import migrate
from conduit.scheduling import Overlapped

SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((2,), torch.float32))
TARGETS = {
    "sharded": lambda: ShardedPlacement(["cpu"] * 3),
    "disk": lambda: DiskPlacement(),
    "host": lambda: HostPlacement(),
}


def batch(ids: range | list[int] | np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.as_tensor(np.asarray(list(ids)), dtype=torch.int64)
    return {"id": t, "obs": torch.stack([t.float(), 2 * t.float()], 1)}


def contents(edp: ExperienceDataPlane) -> list[int]:
    return edp.state_dict()["storage"]["data"]["id"].tolist()


def check_payload(b: ExperienceBatch) -> None:
    ids = b["id"].float()
    assert torch.equal(b["obs"][:, 0], ids) and torch.equal(b["obs"][:, 1], 2 * ids), "payload corrupted"


def replay_twin(prioritized: bool) -> ExperienceDataPlane:
    sampler = PrioritizedSampler(alpha=0.7, beta=0.5) if prioritized else UniformSampler()
    edp = ExperienceDataPlane(SCHEMA, capacity=50, semantics=Replay(sampler, seed=11))
    for i in range(7):  # 70 items into 50 slots: the ring has wrapped and evicted
        ids = range(10 * i, 10 * i + 10)
        edp.ingest(batch(ids), priorities=torch.tensor([float(j % 5 + 1) for j in ids]) if prioritized else None)
    return edp


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("prioritized", [False, True])
def test_migration_keeps_contents_handles_priorities_and_draws(target: str, prioritized: bool) -> None:
    """A migrated buffer and an untouched twin deliver exactly the same items and weights afterwards."""
    a, b = replay_twin(prioritized), replay_twin(prioritized)
    x, ix = a.deliver(16)
    y, iy = b.deliver(16)
    assert torch.equal(x["id"], y["id"])
    old_handles = iy.handles.clone()
    report = b.migrate(TARGETS[target]())
    assert report.items == 50 and (report.oldest, report.next_handle) == (20, 70)
    assert b.storage.tier == {"sharded": "sharded", "disk": "disk", "host": "host"}[target]
    assert contents(a) == contents(b) == list(range(20, 70))
    if prioritized:  # handles issued before the move still name the same items
        p = torch.linspace(0.1, 3.0, 16)
        assert a.update_priorities(ix.handles, p) == b.update_priorities(old_handles, p) == 16
    for step in range(6):
        x, ix = a.deliver(32)
        y, iy = b.deliver(32)
        check_payload(y)
        assert torch.equal(x["id"], y["id"]) and torch.equal(ix.handles, iy.handles)
        if prioritized:
            assert torch.equal(ix.weights, iy.weights)
            p = torch.rand(32, generator=torch.Generator().manual_seed(step)) + 0.01
            a.update_priorities(ix.handles, p)
            b.update_priorities(iy.handles, p)
        a.ingest(batch(range(100 + 5 * step, 105 + 5 * step)))
        b.ingest(batch(range(100 + 5 * step, 105 + 5 * step)))
    assert contents(a) == contents(b)
    assert b.telemetry.summary()["migrate"]["items"] == 50


def test_migration_of_an_on_policy_buffer_mid_rollout() -> None:
    """Minibatches, epochs and versions continue as if nothing moved."""
    def make() -> ExperienceDataPlane:
        edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=4, num_epochs=2, seed=3))
        edp.ingest(batch(range(20)), version=0)
        edp.seal()
        edp.ingest(batch(range(20, 40)), version=1)
        return edp

    a, b = make(), make()
    for _ in range(3):  # into the first rollout's first epoch
        assert torch.equal(a.deliver()[0]["id"], b.deliver()[0]["id"])
    b.migrate(ShardedPlacement(["cpu"] * 2))
    b.seal()
    a.seal()
    seen = []
    for i in range(13):
        if i == 5:  # rollout 0 done: the learner moves to policy 1
            a.set_policy_version(1)
            b.set_policy_version(1)
        (xa, ia), (xb, ib) = a.deliver(), b.deliver()
        check_payload(xb)
        assert torch.equal(xa["id"], xb["id"]) and (ia.version, ia.epoch, ia.minibatch, ia.last) == \
            (ib.version, ib.epoch, ib.minibatch, ib.last)
        seen.append(xb["id"].clone())  # delivered buffers are reused
    assert sorted(torch.cat(seen[5:]).tolist()) == sorted(list(range(20, 40)) * 2)  # rollout 1: twice, once/epoch
    assert len(a) == len(b) == 0


def test_sampling_and_ingestion_continue_while_the_buffer_moves() -> None:
    """Chunked migration: deliveries and ingestions run between chunks; nothing is lost or duplicated."""
    edp = ExperienceDataPlane(SCHEMA, capacity=4000, semantics=Replay(seed=0))
    edp.ingest(batch(range(4000)))
    stop = threading.Event()
    delivered: list[int] = []
    ingested: list[int] = []
    errors: list[BaseException] = []

    def learner() -> None:
        try:
            while not stop.is_set():
                b, info = edp.deliver(64)
                check_payload(b)
                assert torch.equal(b["id"], info.handles)
                delivered.append(int(b["id"].shape[0]))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def actor() -> None:
        try:
            nxt = 4000
            while not stop.is_set():
                edp.ingest(batch(range(nxt, nxt + 7)))
                ingested.extend(range(nxt, nxt + 7))
                nxt += 7
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=learner), threading.Thread(target=actor)]
    for t in threads:
        t.start()
    while not delivered:
        time.sleep(0.001)
    before = len(delivered)
    served_between_chunks = []

    def progress(chunks: int, copied: int) -> None:
        if chunks == 5:  # between two chunks the lock is free: the learner gets a delivery through
            n = len(delivered)
            deadline = time.monotonic() + 30
            while len(delivered) == n and time.monotonic() < deadline:
                time.sleep(0.001)
            served_between_chunks.append(len(delivered) - n)

    report = migrate(edp, ShardedPlacement(["cpu"] * 4), chunk_bytes=2000, progress=progress)  # ~100 items/chunk
    during = len(delivered) - before
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert report.chunks > 10 and served_between_chunks[0] > 0 and during > 0
    assert report.max_blocked_s < report.seconds
    live = contents(edp)
    assert live == list(range(edp.storage.oldest, edp.storage.next_handle))  # consecutive: no loss, no duplicate
    assert live[-1] == ingested[-1] and len(live) == 4000
    assert isinstance(edp.storage, type(ShardedPlacement(["cpu"]).storage(SCHEMA, 1)))


def test_migration_to_a_grown_schema_with_a_transform() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=20, semantics=Replay(seed=1))
    edp.ingest(batch(range(15)))
    wide = ExperienceSchema(id=Field((), torch.int64), obs=Field((4,), torch.float32))

    def pad(b: ExperienceBatch) -> dict[str, torch.Tensor]:
        obs = b["obs"]
        return {"id": b["id"], "obs": torch.cat([obs, torch.zeros(obs.shape[0], 2)], 1)}

    with pytest.raises(ConfigurationError, match="transform"):
        edp.migrate(DiskPlacement(), schema=wide)
    storage = edp.storage
    with pytest.raises(SchemaError):
        edp.migrate(DiskPlacement(), schema=wide, transform=lambda b: {"id": b["id"], "obs": b["obs"]})
    assert edp.storage is storage and edp.schema == SCHEMA  # unchanged after the failures
    report = edp.migrate(DiskPlacement(), schema=wide, transform=pad)
    assert report.items == 15 and edp.schema == wide
    b, info = edp.deliver(10)
    assert torch.equal(b["obs"][:, 0], b["id"].float()) and torch.all(b["obs"][:, 2:] == 0)
    edp.ingest({"id": torch.tensor([15]), "obs": torch.ones(1, 4)})
    with pytest.raises(SchemaError):
        edp.ingest(batch([16]))  # the old shape is refused now


class _Broken(Placement):
    def storage(self, schema, capacity, *, ragged_capacity=None):
        raise PlacementError("no room here; pick another placement")


def test_failed_migration_leaves_the_buffer_unchanged() -> None:
    edp = replay_twin(prioritized=True)
    storage, before = edp.storage, contents(edp)
    with pytest.raises(PlacementError, match="no room"):
        edp.migrate(_Broken())
    with pytest.raises(ConfigurationError):
        edp.migrate(ShardedPlacement(["cpu"] * 51))  # more shards than slots
    assert edp.storage is storage and contents(edp) == before
    assert edp.deliver(4)[0]["id"].shape == (4,)


def test_ragged_items_migrate_with_their_sequences() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=30, ragged_capacity=200, semantics=Replay(seed=2))
    for i in range(0, 40, 8):
        ids = list(range(i, i + 8))
        edp.ingest({"id": torch.tensor(ids), "tok": [torch.full((j % 9 + 1,), j) for j in ids]})
    live = contents(edp)
    edp.migrate(ShardedPlacement(["cpu"] * 3))
    assert contents(edp) == live
    b, _ = edp.deliver(20)
    for k, h in enumerate(b["id"].tolist()):
        assert b["tok"][k].tolist() == [h] * (h % 9 + 1)


# -- the placement map drives migration ------------------------------------------------------------
def small_host_topology() -> Topology:
    """A host with 8 MiB usable for buffers and a disk: small enough to cross over in a test."""
    links = {"host_copy": LinkCost.constant(10, 5), "host_gather": LinkCost.constant(8, 6, 100),
             "disk_read": LinkCost.constant(2, 100, 10_000), "disk_write": LinkCost.constant(2, 50),
             "edp_deliver": LinkCost.constant(1e6, 20), "edp_ingest": LinkCost.constant(1e6, 20)}
    prof = BandwidthProfile(links, source="declared", machine="declared:small-host")
    return Topology("small-host", int((8 << 20) / 0.75), (), 10 << 30, prof, "a test machine", "declared")


def test_adaptive_placement_migrates_when_responses_grow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Response lengths grow until the buffer no longer fits host memory: it moves to disk, once,
    from the precomputed map (no re-profiling), keeping every item."""
    schema = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
    capacity = 1000
    template = Workload.from_schema(schema, capacity=capacity, batch=32, mean_ragged_length=16)
    pmap = Planner(small_host_topology()).placement_map(template, min_item_bytes=64, max_item_bytes=64_000, points=16)
    assert [r.spec.tier for r in pmap.ranges] == ["host", "disk"]
    boundary = pmap.boundaries[0]
    assert (capacity + 2 * 32) * boundary * 1.1 == pytest.approx(8 << 20, rel=0.01)  # memory (+ outputs) decides

    def no_profiling(*a, **k):  # the map is all a migration may use
        raise AssertionError("re-profiled")

    monkeypatch.setattr(profile_module, "profile_machine", no_profiling)
    adaptive = AdaptivePlacement(pmap, mean_ragged_length=16, window=4)
    # a pool of 100 tokens per item: within what the map checked for host (items up to the boundary), and large
    # enough for one ingestion of 50 of the longest responses; the move to disk sizes the disk pool for the new items
    edp = ExperienceDataPlane(schema, capacity=capacity, placement=adaptive, ragged_capacity=capacity * 100)
    assert adaptive.current == PlacementSpec("host", ("cpu",)) and edp.storage.tier == "host"
    length, nxt, moves = 16, 0, []
    while length <= 2000:
        ids = list(range(nxt, nxt + 50))
        edp.ingest({"id": torch.tensor(ids), "tok": [torch.full((length,), j) for j in ids]})
        nxt += 50
        before = contents(edp)
        report = adaptive.rebalance(edp)
        if report is not None:
            moves.append((length, report, before, contents(edp)))
        length = int(length * 1.25) + 1
    assert len(moves) == 1
    grown_at, report, before, after = moves[0]
    assert adaptive.observed_item_bytes(edp) >= boundary  # the observed size (recent ingestions) crossed it
    assert grown_at * 8 + 8 >= boundary / 2
    assert edp.storage.tier == "disk" and adaptive.current.tier == "disk" and edp.placement is adaptive
    # every item live at the move moved (the host pool, sized within the plan, held fewer than the disk one holds
    # later: the buffer grows after the move)
    assert report.items == len(before) and after == before
    live = contents(edp)
    assert live == list(range(nxt - len(live), nxt))
    b, _ = edp.deliver(16)
    for k, h in enumerate(b["id"].tolist()):
        assert set(b["tok"][k].tolist()) == {h}


def test_migration_under_the_overlapped_scheduler() -> None:
    """Background ingestion and delivery prefetch keep working across a move (no deadlock, nothing lost)."""
    from conduit.scheduling import Overlapped

    edp = ExperienceDataPlane(SCHEMA, capacity=600, semantics=Replay(seed=4), scheduler=Overlapped(g_del=4, g_ing=2))
    try:
        for i in range(0, 300, 30):
            edp.ingest(batch(range(i, i + 30)))
        edp.flush()
        for _ in range(3):
            check_payload(edp.deliver(32)[0])
        for i in range(300, 360, 30):  # handed over, maybe not yet stored when the move starts
            edp.ingest(batch(range(i, i + 30)))
        report = edp.migrate(ShardedPlacement(["cpu"] * 2))
        assert report.items == 360 and edp.storage.tier == "sharded"
        for _ in range(5):
            b, info = edp.deliver(32)
            check_payload(b)
            assert torch.equal(b["id"], info.handles)
        edp.ingest(batch(range(360, 390)))
        edp.flush()
        assert contents(edp) == list(range(390))
    finally:
        edp.close()


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_migration_under_prefetch_draws_on_as_a_synchronous_buffer(prioritized: bool) -> None:
    """Draws prepared before a migration are dropped with their old-tier buffers and given back to the
    sampler: the overlapped buffer delivers exactly the synchronous buffer's sequence across the move."""
    def build(scheduler: Overlapped | None) -> ExperienceDataPlane:
        sem = Replay(PrioritizedSampler(), seed=5) if prioritized else Replay(seed=5)
        edp = ExperienceDataPlane(SCHEMA, capacity=64, semantics=sem, scheduler=scheduler)
        edp.ingest(batch(range(48)))
        edp.flush()
        return edp

    sync, over = build(None), build(Overlapped(g_ing=1, g_del=4))
    try:
        seen = []
        for step in range(10):
            if step == 3:
                sync.migrate(DiskPlacement())
                over.migrate(DiskPlacement())
            a, b = sync.deliver(6)[0], over.deliver(6)[0]
            seen.append((a["id"].tolist(), b["id"].tolist()))
        assert all(x == y for x, y in seen), f"(synchronous, overlapped) ids per delivery: {seen}"
    finally:
        sync.close()
        over.close()
