"""A VerlOnPolicy checkpoint taken between epochs of a rollout continues exactly: the seeded loader's
passes are replayed to the saved point, and an epoch waiting for its first delivery (seed=None) still
waits, drawing its order from the global RNG then, as verl's loader does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane
from conduit.testing.reference import ID_SCHEMA, id_batch
from conduit_verl.delivery import VerlOnPolicy


def _buffer(seed: int | None) -> ExperienceDataPlane:
    sem = VerlOnPolicy(num_minibatches=2, num_epochs=3, seed=seed, dataloader_kwargs={"shuffle": True})
    return ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=sem)


def _ids(edp: ExperienceDataPlane, n: int) -> list[list[int]]:
    return [edp.deliver()[0]["id"].tolist() for _ in range(n)]


@pytest.mark.parametrize("seed", [7, None])
@pytest.mark.parametrize("delivered", [1, 2, 3, 4])
def test_a_checkpoint_between_or_inside_epochs_continues_exactly(seed: int | None, delivered: int) -> None:
    torch.manual_seed(0)
    edp = _buffer(seed)
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    _ids(edp, delivered)
    state = edp.state_dict()
    restored = _buffer(seed)
    restored.load_state_dict(state)
    rest = 6 - delivered
    torch.manual_seed(1)  # an unseeded loader draws its next passes from the global RNG: the same for both
    want = _ids(edp, rest)
    torch.manual_seed(1)
    got = _ids(restored, rest)
    assert got == want, f"after {delivered} of 6 minibatches: restored {got}, saved buffer {want}"
    assert sorted(i for mb in want[-2:] for i in mb) == list(range(10)), "the last epoch is not a permutation"


def test_a_damaged_loader_state_is_refused_and_changes_nothing() -> None:
    edp = _buffer(7)
    edp.ingest(id_batch(np.arange(10)), version=0)
    edp.seal()
    _ids(edp, 2)
    state = edp.state_dict()
    target = _buffer(7)
    for bad in ({"orders_drawn": -1}, {"orders_drawn": 1.5}, {"deferred": "yes"}):
        with pytest.raises(ConfigurationError, match="loader state"):
            target.load_state_dict({**state, "semantics": {**state["semantics"], **bad}})
        assert len(target) == 0
