"""Automatic's probe says so when the telemetry's ring dropped some of its calls.

``Automatic`` fits its latency model to the calls recorded since calibration began. It read them with
``Telemetry.since(t0)``, which sees only what the bounded ring (``Telemetry(maxlen=...)``) still holds: a probe that
recorded more calls than the ring keeps was fitted on its latest calls alone (e.g. without the small granularities
probed first), silently. It now reads them from a mark taken at attach and, when the ring dropped some, fits on the
rest with a ``RuntimeWarning`` and a note in the decision's reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conduit import Automatic, ExperienceDataPlane, ExperienceSchema, Field, Telemetry


def _calibrate(edp: ExperienceDataPlane) -> None:
    for _ in range(8):
        edp.ingest({"obs": torch.randn(64, 4)})
    for _ in range(200):
        edp.deliver(16)
        if edp.scheduler.decision is not None:
            return
    raise AssertionError("the probe never ended")


def test_a_probe_longer_than_the_ring_warns_and_says_so_in_the_decision() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((4,))), capacity=1024, scheduler=Automatic(overlap=False))
    edp.telemetry = Telemetry(maxlen=8)  # (far fewer calls than the probe records)
    try:
        with pytest.warns(RuntimeWarning, match=r"maxlen=8\)\) dropped the \d+ earliest"):
            _calibrate(edp)
        decision = edp.scheduler.decision
        assert decision is not None and "dropped" in decision.reason, decision.reason
    finally:
        edp.close()


def test_a_probe_within_the_ring_fits_all_of_its_calls_without_a_warning() -> None:
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((4,))), capacity=1024, scheduler=Automatic(overlap=False))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            _calibrate(edp)
        decision = edp.scheduler.decision
        assert decision is not None and "dropped" not in decision.reason, decision.reason
        assert decision.deliver_fit is not None
    finally:
        edp.close()
