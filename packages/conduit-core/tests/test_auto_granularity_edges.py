"""Granularity ranges under a memory budget where the buffers needed do not grow with ``g_del``, and a probe that
ends on its first delivery (its batch size was read from telemetry the call had not recorded yet)."""

from __future__ import annotations

import numpy as np
from conduit import Automatic, ExperienceDataPlane, Replay
from conduit.scheduling.buffers import buffers_needed
from conduit.scheduling.granularity import g_del_fitting, safe_ranges
from conduit.testing.reference import ID_SCHEMA, id_batch

ITEM = ID_SCHEMA.fixed_item_bytes


def test_a_safe_range_holds_only_the_g_del_that_fit_the_budget_even_where_a_larger_one_fits() -> None:
    need = {g: buffers_needed(g, 6) * g for g in range(1, 6)}
    assert need[4] > need[5], need  # output_depth 6: g_del = 4 needs 16 batches, g_del = 5 needs 15
    rng = safe_ranges(on_policy=False, g_del_max=5, batch_bytes=100, memory_budget=15 * 100, output_depth=6)
    assert rng.g_del == (1.0, 2.0, 3.0, 5.0), (
        f"the range {rng.g_del} holds a g_del whose buffers ({need} batches) exceed the budget of 15 batches")
    assert g_del_fitting(5, batch_bytes=100, memory_budget=None, output_depth=6) == (1, 2, 3, 4, 5)
    assert g_del_fitting(5, batch_bytes=100, memory_budget=99, output_depth=6) == ()


def test_a_probe_that_ends_on_its_first_delivery_prices_that_delivery_s_batch() -> None:
    sched = Automatic(overlap=False, g_ing_max=1, g_del_max=1, probe_rounds=1, memory_budget=1 << 30)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    edp.ingest(id_batch(np.arange(1024)))
    for _ in range(8):
        edp.deliver(64)
        if sched.decision is not None:
            break
    d = sched.decision
    assert d is not None, repr(sched)
    assert d.batch_bytes == 64 * ITEM, (
        f"the decision prices batches of {d.batch_bytes} bytes; the probe delivered batches of 64 items "
        f"({64 * ITEM} bytes)")
    edp.close()
