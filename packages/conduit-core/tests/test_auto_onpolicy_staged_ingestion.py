"""On-policy, the ingestion model predicts the staging its own probe measured.

A producer that hands a rollout over in M parts has them concatenated (staged, a ``"stage"`` record) when ``g_ing``
covers several parts: at ``g_ing = 1`` every write the probe timed was staged, and the fit has a staging term for it.
The predictions left staging out for every on-policy ``g_ing`` (only off-policy ``g_ing > 1`` counted as staged),
so the cost predicted for ``g_ing = 1`` was the per-call overhead alone, below what the probe measured for it."""

from __future__ import annotations

import numpy as np
import pytest
from conduit import Automatic, ExperienceDataPlane, OnPolicy
from conduit.testing.reference import ID_SCHEMA, id_batch


def test_on_policy_predictions_stage_a_write_that_covers_several_calls() -> None:
    sched = Automatic(overlap=False)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=OnPolicy(num_minibatches=4), scheduler=sched)
    try:
        v = 0
        while not sched.calibrated:
            edp.set_policy_version(v)
            for part in range(4):  # a rollout of 64 items in 4 calls of 16
                edp.ingest(id_batch(np.arange(1000 * v + 16 * part, 1000 * v + 16 * part + 16)), version=v)
            edp.seal()
            while not edp.deliver()[1].last:
                pass
            v += 1
        d = sched.decision
        assert d is not None and d.ingest_fit is not None
        assert any(r.kind == "stage" and r.items == 64 for r in edp.telemetry.records), "g_ing=1 wrote unstaged"
        fit, rollout = d.ingest_fit, d.rollout_bytes
        assert d.ingest_sequential[1.0] == pytest.approx(fit.seconds(rollout, staged=True), rel=1e-9)
        assert d.ingest_sequential[0.5] == pytest.approx(2 * fit.seconds(rollout / 2, staged=True), rel=1e-9)
        # a quarter is one producer call: written as it came
        assert d.ingest_sequential[0.25] == pytest.approx(4 * fit.seconds(rollout / 4), rel=1e-9)
    finally:
        edp.close()
