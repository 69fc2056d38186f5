"""A checkpointed decision loaded by an ``Automatic`` with smaller caps reports this scheduler's safe ranges.

``load_state_dict`` applies a saved decision only when its ``g_ing``/``g_del`` are within the loading scheduler's
caps, but the decision kept the saved range (and predictions) as its own: ``explain()`` said "safe ranges: g_ing in
{1, ..., 8}" for a scheduler whose ``g_ing_max`` is 2, granularities it can never use."""

from __future__ import annotations

import numpy as np
from conduit import Automatic, ExperienceDataPlane, Replay
from conduit.testing.reference import ID_SCHEMA, id_batch


def test_a_loaded_decision_reports_the_loading_schedulers_ranges() -> None:
    saved = Automatic(overlap=False, probe_rounds=1)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=saved)
    edp.ingest(id_batch(np.arange(512)))
    while not saved.calibrated:
        edp.deliver(16)
    state = edp.state_dict()
    state["scheduler"]["state"]["decision"]["g_ing"] = 1.0  # (within both schedulers' caps: it is applied)
    state["scheduler"]["state"]["decision"]["g_del"] = 2.0
    edp.close()
    sched = Automatic(overlap=False, g_ing_max=2, g_del_max=3)
    edp2 = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    try:
        edp2.load_state_dict(state)
        d = sched.decision
        assert sched.calibrated and d is not None and (d.g_ing, d.g_del) == (1.0, 2.0)
        assert d.range.g_ing == (1.0, 2.0) and d.range.g_del == (1.0, 2.0, 3.0), d.range
        assert "g_ing in {1, 2}, g_del in {1, 2, 3}" in d.explain().splitlines()[0], d.explain()
        for costs in (d.deliver_sequential, d.deliver_overlapped):
            assert set(costs) <= {1.0, 2.0, 3.0}, costs
        for costs in (d.ingest_sequential, d.ingest_overlapped):
            assert set(costs) <= {1.0, 2.0}, costs
        assert sched.state_dict()["decision"]["range"]["g_ing"] == [1.0, 2.0]
    finally:
        edp2.close()
