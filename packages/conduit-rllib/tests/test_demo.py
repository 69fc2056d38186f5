"""`conduit demo` runs conduit-rllib's DQN comparison end to end (tiny settings) and writes its plot."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest


def test_the_demo_entry_point_is_registered() -> None:
    demos = {e.name: e.value for e in entry_points(group="conduit.demos")}
    assert demos.get("rllib") == "conduit_rllib.demo:run"
    conformance = {e.name: e.value for e in entry_points(group="conduit.conformance")}
    assert conformance.get("rllib") == "conduit_rllib.testing:ENDPOINTS"


@pytest.mark.slow
def test_conduit_demo_prints_both_variants_and_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "demo.png"
    proc = subprocess.run(
        [sys.executable, "-m", "conduit.cli", "demo", "--obs-dim", "64", "--iterations", "2", "--steps", "40",
         "--batch", "8", "--capacity", "200", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for needle in ("native    1", "conduit    2", "exposed experience path", "iteration time", "plot:"):
        assert needle in text, f"{needle!r} missing from the demo output:\n{text}"
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
