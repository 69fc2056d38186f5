"""The cost model against this machine: predicted host-tier delivery latency within 25% of measured."""

from __future__ import annotations

import os

import pytest
from conduit.placement.validation import check_host_delivery_isolated

#: the issue's tolerance on the relative error of the predicted delivery latency
TOLERANCE = 0.25


def _overloaded() -> str | None:
    """Why timings mean nothing here now (more than 2 runnable processes per core), or None."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    return f"machine overloaded: load {load:.1f} on {cpus} cores" if load > 2 * cpus else None


def test_predicted_host_delivery_within_25_percent_of_measured() -> None:
    """For d in {128, 1000, 5000, 20000}, batch 512, from a transition buffer of
    at least 96 MiB and twice the last-level cache:
    the cost model's delivery latency, built from single-column gathers measured at other widths, matches the
    EDP's measured ``deliver(512)`` within 25%. Skipped, with the reason, when the machine runs more than two
    processes per core: then other processes decide the timings, not the code.

    Measured in a fresh single-threaded interpreter (this session's state, e.g. Ray's threads after the
    distributed tests, slowed the EDP's Python path and biased the measured side only), on that thread's CPU
    time (on a shared machine, time other processes hold the core does not count; on an idle machine it equals
    wall time), medians after warm-up, in 5 rounds that each re-measure the host paths right before the
    deliveries on freshly allocated memory (so a round whose profile memory got other page sizes than the buffer
    is outvoted); the error is the median over rounds.

    A disturbance that lasts the whole check (another process, the hypervisor, huge pages granted to the
    buffer but not to the profile's memory after a long test session) shifts every round of it, so a check
    that misses is repeated, up to three attempts in all, before the test fails; the failure shows them all.

    Troubleshooting: a failure on a loaded machine shows as a negative error at small d (other processes
    evicting the caches); rerun on a quieter machine before changing the model.
    """
    busy = _overloaded()
    if busy:
        pytest.skip(f"{busy}: a latency comparison is meaningless; the benchmark table records the figures")
    tables = []
    for _attempt in range(3):  # a disturbance that lasts the whole check shifts every round: measure again
        checks = check_host_delivery_isolated((128, 1000, 5000, 20000), batch=512, rounds=5, buffer_bytes=96 << 20)
        tables.append("\n".join(f"d={c['obs_dim']:>6}: predicted {c['predicted_ms']:7.3f} ms, measured "
                                f"{c['measured_ms']:7.3f} ms, error {c['error']:+.1%}" for c in checks))
        assert [c["obs_dim"] for c in checks] == [128, 1000, 5000, 20000]
        assert all(c["measured_ms"] > 0 and c["predicted_ms"] > 0 for c in checks)
        # the latency grows with d, in the model and on the machine
        assert [c["predicted_ms"] for c in checks] == sorted(c["predicted_ms"] for c in checks), tables[-1]
        if all(abs(c["error"]) <= TOLERANCE for c in checks):
            break
    else:
        pytest.fail("The cost model missed the measured delivery by more than 25% in all three attempts:\n"
                    + "\n--\n".join(tables))
    assert [c["measured_ms"] for c in checks] == sorted(c["measured_ms"] for c in checks), tables[-1]
