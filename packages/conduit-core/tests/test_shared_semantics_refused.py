"""One semantics object (or sampler) passed to two buffers.

Bug found: a buffer binds its semantics to its storage, and a second buffer built with the same ``Replay`` (or a
``Replay`` around the same sampler) bound it again, to its own storage, resetting the sampler: the first buffer then
drew handles from the second buffer's bookkeeping (from its 2 items, not its own 6) and gathered its own rows at
those slots, silently, and its priority updates and checkpoints read the second buffer's sampler. Now a second
open buffer is refused with a ConfigurationError before it builds anything; a buffer whose construction failed,
or that was closed, leaves the semantics free for the next one (as a scheduler is).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import (
    ConfigurationError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    Replay,
    Synchronous,
    UniformSampler,
)
from conduit.testing.reference import id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import _FakeRay, _plane, patch_ray  # noqa: E402, I001

SCHEMA = ExperienceSchema(id=Field((), torch.int64))


def _ids(lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {"id": torch.arange(lo, hi)}


@pytest.mark.parametrize("sampler", [UniformSampler, PrioritizedSampler], ids=["uniform", "prioritized"])
def test_a_second_buffer_cannot_take_over_an_open_buffers_replay(sampler: type) -> None:
    sem = Replay(sampler(), seed=0)
    a = ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)
    a.ingest(_ids(100, 106))
    with pytest.raises(ConfigurationError, match="another open buffer"):
        ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)
    # the first buffer still draws from its own six items
    batch, info = a.deliver(64)
    assert set(info.handles.tolist()) == set(range(6))
    assert set(batch["id"].tolist()) == set(range(100, 106))
    a.close()


def test_a_sampler_shared_by_two_replays_is_refused() -> None:
    shared = PrioritizedSampler()
    a = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(shared, seed=0))
    a.ingest(_ids(0, 6))
    with pytest.raises(ConfigurationError, match="another open buffer"):
        ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(shared, seed=1))
    assert a.update_priorities(torch.arange(6), torch.full((6,), 2.0)) == 6
    assert set(a.deliver(64)[1].handles.tolist()) == set(range(6))


def test_on_policy_semantics_shared_by_two_open_buffers_is_refused() -> None:
    sem = OnPolicy(num_minibatches=1, num_epochs=1)
    a = ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)
    with pytest.raises(ConfigurationError, match="another open buffer"):
        ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)
    a.ingest(_ids(0, 4), version=0)
    a.seal()
    assert sorted(a.deliver()[0]["id"].tolist()) == [0, 1, 2, 3]


def test_semantics_are_free_again_after_close_a_failed_build_or_collection() -> None:
    sem = Replay(seed=0)
    a = ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)
    a.close()
    b = ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)  # a closed buffer frees them
    b.ingest(_ids(0, 3))
    assert set(b.deliver(16)[1].handles.tolist()) == {0, 1, 2}
    del b
    gc.collect()
    ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)  # so does a buffer dropped
    # a build that fails after binding (here: a scheduler serving another open buffer) claims nothing
    other = Replay(seed=0)
    sched = Synchronous()
    keep = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(seed=0), scheduler=sched)
    with pytest.raises(ConfigurationError, match="scheduler"):
        ExperienceDataPlane(SCHEMA, capacity=8, semantics=other, scheduler=sched)
    built = ExperienceDataPlane(SCHEMA, capacity=8, semantics=other)
    built.ingest(_ids(0, 2))
    assert len(built) == 2 and len(keep) == 0


def test_a_distributed_buffer_and_a_local_one_cannot_share_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The distributed plane (real shard server bodies, called in-process) binds its semantics the same way."""
    threads = torch.get_num_threads()
    patch_ray(monkeypatch, _FakeRay)
    try:
        sem = Replay(PrioritizedSampler(), seed=0)
        p = _plane(["a", "b"], capacity=10, semantics=sem)
        p.ingest(id_batch(np.arange(6)))
        with pytest.raises(ConfigurationError, match="another open buffer"):
            ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)
        local = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(seed=0))
        with pytest.raises(ConfigurationError, match="another open buffer"):
            _plane(["a", "b"], capacity=10, semantics=local.semantics)
        assert set(p.deliver(64)[1].handles.tolist()) == set(range(6))
        p.close()
    finally:
        torch.set_num_threads(threads)


def test_released_semantics_can_be_handed_to_a_new_buffer_and_claimed_back() -> None:
    """An adapter replacing an open buffer by a larger one hands its semantics over (conduit-verl's growing delivery):
    ``release`` lets the new buffer take them, ``claim`` gives them back to the old one should that build fail."""
    from conduit.semantics.base import check_unshared, claim, release

    sem = Replay(PrioritizedSampler(), seed=0)
    old = ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)
    release(sem)
    check_unshared(sem)  # free now
    claim(sem, old)
    with pytest.raises(ConfigurationError, match="another open buffer"):
        check_unshared(sem)
    release(sem)
    new = ExperienceDataPlane(SCHEMA, capacity=16, semantics=sem)
    old.close()
    with pytest.raises(ConfigurationError, match="another open buffer"):
        ExperienceDataPlane(SCHEMA, capacity=8, semantics=sem)  # the new buffer holds them now
    new.close()
