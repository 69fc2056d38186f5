"""``conduit demo --synthetic`` and ``conduit schedule calibrate`` refuse, before printing or running anything,
sizes whose buffer alone needs more than this machine's memory (as conduit-rllib's demo does).

Before, the synthetic loop printed its header and the table's, then tried the allocation: refused by the OS
only when one array was larger than memory, and otherwise allocated (lazily) and filled until the machine ran out.
The sizes used here make each array 4x this machine's memory, so the run before the fix failed cleanly too.
"""

from __future__ import annotations

import pytest
from conduit.cli import main
from conduit.placement.profile import host_memory

pytestmark = pytest.mark.skipif(not host_memory(), reason="this OS does not say its memory size")


def _huge_obs_dim(capacity: int) -> str:
    return str(4 * host_memory() // (4 * capacity))  # one float32 observation array of 4x the machine's memory


def test_demo_synthetic_refuses_a_buffer_larger_than_memory_before_printing(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--synthetic", "--obs-dim", _huge_obs_dim(10), "--capacity", "10", "--rollout", "1",
               "--batch", "1", "--trace", ""])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert out == "", f"printed before the refusal: {out!r}"
    assert err.startswith("error: ") and "--capacity 10" in err and "--obs-dim" in err and "GiB" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_schedule_calibrate_refuses_a_buffer_larger_than_memory_before_calibrating(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["schedule", "calibrate", "--obs-dim", _huge_obs_dim(10), "--capacity", "10", "--rollout", "1",
               "--batch", "1"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (out, err)
    assert "--capacity 10" in err and "--obs-dim" in err, err
