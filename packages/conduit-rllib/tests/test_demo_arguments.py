"""``conduit demo``'s (RLlib DQN) argument refusals: each bad count is named alone, before Ray or RLlib start.

One message covered three options ("--iterations and --steps must be >= 1 and --obs-dim >= 4"), whichever of
them was wrong, and so named options the user had not typed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conduit_rllib.demo import run

ALL = ("--obs-dim", "--iterations", "--steps", "--batch", "--capacity", "--hidden")


@pytest.mark.parametrize(("flag", "value", "least"), [("--iterations", "1", 2), ("--steps", "-3", 1),
                                                      ("--obs-dim", "3", 4), ("--batch", "0", 1),
                                                      ("--capacity", "-1", 1), ("--hidden", "0", 1)])
def test_each_bad_count_is_refused_by_its_own_name(flag: str, value: str, least: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        run([flag, value, "--no-progress"])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert line.startswith("conduit demo: error: ") and "Traceback" not in err, err
    assert f"{flag} must be >= {least}, got {value}" in line, line
    assert f"give {flag} {least} or more" in line, line
    assert [f for f in ALL if f in line] == [flag], f"names options that were not wrong: {line}"
    assert "RLlib DQN on LargeObsCartPole" not in out, "the run started before the refusal"


HUGE = str(10**20)  # past int64


@pytest.mark.parametrize(("argv", "named"), [
    (["--capacity", HUGE], "--capacity must be at most 2**63 - 1"),
    (["--steps", HUGE], "--steps must be at most 2**63 - 1"),
    (["--capacity", str(10**13), "--obs-dim", "5000"], "--capacity 10000000000000 with --obs-dim 5000: "),
    (["--batch", str(10**13), "--obs-dim", "5000"], "--batch 10000000000000 with --obs-dim 5000: "),
    (["--hidden", str(10**13), "--obs-dim", "5000"], "--hidden 10000000000000 with --obs-dim 5000: "),
])
def test_a_count_too_large_is_refused_before_ray_starts(argv: list[str], named: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A --capacity past int64 passed, started Ray and ended in RLlib's "TypeError: loop of ufunc does not support
    argument 0 of type int" traceback; sizes no memory holds passed too (RLlib's prioritized buffer builds Python
    lists of 4x the capacity, element by element; Conduit's preallocates the observations), after the native run
    if that survived them. (Ray is stopped at its start so that a check that lets them through fails at once.)"""
    import ray

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started Ray: the count was not refused")

    monkeypatch.setattr(ray, "init", reached)
    with pytest.raises(SystemExit) as done:
        run([*argv, "--no-progress", "--out", str(tmp_path / "plot.png")])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert line.startswith("conduit demo: error: ") and "Traceback" not in err, err
    assert named in line, line
    assert "give a smaller" in line or "; lower " in line, line
    assert "RLlib DQN on LargeObsCartPole" not in out, "the run started before the refusal"
    assert not list(tmp_path.iterdir()), "the refused command left a file"


def test_the_plots_missing_folders_are_not_left_behind_by_a_run_that_does_not_finish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check of --out created its missing folders before the (minutes-long) run: a run that then failed or was
    interrupted (Ctrl-C) left them behind, empty. (Here Ray fails to start.)"""
    import ray

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Ray could not start")

    monkeypatch.setattr(ray, "init", fails)
    with pytest.raises(RuntimeError, match="Ray could not start"):
        run(["--no-progress", "--out", str(tmp_path / "results" / "run1" / "plot.png")])
    assert not (tmp_path / "results").exists(), "the plot's folders were left behind"


def test_counts_written_as_1e6_are_read_as_conduit_plan_reads_them(capsys: pytest.CaptureFixture[str]) -> None:
    """``--capacity 1e6`` was refused ("invalid int value: '1e6'") while ``conduit plan --capacity 1e6`` took it:
    here it is read, and the refusal is the one for ``--iterations 0`` (so that nothing starts)."""
    with pytest.raises(SystemExit) as done:
        run(["--capacity", "1e6", "--steps", "2e2", "--iterations", "0", "--no-progress"])
    assert done.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--iterations must be >= 2, got 0" in line, line


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_numpy_cannot_take_is_refused_before_ray_starts(seed: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--seed 4294967296`` passed, started Ray and ended in a traceback from building the native variant (RLlib
    seeds NumPy's global generator with it: ``ValueError: Seed must be between 0 and 2**32 - 1``)."""
    import ray

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started Ray: the seed was not refused")

    monkeypatch.setattr(ray, "init", reached)
    with pytest.raises(SystemExit) as done:
        run(["--seed", seed, "--no-progress", "--out", str(tmp_path / "plot.png")])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert line.startswith("conduit demo: error: ") and "Traceback" not in err, err
    assert f"--seed must be from 0 to 2**32 - 1, got {seed}" in line, line
    assert "RLlib DQN on LargeObsCartPole" not in out, "the run started before the refusal"


def test_a_capacity_whose_observations_and_next_observations_overflow_memory_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Conduit's buffer preallocates each transition's observation and next observation (2 x capacity x d float32),
    but the check counted the observations once: a --capacity whose two copies overflow memory passed, the native
    run went first, and Conduit's first add then failed (a CapacityError traceback after minutes)."""
    import conduit_rllib.demo as demo
    import ray

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started Ray: the capacity was not refused")

    monkeypatch.setattr(ray, "init", reached)
    monkeypatch.setattr(demo, "host_memory", lambda: 1 << 30)  # 1 GiB
    # 30,000 x 5,000 float32 = 0.56 GiB of observations, 1.12 GiB with the next observations
    with pytest.raises(SystemExit) as done:
        run(["--capacity", "30000", "--obs-dim", "5000", "--no-progress", "--out", str(tmp_path / "plot.png")])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert line.startswith("conduit demo: error: ") and "Traceback" not in err, err
    assert "--capacity 30000 with --obs-dim 5000: " in line and "lower --capacity or --obs-dim" in line, line
    assert "RLlib DQN on LargeObsCartPole" not in out, "the run started before the refusal"
