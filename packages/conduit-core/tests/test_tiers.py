"""Storage tiers: the same semantics on every tier this machine has (conformance suites per tier), and
the tier-specific logic (sharded interleaving, memory-mapped files, device checks)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PlacementError,
    Ragged,
)
from conduit.placement import DevicePlacement, DiskPlacement, HostPlacement, PlacementSpec, ShardedPlacement
from conduit.storage import ColumnarStorage, DiskStorage, ShardedStorage
from conduit.testing import (
    ConcurrencySuite,
    CoreOnPolicyEndpoint,
    CoreReplayEndpoint,
    FreshnessSuite,
    ReplaySuite,
)

CPU_SHARDS = ["cpu", "cpu", "cpu"]


# -- the conformance suites on every tier --------------------------------------------------------
# GPU-tier classes deliver to a host learner (device="cpu"): the endpoints read ids with NumPy; the
# storage, the sampling and the gathers still run on the GPU.
class TestShardedCpuReplay(ReplaySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(placement=ShardedPlacement(CPU_SHARDS), **kwargs)


class TestShardedCpuFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs):
        return CoreOnPolicyEndpoint(placement=ShardedPlacement(CPU_SHARDS), **kwargs)


class TestShardedCpuConcurrency(ConcurrencySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(placement=ShardedPlacement(CPU_SHARDS), **kwargs)


class TestDiskReplay(ReplaySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(placement=DiskPlacement(), **kwargs)


class TestDiskFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs):
        return CoreOnPolicyEndpoint(placement=DiskPlacement(), **kwargs)


@pytest.mark.gpu
class TestGpuReplay(ReplaySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(placement=DevicePlacement("cuda:0"), device="cpu", **kwargs)


@pytest.mark.gpu
class TestGpuFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs):
        return CoreOnPolicyEndpoint(placement=DevicePlacement("cuda:0"), device="cpu", **kwargs)


@pytest.mark.gpu
class TestPinnedReplay(ReplaySuite):
    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(placement=HostPlacement(pin_memory=True), device="cuda:0", **kwargs)


@pytest.mark.gpu
class TestShardedMixedReplay(ReplaySuite):
    """Shards on the GPU and on the host: cross-device gathers and scatters."""

    def make_replay(self, **kwargs):
        return CoreReplayEndpoint(placement=ShardedPlacement(["cuda:0", "cpu", "cuda:0"]), device="cpu", **kwargs)


@pytest.mark.gpu
class TestShardedMixedFreshness(FreshnessSuite):
    def make_on_policy(self, **kwargs):
        return CoreOnPolicyEndpoint(placement=ShardedPlacement(["cuda:0", "cpu"]), device="cpu", **kwargs)


# -- sharded storage -------------------------------------------------------------------------------
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((2,), torch.float32))


def _batch(ids: range | list[int]) -> ExperienceBatch:
    t = torch.as_tensor(list(ids), dtype=torch.int64)
    return ExperienceBatch({"id": t, "obs": torch.stack([t.float(), -t.float()], 1)}, len(t))


@pytest.mark.parametrize("capacity,k", [(12, 3), (10, 3), (7, 4), (5, 1)])
def test_sharded_slots_are_interleaved_and_wrap(capacity: int, k: int) -> None:
    """Slot s lives in shard s % K at row s // K, also when an append wraps around the ring."""
    st = ShardedStorage(SCHEMA, capacity, ["cpu"] * k)
    assert sum(st.shard_rows) == capacity
    first = 0
    for n in (3, capacity - 1, 2, capacity, 1):
        res = st.append(_batch(range(first, first + n)))
        assert res.first == first
        first += n
        slots = torch.arange(st.oldest, st.next_handle) % capacity
        got = st.gather(slots)
        assert got["id"].tolist() == list(range(st.oldest, st.next_handle))
        assert torch.equal(got["obs"][:, 1], -got["id"].float())
        for h in range(st.oldest, st.next_handle):  # the physical layout
            s = h % capacity
            assert int(st._shards[s % k]["id"][s // k]) == h


def test_sharded_gather_writes_into_given_buffers_in_order() -> None:
    st = ShardedStorage(SCHEMA, 9, ["cpu"] * 3)
    st.append(_batch(range(9)))
    out = {"id": torch.full((5,), -1, dtype=torch.int64), "obs": torch.zeros(5, 2)}
    slots = torch.tensor([8, 0, 4, 4, 7])
    b = st.gather(slots, out)
    assert b["id"].data_ptr() == out["id"].data_ptr()
    assert out["id"].tolist() == [8, 0, 4, 4, 7]


def test_sharded_capacity_error_leaves_storage_unchanged() -> None:
    st = ShardedStorage(SCHEMA, 6, ["cpu"] * 2)
    st.append(_batch(range(4)))
    with pytest.raises(CapacityError):
        st.append(_batch(range(4, 8)), evict=False)
    with pytest.raises(CapacityError):
        st.append(_batch(range(7)))
    assert (st.oldest, st.next_handle) == (0, 4)
    assert st.gather(torch.arange(4))["id"].tolist() == [0, 1, 2, 3]


def test_sharded_release_and_state_round_trip() -> None:
    st = ShardedStorage(SCHEMA, 8, ["cpu"] * 3)
    st.append(_batch(range(6)))
    st.append(_batch(range(6, 11)))
    st.release(5)
    state = st.state_dict()
    other = ShardedStorage(SCHEMA, 8, ["cpu"] * 3)
    other.load_state_dict(state)
    assert (other.oldest, other.next_handle) == (5, 11)
    assert other.gather(torch.arange(5, 11) % 8)["id"].tolist() == list(range(5, 11))
    plain = ColumnarStorage(SCHEMA, 8)  # the same checkpoint format as the host tier
    plain.load_state_dict(state)
    assert plain.gather(torch.arange(5, 11) % 8)["id"].tolist() == list(range(5, 11))


def test_sharded_ragged_fields_follow_the_ring() -> None:
    schema = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))
    st = ShardedStorage(schema, 6, ["cpu"] * 2, ragged_capacity=20)
    n_total = 0
    for n in (3, 4, 2):
        ids = list(range(n_total, n_total + n))
        seqs = [torch.full((i % 5 + 1,), i) for i in ids]
        st.append(ExperienceBatch({"id": torch.tensor(ids), "tok": Ragged.from_sequences(seqs)}, n))
        n_total += n
    live = list(range(st.oldest, st.next_handle))
    got = st.gather(torch.tensor(live) % 6)
    assert got["id"].tolist() == live
    for j, h in enumerate(live):
        assert got["tok"][j].tolist() == [h] * (h % 5 + 1)
    assert st.ragged_capacity == 20


def test_sharded_configuration_errors() -> None:
    with pytest.raises(ConfigurationError):
        ShardedStorage(SCHEMA, 2, ["cpu"] * 3)
    with pytest.raises(PlacementError):
        ShardedPlacement([])


# -- disk tier --------------------------------------------------------------------------------------
def test_disk_columns_are_memory_mapped_files_removed_with_the_storage(tmp_path) -> None:
    st = DiskStorage(SCHEMA, 1000, directory=tmp_path)
    files = sorted(p.name for p in st.directory.iterdir())
    assert files == ["id.bin", "obs.bin"]
    assert (st.directory / "obs.bin").stat().st_size == 1000 * 2 * 4
    st.append(_batch(range(10)))
    # the bytes are in the file itself
    mapped = np.memmap(st.directory / "id.bin", dtype=np.int64, mode="r")
    assert mapped[:10].tolist() == list(range(10))
    d = st.directory
    del mapped
    st.close()
    assert not d.exists()


def test_disk_tier_refuses_a_buffer_larger_than_the_volume(tmp_path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    huge = ExperienceSchema(x=Field((1 << 20,), torch.float32))  # 4 MiB per item
    with pytest.raises(PlacementError, match="free"):
        DiskStorage(huge, int(free // (4 << 20)) + 10, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_disk_edp_round_trip_and_tier_name(tmp_path) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=16, placement=DiskPlacement(directory=tmp_path))
    assert edp.storage.tier == "disk" and edp.placement.spec == PlacementSpec("disk", ("disk",))
    edp.ingest(_batch(range(12)))
    edp.ingest(_batch(range(12, 20)))
    b, info = edp.deliver(8)
    assert torch.equal(b["id"], info.handles)
    assert set(info.handles.tolist()) <= set(range(4, 20))


# -- device checks ----------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_placement_without_cuda_is_a_placement_error() -> None:
    with pytest.raises(PlacementError, match="not available"):
        DevicePlacement("cuda:0")
    with pytest.raises(PlacementError, match="not available"):
        ShardedPlacement(["cpu", "cuda:1"])
    with pytest.raises(PlacementError):
        PlacementSpec("gpu", ("cuda:0",)).build()


def test_device_placement_on_cpu_runs_the_same_code_path() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, placement=DevicePlacement("cpu"))
    edp.ingest(_batch(range(5)))
    assert edp.deliver(3)[0]["id"].shape == (3,)
    assert edp.placement.spec == PlacementSpec("host", ("cpu",))


def test_unknown_tier_in_a_spec() -> None:
    with pytest.raises(PlacementError, match="tier"):
        PlacementSpec("tape", ())


def test_on_policy_on_sharded_tier_never_evicts_unconsumed() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=6, placement=ShardedPlacement(["cpu"] * 2),
                              semantics=OnPolicy(num_minibatches=2))
    edp.ingest(_batch(range(4)), version=0)
    with pytest.raises(CapacityError):
        edp.ingest(_batch(range(4, 8)), version=0)
    assert len(edp) == 4


@pytest.mark.gpu
def test_sharded_gpu_and_host_shards_deliver_on_the_learner_device() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=10, placement=ShardedPlacement(["cuda:0", "cpu"]), device="cuda:0")
    edp.ingest(_batch(range(10)))
    b, info = edp.deliver(6)
    assert b["id"].device.type == "cuda"
    assert torch.equal(b["id"].cpu(), info.handles)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity,k", [(12, 2), (10, 3)])
def test_sharded_gpu_shards_are_written_through_pinned_staging(capacity: int, k: int) -> None:
    """Host batches reach GPU shards through page-locked staging (non-blocking copies); the layout and
    every read are those of the synchronous path, also across wraps and back-to-back appends."""
    st = ShardedStorage(SCHEMA, capacity, ["cuda:0"] * k)
    assert st._staging is not None
    first = 0
    for n in (3, capacity - 1, 2, capacity, 1):
        st.append(_batch(range(first, first + n)))
        first += n
        slots = torch.arange(st.oldest, st.next_handle) % capacity
        got = st.gather(slots)
        assert got["id"].cpu().tolist() == list(range(st.oldest, st.next_handle))
        assert torch.equal(got["obs"][:, 1].cpu(), -got["id"].float().cpu())
    assert st._staging._bufs and all(b.is_pinned() for b in st._staging._bufs.values())


def test_sharded_host_shards_need_no_staging() -> None:
    """Only host-to-GPU shard writes are staged: host shards are written directly."""
    assert ShardedStorage(SCHEMA, 8, ["cpu"] * 2)._staging is None


_RESIDENT = """
import ctypes, os
import torch
from conduit import ExperienceSchema, Field
from conduit.storage import ColumnarStorage

def resident(column):
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = column.data_ptr() // page * page
    length = column.data_ptr() + column.nbytes - start
    pages = (ctypes.c_ubyte * -(-length // page))()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in pages) * page

schema = ExperienceSchema(obs=Field((1024,), torch.float32))  # 4 KiB per item, 64 MiB per storage
lazy = ColumnarStorage(schema, 16384, prefault=False)
eager = ColumnarStorage(schema, 16384)
assert len(lazy) == len(eager) == 0
print("RESIDENT", resident(lazy._cols["obs"]), resident(eager._cols["obs"]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads resident pages with Linux mincore")
def test_host_columns_are_committed_at_construction_unless_prefault_is_off() -> None:
    """prefault=True writes every page of a host column up front; prefault=False leaves them to the first write.

    Read with Linux ``mincore``: the bytes of each column's own pages in memory (not the process's resident size,
    which another test's garbage freed meanwhile would shrink). In a fresh interpreter: in a worker that ran other
    tests, the allocator once handed the lazy column pages already in memory (64 MiB resident "at construction")."""
    out = subprocess.run([sys.executable, "-c", _RESIDENT], capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESIDENT")]
    assert line, f"the measurement failed: {out.stderr[-2000:]}"
    lazy_resident, eager_resident = (int(v) for v in line[0].split()[1:])
    assert eager_resident >= 60 << 20, f"only {eager_resident >> 20} MiB of the prefaulted column are in memory"
    assert lazy_resident < 16 << 20, f"prefault=False committed {lazy_resident >> 20} MiB of the column at construction"


def test_truncate_forgets_the_newest_items_and_their_slots_take_the_next_append() -> None:
    """``truncate`` undoes appends: the newest handles go, older items stay, the next append reuses the
    handles; it never reaches below the oldest live item."""
    st = ColumnarStorage(SCHEMA, 6)
    st.append(_batch(range(4)))
    st.release(1)
    st.append(_batch([90, 91]))
    st.truncate(4)
    assert (st.oldest, st.next_handle) == (1, 4)
    res = st.append(_batch([4, 5, 6]))
    assert res.first == 4 and res.evicted_from == res.evicted_to == 1  # room again: nothing evicted
    assert st.gather(torch.arange(1, 7) % 6)["id"].tolist() == [1, 2, 3, 4, 5, 6]
    st.truncate(0)
    assert (st.oldest, st.next_handle) == (1, 1)


@pytest.mark.gpu
def test_ranges_are_built_on_the_device_of_their_starts() -> None:
    """Ragged selection on a GPU tier: the flat element indices stay on the GPU (a CPU arange was added to a
    CUDA tensor and failed)."""
    from conduit.batch import ranges

    got = ranges(torch.tensor([5, 0], device="cuda"), torch.tensor([2, 3], device="cuda"))
    assert got.device.type == "cuda" and got.tolist() == [5, 6, 0, 1, 2]
    assert ranges(torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda")).device.type == "cuda"


@pytest.mark.gpu
def test_sharded_gather_from_a_gpu_shard_into_host_buffers_is_complete() -> None:
    """Shards on the host and a GPU, output on the host: the GPU shard's rows must have landed before they are
    scattered into the output (an asynchronous device-to-host copy was read at once)."""
    st = ShardedStorage(SCHEMA, 4096, ["cpu", "cuda:0"])
    st.append(_batch(range(4096)))
    slots = torch.randperm(4096)[:2048]
    for _ in range(20):
        got = st.gather(slots, {"id": torch.empty(2048, dtype=torch.int64), "obs": torch.empty(2048, 2)})
        assert torch.equal(got["id"], slots), "rows from the GPU shard were read before their copy landed"
