"""Automatic's probe under a memory budget lowers ``g_del`` for a delivery whose batch is too large for the probed
value; the next delivery whose batch fits goes back to the probed value (it stayed at the lowered one, so the rest
of that probed value's deliveries were timed at another granularity)."""

from __future__ import annotations

import torch
from conduit import Automatic, ExperienceDataPlane, ExperienceSchema, Field, Replay
from conduit.scheduling.granularity import g_del_fitting


def test_a_probe_delivery_after_a_lowered_one_goes_back_to_the_probed_g_del() -> None:
    budget = 60_000
    sched = Automatic(overlap=False, memory_budget=budget)
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((8,))), capacity=4096, semantics=Replay(seed=0),
                              scheduler=sched)
    try:
        item = 8 * 4
        assert g_del_fitting(8, batch_bytes=item * 256, memory_budget=budget, output_depth=sched.output_depth)[-1] < 4
        assert g_del_fitting(8, batch_bytes=item * 16, memory_budget=budget, output_depth=sched.output_depth)[-1] == 8
        edp.ingest({"obs": torch.randn(2048, 8)})
        while sched.g_del < 4:  # the probe's plan reaches a g_del that a batch of 256 does not fit
            edp.deliver(16)
        probed = sched.g_del
        edp.deliver(16)  # (this probed value's deliveries are not all made yet)
        assert sched.g_del == probed and sched.calibrated is False
        edp.deliver(256)
        assert sched.g_del < probed  # lowered for that call's batch
        edp.deliver(16)
        assert sched.g_del == probed, f"a batch of 16 was delivered at g_del={sched.g_del}, not the probed {probed}"
    finally:
        edp.close()
