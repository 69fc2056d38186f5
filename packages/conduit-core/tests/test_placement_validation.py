"""The cost model against this machine: predicted host-tier delivery latency within 25% of measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

#: the issue's tolerance on the relative error of the predicted delivery latency
TOLERANCE = 0.25


def _overloaded() -> str | None:
    """Why timings mean nothing here now (more than 2 runnable processes per core), or None."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    return f"machine overloaded: load {load:.1f} on {cpus} cores" if load > 2 * cpus else None


@pytest.mark.skipif(torch.get_num_threads() != 1,
                    reason="the thread-CPU clock is only valid with torch single-threaded (OMP_NUM_THREADS=1)")
def test_predicted_host_delivery_within_25_percent_of_measured() -> None:
    """For d in {128, 1000, 5000, 20000}, batch 512, from a 128 MiB transition buffer (larger than the caches):
    the cost model's delivery latency, built from single-column gathers measured at other widths, matches the
    EDP's measured ``deliver(512)`` within 25%. Skipped, with the reason, when the machine runs more than two
    processes per core: then other processes decide the timings, not the code.

    Both sides use this thread's CPU time (on a shared machine, time other processes hold the core does not
    count; on an idle machine it equals wall time), medians after warm-up, in 3 rounds that each re-measure the
    host paths right before the deliveries; the error is the median over rounds.

    Troubleshooting: a failure on a loaded machine shows as a negative error at small d (other processes
    evicting the caches); rerun on a quieter machine before changing the model.
    """
    busy = _overloaded()
    if busy:
        pytest.skip(f"{busy}: a latency comparison is meaningless; the benchmark table records the figures")
    checks = _checks_in_fresh_interpreter()
    table = "\n".join(f"d={c['obs_dim']:>6}: predicted {c['predicted_ms']:7.3f} ms, measured {c['measured_ms']:7.3f}"
                      f" ms, error {c['error']:+.1%}" for c in checks)
    assert [c["obs_dim"] for c in checks] == [128, 1000, 5000, 20000]
    assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in checks)
    # the latency grows with d, in the model and on the machine
    assert [c["predicted_ms"] for c in checks] == sorted(c["predicted_ms"] for c in checks), table
    assert [c["measured_ms"] for c in checks] == sorted(c["measured_ms"] for c in checks), table
    assert all(abs(c["error"]) <= TOLERANCE for c in checks), table


_MEASURE = """
import json, time
from conduit.placement.validation import check_host_delivery
checks = check_host_delivery((128, 1000, 5000, 20000), batch=512, rounds=3, buffer_bytes=96 << 20,
                             clock=time.thread_time)
print(json.dumps([c.to_dict() for c in checks]))
"""


def _checks_in_fresh_interpreter() -> list[dict[str, float]]:
    """Run the check in a new Python process: the suite's earlier state (Ray's threads, a large heap)
    slows the EDP's Python path in this process and would bias the measured side only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _MEASURE], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
