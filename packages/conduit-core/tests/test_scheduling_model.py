"""Safe granularity ranges, the latency model, and the automatic scheduler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conduit import (
    Automatic,
    ConfigurationError,
    ExperienceDataPlane,
    OnPolicy,
    PrioritizedSampler,
    Replay,
    Synchronous,
    safe_ranges,
)
from conduit.scheduling import fit_latency
from conduit.scheduling.auto import confirm_choice
from conduit.scheduling.model import choose_granularity, exposed_per_unit, observations, per_unit
from conduit.telemetry import CallRecord
from conduit.testing.reference import ID_SCHEMA, id_batch


# -- safe ranges --------------------------------------------------------------------------------------------------
def test_off_policy_ranges_come_from_the_caps() -> None:
    r = safe_ranges(on_policy=False, g_ing_max=3, g_del_max=5)
    assert r.g_ing == (1, 2, 3) and r.g_del == (1, 2, 3, 4, 5) and not r.on_policy


def test_on_policy_ranges_come_from_m() -> None:
    r = safe_ranges(on_policy=True, num_minibatches=4, g_ing_max=99, g_del_max=99)
    assert r.g_ing == (0.25, 0.5, 0.75, 1.0) and r.g_del == (0.25,)
    assert "M=4" in r.describe() and "1/4" in r.describe()


def test_memory_budget_caps_g_del() -> None:
    mib = 1 << 20
    # output_depth 2: 3 chunk buffers of g batches of 10 MiB; g=3 needs 90 MiB, g=4 120 MiB
    r = safe_ranges(on_policy=False, g_del_max=8, batch_bytes=10 * mib, memory_budget=100 * mib)
    assert max(r.g_del) == 3
    with pytest.raises(ConfigurationError, match="memory_budget"):
        safe_ranges(on_policy=False, batch_bytes=10 * mib, memory_budget=mib)


@pytest.mark.parametrize("kwargs", [{"g_ing_max": 0}, {"g_del_max": 1.5}])
def test_bad_caps_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        safe_ranges(on_policy=False, **kwargs)  # type: ignore[arg-type]


# -- the latency model --------------------------------------------------------------------------------------------
def _truth(x: float) -> float:
    """100 us per call, 1 ns/B, and 3 ns/B more past 1 MiB."""
    return 100e-6 + 1e-9 * x + 3e-9 * max(0.0, x - (1 << 20))


def test_fit_recovers_overhead_bandwidth_and_chunk_cost() -> None:
    rng = np.random.default_rng(0)
    unit = 256 << 10
    obs = [(g * unit, _truth(g * unit) * rng.uniform(0.98, 1.02), False) for g in (1, 2, 3, 4, 6, 8) for _ in range(5)]
    fit = fit_latency(obs)
    assert fit.overhead_s == pytest.approx(100e-6, rel=0.3)
    assert fit.per_byte_s == pytest.approx(1e-9, rel=0.1)
    assert fit.chunk_per_byte_s == pytest.approx(3e-9, rel=0.15)
    assert 0.75 * (1 << 20) <= fit.knee_bytes <= 1.5 * (1 << 20)
    costs = {g: per_unit(fit, g, unit) for g in (1, 2, 3, 4, 6, 8)}
    truth = {g: _truth(g * unit) / g for g in costs}
    assert choose_granularity(costs) == min(truth, key=truth.get) == 4  # past 4 units the chunk term wins


def test_without_a_chunk_cost_larger_granularity_wins() -> None:
    obs = [(g * 1e5, 200e-6 + 1e-9 * g * 1e5, False) for g in (1, 2, 4, 8)]
    fit = fit_latency(obs)
    assert not math.isfinite(fit.knee_bytes) or fit.chunk_per_byte_s == 0
    costs = {g: per_unit(fit, g, 1e5) for g in (1, 2, 4, 8)}
    assert choose_granularity(costs) == 8


def test_slack_makes_differences_far_below_the_cycle_ties() -> None:
    """Overlapped costs of 90 us vs 38 us per batch behind a 25 ms learner step are a tie: the smallest g wins."""
    costs = {1: 90e-6, 2: 60e-6, 4: 45e-6, 8: 38e-6}
    assert choose_granularity(costs) == 8
    assert choose_granularity(costs, slack_s=0.01 * 25e-3) == 1
    assert choose_granularity(costs, slack_s=0.01 * 4e-3) == 2  # a 4 ms cycle: 40 us of slack


def test_ties_prefer_the_smaller_granularity() -> None:
    assert choose_granularity({1: 1.0, 2: 1.005, 4: 1.01, 8: 0.999}, tolerance=0.02) == 1
    assert choose_granularity({1: 2.0, 2: 1.0, 4: 1.0}) == 2


def test_overlap_hides_what_fits_between_calls() -> None:
    fit = fit_latency([(1e6, 1e-3, False), (2e6, 2e-3, False)])
    assert exposed_per_unit(fit, 1, 1e6, gap_s=5e-3, handover_s=1e-5) == pytest.approx(1e-5)
    assert exposed_per_unit(fit, 1, 1e6, gap_s=0.4e-3, handover_s=0) == pytest.approx(0.6e-3, rel=0.05)
    # a prioritized chunk is prepared during one gap only
    assert exposed_per_unit(fit, 2, 1e6, gap_s=1e-3, handover_s=0, window_units=1) > 0


def test_observations_pair_staging_with_its_write() -> None:
    recs = [CallRecord("stage", 30, 300, 0.0, 0.001, 7), CallRecord("ingest", 30, 300, 0.001, 0.003, 7),
            CallRecord("ingest", 10, 100, 0.004, 0.005, 7), CallRecord("deliver", 8, 80, 0.0, 0.002, 9)]
    assert observations(recs, "ingest") == [(300.0, pytest.approx(0.003), True), (100.0, pytest.approx(0.001), False)]
    assert observations(recs, "deliver") == [(80.0, pytest.approx(0.002), False)]
    with pytest.raises(ValueError):
        fit_latency([])


# -- the automatic scheduler ----------------------------------------------------------------------------------------
def _drive(edp: ExperienceDataPlane, steps: int, n: int = 32) -> list[list[int]]:
    out = []
    for k in range(steps):
        if k % 4 == 0:
            edp.ingest(id_batch(np.arange(512 + 16 * k, 512 + 16 * k + 64)))
        b, info = edp.deliver(n)
        assert torch.equal(b["id"], info.handles)
        out.append(b["id"].tolist())
    return out


def test_confirm_choice_measures_first_and_lets_the_model_break_ties_within_noise() -> None:
    clear = {"sequential": [0.040, 0.041, 0.042], "overlapped": [0.030, 0.031, 0.029]}
    assert confirm_choice(clear, model_prefers_overlap=False)[0] is True  # a clear measurement beats the model
    assert confirm_choice({"sequential": clear["overlapped"], "overlapped": clear["sequential"]}, True)[0] is False
    noisy = {"sequential": [0.041, 0.036, 0.046], "overlapped": [0.043, 0.040, 0.047]}  # 2 ms apart, 5 ms spread
    for model in (True, False):
        on, why = confirm_choice(noisy, model_prefers_overlap=model)
        assert on is model and "spread" in why


def test_automatic_probes_fits_confirms_and_settles_within_the_safe_range() -> None:
    sched = Automatic(g_ing_max=4, g_del_max=4, confirm_deliveries=4)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    edp.ingest(id_batch(np.arange(512)))
    _drive(edp, 120)
    d = sched.decision
    assert d is not None and sched._phase == "run"
    assert d.g_del in d.range.g_del and d.g_ing in d.range.g_ing
    assert set(d.deliver_sequential) == {1.0, 2.0, 3.0, 4.0} and d.deliver_fit is not None
    assert set(d.confirmed) == {"sequential", "overlapped"}
    assert (d.overlap, d.reason) == confirm_choice(sched._cycles, sched._model_prefers_overlap())
    assert sched.inner.overlap == d.overlap and sched.inner.g_del == d.g_del
    assert "chosen:" in d.explain()
    # probing covered the range: delivery calls of 1, 2 and 4 batches were timed
    sizes = {r.items // 32 for r in edp.telemetry.records if r.kind == "deliver"}
    assert {1, 2, 4} <= sizes
    edp.close()


def test_automatic_with_overlap_fixed_skips_confirmation() -> None:
    sched = Automatic(overlap=True, g_del_max=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=4096, semantics=Replay(seed=0), scheduler=sched)
    edp.ingest(id_batch(np.arange(512)))
    _drive(edp, 40)
    assert sched.decision is not None and sched.decision.overlap and not sched.decision.confirmed
    assert sched.inner.overlap
    edp.close()


def test_automatic_on_policy_keeps_one_minibatch_per_call_and_the_synchronous_sequence() -> None:
    def run(sched: object) -> list[tuple[int, list[int]]]:
        edp = ExperienceDataPlane(ID_SCHEMA, capacity=2048, semantics=OnPolicy(num_minibatches=4, num_epochs=2),
                                  scheduler=sched)  # type: ignore[arg-type]
        out = []
        for v in range(8):
            edp.set_policy_version(v)
            for part in range(4):
                edp.ingest(id_batch(np.arange(1000 * v + 16 * part, 1000 * v + 16 * part + 16)), version=v)
            edp.seal()
            while True:
                b, info = edp.deliver()
                out.append((info.version, b["id"].tolist()))
                if info.last:
                    break
        if isinstance(sched, Automatic):
            assert sched.decision is not None and sched.decision.g_del == 0.25
            assert sched.decision.g_ing in (0.25, 0.5, 0.75, 1.0)
        edp.close()
        return out

    assert run(Automatic(confirm_deliveries=4)) == run(Synchronous())


def test_automatic_prioritized_declares_its_staleness_bound() -> None:
    sched = Automatic(g_del_max=2, confirm_deliveries=2)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=1024, semantics=Replay(PrioritizedSampler(), seed=0),
                              scheduler=sched)
    edp.ingest(id_batch(np.arange(512)))
    for _ in range(40):
        b, info = edp.deliver(16)
        edp.update_priorities(info.handles, torch.rand(16, dtype=torch.float64) + 0.1)
        assert sched.priority_staleness <= 2
    edp.close()


# -- the command line ---------------------------------------------------------------------------------------------
def test_cli_prints_safe_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.cli import main

    assert main(["schedule", "ranges", "--on-policy", "-M", "4"]) == 0
    assert capsys.readouterr().out.strip() == "on-policy (M=4): g_ing in {1/4, 1/2, 3/4, 1}, g_del in {1/4}"
    assert main(["schedule", "ranges", "--g-del-max", "8", "--batch-bytes", str(100 << 20),
                 "--memory-budget", str(1 << 20)]) == 2
    assert "memory_budget" in capsys.readouterr().err


def test_cli_calibrate_explains_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    from conduit.cli import main

    assert main(["schedule", "calibrate", "--obs-dim", "16", "--batch", "32", "--rollout", "64", "--capacity", "512",
                 "--g-del-max", "2", "--g-ing-max", "2", "--iterations", "1", "--warmup", "14"]) == 0
    out = capsys.readouterr().out
    assert "chosen: g_ing=" in out and "delivery model:" in out and "measured in the confirm phase" in out


# -- the docstring examples -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["conduit.scheduling.overlapped", "conduit.scheduling.auto",
                                  "conduit.scheduling.granularity", "conduit.exposure"])
def test_docstring_examples_run(name: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
