"""The automatic scheduler's ingestion choice needs the ingestion probe's data.

The decision is made when the delivery probe ends. Off-policy, the ingestion probe writes at every probed ``g_ing``
(1, 2, 4, 8, ...) only as fast as the producer ingests: a producer that ingests one rollout per many deliveries (the
synthetic loop with ``--updates 64``) has written a rollout or three by then. The decision fitted an ingestion model
to two calls at two sizes (or printed none at all) and picked ``g_ing = 1`` without saying that nothing backed it.
Now a probe that did not write every probed ``g_ing`` once fits no ingestion model, keeps the smallest ``g_ing``,
and the decision (and ``conduit schedule calibrate``) says so."""

from __future__ import annotations

import torch
from conduit import Automatic, ExperienceDataPlane, ExperienceSchema, Field
from conduit.cli import main


def _decided_after(ingests: int) -> Automatic:
    sched = Automatic(overlap=False, probe_rounds=1, g_ing_max=4, g_del_max=2)
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((4,))), capacity=1024, scheduler=sched)
    try:
        for _ in range(ingests):  # the probe writes them at g_ing = 1, then 2 (staged), then 4 ...
            edp.ingest({"obs": torch.randn(16, 4)})
        edp.flush()
        while not sched.calibrated:
            edp.deliver(8)
        assert sched.decision is not None
        return sched
    finally:
        edp.close()


def test_a_partial_ingestion_probe_fits_no_model_and_says_so() -> None:
    d = _decided_after(3).decision  # g_ing = 1 and 2 written; 4 never was
    assert d is not None
    assert d.ingest_fit is None, f"an ingestion model was fitted to a partial probe: {d.ingest_fit}"
    assert d.g_ing == 1 and not d.ingest_sequential
    assert "ingestion" in d.reason and "g_ing=4" in d.reason, d.reason
    assert "ingestion model: none" in d.explain(), d.explain()


def test_a_complete_ingestion_probe_fits_the_model() -> None:
    d = _decided_after(1 + 2 + 4).decision
    assert d is not None and d.ingest_fit is not None and set(d.ingest_sequential) == {1.0, 2.0, 3.0, 4.0}
    assert "ingestion" not in d.reason, d.reason


def test_calibrate_says_the_ingestion_was_not_calibrated(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["schedule", "calibrate", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "256",
               "--updates", "64", "--iterations", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ingestion model: none" in out, out
    assert "--updates" in out.split("ingestion model: none", 1)[1], f"no way to calibrate it is given: {out}"


def test_calibrate_with_one_g_ing_claims_nothing_about_ingestion(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["schedule", "calibrate", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "256",
               "--updates", "64", "--iterations", "0", "--g-ing-max", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "g_ing in {1}" in out and "ingestion model: none" not in out and "not calibrated" not in out, out


def test_calibrate_names_no_updates_that_cannot_help(capsys) -> None:  # type: ignore[no-untyped-def]
    """A delivery probe of 3 deliveries (--g-del-max 1) ends before 15 rollouts, whatever --updates is."""
    rc = main(["schedule", "calibrate", "--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "256",
               "--updates", "1", "--g-del-max", "1", "--iterations", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ingestion model: none" in out and "--updates 1 or fewer" not in out and "--g-ing-max" in out, out
