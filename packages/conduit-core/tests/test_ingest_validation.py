"""Ingestion: schema validation, typed errors, and an unchanged buffer after bad input."""

from __future__ import annotations

import numpy as np
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
    PriorityError,
    Ragged,
    Replay,
    SchemaError,
)

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))


def good(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 4).contiguous(),
            "action": torch.arange(start, start + n)}


def snapshot(edp: ExperienceDataPlane) -> tuple[int, int, list[float]]:
    st = edp.state_dict()["storage"]
    return st["oldest"], st["next"], st["data"]["obs"][:, 0].tolist()


@pytest.mark.parametrize("bad, err, words", [
    ({"obs": torch.zeros(3, 4)}, SchemaError, "missing ['action']"),
    ({**good(3), "extra": torch.zeros(3)}, SchemaError, "unexpected ['extra']"),
    ({"obs": torch.zeros(3, 4, dtype=torch.float64), "action": torch.zeros(3, dtype=torch.int64)}, SchemaError,
     "dtype"),
    ({"obs": torch.zeros(3, 5), "action": torch.zeros(3, dtype=torch.int64)}, SchemaError, "shape"),
    ({"obs": torch.zeros(3, 4), "action": torch.zeros(2, dtype=torch.int64)}, SchemaError, "batch size"),
    (good(9), CapacityError, "larger than the capacity"),
])
def test_bad_batches_raise_typed_errors_and_change_nothing(bad: dict, err: type, words: str) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8)
    edp.ingest(good(5))
    before = snapshot(edp)
    recorded = len(edp.telemetry.since(0.0))
    with pytest.raises(err, match=None) as info:
        edp.ingest(bad)
    assert words in str(info.value), str(info.value)
    assert snapshot(edp) == before
    assert len(edp.telemetry.since(0.0)) == recorded  # the refused call left no record


@pytest.mark.parametrize("cap", [0, -3, 2.5, True])
def test_capacity_must_be_a_positive_int(cap: object) -> None:
    with pytest.raises(ConfigurationError, match="capacity"):
        ExperienceDataPlane(SCHEMA, capacity=cap)  # type: ignore[arg-type]


@pytest.mark.parametrize("cap", [np.int64(6), np.int32(6), np.uint8(6)])
def test_capacity_takes_a_numpy_integer_as_every_count_in_core_does(cap: object) -> None:
    # refused before ("capacity must be a positive int, got np.int64(6)"), while ragged_capacity, num_minibatches and
    # the distributed plane's shard_capacity take NumPy integers (conduit.checks.is_int)
    edp = ExperienceDataPlane(SCHEMA, capacity=cap)  # type: ignore[arg-type]
    assert edp.capacity == 6 and type(edp.capacity) is int  # (a checkpoint holds it: a plain int loads anywhere)
    edp.ingest(good(6))
    edp.ingest(good(2, start=6))
    assert len(edp) == 6 and edp.state_dict()["storage"]["capacity"] == 6


@pytest.mark.parametrize("prio", [float("nan"), float("inf"), -1.0])
def test_bad_initial_priorities_change_nothing(prio: float) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(PrioritizedSampler()))
    edp.ingest(good(4))
    before = snapshot(edp)
    with pytest.raises(PriorityError, match="NaN, infinite or negative"):
        edp.ingest(good(2, 4), priorities=torch.tensor([1.0, prio]))
    assert snapshot(edp) == before


def test_priorities_on_a_uniform_buffer_are_rejected() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8)
    with pytest.raises(ConfigurationError, match="PrioritizedSampler"):
        edp.ingest(good(2), priorities=torch.ones(2))
    assert len(edp) == 0


def test_numpy_input_is_accepted_and_ingested_exactly() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8)
    obs = np.arange(12, dtype=np.float32).reshape(3, 4)
    handles = edp.ingest({"obs": obs, "action": np.array([7, 8, 9])})
    assert handles.tolist() == [0, 1, 2]
    batch, info = edp.deliver(3, replace=False)
    order = torch.argsort(info.handles)
    assert torch.equal(batch["obs"][order], torch.from_numpy(obs))
    assert batch["action"][order].tolist() == [7, 8, 9]


def test_on_policy_ingest_needs_a_version_and_refuses_to_evict_unconsumed_data() -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=2))
    with pytest.raises(ConfigurationError, match="version"):
        edp.ingest(good(2))
    edp.ingest(good(6), version=0)
    before = snapshot(edp)
    with pytest.raises(CapacityError, match="may not evict"):
        edp.ingest(good(4, 6), version=0)
    assert snapshot(edp) == before
    with pytest.raises(ConfigurationError, match="backwards"):
        edp.ingest(good(1), version=-1)


RAGGED = ExperienceSchema(tokens=Field((), torch.int64, ragged=True), reward=Field(()))


def test_ragged_fields_round_trip_through_storage() -> None:
    edp = ExperienceDataPlane(RAGGED, capacity=16, ragged_capacity=64)
    seqs = [torch.arange(k, dtype=torch.int64) + 10 * k for k in (3, 1, 0, 5)]
    edp.ingest({"tokens": seqs, "reward": torch.tensor([3.0, 1.0, 0.0, 5.0])})
    batch, info = edp.deliver(4, replace=False)
    tok = batch["tokens"]
    assert isinstance(tok, Ragged)
    for i, h in enumerate(info.handles.tolist()):
        assert torch.equal(tok[i], seqs[h]), (h, tok[i], seqs[h])
        assert batch["reward"][i].item() == float(len(seqs[h]))
    padded = tok.padded(-1)
    assert padded.shape == (4, 5)


def test_ragged_pool_evicts_oldest_items_fifo_when_it_wraps() -> None:
    edp = ExperienceDataPlane(RAGGED, capacity=100, ragged_capacity=10)
    for i in range(6):  # 6 items x 4 tokens into a pool of 10: the pool wraps and evicts the oldest
        edp.ingest({"tokens": [torch.full((4,), i, dtype=torch.int64)], "reward": torch.tensor([float(i)])})
        batch, info = edp.deliver(len(edp), replace=False)
        live = sorted(info.handles.tolist())
        assert live == list(range(live[0], i + 1)), live  # a contiguous, newest-ending range
        for k, h in enumerate(info.handles.tolist()):
            assert batch["tokens"][k].tolist() == [h] * 4
    assert len(edp) == 2
    with pytest.raises(CapacityError, match="ragged_capacity"):
        edp.ingest({"tokens": [torch.zeros(11, dtype=torch.int64)], "reward": torch.zeros(1)})
    assert len(edp) == 2


@pytest.mark.parametrize("data", [
    good(3),
    {"obs": torch.zeros(3, 4), "action": torch.zeros(3, 1, dtype=torch.int64)},  # a per-item shape (1,), not ()
    {"obs": torch.zeros(3, 4), "action": torch.tensor(7)},  # a scalar column
    {"obs": torch.zeros(3, 2, 2), "action": torch.zeros(3, dtype=torch.int64)},  # same numel, other shape
    {"obs": torch.zeros(3, 4, dtype=torch.float64), "action": torch.zeros(3, dtype=torch.int64)},
    {"obs": torch.zeros(3, 4), "action": torch.zeros(2, dtype=torch.int64)},
    {"obs": torch.zeros(3, 4), "act": torch.zeros(3, dtype=torch.int64)},
    {"obs": np.zeros((3, 4), np.float32), "action": np.zeros(3, np.int64)},
    {"obs": torch.zeros(0, 4), "action": torch.zeros(0, dtype=torch.int64)},
])
def test_the_one_pass_check_agrees_with_from_mapping_then_validate(data: dict) -> None:
    from conduit.batch import ExperienceBatch

    try:
        ref = ExperienceBatch.from_mapping(data)
        ref.validate(SCHEMA)
    except SchemaError as e:
        with pytest.raises(SchemaError) as info:
            ExperienceBatch.checked(data, SCHEMA)
        assert str(info.value) == str(e)
        return
    got = ExperienceBatch.checked(data, SCHEMA)
    assert got.batch_size == ref.batch_size and list(got) == list(ref)
    assert all(got[k] is ref[k] or torch.equal(got[k], ref[k]) for k in ref)
