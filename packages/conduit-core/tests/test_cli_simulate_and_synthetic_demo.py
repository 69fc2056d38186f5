"""The command line and the scale simulator, as a demanding user of ``conduit simulate`` and
``conduit demo --synthetic``: every case here was a bug (a hang, an output that misreports what was simulated, an
option silently ignored, a refused command that still wrote files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conduit.cli import main
from conduit.errors import ConfigurationError
from conduit.simulation import SCENARIOS, simulate_scale
from conduit.simulation.model import MAX_NODES

A100 = ["simulate", "--scenario", "a100", "--samples", "1"]


# -- conduit simulate: a scale too large to simulate is refused at once, not simulated for hours -------------


def test_a_scale_beyond_the_simulators_node_limit_is_refused_before_building_anything() -> None:
    """``simulate_iteration`` builds a fetch for every ordered pair of nodes (time and memory grow with nodes**2:
    4096 GPUs took 25 s and 2 GB, 10**9 never ended); a scale over the limit is a typed error naming it."""
    too_many = (MAX_NODES + 1) * 8
    with pytest.raises(ConfigurationError, match=f"at most {MAX_NODES} nodes"):
        simulate_scale(SCENARIOS["mi250x"], too_many)
    with pytest.raises(ConfigurationError, match=f"{MAX_NODES * 8} GPUs"):
        simulate_scale(SCENARIOS["a100"], 10**9)


def test_cli_refuses_a_huge_scale_with_one_line_before_simulating_the_others_or_writing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    # (1 and 2 GPUs come first: before the fix they were simulated, then 10**9 never ended)
    assert main([*A100, "--gpus", "1,2,1e9", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "--gpus" in err, err
    assert not out.exists(), "a refused command still created its output directory"


def test_cli_checks_every_scale_of_every_scenario_before_writing_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """12 GPUs do not fill nodes of 8: refused before the directory is made or any scale simulated."""
    out = tmp_path / "o"
    assert main(["simulate", "--gpus", "1,12", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "12 GPUs do not fill nodes of 8" in err, err
    assert not out.exists()


def test_a_replay_ratio_refusal_creates_no_output_directory(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o"
    assert main([*A100, "--gpus", "1", "--capacity", "100", "--out", str(out)]) == 2
    assert "replay_ratio" in capsys.readouterr().err
    assert not out.exists(), "a refused command still created its output directory"


# -- conduit simulate: the outputs say what was simulated ----------------------------------------------------


def test_table_and_json_report_the_rpc_cost_given_not_the_default(tmp_path: Path) -> None:
    """With ``--rpc-us 5000`` the JSON used to carry only the network's source ("50 us per remote fetch is an
    assumption") and the table nothing: a result of another remote-fetch cost, labelled as the default."""
    out = tmp_path / "o"
    assert main([*A100, "--gpus", "16", "--rpc-us", "5000", "--out", str(out)]) == 0
    head = (out / "scale-a100.md").read_text().splitlines()[0]
    assert "5000 us per remote fetch" in head, head
    data = json.loads((out / "scale-a100.json").read_text())
    assert data["rpc_us"] == 5000, data.keys()
    assert "--rpc-us 5000" in data["network"], data["network"]


def test_default_rpc_cost_is_reported_as_the_networks(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main([*A100, "--gpus", "1", "--out", str(out)]) == 0
    assert "50 us per remote fetch" in (out / "scale-a100.md").read_text().splitlines()[0]
    data = json.loads((out / "scale-a100.json").read_text())
    assert data["rpc_us"] == 50 and "--rpc-us" not in data["network"], data


def test_gpus_are_simulated_once_each_in_increasing_order(tmp_path: Path) -> None:
    """``--gpus 16,1,16`` used to give three rows (one twice) in that order, and a plot line drawn back and forth."""
    out = tmp_path / "o"
    assert main([*A100, "--gpus", "16,1,16", "--out", str(out)]) == 0
    data = json.loads((out / "scale-a100.json").read_text())
    assert [r["gpus"] for r in data["rows"]] == [1, 16]
    assert data["scenario"]["gpus"] == [1, 16]


def test_simulate_help_says_where_the_output_goes_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default simulation-out" in text, text


# -- conduit demo --synthetic: options the chosen scheduler does not use are refused, not ignored ------------


@pytest.mark.parametrize(("scheduler", "flag"), [("sync", "--g-del"), ("auto", "--g-ing"), ("auto", "--g-del")])
def test_demo_granularity_with_a_scheduler_that_ignores_it_is_an_error(
        scheduler: str, flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    rc = main(["demo", "--synthetic", "--scheduler", scheduler, flag, "2", "--obs-dim", "4", "--iterations", "1",
               "--warmup", "0", "--rollout", "4", "--batch", "4", "--capacity", "16", "--no-baseline",
               "--trace", str(trace)])
    out = capsys.readouterr()
    assert rc == 2, out.out
    assert out.err.startswith("error: ") and flag in out.err and scheduler in out.err, out.err
    assert "synthetic loop" not in out.out and not trace.exists(), "refused after (or while) running"


def test_demo_granularity_is_still_taken_by_the_schedulers_that_use_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--synthetic", "--scheduler", "sequential", "--g-ing", "2", "--g-del", "3", "--obs-dim", "4",
               "--iterations", "1", "--warmup", "0", "--rollout", "4", "--batch", "4", "--capacity", "16",
               "--no-baseline", "--trace", ""])
    assert rc == 0
    assert "g_ing=2, g_del=3, overlap=False" in capsys.readouterr().out


def test_an_empty_out_is_refused_instead_of_writing_into_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*A100, "--gpus", "1", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--out" in err, err
    assert list(tmp_path.iterdir()) == [], "a refused command still wrote files"


def test_samples_with_a_baseline_that_does_not_use_them_is_said(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*A100, "--gpus", "1", "--out", str(tmp_path / "o")]) == 0
    assert "--samples applies to --baseline link-blind only" in capsys.readouterr().err
    assert main(["simulate", "--scenario", "a100", "--gpus", "1", "--out", str(tmp_path / "o")]) == 0
    assert "--samples" not in capsys.readouterr().err  # not given: nothing to say
    assert main([*A100, "--gpus", "1", "--baseline", "link-blind", "--out", str(tmp_path / "o")]) == 0
    assert "--samples" not in capsys.readouterr().err


def test_a_scenario_where_nothing_fits_leaves_no_output_of_the_others(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Transitions of d = 10**6 (8 MB; 7.5 TB at capacity 10**6) fit an A100 node's disk but no MI250X node: the
    command is refused (exit 2, one line), and the A100 table and JSON used to be written before the refusal."""
    out = tmp_path / "o"
    assert main(["simulate", "--gpus", "8", "--obs-dim", "1e6", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No placement on 'mi250x-node'") and "Traceback" not in err, err
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    existing = tmp_path / "existing"
    existing.mkdir()
    assert main(["simulate", "--gpus", "8", "--obs-dim", "1e6", "--out", str(existing)]) == 2
    assert existing.is_dir() and list(existing.iterdir()) == []  # a directory it did not make stays


@pytest.mark.parametrize("scheduler", ["sequential", "overlapped"])
def test_demo_g_del_beyond_the_runs_deliveries_is_refused_not_prepared(
        scheduler: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--g-del 100000000`` made the first delivery call prepare 10**8 batches (no end in sight); the run takes
    --updates x (--warmup + --iterations) = 4 x 2 batches, so a chunk larger than that is refused up front."""
    base = ["demo", "--synthetic", "--scheduler", scheduler, "--obs-dim", "4", "--iterations", "1", "--warmup", "1",
            "--rollout", "4", "--batch", "4", "--capacity", "16", "--updates", "4", "--no-baseline", "--trace", ""]
    assert main([*base, "--g-del", "100000000"]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: --g-del 100000000") and "--g-del 8 or less" in out.err, out.err
    assert "synthetic loop" not in out.out
    assert main([*base, "--g-del", "8"]) == 0  # the whole run in one chunk is still allowed
    assert f"g_del=8, overlap={scheduler == 'overlapped'}" in capsys.readouterr().out


def test_simulate_one_scenario_names_another_scenarios_earlier_files_left_in_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An earlier run's ``scale-mi250x.*`` stayed beside a new ``--scenario a100`` run's files, and the new
    ``scale.png`` (a100 only) said nothing of them: the folder read as one run."""
    (tmp_path / "scale-mi250x.md").write_text("earlier\n")
    assert main(["simulate", "--scenario", "a100", "--gpus", "16", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "scale-mi250x.md" in err and "from an earlier run" in err, err
    assert (tmp_path / "scale-mi250x.md").read_text() == "earlier\n"  # a user's file is never deleted
    assert main(["simulate", "--scenario", "a100", "--gpus", "16", "--out", str(tmp_path / "fresh")]) == 0
    assert "earlier run" not in capsys.readouterr().err
