"""Storage and semantics: checkpoints loaded into buffers of other settings, ring and pool edges."""

from __future__ import annotations

import pytest
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    Replay,
)

SCALAR = ExperienceSchema(r=Field((), torch.float32))


# -- on-policy checkpoints into other OnPolicy settings -----------------------------------------
def _mid_last_epoch() -> dict[str, object]:
    """A checkpoint of OnPolicy(M=2, E=3) whose 4-item rollout is one minibatch from its end."""
    edp = ExperienceDataPlane(SCALAR, capacity=8, semantics=OnPolicy(num_minibatches=2, num_epochs=3))
    edp.ingest({"r": torch.arange(4.0)}, version=0)
    edp.seal()
    for _ in range(5):
        edp.deliver()
    return edp.state_dict()


@pytest.mark.parametrize("settings", [{"num_minibatches": 2, "num_epochs": 2}, {"num_minibatches": 3, "num_epochs": 3}],
                         ids=["fewer-epochs", "other-M"])
def test_on_policy_progress_of_other_settings_is_refused_and_changes_nothing(settings: dict[str, int]) -> None:
    state = _mid_last_epoch()
    edp = ExperienceDataPlane(SCALAR, capacity=8, semantics=OnPolicy(**settings))  # type: ignore[arg-type]
    edp.ingest({"r": torch.full((3,), 7.0)}, version=4)
    edp.seal()
    # (said "damaged" before, though the checkpoint is whole: it names both settings now)
    m, e = settings["num_minibatches"], settings["num_epochs"]
    with pytest.raises(ConfigurationError, match=rf"other OnPolicy settings.*in epoch 2.*num_minibatches={m}, "
                                                 rf"minibatch_size=None, num_epochs={e}"):
        edp.load_state_dict(state)  # type: ignore[arg-type]
    assert len(edp) == 3, f"a refused checkpoint changed the storage: {len(edp)} items live, 3 expected"
    batch, info = edp.deliver()
    assert info.version == 4 and set(batch["r"].tolist()) == {7.0}, (
        f"a refused checkpoint changed what is delivered: version {info.version}, rows {batch['r'].tolist()}")


def test_on_policy_checkpoint_loaded_into_the_same_settings_still_finishes_its_rollout() -> None:
    state = _mid_last_epoch()
    edp = ExperienceDataPlane(SCALAR, capacity=8, semantics=OnPolicy(num_minibatches=2, num_epochs=3))
    edp.load_state_dict(state)  # type: ignore[arg-type]
    _, info = edp.deliver()
    assert (info.epoch, info.minibatch, info.last) == (2, 1, True), f"resumed at the wrong place: {info}"
    assert len(edp) == 0, f"the finished rollout's {len(edp)} items were not released"


# -- prioritized checkpoints into another alpha -------------------------------------------------
def _prioritized(alpha: float) -> ExperienceDataPlane:
    return ExperienceDataPlane(SCALAR, capacity=4, semantics=Replay(PrioritizedSampler(alpha=alpha), seed=0))


def test_prioritized_checkpoint_into_another_alpha_is_refused_and_changes_nothing() -> None:
    src = _prioritized(1.0)
    src.ingest({"r": torch.arange(2.0)}, priorities=torch.tensor([1.0, 4.0]))
    state = src.state_dict()
    dst = _prioritized(0.5)
    dst.ingest({"r": torch.arange(2.0)}, priorities=torch.tensor([1.0, 1.0]))
    before = dst.state_dict()
    with pytest.raises(ConfigurationError, match="alpha"):
        dst.load_state_dict(state)
    after = dst.state_dict()
    assert torch.equal(after["semantics"]["sampler"]["leaves"], before["semantics"]["sampler"]["leaves"]), (
        "a refused checkpoint changed the priorities")
    _, info = dst.deliver(64)
    assert info.probabilities is not None
    assert torch.allclose(info.probabilities, torch.full((64,), 0.5, dtype=torch.float64)), (
        f"P(i) is no longer p_i^alpha / sum: {info.probabilities[:4].tolist()}")


def test_prioritized_checkpoint_into_the_same_alpha_round_trips() -> None:
    src = _prioritized(0.5)
    src.ingest({"r": torch.arange(2.0)}, priorities=torch.tensor([1.0, 4.0]))
    dst = _prioritized(0.5)
    dst.load_state_dict(src.state_dict())
    _, info = dst.deliver(8)
    assert info.probabilities is not None
    got = sorted(set(round(p, 6) for p in info.probabilities.tolist()))
    assert set(got) <= {round(1 / 3, 6), round(2 / 3, 6)}, f"probabilities {got}, expected 1/3 and 2/3 (alpha 0.5)"


# -- on-policy: selections made ahead release only their own rollout -------------------------------
def test_handing_over_one_rollouts_last_minibatch_keeps_a_later_selected_rollout_live() -> None:
    edp = ExperienceDataPlane(SCALAR, capacity=4, semantics=OnPolicy(num_minibatches=1, shuffle=False))
    edp.ingest({"r": torch.tensor([0.0, 1.0])}, version=0)
    edp.ingest({"r": torch.tensor([2.0, 3.0])}, version=1)
    edp.seal()
    sels = edp.select_now([None, None])  # both rollouts' last minibatches, neither handed over yet
    assert sels is not None and [s.info.last for s in sels] == [True, True]
    first = edp.gather_now([sels[0]])
    edp.release_now(sels[0])
    assert len(edp) == 2, f"handing over rollout 0 released {4 - len(edp)} items; only its 2 are consumed"
    with pytest.raises(CapacityError):  # the selected rollout 1 is not consumed yet: its slots are not free
        edp.ingest({"r": torch.tensor([6.0, 7.0, 8.0, 9.0])}, version=2)
    second = edp.gather_now([sels[1]])
    edp.release_now(sels[1])
    assert first["r"].tolist() == [0.0, 1.0] and second["r"].tolist() == [2.0, 3.0], (
        f"delivered {first['r'].tolist()} and {second['r'].tolist()}, expected [0, 1] and [2, 3]")
    assert len(edp) == 0, f"{len(edp)} items live after both rollouts were handed over"
