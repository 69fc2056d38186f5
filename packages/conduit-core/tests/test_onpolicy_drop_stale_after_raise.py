"""``OnPolicy(on_stale="raise")``: a refused delivery leaves the stale rollout waiting (state unchanged), so every
later delivery raised again, also for the fresh rollouts behind it, and nothing public dropped it.
``ExperienceDataPlane.drop_stale()`` drops the stale rollouts as ``on_stale="drop"`` would (counted in
``dropped_items``, storage released) and delivery goes on with the fresh ones, under every scheduler."""

from __future__ import annotations

import pytest
import torch
from conduit import (
    Automatic,
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    Overlapped,
    Replay,
    StaleExperienceError,
    Synchronous,
)

SCHEMA = ExperienceSchema(id=Field((), torch.int64))
SCHEDULERS = {"synchronous": Synchronous, "overlapped": Overlapped, "automatic": Automatic}


def _rollout(edp: ExperienceDataPlane, first: int, n: int, version: int) -> None:
    edp.ingest({"id": torch.arange(first, first + n)}, version=version)
    edp.seal()


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_drop_stale_lets_delivery_go_on_with_the_fresh_rollouts(scheduler: str) -> None:
    sem = OnPolicy(num_minibatches=2, num_epochs=2, max_staleness=1, on_stale="raise", seed=0)
    edp = ExperienceDataPlane(SCHEMA, capacity=32, semantics=sem, scheduler=SCHEDULERS[scheduler]())
    _rollout(edp, 0, 6, version=0)
    _rollout(edp, 100, 4, version=1)
    edp.set_policy_version(2)  # version 0 is 2 behind (stale), version 1 is 1 behind (fresh)
    for _ in range(2):  # refused, and refused again: the stale rollout keeps waiting
        with pytest.raises(StaleExperienceError, match=r"version 0 \(6 items\).*drop_stale\(\)"):
            edp.deliver()
    assert sem.dropped_items == 0 and len(edp) == 10
    assert edp.drop_stale() == 6
    assert sem.dropped_items == 6 and edp.drop_stale() == 0
    seen: list[list[int]] = []
    for _ in range(4):  # 2 minibatches x 2 epochs of the fresh rollout
        batch, info = edp.deliver()
        assert info.version == 1
        seen.append(batch.tensor("id").tolist())
    assert sorted(seen[0] + seen[1]) == sorted(seen[2] + seen[3]) == [100, 101, 102, 103]
    assert len(edp) == 0, "the delivered and the dropped rollouts' storage was not released"
    edp.close()


def test_drop_stale_drops_a_rollout_that_turned_stale_while_delivered_and_keeps_the_open_one() -> None:
    sem = OnPolicy(num_minibatches=2, max_staleness=0, on_stale="raise", seed=0)
    edp = ExperienceDataPlane(SCHEMA, capacity=32, semantics=sem)
    _rollout(edp, 0, 4, version=0)
    edp.deliver()  # the first of its two minibatches
    edp.ingest({"id": torch.arange(50, 53)}, version=1)  # open, not sealed
    edp.set_policy_version(1)
    with pytest.raises(StaleExperienceError):
        edp.deliver()
    assert edp.drop_stale() == 4 and sem.dropped_items == 4
    assert len(edp) == 3  # the open rollout stays
    edp.seal()
    ids = sorted(i for _ in range(2) for i in edp.deliver()[0].tensor("id").tolist())
    assert ids == [50, 51, 52]
    edp.close()


def test_drop_stale_is_refused_for_replay_and_after_close() -> None:
    replay = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(seed=0))
    with pytest.raises(ConfigurationError, match="OnPolicy"):
        replay.drop_stale()
    replay.close()
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=1))
    edp.close()
    with pytest.raises(ConfigurationError):
        edp.drop_stale()
