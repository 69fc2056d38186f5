"""Review of automatic scheduling: safe ranges at their boundaries, the latency fit on degenerate telemetry,
the automatic scheduler's settings, its on-policy ingestion unit, and a scheduler that serves a new buffer."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from conduit import Automatic, ConfigurationError, ExperienceDataPlane, OnPolicy, Replay, safe_ranges
from conduit.scheduling import fit_latency
from conduit.scheduling.model import choose_granularity
from conduit.testing.reference import ID_SCHEMA, id_batch


# -- safe ranges -------------------------------------------------------------------------------------------------
def test_describe_prints_exact_fractions_for_m_above_1024() -> None:
    text = safe_ranges(on_policy=True, num_minibatches=2000).describe()
    assert "g_del in {1/2000}" in text, f"1/M printed wrong for M=2000: {text[-60:]!r}"
    assert text.startswith("on-policy (M=2000): g_ing in {1/2000, 1/1000, 3/2000,"), text[:80]


def test_safe_ranges_takes_numpy_integer_caps() -> None:
    r = safe_ranges(on_policy=False, g_ing_max=np.int64(3), g_del_max=np.int32(2), batch_bytes=np.int64(10),
                    memory_budget=np.int64(1000), output_depth=np.int64(2))
    assert r.g_ing == (1.0, 2.0, 3.0) and r.g_del == (1.0, 2.0)
    r = safe_ranges(on_policy=True, num_minibatches=np.int64(2))
    assert r.g_ing == (0.5, 1.0) and r.g_del == (0.5,) and type(r.num_minibatches) is int


@pytest.mark.parametrize("kwargs", [dict(output_depth=0), dict(output_depth=-3), dict(output_depth=1.5),
                                    dict(output_depth=True), dict(on_policy="no"), dict(on_policy=None)])
def test_safe_ranges_refuses_a_bad_output_depth_or_kind_typed(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = dict(on_policy=False, batch_bytes=10, memory_budget=100)
    args.update(kwargs)
    with pytest.raises(ConfigurationError, match="must be"):
        safe_ranges(**args)


# -- the latency fit and the choice --------------------------------------------------------------------------------
def test_fit_takes_a_zero_byte_size() -> None:
    fit = fit_latency([(0.0, 1e-4, False), (100.0, 2e-4, False), (200.0, 3e-4, False)])
    assert fit.overhead_s == pytest.approx(1e-4, rel=1e-6) and fit.per_byte_s == pytest.approx(1e-6, rel=1e-6)


@pytest.mark.parametrize("bad", [(10.0, math.nan, False), (10.0, math.inf, False), (10.0, -1e-3, False),
                                 (math.nan, 1e-3, False), (-5.0, 1e-3, False)])
def test_fit_refuses_non_finite_or_negative_observations_with_a_value_error(bad: tuple[float, float, bool]) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        fit_latency([bad, (100.0, 2e-4, False), (200.0, 3e-4, False)])


def test_fit_predictions_are_never_negative_on_degenerate_samples() -> None:
    for obs in ([(100.0, 0.0, False)] * 3, [(100.0, 1e-3, False)] * 5,
                [(1e3, 5e-3, False), (1e4, 1e-3, False), (1e5, 2e-4, False)]):  # falling with size
        fit = fit_latency(obs)
        for x in (0.0, 1.0, 1e3, 1e6, 1e9):
            assert fit.seconds(x) >= 0 and fit.seconds(x, staged=True) >= 0, (obs, x, fit)


def test_choose_granularity_refuses_empty_or_non_finite_costs_with_a_message() -> None:
    with pytest.raises(ValueError, match="no granularities"):
        choose_granularity({})
    with pytest.raises(ValueError, match="finite and >= 0"):
        choose_granularity({1.0: math.nan, 2.0: 1.0})


# -- Automatic's settings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [dict(overlap="yes"), dict(overlap=1), dict(memory_budget="1GiB"),
                                    dict(memory_budget=-1), dict(g_del_max=0), dict(g_ing_max=2.5),
                                    dict(output_depth=0), dict(queue_depth=0), dict(queue_depth=True)])
def test_automatic_refuses_bad_settings_at_construction(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="must be"):
        Automatic(**kwargs)


def test_automatic_takes_numpy_integer_caps() -> None:
    sched = Automatic(g_ing_max=np.int64(2), g_del_max=np.int64(2), memory_budget=np.int64(1 << 30),
                      confirm_deliveries=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    edp.ingest(id_batch(np.arange(512)))
    for _ in range(40):
        edp.deliver(16)
    assert sched.decision is not None and sched.decision.g_del in (1.0, 2.0)
    assert sched.priority_staleness == 2 and type(sched.priority_staleness) is int
    edp.close()


# -- Automatic, on-policy: the ingestion model's unit is a whole rollout -----------------------------------------------
def test_on_policy_calibration_measures_a_rollout_not_one_ingest_call() -> None:
    """Each rollout of 64 items is handed over in 4 calls of 16: g_ing = 1 writes 64 items, 1/4 writes 16."""
    sched = Automatic(overlap=False)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=OnPolicy(num_minibatches=4), scheduler=sched)
    for v in range(6):
        edp.set_policy_version(v)
        for part in range(4):
            edp.ingest(id_batch(np.arange(1000 * v + 16 * part, 1000 * v + 16 * part + 16)), version=v)
        edp.seal()
        while not edp.deliver()[1].last:
            pass
    d = sched.decision
    assert d is not None and d.ingest_fit is not None, "the on-policy probe did not fit an ingestion model"
    writes = sorted({r.nbytes for r in edp.telemetry.records if r.kind == "ingest"})
    assert d.rollout_bytes == pytest.approx(max(writes)), (
        f"the model's rollout is {d.rollout_bytes} B, but a whole-rollout write (g_ing=1) moved {max(writes)} B")
    # at g = 1/4 a rollout costs four writes of a quarter rollout: what the fit says such a write costs
    assert d.ingest_sequential[0.25] == pytest.approx(4 * d.ingest_fit.seconds(min(writes)), rel=1e-6)
    assert d.g_del == 0.25 and d.g_ing in d.range.g_ing
    edp.close()


# -- a scheduler that serves a new buffer ------------------------------------------------------------------------------
def test_automatic_serving_a_new_buffer_drops_the_last_buffers_decision() -> None:
    sched = Automatic(overlap=False, g_del_max=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    edp.ingest(id_batch(np.arange(512)))
    for _ in range(30):
        edp.deliver(16)
    assert sched.decision is not None
    edp.close()
    edp2 = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=OnPolicy(num_minibatches=2), scheduler=sched)
    assert sched.decision is None, (
        f"a scheduler calibrating for a new (on-policy) buffer still reports the last buffer's decision: "
        f"{sched.decision.explain() if sched.decision else ''}")
    edp2.close()


# -- the memory budget bounds the batches the job delivers, not only its first one -------------------------------------
def test_memory_budget_caps_the_chosen_g_del_for_the_batches_delivered_after_the_first() -> None:
    from conduit.scheduling.auto import _item_bytes
    from conduit.scheduling.buffers import buffers_needed

    probe = ExperienceDataPlane(ID_SCHEMA, capacity=8)
    item = _item_bytes(probe)
    probe.close()
    budget = buffers_needed(2, 2) * 2 * 64 * item  # batches of 64: g_del <= 2 fits, 3 does not
    assert buffers_needed(3, 2) * 3 * 64 * item > budget
    sched = Automatic(overlap=False, memory_budget=budget)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    edp.ingest(id_batch(np.arange(512)))
    edp.deliver(1)  # a first, tiny delivery (e.g. a warm-up): it alone would allow g_del = 8
    for _ in range(80):
        edp.deliver(64)
    d = sched.decision
    assert d is not None
    assert max(d.range.g_del) <= 2 and d.g_del <= 2 and set(d.deliver_sequential) <= {1.0, 2.0}, (
        f"the delivery buffers of g_del={d.g_del} (range {d.range.g_del}) for batches of 64 exceed "
        f"memory_budget={budget}")
    edp.close()


def test_priority_staleness_reads_before_the_scheduler_serves_a_buffer() -> None:
    assert Automatic(g_del_max=3).priority_staleness == 3
