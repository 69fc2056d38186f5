"""Bad input raises a typed error and leaves the buffer unchanged: batches, checkpoints of another
kind, and old-schema batches stored after a migration."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from conduit import (
    ConduitError,
    ConfigurationError,
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    Ragged,
    Replay,
    SchemaError,
)

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))
RAGGED = ExperienceSchema(tok=Field((), torch.int64, ragged=True), r=Field(()))


def good(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 4).contiguous(),
            "action": torch.arange(start, start + n)}


def contents(edp: ExperienceDataPlane) -> tuple[int, int, dict[str, list]]:
    st = edp.storage.state_dict()
    data = {k: ([t.tolist() for t in v] if isinstance(v, tuple) else v.tolist()) for k, v in st["data"].items()}
    return st["oldest"], st["next"], data


@pytest.mark.parametrize("make", [
    lambda: ExperienceBatch(good(5, 100), 3),  # batch_size below the rows
    lambda: ExperienceBatch(good(2, 100), 4),  # batch_size above the rows
    lambda: ExperienceBatch({**good(4, 100), "action": torch.arange(2)}, 4),  # fields of different lengths
    lambda: ExperienceBatch({"obs": torch.zeros(1, 4), "action": torch.tensor(7)}, 1),  # a scalar column
])
def test_an_experience_batch_whose_columns_disagree_with_its_size_is_refused(make: Callable) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8)
    edp.ingest(good(6))
    before = contents(edp)
    with pytest.raises(SchemaError, match="rows"):
        edp.ingest(make())
    assert contents(edp) == before


def test_a_zero_item_ragged_batch_with_stray_values_is_refused_and_evicts_nothing() -> None:
    edp = ExperienceDataPlane(RAGGED, capacity=8, ragged_capacity=10)
    edp.ingest({"tok": Ragged(torch.arange(8), torch.tensor([4, 4])), "r": torch.zeros(2)})
    before = contents(edp)
    with pytest.raises(SchemaError, match="sum to"):
        edp.ingest({"tok": Ragged(torch.arange(5), torch.zeros(0, dtype=torch.int64)), "r": torch.zeros(0)})
    assert contents(edp) == before
    # a genuine zero-item batch is still fine
    edp.ingest({"tok": Ragged(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)),
                "r": torch.zeros(0)})
    assert contents(edp) == before


SEMANTICS = {
    "uniform": lambda: Replay(seed=1),
    "prioritized": lambda: Replay(PrioritizedSampler(), seed=1),
    "on_policy": lambda: OnPolicy(num_minibatches=2),
}


@pytest.mark.parametrize("src, dst", [(a, b) for a in SEMANTICS for b in SEMANTICS if a != b])
def test_loading_a_checkpoint_of_other_semantics_raises_typed_and_changes_nothing(src: str, dst: str) -> None:
    donor = ExperienceDataPlane(SCHEMA, capacity=8, semantics=SEMANTICS[src]())
    donor.ingest(good(3), version=0 if src == "on_policy" else None)
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=SEMANTICS[dst]())
    edp.ingest(good(5, 10), version=0 if dst == "on_policy" else None)
    before, sem_before = contents(edp), edp.semantics.state_dict()
    with pytest.raises(ConduitError):
        edp.load_state_dict(donor.state_dict())
    assert contents(edp) == before
    sem_after = edp.semantics.state_dict()
    assert repr(sem_after) == repr(sem_before) or all(
        np.array_equal(np.asarray(sem_after[k]), np.asarray(sem_before[k])) for k in sem_before)
    # and the buffer still works, drawing what it would have drawn
    if dst != "on_policy":
        twin = ExperienceDataPlane(SCHEMA, capacity=8, semantics=SEMANTICS[dst]())
        twin.ingest(good(5, 10))
        assert torch.equal(edp.deliver(6)[1].handles, twin.deliver(6)[1].handles)


def test_a_checkpoint_of_another_capacity_changes_neither_storage_nor_sampler() -> None:
    donor = ExperienceDataPlane(SCHEMA, capacity=4, semantics=Replay(PrioritizedSampler(), seed=7))
    donor.ingest(good(3))
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(PrioritizedSampler(), seed=1))
    edp.ingest(good(5, 10))
    before, rng = contents(edp), edp.semantics.state_dict()["sampler"]["rng"]
    with pytest.raises(ConfigurationError, match="capacity"):
        edp.load_state_dict(donor.state_dict())
    assert contents(edp) == before
    assert edp.semantics.state_dict()["sampler"]["rng"] == rng


@pytest.mark.parametrize("transform_fails", [False, True])
def test_an_old_schema_batch_stored_after_a_growing_migration_goes_through_its_transform(
        transform_fails: bool) -> None:
    from conduit import HostPlacement, Scheduler

    grown = ExperienceSchema(obs=Field((5,), torch.float32), action=Field((), torch.int64))

    def pad(b: ExperienceBatch) -> dict[str, torch.Tensor]:
        if transform_fails and b.batch_size == 2:  # the migration's chunks pass, the late batch does not
            raise ValueError("cannot pad this one")
        return {"obs": torch.nn.functional.pad(b.tensor("obs"), (0, 1)), "action": b.tensor("action")}

    class MigratesFirst(Scheduler):
        """The interleaving a producer thread can hit: validated, then a migration swaps, then stored."""

        armed = False

        def ingest(self, batch, *, version, priorities):  # noqa: ANN001, ANN202
            if self.armed:
                self.armed = False
                self.edp.migrate(HostPlacement(), schema=grown, transform=pad)
            return self.edp.ingest_now(batch, version=version, priorities=priorities)

        def deliver(self, n, **kwargs):  # noqa: ANN001, ANN003, ANN202
            return self.edp.deliver_now(n, **kwargs)

    sched = MigratesFirst()
    edp = ExperienceDataPlane(SCHEMA, capacity=8, scheduler=sched)
    edp.ingest(good(8))  # full: the next ingestion evicts
    sched.armed = True
    if transform_fails:
        with pytest.raises(SchemaError, match="transform failed"):
            edp.ingest(good(2, 100))  # valid for the schema at the call
        assert (edp.storage.oldest, edp.storage.next_handle) == (0, 8), "a refused batch evicted items"
        return
    edp.ingest(good(2, 100))
    data = edp.storage.state_dict()["data"]
    assert data["action"].tolist() == [2, 3, 4, 5, 6, 7, 100, 101]
    assert data["obs"][-1].tolist() == [101.0, 101.0, 101.0, 101.0, 0.0]
    edp.ingest({"obs": torch.ones(1, 5), "action": torch.zeros(1, dtype=torch.int64)})  # the new schema as is
    assert edp.storage.state_dict()["data"]["obs"][-1].tolist() == [1.0] * 5


# -- options and roles of the wrong kind ----------------------------------------------------------------------------
def test_a_misspelt_delivery_option_is_refused_typed() -> None:
    replay = ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=16,
                                 semantics=Replay(PrioritizedSampler(), seed=0))
    replay.ingest({"obs": torch.randn(8, 2)})
    before = replay.state_dict()
    for bad in ({"betta": 0.4}, {"replce": False}):
        with pytest.raises(ConfigurationError, match="check the spelling"):
            replay.deliver(4, **bad)
    twin = ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=16,
                               semantics=Replay(PrioritizedSampler(), seed=0))
    twin.load_state_dict(before)
    assert replay.deliver(4)[1].handles.tolist() == twin.deliver(4)[1].handles.tolist(), "a refusal drew"
    ppo = ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=16, semantics=OnPolicy(num_minibatches=2))
    ppo.ingest({"obs": torch.randn(8, 2)}, version=0)
    ppo.seal()
    with pytest.raises(ConfigurationError, match="takes no options"):
        ppo.deliver(beta=0.4)
    assert len(ppo) == 8


@pytest.mark.parametrize("kwargs", [{"semantics": "replay"}, {"placement": "host"}, {"scheduler": "sync"},
                                    {"device": "nope"}, {"device": 3.5}])
def test_roles_and_devices_of_the_wrong_kind_are_refused_typed(kwargs: dict) -> None:
    with pytest.raises(ConfigurationError, match="must be a"):
        ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=4, **kwargs)


def _absent_cuda_device() -> str:
    """A CUDA device this machine does not have (cuda:0 without a GPU)."""
    return f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


def test_a_cuda_device_the_machine_lacks_is_refused_at_construction() -> None:
    # accepted before: the first delivery then failed with torch's RuntimeError (pinned staging needs CUDA), after
    # its draw had consumed the selection
    with pytest.raises(ConfigurationError, match="not on this machine"):
        ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=4, device=_absent_cuda_device())
