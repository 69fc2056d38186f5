"""``conduit simulate`` refused for an output it cannot write leaves no half output behind (run through
:func:`conduit.cli.main`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conduit.cli import main

#: one small scale of both scenarios: a second or so
SMALL = ["simulate", "--gpus", "4"]


@pytest.mark.parametrize("blocked", ["scale.png", "scale-mi250x.json"])
def test_simulate_refuses_an_output_name_taken_by_a_folder_before_writing_any_file(
        tmp_path: Path, blocked: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder in --out under the name of one of its outputs (the plot, the last scenario's JSON) was found only
    when that output was written: the command exited 2 after writing the tables and JSON files before it (a
    half output), and the message said "free space there". It is now refused before anything is simulated or
    written, naming the path and --out."""
    out = tmp_path / "out"
    (out / blocked).mkdir(parents=True)
    assert main([*SMALL, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(out / blocked) in err and "--out" in err, err
    assert "free space" not in err, err
    assert sorted(p.name for p in out.iterdir()) == [blocked], "a refused command left files behind"


def test_simulate_still_replaces_the_files_of_a_previous_run(tmp_path: Path) -> None:
    """Outputs that exist as files (a previous run's) are replaced, as before."""
    out = tmp_path / "out"
    assert main([*SMALL, "--scenario", "a100", "--out", str(out)]) == 0
    (out / "scale-a100.md").write_text("old")
    assert main([*SMALL, "--scenario", "a100", "--out", str(out)]) == 0
    assert (out / "scale-a100.md").read_text().startswith("**SIMULATION**")
