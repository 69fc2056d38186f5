"""``ExposureLog.summary`` reads the held iterations and the count accounted together, under the log's lock: an
iteration being accounted on another thread (appended, not yet counted) must not shift which ones ``skip`` leaves
out."""

from __future__ import annotations

import threading

from conduit.exposure import ExposureLog, IterationExposure
from conduit.telemetry import Telemetry


def _it(i: int) -> IterationExposure:
    return IterationExposure(start=float(i), end=i + 1.0, total_s=0.1 * i, exposed_s=0.1 * i, hidden_s=0.0,
                             rollout_s=0.0, update_s=0.0)


def test_summary_waits_for_an_iteration_being_accounted() -> None:
    log = ExposureLog(Telemetry())
    for i in range(3):  # three accounted iterations, as iteration() leaves them
        log.iterations.append(_it(i))
        log.accounted += 1
    out: list[dict[str, float]] = []
    reader = threading.Thread(target=lambda: out.append(log.summary(skip=3)))
    with log._lock:  # as iteration() holds it while it accounts the fourth: appended, then counted
        log.iterations.append(_it(10))
        reader.start()
        reader.join(0.5)  # (a reader that does not wait for the lock has read the half-accounted state by now)
        log.accounted += 1
    reader.join(60)
    assert not reader.is_alive()
    # skip=3 leaves out the first three: the summary is the fourth's alone
    assert out == [log.summary(skip=3)] and out[0]["total_s"] == _it(10).total_s, out
