"""Third review round: planner capacity boundaries and ties, topology link matrices, telemetry traces, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conduit.cli import build_parser, main
from conduit.commands import count
from conduit.errors import ConfigurationError, PlacementError
from conduit.exposure import measure_iteration
from conduit.placement import load_topology
from conduit.placement.base import PlacementSpec
from conduit.placement.cost import CostModel, Workload
from conduit.placement.planner import Planner
from conduit.placement.profile import BandwidthProfile, LinkCost, load_profile, machine_id
from conduit.placement.topology import Gpu, Topology
from conduit.telemetry import CallRecord, Telemetry

GPU0 = PlacementSpec("gpu", ("cuda:0",))


def _one_gpu(memory_bytes: int) -> Topology:
    return Topology("t", 10**12, (Gpu(0, "g", memory_bytes),), 0, load_topology("h200x1").declared)


# -- capacity at exact boundaries ------------------------------------------------------------
def test_a_buffer_that_exactly_fills_a_gpu_with_its_headroom_fits() -> None:
    w = Workload((100,), capacity=1000, batch=10)  # columns 100_000 B + 2 output batches 2_000 B
    need = CostModel(_one_gpu(1)).memory(GPU0, w)["cuda:0"]
    assert need == 102_000
    exact = 112_200  # 102_000 * (1 + 0.1), the usable bytes exactly
    est = CostModel(_one_gpu(exact), gpu_usable=1.0, headroom=0.1).estimate(GPU0, w)
    assert est.feasible, f"a buffer needing exactly the usable bytes was refused: {est.shortfalls()}"
    plan = Planner(_one_gpu(exact), gpu_usable=1.0).plan(w)
    assert next(c for c in plan.candidates if c.spec == GPU0).feasible, plan.explain()
    short = CostModel(_one_gpu(exact - 1), gpu_usable=1.0, headroom=0.1).estimate(GPU0, w)
    assert short.shortfalls() == ["needs 112200 B on cuda:0 (with 10% headroom), 112199 B usable"], \
        "a near miss must show the difference, not '0.0 GiB' against '0.0 GiB'"


@pytest.mark.parametrize("share, usable", [(0.29, 29), (0.57, 57), (0.58, 58), (0.9, 90)])
def test_the_usable_share_of_a_device_is_exact(share: float, usable: int) -> None:
    model = CostModel(_one_gpu(100), gpu_usable=share, headroom=0.0)
    assert model.usable_bytes("cuda:0") == usable, f"{share} of 100 B is {usable} B"
    w = Workload((1,), capacity=usable - 4, batch=2)  # columns + 2 output batches of 2 items: exactly `usable`
    assert model.memory(GPU0, w) == {"cuda:0": usable}
    assert model.estimate(GPU0, w).feasible


# -- candidates and their explanations on odd profiles ----------------------------------------
def _free_profile_topology() -> Topology:
    """Two GPUs whose paths cost nothing (zero overhead, unlimited bandwidth) except the pinned uploads."""
    names = ("host_copy", "host_gather", "h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "gpu_gather",
             "p2p", "edp_deliver", "edp_ingest")
    links = {k: LinkCost(0.0) for k in names}
    links["h2d_pinned"] = LinkCost.constant(10, 5)
    prof = BandwidthProfile(links, source="declared", machine="declared:free")
    return Topology("free", 10**12, (Gpu(0, "g", 10**11), Gpu(1, "g", 10**11)), 0, prof)


def test_a_plan_whose_chosen_path_costs_nothing_explains_every_slower_candidate() -> None:
    plan = Planner(_free_profile_topology()).plan(Workload((100,), capacity=1000, batch=10))
    assert plan.chosen.estimate.total_s == 0.0
    slower = [c for c in plan.candidates if c.reason.startswith("slower")]
    assert slower, plan.explain()
    assert all("the chosen costs nothing" in c.reason for c in slower), plan.explain()


def test_the_learners_gpu_outranks_one_with_unlimited_links_to_it() -> None:
    """A GPU's unlimited P2P bandwidth to the learner must not rank it above the learner's own GPU."""
    planner = Planner(_free_profile_topology())
    sharded = [s for s, _ in planner.candidates(Workload((100,), capacity=1000, batch=10)) if s.tier == "sharded"]
    assert sharded and all(s.devices[0] == "cuda:0" for s in sharded), \
        f"the learner sits on cuda:0, so shards gather there: {sharded}"


def test_ties_between_identical_gpus_choose_the_first_every_time() -> None:
    plans = [Planner(_free_profile_topology()).plan(Workload((100,), capacity=1000, batch=10)) for _ in range(3)]
    assert {str(p.placement) for p in plans} == {"gpu[cuda:0]"}


# -- topology link matrices -------------------------------------------------------------------
def _two_gpus(p2p: dict[str, object]) -> dict[str, object]:
    return {"name": "m", "host_memory_gib": 1, "gpu": {"count": 2, "name": "g", "memory_gib": 1}, "p2p": p2p,
            "links": {"h2d_pageable": {"gbps": 8}}}


@pytest.mark.parametrize("entry", [None, 0, -5, float("nan"), float("inf"), "fast", True])
def test_a_link_matrix_with_a_missing_or_bad_pair_is_refused_when_loaded(entry: object) -> None:
    d = _two_gpus({"matrix_gbps": [[None, entry], [100, None]]})
    with pytest.raises(PlacementError, match=r"matrix_gbps\[0\]\[1\].*finite bandwidth > 0"):
        Topology.from_file_dict(d)


@pytest.mark.parametrize("count", [2.5, True])
def test_a_gpu_count_that_is_not_a_whole_number_is_refused_as_such(count: object) -> None:
    d = _two_gpus({"gbps": 50})
    d["gpu"] = {"count": count, "name": "g", "memory_gib": 1}
    with pytest.raises(PlacementError, match="gpu.count must be a whole number"):
        Topology.from_file_dict(d)


def test_pairs_a_link_matrix_leaves_out_take_its_declared_default() -> None:
    topo = Topology.from_file_dict(_two_gpus({"gbps": 50, "matrix_gbps": [[None, None], [100, None]]}))
    assert topo.declared is not None
    assert topo.declared.link("p2p", 0, 1).peak_bandwidth == 50e9
    assert topo.declared.link("p2p", 1, 0).peak_bandwidth == 100e9


# -- measured profiles with bad details ------------------------------------------------------------
@pytest.mark.parametrize("details, machine", [({"llc_bytes": "big"}, None), ({"llc_bytes": None}, None), ([1], None),
                                              ({"machine": "box"}, "another-machine")])
def test_a_profile_with_malformed_details_is_a_placement_error_when_loaded(tmp_path: Path, details: object,
                                                                          machine: str | None) -> None:
    links = {k: LinkCost.constant(10, 5) for k in ("host_copy", "host_gather", "edp_deliver", "edp_ingest")}
    d = {**BandwidthProfile(links, machine=machine or machine_id()).to_dict(), "details": details}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlacementError, match="details are malformed.*conduit profile"):
        load_profile(path)


# -- telemetry ----------------------------------------------------------------------------------
def test_counts_add_up_exactly_while_threads_record_and_another_reads() -> None:
    tel = Telemetry(maxlen=100_000, fold_every=7)
    writers, per = 4, 2000
    stop = threading.Event()
    alive = threading.Barrier(writers)  # every writer alive at once: distinct thread ids

    def write(k: int) -> None:
        alive.wait()
        for i in range(per):
            tel.record(f"k{k % 2}", 1, 2, float(i), i + 0.5)
        alive.wait()

    def read() -> None:
        while not stop.is_set():
            tel.records, tel.totals, tel.recent("k0", 3), tel.chrome_trace()  # noqa: B018

    reader = threading.Thread(target=read)
    reader.start()
    threads = [threading.Thread(target=write, args=(k,), name=f"writer-{k}") for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    reader.join()
    totals = tel.totals
    assert {k: (t.calls, t.items, t.nbytes) for k, t in totals.items()} == \
        {"k0": (2 * per, 2 * per, 4 * per), "k1": (2 * per, 2 * per, 4 * per)}
    assert len(tel.records) == writers * per
    trace = json.loads(json.dumps(tel.chrome_trace(), allow_nan=False))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert len(spans) == writers * per and all(e["dur"] >= 0 for e in spans)
    assert {e["tid"] for e in spans} == set(names) and set(names.values()) == {f"writer-{k}" for k in range(writers)}


def _fails_and_keeps_the_old_file(script: str, path: Path) -> None:
    """Run ``script`` on ``path`` in a fresh interpreter (it lowers its own file-size limit): its second write
    must fail and the first file's content stay."""
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["write", "failed", "old", "kept"], out.stdout


_TRACE_UNDER_A_FILE_SIZE_LIMIT = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from conduit.telemetry import CallRecord, Telemetry
    path = Path(sys.argv[1])
    tel = Telemetry()
    tel.record("ingest", 1, 8, 0.0, 1.0)
    tel.chrome_trace(path)
    old = path.read_text()
    for i in range(2000):
        tel.record("deliver", 1, 8, float(i), i + 0.5)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        tel.chrome_trace(path)
    except OSError:
        print("write failed")
    print("old kept" if path.read_text() == old else "old lost: " + str(len(path.read_text())) + " bytes")
""")


def test_a_trace_write_that_fails_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    _fails_and_keeps_the_old_file(_TRACE_UNDER_A_FILE_SIZE_LIMIT, path)
    assert json.loads(path.read_text())["traceEvents"][0]["name"] == "ingest"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"], "no temporary file may be left behind"


_PROFILE_UNDER_A_FILE_SIZE_LIMIT = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from conduit.placement.profile import BandwidthProfile, LinkCost
    path = Path(sys.argv[1])
    BandwidthProfile({"host_copy": LinkCost.constant(10, 5)}).save(path)
    old = path.read_text()
    big = BandwidthProfile({f"host_copy:{i}": LinkCost.constant(10, 5) for i in range(500)})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        big.save(path)
    except Exception as e:  # a PlacementError naming the file (an OSError before it said what to do)
        print("write failed" if str(path) in str(e) else "unexpected " + repr(e))
    print("old kept" if path.read_text() == old else "old lost")
""")


def test_a_profile_save_that_fails_leaves_the_old_profile_and_no_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    _fails_and_keeps_the_old_file(_PROFILE_UNDER_A_FILE_SIZE_LIMIT, path)
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"], "no partial file may be left behind"


def test_a_profile_that_cannot_be_written_is_a_placement_error_saying_where(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(PlacementError, match="not-a-directory.*pass a writable path"):
        BandwidthProfile({"host_copy": LinkCost.constant(10, 5)}).save(blocker / "profile.json")


# -- exposure -----------------------------------------------------------------------------------
def test_an_iteration_window_that_ends_before_it_starts_is_refused() -> None:
    recs = [CallRecord("deliver", 0, 0, 0.2, 2.0, 1), CallRecord("rollout", 0, 0, 0.2, 2.0, 1)]
    with pytest.raises(ConfigurationError, match="ends before it starts"):
        measure_iteration(recs, 1.0, 0.5)
    empty = measure_iteration(recs, 1.0, 1.0)  # a zero-length window is empty, not negative
    assert (empty.exposed_s, empty.hidden_s, empty.total_s, empty.rollout_s) == (0.0, 0.0, 0.0, 0.0)


def test_nested_overlapping_and_zero_length_spans_are_counted_once() -> None:
    loop, worker = 1, 2
    recs = [CallRecord("rollout", 0, 0, 0.0, 1.0, loop),
            CallRecord("deliver_wait", 0, 0, 0.1, 0.4, loop), CallRecord("deliver", 0, 0, 0.2, 0.3, loop),  # nested
            CallRecord("ingest", 0, 0, 0.35, 0.5, loop),  # overlapping the wait
            CallRecord("ingest", 0, 0, 0.6, 0.6, loop),  # zero length
            CallRecord("stage", 0, 0, -0.5, 0.45, worker),  # from before the iteration, hidden until the wait
            CallRecord("stage", 0, 0, 0.9, 1.5, worker)]  # past its end
    it = measure_iteration(recs, 0.0, 1.0)
    assert it.exposed_s == pytest.approx(0.4)  # [0.1, 0.5)
    assert it.hidden_s == pytest.approx(0.1 + 0.1)  # [0, 0.1) and [0.9, 1.0)
    assert it.total_s == pytest.approx(0.6) and it.rollout_s == pytest.approx(1.0)


# -- the command line ---------------------------------------------------------------------------
def _subcommands() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(sub.choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--obs-dim", "--capacity", "--batch", "--learners"])
def test_plan_counts_too_large_for_int64_are_argument_errors(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--obs-dim": "4", "--capacity": "1000", "--batch": "10", "--learners": "1", flag: "1e30"}
    with pytest.raises(SystemExit) as e:
        main(["plan", "--topology", "h200x1", *[x for kv in args.items() for x in kv]])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "too large" in err, err


def test_counts_written_out_are_read_exactly() -> None:
    """``conduit plan`` and ``conduit simulate`` read their counts with ``conduit.commands.count``: exact up to
    int64 (through a float, 2**63 - 1 became 2**63), ``1e6`` and ``1_000`` accepted."""
    assert count("9223372036854775807") == 2**63 - 1
    assert count("12345678901234567") == 12345678901234567
    assert count("1e6") == 10**6 and count("1_000") == 1000
