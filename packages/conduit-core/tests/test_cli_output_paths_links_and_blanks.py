"""Output paths of ``conduit demo --synthetic --trace`` and ``conduit simulate --out``: symbolic links and blank names.

Each case was a known defect: a ``--trace`` that is a symbolic link was replaced by a regular file (the rename of the
atomic write went over the link), leaving the file it pointed to stale -- and a dangling link was deleted by the
writability probe; ``--trace '  '`` wrote a file named with spaces; ``--out '   '`` was refused with a message
naming ``--out ''``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conduit.cli import main
from conduit.telemetry import write_atomically

DEMO = ["demo", "--synthetic", "--obs-dim", "4", "--iterations", "1", "--warmup", "0", "--rollout", "4", "--batch",
        "4", "--capacity", "16", "--no-baseline"]


def test_write_atomically_writes_through_a_link_and_keeps_it(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "data.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    write_atomically(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["link.txt", "real"]
    assert os.listdir(target.parent) == ["data.txt"], "a temporary file was left behind"


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_demo_trace_through_a_symbolic_link_updates_the_file_it_points_to(tmp_path: Path, dangling: bool,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "traces").mkdir()
    target = tmp_path / "traces" / "trace.json"
    if not dangling:
        target.write_text("stale")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    assert main([*DEMO, "--trace", str(link)]) == 0, capsys.readouterr().err
    assert link.is_symlink(), "the link was replaced by a regular file"
    assert "traceEvents" in json.loads(target.read_text()), "the file the link points to was left stale"


def test_a_blank_trace_is_refused_naming_it_instead_of_writing_a_file_named_with_spaces(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*DEMO, "--trace", "  "]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: ") and "--trace '  '" in out.err, out.err
    assert "synthetic loop" not in out.out and list(tmp_path.iterdir()) == [], "refused after (or while) running"


def test_a_blank_out_is_refused_naming_it_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--scenario", "a100", "--samples", "1", "--gpus", "1", "--out", "   "]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--out '   '" in err, err
    assert list(tmp_path.iterdir()) == []
