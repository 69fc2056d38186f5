"""Stream order between ingestion writes into GPU storage and the Overlapped scheduler's gathers.

With storage on a GPU, a fill gathers from the storage on the scheduler's side stream, which PyTorch creates
non-blocking with respect to the default stream, where ingestion writes run. Before the fix nothing ordered the
two: a gather could read a slot before a write into it had landed (the write's copy still queued on the default
stream), and a write that overwrote slots could run before an earlier gather of them. The GPU tests hold one stream
back with ``torch.cuda._sleep`` so that the unordered interleaving happens on every round, and check every delivered
row against the item its handle names (each item's payload is its handle): the synchronous reference. The CPU tests
check the part of the fix that runs without CUDA: where the ordering is placed (under the buffer's lock, right
around the gather, on every fill path) and which devices it covers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, OnPolicy, Overlapped, Replay
from conduit.placement import DevicePlacement, ShardedPlacement
from conduit.scheduling.buffers import ChunkRing, storage_devices
from conduit.testing.reference import ID_SCHEMA, id_batch

#: GPU clock cycles a stream is held back for (about 50 ms at 2 GHz): far longer than what the host does meanwhile
_HOLD = 100_000_000
_WIDTH = 256
_ROWS = 4096
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((_WIDTH,), torch.float32))


def _items(first: int, device: str) -> dict[str, torch.Tensor]:
    """``_ROWS`` items whose payload is their handle (the buffer's handles count ingested items from 0)."""
    ids = torch.arange(first, first + _ROWS, dtype=torch.int64, device=device)
    return {"id": ids, "obs": ids.to(torch.float32)[:, None].expand(-1, _WIDTH).contiguous()}


def _check(batch: Any, info: Any, where: str) -> None:
    handles = info.handles.cpu()
    ids = batch["id"].cpu()
    obs = batch["obs"].cpu()
    assert torch.equal(ids, handles), (f"{where}: rows of other items than the handles name were delivered (e.g. "
                                       f"handle {handles[0].item()} with the row of item {ids[0].item()})")
    assert torch.equal(obs, handles.to(torch.float32)[:, None].expand_as(obs)), f"{where}: a row's payload is torn"


_PLACEMENTS = {
    # a GPU batch: the write is a device-to-device copy on the writer's stream, asynchronous to the host
    "device": (lambda: DevicePlacement("cuda:0"), "cuda"),
    # a host batch staged for a GPU shard: its copy is non_blocking, so the write returns before it lands (the
    # host shard's half of every batch is written and read on the host, in order)
    "sharded": (lambda: ShardedPlacement(["cuda:0", "cpu"]), "cpu"),
}


def _gpu_buffer(placement: str, learner: str, overlap: bool) -> tuple[ExperienceDataPlane, str]:
    make, source = _PLACEMENTS[placement]
    edp = ExperienceDataPlane(SCHEMA, capacity=_ROWS, semantics=Replay(seed=0), placement=make(), device=learner,
                              scheduler=Overlapped(g_del=2, overlap=overlap))
    return edp, source


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("learner", ["cuda:0", "cpu"])
@pytest.mark.parametrize("placement", sorted(_PLACEMENTS))
def test_gpu_a_gather_reads_the_rows_a_write_still_queued_on_the_default_stream_stores(
        placement: str, learner: str, overlap: bool) -> None:
    """(a) Each round holds the default stream back, then stores a batch that overwrites every slot (its write is
    queued behind the hold: background ingestion writes on the worker's default stream, in-caller ingestion on this
    thread's) and delivers at once. Before the fix the side stream gathered the old rows under the new handles."""
    edp, source = _gpu_buffer(placement, learner, overlap)
    edp.ingest(_items(0, source))
    edp.flush()
    for r in range(1, 5):
        torch.cuda._sleep(_HOLD)  # on the default stream of cuda:0
        edp.ingest(_items(r * _ROWS, source))
        edp.flush()  # stored: the write is enqueued (not necessarily done)
        for k in range(3):
            batch, info = edp.deliver(512)
            _check(batch, info, f"round {r}, delivery {k}")
    edp.close()


@pytest.mark.gpu
@pytest.mark.parametrize("placement", sorted(_PLACEMENTS))
def test_gpu_a_write_that_overwrites_the_rows_waits_for_the_gather_still_queued_on_the_side_stream(
        placement: str) -> None:
    """(b) Each round holds the side stream back, delivers (its gather is queued behind the hold), then stores a
    batch that overwrites every slot on the default stream. Before the fix that write ran first and the delivered
    batch held the new items' rows under the old handles."""
    edp, source = _gpu_buffer(placement, "cuda:0", overlap=False)
    edp.ingest(_items(0, source))
    edp.flush()
    ring = edp.scheduler._ring
    for r in range(1, 7):
        with torch.cuda.stream(ring.stream):
            torch.cuda._sleep(_HOLD)
        batch, info = edp.deliver(512)
        edp.ingest(_items(r * _ROWS, source))
        edp.flush()
        _check(batch, info, f"round {r}")
    edp.close()


@pytest.mark.gpu
@pytest.mark.parametrize("placement", sorted(_PLACEMENTS))
def test_gpu_prefetch_under_many_overwriting_writes_delivers_only_whole_items(placement: str) -> None:
    """Background ingestion and prefetch together, many rounds: large writes that each overwrite the whole storage,
    handed over without waiting, with deliveries right after; one stream or the other is held back in turn."""
    edp, source = _gpu_buffer(placement, "cuda:0", overlap=True)
    edp.ingest(_items(0, source))
    edp.flush()
    ring = edp.scheduler._ring
    for r in range(1, 25):
        held = torch.cuda.default_stream(torch.device("cuda:0")) if r % 2 else ring.stream
        with torch.cuda.stream(held):
            torch.cuda._sleep(_HOLD // 4)
        edp.ingest(_items(r * _ROWS, source))
        if r % 3 == 0:
            edp.flush()
        for k in range(2):
            batch, info = edp.deliver(1024)
            _check(batch, info, f"round {r}, delivery {k}")
    edp.close()


# -- CPU: where the ordering is placed ---------------------------------------------------------------------------
def _trace(monkeypatch: pytest.MonkeyPatch, edp: ExperienceDataPlane) -> list[tuple[str, bool]]:
    """Log, with whether the buffer's lock is held, each fill's ordering points, each gather and each write."""
    log: list[tuple[str, bool]] = []
    before, after = ChunkRing.before_gather, ChunkRing.after_gather
    storage = edp.storage
    gather, append = storage.gather, storage.append

    def traced_before(ring: ChunkRing, fill: Any, devices: Any) -> None:
        assert list(devices) == storage_devices(edp.storage)
        log.append(("before", edp.holds_lock()))
        before(ring, fill, devices)

    def traced_after(ring: ChunkRing, fill: Any) -> None:
        log.append(("after", edp.holds_lock()))
        after(ring, fill)

    def traced_gather(*a: Any, **kw: Any) -> Any:
        log.append(("gather", edp.holds_lock()))
        return gather(*a, **kw)

    def traced_append(*a: Any, **kw: Any) -> Any:
        log.append(("write", edp.holds_lock()))
        return append(*a, **kw)

    monkeypatch.setattr(ChunkRing, "before_gather", traced_before)
    monkeypatch.setattr(ChunkRing, "after_gather", traced_after)
    monkeypatch.setattr(storage, "gather", traced_gather)
    monkeypatch.setattr(storage, "append", traced_append)
    return log


def _assert_ordered_around_every_gather(log: list[tuple[str, bool]]) -> None:
    assert all(held for _, held in log), f"an ordering point, gather or write ran without the buffer's lock: {log}"
    kinds = [k for k, _ in log]
    gathers = [i for i, k in enumerate(kinds) if k == "gather"]
    assert gathers, "nothing was gathered"
    for i in gathers:
        assert kinds[i - 1] == "before", f"a gather not ordered after the writes before it: {kinds[i - 3:i + 2]}"
        assert kinds[i + 1] == "after", f"a gather that later writes are not ordered after: {kinds[i - 1:i + 3]}"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("placement", ["host", "sharded"])
def test_replay_fills_are_ordered_under_the_lock_right_around_each_gather(
        monkeypatch: pytest.MonkeyPatch, placement: str, overlap: bool) -> None:
    """Prefetch jobs (overlap) and in-call fills: each gather is preceded by ``before_gather`` and followed by
    ``after_gather``, all in the hold of the buffer's lock that gathers (no write in between), while background
    ingestion writes concurrently."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=256, semantics=Replay(seed=1),
                              placement=ShardedPlacement(["cpu", "cpu"]) if placement == "sharded" else None,
                              scheduler=Overlapped(g_del=2, overlap=overlap))
    log = _trace(monkeypatch, edp)
    edp.ingest(id_batch(np.arange(256)))
    edp.flush()
    for r in range(30):
        edp.ingest(id_batch(np.arange(256 + 16 * r, 256 + 16 * (r + 1))))
        batch, info = edp.deliver(8)
        assert torch.equal(batch["id"], info.handles)
    hits = edp.scheduler.prefetch_hits
    edp.close()
    assert hits > 0  # (batches prepared ahead: by the prefetch job with overlap, the chunk's second one without)
    _assert_ordered_around_every_gather(log)


def test_on_policy_fills_are_ordered_under_the_lock_right_around_each_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """On-policy: a rollout's first minibatch is gathered in the call (no prediction yet), the next ones by the
    prefetch job; both paths are ordered the same way."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=4, seed=2),
                              scheduler=Overlapped(g_del=0.25))
    log = _trace(monkeypatch, edp)
    for version in range(3):
        edp.set_policy_version(version)
        edp.ingest(id_batch(np.arange(16 * version, 16 * (version + 1))), version=version)
        edp.seal()
        for _ in range(4):
            batch, info = edp.deliver()
            assert torch.equal(batch["id"], info.handles)
    hits, misses = edp.scheduler.prefetch_hits, edp.scheduler.prefetch_misses
    edp.close()
    assert hits > 0 and misses > 0, (hits, misses)
    _assert_ordered_around_every_gather(log)


def test_a_gather_that_fails_is_still_followed_by_its_ordering_point_and_leaves_the_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels a failed gather enqueued before it failed are ordered before later writes too, and the lock the fill
    took around it is let go: the next write and delivery go on."""
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=Overlapped(overlap=False))
    log = _trace(monkeypatch, edp)
    edp.ingest(id_batch(np.arange(64)))
    edp.flush()
    traced = edp.storage.gather

    def fails(*a: Any, **kw: Any) -> Any:
        traced(*a, **kw)
        raise RuntimeError("gather failed")

    monkeypatch.setattr(edp.storage, "gather", fails)
    with pytest.raises(RuntimeError, match="gather failed"):
        edp.deliver(8)
    assert [k for k, _ in log[-3:]] == ["before", "gather", "after"]
    assert not edp.holds_lock()
    monkeypatch.setattr(edp.storage, "gather", traced)
    edp.ingest(id_batch(np.arange(64, 72)))
    edp.flush()
    batch, info = edp.deliver(8)
    assert torch.equal(batch["id"], info.handles)
    edp.close()


def test_storage_devices_names_every_shard_and_an_indexed_gpu() -> None:
    host = ExperienceDataPlane(ID_SCHEMA, capacity=8)
    sharded = ExperienceDataPlane(ID_SCHEMA, capacity=8, placement=ShardedPlacement(["cpu", "cpu", "cpu"]))
    assert storage_devices(host.storage) == [torch.device("cpu")]
    assert storage_devices(sharded.storage) == [torch.device("cpu")] * 3

    class _Unindexed:  # a storage naming "cuda" without an index (a placement reads it as cuda:0)
        device = torch.device("cuda")

    assert storage_devices(_Unindexed()) == [torch.device("cuda", 0)]
    host.close()
    sharded.close()


def test_off_cuda_a_fill_has_no_streams_to_order() -> None:
    ring = ChunkRing(ID_SCHEMA, torch.device("cpu"), torch.device("cpu"), count=2, output_depth=2)
    with ring.filling(0) as fill:
        assert fill is None
        ring.before_gather(fill, [torch.device("cpu")])
        ring.after_gather(fill)
