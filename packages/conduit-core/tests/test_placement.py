"""Topology, bandwidth profiles, the cost model and the planner, the placement map, and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conduit import ConfigurationError, PlacementError
from conduit.cli import main
from conduit.placement import (
    BandwidthProfile,
    CostModel,
    Gpu,
    LinkCost,
    PlacementSpec,
    Planner,
    Topology,
    Workload,
    available_topologies,
    discover_topology,
    load_profile,
    load_topology,
    machine_id,
    profile_machine,
    transition_schema,
)
from conduit.placement.profile import profile_path

DGX = "dgx-a100-80g"
MI = "mi250x-node"


def plan(topology: str, d: int, *, capacity: int = 10**6, batch: int = 512, learners: int = 1):
    return Planner(load_topology(topology)).plan(Workload.transitions(d, capacity=capacity, batch=batch,
                                                                      learners=learners))


# -- topologies -------------------------------------------------------------------------------------
def test_declared_topologies_ship_with_conduit() -> None:
    names = available_topologies()
    assert {DGX, MI, "h200x1", "local"} <= set(names)
    dgx = load_topology(DGX)
    assert dgx.num_gpus == 8 and dgx.gpus[0].memory_bytes == 80 * 2**30 and dgx.source == "declared"
    assert dgx.declared is not None and dgx.declared.link("p2p", 0, 7).peak_bandwidth > \
        10 * dgx.declared.link("h2d_pinned", 0).peak_bandwidth / 2  # GPU-GPU ~10x CPU-GPU
    h200 = load_topology("h200x1")
    assert h200.num_gpus == 1 and h200.gpus[0].memory_bytes > 130 * 2**30


def test_mi250x_links_are_non_uniform() -> None:
    prof = load_topology(MI).declared
    assert prof is not None
    fast = prof.link("p2p", 0, 2).peak_bandwidth
    slow = prof.link("p2p", 0, 3).peak_bandwidth
    assert fast >= 2 * slow
    assert {prof.link("p2p", i, j).peak_bandwidth / 1e9 for i in range(8) for j in range(8) if i != j} == \
        {100.0, 200.0, 400.0}


def test_unknown_topology_is_a_placement_error_naming_the_known_ones() -> None:
    with pytest.raises(PlacementError, match=r"dgx-a100-80g.*local"):
        load_topology("dgx-h100-imaginary")


def test_malformed_topology_data_is_a_placement_error() -> None:
    with pytest.raises(PlacementError, match="Malformed"):
        Topology.from_file_dict({"name": "x"})
    with pytest.raises(PlacementError, match="2x2"):
        Topology.from_file_dict({"name": "x", "host_memory_gib": 1, "gpu": {"count": 2, "name": "g", "memory_gib": 1},
                                 "p2p": {"matrix_gbps": [[None, 1]]}})
    with pytest.raises(PlacementError, match="host_link_groups"):
        Topology.from_file_dict({"name": "x", "host_memory_gib": 1, "gpu": {"count": 2, "name": "g", "memory_gib": 1},
                                 "host_link_groups": [[0, 1], [1]]})


def test_local_topology_without_gpu_says_so_and_plans_host_and_disk_only() -> None:
    topo = discover_topology()
    assert topo.host_memory_bytes > 2**30 and topo.source == "discovered" and topo.declared is None
    if torch.cuda.is_available():
        assert topo.num_gpus == torch.cuda.device_count()
        return
    assert topo.num_gpus == 0 and "no GPU" in topo.details["gpus"]
    fake = BandwidthProfile(load_topology(DGX).declared.links, source="measured", machine=machine_id())
    planner = Planner(topo, fake)
    tiers = {spec.tier for spec, _ in planner.candidates(Workload.transitions(100, capacity=1000, batch=32))}
    assert tiers == {"host", "disk"}


# -- link costs and profiles ------------------------------------------------------------------------------
def test_a_link_measured_on_a_busy_machine_is_bounded_not_infinitely_fast() -> None:
    """The 8-byte probe took longer than the big ones (noise): larger transfers must still cost more."""
    samples = [(1 << 18, 0.007), (1 << 22, 0.008)]
    with pytest.raises(PlacementError):
        LinkCost.fit(samples, 0.009)
    link = LinkCost.fit_or_bound(samples, 0.009)
    assert link.overhead_s == 0.007
    assert math.isfinite(link.bandwidth(1 << 22)) and link.bandwidth(1 << 22) == pytest.approx((1 << 22) / 0.008)
    assert link.seconds(4 << 20) > link.seconds(4 << 10) > 0
    fitted = LinkCost.fit_or_bound(samples, 0.001)  # a normal measurement is the plain fit
    assert fitted == LinkCost.fit(samples, 0.001)


def test_link_cost_arithmetic() -> None:
    link = LinkCost.constant(10.0, overhead_us=5.0, per_row_ns=100.0)
    assert link.seconds(0) == 0.0
    assert link.seconds(1e9, rows=10) == pytest.approx(5e-6 + 1e-6 + 0.1)
    curve = LinkCost(1e-6, ((1e3, 1e9), (1e6, 4e9)))
    assert curve.bandwidth(10) == 1e9 and curve.bandwidth(1e9) == 4e9
    assert curve.bandwidth(math.sqrt(1e3 * 1e6)) == pytest.approx(2.5e9)  # linear in log(size)
    rows = LinkCost.fit_rows([(512, 512 * 16, 1e-6 + 512 * 16 / 1e8), (512, 512 * 4096, 1e-6 + 512 * 4096 / 4e9)],
                             1e-6)
    assert rows.by_row and rows.seconds(100 * 16, rows=100) == pytest.approx(1e-6 + 1600 / 1e8)
    for lk in (link, curve, rows):
        back = LinkCost.from_dict(json.loads(json.dumps(lk.to_dict())))
        assert back.by_row == lk.by_row
        for n, r in ((10, 1), (5e3, 50), (1e8, 512)):
            assert back.seconds(n, r) == pytest.approx(lk.seconds(n, r), rel=1e-9)
    with pytest.raises(PlacementError):
        LinkCost(-1.0)


def test_gather_fit_recovers_its_terms() -> None:
    true = LinkCost(7e-6, ((1.0, 5e9),), 100e-9)
    samples = [(r, r * w, true.seconds(r * w, r)) for r in (1, 64, 512) for w in (16, 4096, 65536)]
    fit = LinkCost.fit_gather(samples)
    assert fit.overhead_s == pytest.approx(7e-6, rel=1e-6)
    assert fit.per_row_s == pytest.approx(100e-9, rel=1e-6)
    assert fit.peak_bandwidth == pytest.approx(5e9, rel=1e-6)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> BandwidthProfile:
    """One quick measurement of this machine, cached in a private cache directory."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CONDUIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    prof = profile_machine(quick=True, disk_directory=str(tmp_path_factory.mktemp("disk")))
    yield prof
    mp.undo()


def test_profile_measures_and_caches_this_machine(measured: BandwidthProfile, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path) -> None:
    assert measured.source == "measured" and measured.machine == machine_id()
    for path in ("host_copy", "host_gather", "host_gather_scalar", "host_gather_scalar_cached", "edp_deliver",
                 "edp_ingest", "disk_read", "disk_write"):
        assert measured.has(path), path
    # figures in bytes per second and seconds, whatever this machine's speed and load: a busy machine's noise
    # can put a sample barely above the overhead (a huge fitted bandwidth) or slow every call down
    gather = measured.link("host_gather")
    assert 1e6 < gather.peak_bandwidth and math.isfinite(gather.peak_bandwidth), gather
    assert 0 < gather.overhead_s < 1.0, gather
    assert isinstance(measured.details["disk_read_cold"], bool)
    if not torch.cuda.is_available():
        assert not measured.has("h2d_pinned") and measured.details["gpus"] == 0
    path = tmp_path / "p.json"
    measured.save(path)
    again = load_profile(path)
    assert again.links == measured.links and again.created == measured.created


def test_cached_profile_is_reused(measured: BandwidthProfile, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    measured.save()
    assert profile_path().parent == tmp_path
    again = profile_machine(quick=True, disk_directory=measured.details["disk_directory"])
    assert again.created == measured.created  # no re-measurement (its disk tier measured in the same directory)


def test_profile_from_another_machine_is_refused(measured: BandwidthProfile, tmp_path) -> None:
    data = measured.to_dict()
    data["machine"] = "0123456789abcdef"
    data["details"] = {**data["details"], "machine": {"hostname": "elsewhere", "cpu": "other", "gpus": ["X"]}}
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlacementError, match=r"another machine.*conduit profile"):
        load_profile(path)
    foreign = BandwidthProfile.from_dict(data)
    with pytest.raises(PlacementError, match="another machine"):
        CostModel(discover_topology(), foreign)


def test_missing_or_corrupt_profile_says_what_to_do(tmp_path) -> None:
    with pytest.raises(PlacementError, match="conduit profile"):
        load_profile(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlacementError, match="conduit profile"):
        load_profile(bad)


def test_local_plan_uses_the_measured_profile(measured: BandwidthProfile) -> None:
    local = discover_topology(disk_directory=measured.details["disk_directory"])  # (the volume it measured)
    p = Planner(local, measured).plan(Workload.transitions(1000, capacity=10_000, batch=256))
    assert p.profile_source == f"measured:{machine_id()}"
    assert p.placement.tier in ("host", "disk", "gpu", "sharded", "pinned")
    assert all(c.reason for c in p.candidates)


# -- cost model and planner -------------------------------------------------------------------------------
def test_workload_of_transitions_and_resizing() -> None:
    w = Workload.transitions(5000, capacity=10**6, batch=512)
    assert w.item_bytes == transition_schema(5000).fixed_item_bytes == 2 * 5000 * 4 + 8 + 4 + 1
    assert w.scalar == (2, 3, 4) and w.growing == (0, 1)
    big = w.resized(160_013)
    assert big.field_bytes == (80_000, 80_000, 8, 4, 1)
    with pytest.raises(ConfigurationError):
        Workload((8,), capacity=10, batch=11)
    with pytest.raises(ConfigurationError):
        Workload.transitions(0, capacity=10, batch=1)


def test_dgx_plan_one_gpu_at_5000_sharded_at_20000() -> None:
    """The paper's placement finding: d <= 5000 fits one GPU; d = 20000 needs the buffer sharded over GPUs."""
    small = plan(DGX, 5000)
    assert small.placement == PlacementSpec("gpu", ("cuda:0",))
    large = plan(DGX, 20000)
    assert large.placement.tier == "sharded" and len(large.placement.devices) >= 2
    assert large.placement.devices[0] == "cuda:0"  # the learner's GPU gathers
    single = [c for c in large.candidates if c.spec.tier == "gpu"]
    assert single and all(not c.feasible and c.reason.startswith("does not fit") for c in single)


def test_every_candidate_is_explained() -> None:
    p = plan(DGX, 5000)
    assert sum(c.chosen for c in p.candidates) == 1 and p.candidates[0].chosen
    assert p.chosen.reason.startswith("chosen")
    for c in p.candidates[1:]:
        assert c.reason.startswith(("slower", "does not fit", "within", "not needed")), c.reason
        assert c.reason.startswith("not needed") == (c.spec.tier == "disk")  # memory holds 40 GB
        e = c.estimate
        assert e.ingest_s > 0 and e.deliver_s > 0 and e.memory and e.usable
    tiers = {c.spec.tier for c in p.candidates}
    assert tiers == {"host", "pinned", "gpu", "sharded", "disk"}
    text = p.explain()
    assert "chosen: gpu[cuda:0]" in text and text.count("\n") >= len(p.candidates)


def test_host_loses_to_gpu_on_transfers() -> None:
    p = plan(DGX, 5000)
    host = next(c for c in p.candidates if c.spec.tier == "host")
    assert host.feasible and "deliver" in host.reason
    assert host.estimate.breakdown["deliver: transfer"] > 0  # the H2D copy a GPU tier avoids


def test_mi250x_sharded_plan_prefers_fast_ranks() -> None:
    """On non-uniform links the sharded plan uses the fast ranks 0/2/4/6, not the first four GCDs."""
    p = plan(MI, 20000)
    assert p.placement.tier == "sharded"
    assert set(p.placement.devices) == {"cuda:0", "cuda:2", "cuda:4", "cuda:6"}
    first4 = next(c for c in p.candidates if set(c.spec.devices) == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"})
    assert first4.feasible and not first4.chosen
    assert first4.estimate.deliver_s > p.chosen.estimate.deliver_s
    assert first4.estimate.breakdown["deliver: transfer"] > p.chosen.estimate.breakdown["deliver: transfer"]


def test_planner_ranks_learner_gpus_by_their_links_to_the_other_learners() -> None:
    """With a learner on every GCD, the fastest-linked ones (0/2/4/6) still come first, not all tied in rank order."""
    topo = load_topology(MI)
    w = Workload.transitions(20000, capacity=2_000_000, batch=512, learners=8)
    planner = Planner(topo)
    learners = planner.cost.learner_devices(w)
    scores = [planner._link_score(i, learners) for i in range(8)]
    assert min(scores[0], scores[2], scores[4], scores[6]) > max(scores[1], scores[3], scores[5], scores[7])
    cands = dict(planner.candidates(w))
    assert cands[PlacementSpec("sharded", ("cuda:0", "cuda:2", "cuda:4", "cuda:6"))].startswith("4 GPUs with the "
                                                                                               "fastest links")


def test_planner_proposes_shards_spread_over_the_pcie_switches() -> None:
    w = Workload.transitions(20000, capacity=10**6, batch=512)
    cands = dict(Planner(load_topology(DGX)).candidates(w))
    assert cands[PlacementSpec("sharded", ("cuda:0", "cuda:2"))] == "2 GPUs spread over the host links"
    assert cands[PlacementSpec("sharded", ("cuda:0", "cuda:2", "cuda:4", "cuda:6"))].endswith("host links")
    no_groups = load_topology(DGX)
    no_groups = Topology(no_groups.name, no_groups.host_memory_bytes, no_groups.gpus, no_groups.disk_bytes,
                         no_groups.declared)  # the same machine without host_link_groups
    assert not any("spread" in label for _, label in Planner(no_groups).candidates(w))


# -- the cost model prices the implementation's steps -------------------------------------------------------
def test_sharded_ingestion_is_staged_and_fills_the_shards_host_links_in_parallel() -> None:
    """ShardedStorage.append packs each shard's rows into page-locked memory and copies without blocking."""
    topo = load_topology(MI)  # every GCD has its own host link
    model = CostModel(topo)
    prof = model.profile
    w = Workload.transitions(20000, capacity=100_000, batch=512)
    spec = PlacementSpec("sharded", tuple(f"cuda:{i}" for i in range(8)))
    st = model.ingest_steps(spec, w)
    assert len(st.steps) == 8 * 5  # one step per shard and field
    for j, step in enumerate(st.steps):
        i, b = j // 5, w.field_bytes[j % 5] * 512 / 8  # shard after shard, field after field
        assert step.shard == i and step.resource == f"hostlink:{i}"
        assert step.cpu_s == pytest.approx(prof.link("host_copy").seconds(b) + prof.link("h2d_pinned").overhead_s)
        assert step.link_s == pytest.approx(prof.link("h2d_pinned").seconds(b) - prof.link("h2d_pinned").overhead_s)
    # the DMAs run behind the packing, on eight links at once
    dma = sum(s.link_s for s in st.steps)
    assert st.calls_s + st.thread_s < st.total_s < st.calls_s + st.thread_s + dma / 4
    total, parts = model.ingest(spec, w)
    assert total == pytest.approx(st.total_s) and set(parts) == {"ingest: edp", "ingest: stage", "ingest: copy"}
    # the same bytes shard after shard, each packed and copied from pageable memory, cost more
    serial = st.calls_s + sum(prof.link("host_copy").seconds(fb * 64) + prof.link("h2d_pageable").seconds(fb * 64)
                              for _ in range(8) for fb in w.field_bytes)
    assert total < 0.7 * serial
    # one GPU (ColumnarStorage): one synchronous pageable copy per field from the actor's tensor
    one = model.ingest_steps(PlacementSpec("gpu", ("cuda:0",)), w)
    assert [s.resource for s in one.steps] == [None] * 5
    assert [s.cpu_s for s in one.steps] == pytest.approx([prof.link("h2d_pageable").seconds(fb * 512)
                                                          for fb in w.field_bytes])


def test_gpus_behind_one_pcie_switch_share_its_uplink() -> None:
    """DGX A100 pairs (0/1, 2/3, ...) share a switch: their DMAs queue on one link; spread shards do not."""
    dgx = load_topology(DGX)
    # fast packing, so that the DMAs rather than the thread decide (with the declared 10 GB/s packing they
    # never overlap on a link)
    fast = BandwidthProfile({**dgx.declared.links, "host_copy": LinkCost.constant(1000)}, source="declared",
                            machine="declared:fast-pack")
    w = Workload.transitions(20000, capacity=100_000, batch=512)
    pair, spread = PlacementSpec("sharded", ("cuda:0", "cuda:1")), PlacementSpec("sharded", ("cuda:0", "cuda:2"))
    model = CostModel(dgx, fast)
    assert model.host_link_group(0) == model.host_link_group(1) != model.host_link_group(2)
    t_pair, t_spread = model.ingest(pair, w)[0], model.ingest(spread, w)[0]
    dma = w.item_bytes * 512 / 22e9  # every byte once over one link at the pinned rate
    assert t_pair > dma and t_spread < 0.6 * dma + 0.5e-3
    no_groups = Topology(dgx.name, dgx.host_memory_bytes, dgx.gpus, dgx.disk_bytes, dgx.declared)
    ungrouped = CostModel(no_groups, fast)
    assert ungrouped.ingest(pair, w)[0] == pytest.approx(ungrouped.ingest(spread, w)[0]) == pytest.approx(t_spread)
    declared = CostModel(dgx)  # never faster on one switch
    assert declared.ingest(pair, w)[0] >= declared.ingest(spread, w)[0]


def test_sharded_delivery_uploads_row_indices_per_shard_and_positions_per_field() -> None:
    """ShardedStorage.gather: r.to(shard device) per shard, pos.to(gathering device) per field and shard."""
    model = CostModel(load_topology(DGX))
    prof = model.profile
    w = Workload.transitions(128, capacity=100_000, batch=512)
    totals = []
    for k in (2, 4, 8):
        spec = PlacementSpec("sharded", tuple(f"cuda:{i}" for i in range(k)))
        parts = model.deliver_one(spec, w, "cuda:0")
        upload = prof.link("h2d_pageable").seconds(8 * 512 / k)
        issued = k * 5 * prof.link("gpu_gather").overhead_s + (k - 1) * 5 * prof.link("p2p").overhead_s
        assert parts["deliver: calls"] == pytest.approx(issued + k * (1 + 5) * upload)
        totals.append(model.deliver(spec, w)[0])
    assert totals[0] < totals[1] < totals[2]
    one = model.deliver_one(PlacementSpec("gpu", ("cuda:0",)), w, "cuda:0")
    # one GPU: the drawn rows' indices go up once (ColumnarStorage.gather)
    assert one["deliver: calls"] == pytest.approx(prof.link("h2d_pageable").seconds(8 * 512))
    assert sum(one.values()) < totals[0]


def test_more_learners_take_more_gpus_and_are_checked() -> None:
    p = plan(DGX, 1000, learners=4)
    assert p.chosen.estimate.deliver_s > plan(DGX, 1000).chosen.estimate.deliver_s
    with pytest.raises(PlacementError, match="--learners 8"):
        plan(DGX, 1000, learners=9)


def test_capacity_that_fits_nowhere_is_a_placement_error() -> None:
    with pytest.raises(PlacementError, match=r"No placement .* Lower the capacity"):
        plan("h200x1", 100_000, capacity=10**6)


def test_gpu_memory_headroom_decides_feasibility() -> None:
    """d = 10000 is 80 GB of transitions: more than one 80 GB A100 can hold with headroom."""
    p = plan(DGX, 10000)
    gpu0 = next(c for c in p.candidates if c.spec == PlacementSpec("gpu", ("cuda:0",)))
    assert not gpu0.feasible and "headroom" in gpu0.reason
    assert p.placement.tier == "sharded"


def test_memory_per_device_of_a_sharded_candidate() -> None:
    topo = load_topology(DGX)
    model = CostModel(topo)
    w = Workload.transitions(1000, capacity=1000, batch=10)
    need = model.memory(PlacementSpec("sharded", ("cuda:0", "cuda:1", "cuda:2")), w)
    out = 2 * 10 * w.item_bytes
    staging = 3 * 4 * w.item_bytes  # page-locked, per shard: ceil(10 / 3) rows of an ingestion call (was uncharged)
    assert need == {"cuda:0": 334 * w.item_bytes + out, "cuda:1": 333 * w.item_bytes, "cuda:2": 333 * w.item_bytes,
                    "cpu": staging}


def test_custom_topology_object() -> None:
    tiny = Topology("tiny", 1 << 30, (Gpu(0, "g", 1 << 30),), 0,
                    BandwidthProfile({k: v for k, v in load_topology(DGX).declared.links.items()}, source="declared",
                                     machine="declared:tiny"))
    p = Planner(tiny).plan(Workload.transitions(100, capacity=1000, batch=16))
    assert p.chosen.feasible and not any(c.spec.tier == "disk" for c in p.candidates)  # no disk declared
    assert {c.spec.tier for c in p.candidates} == {"host", "pinned", "gpu"}  # one GPU: nothing to shard


# -- placement map ----------------------------------------------------------------------------------------
def test_placement_map_over_experience_size() -> None:
    planner = Planner(load_topology(DGX))
    w = Workload.transitions(128, capacity=10**6, batch=512)
    lo, hi = w.item_bytes, Workload.transitions(20000, capacity=10**6, batch=512).item_bytes
    pmap = planner.placement_map(w, min_item_bytes=lo, max_item_bytes=hi, points=24)
    assert pmap.lookup(Workload.transitions(5000, capacity=1, batch=1).item_bytes).tier == "gpu"
    assert pmap.lookup(hi).tier == "sharded"
    assert pmap.boundaries
    first_shard = next(r for r in pmap.ranges if r.spec is not None and r.spec.tier == "sharded")
    b = int(first_shard.lo)
    assert 40_013 < b <= 80_013  # between d = 5000 and d = 10000
    # a boundary is exact: one byte less plans differently
    assert planner.plan(w.resized(b)).placement == first_shard.spec
    assert planner.plan(w.resized(b - 1)).placement != first_shard.spec
    assert "nothing fits" not in pmap.explain()
    assert json.loads(json.dumps(pmap.to_dict()))["ranges"][0]["placement"]["tier"] == "gpu"


def test_placement_map_marks_sizes_that_fit_nowhere() -> None:
    planner = Planner(load_topology("h200x1"))
    w = Workload.transitions(128, capacity=10**6, batch=512)
    pmap = planner.placement_map(w, min_item_bytes=1000, max_item_bytes=10**6, points=12)
    assert pmap.ranges[-1].spec is None
    with pytest.raises(PlacementError, match="No placement"):
        pmap.lookup(10**6)


# -- CLI --------------------------------------------------------------------------------------------------
def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", DGX, "--obs-dim", "5000", "--capacity", "1e6", "--batch", "512",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"]["tier"] == "gpu" and out["placement"]["devices"] == ["cuda:0"]
    assert len(out["candidates"]) > 5 and all("reason" in c and "feasible" in c for c in out["candidates"])
    assert main(["plan", "--topology", DGX, "--obs-dim", "20000", "--capacity", "1e6", "--batch", "512",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"]["tier"] == "sharded" and len(out["placement"]["devices"]) >= 2


def test_cli_plan_text_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", MI, "--obs-dim", "20000", "--capacity", "1e6", "--batch", "512"]) == 0
    text = capsys.readouterr().out
    assert "chosen: sharded[cuda:0,cuda:2,cuda:4,cuda:6]" in text and "does not fit" in text
    assert main(["plan", "--topology", "nope", "--obs-dim", "8", "--capacity", "10", "--batch", "2"]) == 2
    assert "Unknown topology" in capsys.readouterr().err
    assert main(["plan", "--topology", "h200x1", "--obs-dim", "100000", "--capacity", "1e6", "--batch", "2"]) == 2
    assert "Lower the capacity" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--topology", DGX, "--obs-dim", "1.5", "--capacity", "10", "--batch", "2"])


def test_cli_profile_cached_json(measured: BandwidthProfile, monkeypatch: pytest.MonkeyPatch, tmp_path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONDUIT_CACHE_DIR", str(tmp_path))
    assert main(["profile", "--cached"]) == 2  # nothing cached in this directory yet
    assert "conduit profile" in capsys.readouterr().err
    measured.save()
    assert main(["profile", "--cached", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["machine"] == machine_id() and "host_gather" in out["links"]
    assert main(["profile", "--cached"]) == 0
    assert "host_gather" in capsys.readouterr().out


def test_planner_docstring_example_runs() -> None:
    import doctest

    import conduit.placement.planner

    result = doctest.testmod(conduit.placement.planner)
    assert result.attempted > 0 and result.failed == 0, result


def test_measured_figures_replace_declared_ones_where_present(measured: BandwidthProfile) -> None:
    """Planning a declared machine with a profile: measured paths win, declared ones fill the rest."""
    model = CostModel(load_topology("h200x1"), measured)
    assert model.profile.link("host_gather") == measured.link("host_gather")
    # on a machine without a GPU the GPU's paths are not measured, so the declared ones stand
    gpu = measured.link("gpu_gather") if measured.has("gpu_gather") else load_topology("h200x1").declared.link(
        "gpu_gather")
    assert model.profile.link("gpu_gather") == gpu
    p = Planner(load_topology("h200x1"), measured).plan(Workload.transitions(1000, capacity=10**5, batch=256))
    host = next(c for c in p.candidates if c.spec.tier == "host")
    declared_host = next(c for c in Planner(load_topology("h200x1")).plan(
        Workload.transitions(1000, capacity=10**5, batch=256)).candidates if c.spec.tier == "host")
    assert host.estimate.deliver_s != declared_host.estimate.deliver_s


def test_disk_tier_only_when_memory_cannot_hold_the_buffer() -> None:
    topo = load_topology("h200x1")
    small = Planner(topo).plan(Workload.transitions(1000, capacity=10**6, batch=512))
    assert small.placement.tier != "disk"
    # 37 GiB of transitions on a machine with 16 GiB of memory, no GPU and a 1 TiB disk: only the disk holds it
    no_gpu = Topology("small-host-big-disk", 16 << 30, (), 1 << 40, topo.declared)
    big = Planner(no_gpu).plan(Workload.transitions(5000, capacity=10**6, batch=512))
    assert big.placement.tier == "disk"
    host = next(c for c in big.candidates if c.spec.tier == "host")
    assert not host.feasible
