"""Storage, semantics, batches, schemas: refusals, zero sizes, damaged checkpoints, peeks that keep storage."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import (
    ConfigurationError,
    EmptyBufferError,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    OnPolicy,
    PrioritizedSampler,
    Replay,
    SchemaError,
)
from conduit.batch import ExperienceBatch
from conduit.semantics.base import select_many
from conduit.storage import DiskStorage

SCALAR = ExperienceSchema(r=Field((), torch.float32))


def _on_policy(**kwargs: object) -> ExperienceDataPlane:
    return ExperienceDataPlane(SCALAR, capacity=8, semantics=OnPolicy(num_minibatches=1, **kwargs))  # type: ignore[arg-type]


# -- on-policy ---------------------------------------------------------------------------------
def test_a_peek_that_drops_a_stale_rollout_leaves_its_storage_live() -> None:
    edp = _on_policy(on_stale="drop")
    edp.ingest({"r": torch.arange(4.0)}, version=0)
    edp.seal()
    edp.set_policy_version(1)
    with pytest.raises(EmptyBufferError):
        edp.select_now([None], peek=True)
    assert len(edp) == 4, f"a peek (a prediction) freed the stale rollout's storage: {len(edp)} items live, 4 expected"
    assert edp.semantics.pending_rollouts == 1  # type: ignore[attr-defined]
    # the policy goes back: the rollout is deliverable again, and must still hold its own items
    edp.set_policy_version(0)
    edp.ingest({"r": torch.full((4,), 9.0)}, version=0)  # fits only by overwriting freed slots
    batch, info = edp.deliver()
    assert sorted(batch["r"].tolist()) == [0.0, 1.0, 2.0, 3.0], (
        f"the rollout delivered other items' data after a peek: {batch['r'].tolist()}")
    assert not edp.semantics.peeking


def test_a_real_delivery_still_drops_and_frees_a_stale_rollout() -> None:
    edp = _on_policy(on_stale="drop")
    edp.ingest({"r": torch.arange(4.0)}, version=0)
    edp.seal()
    edp.set_policy_version(1)
    with pytest.raises(EmptyBufferError):
        edp.deliver()
    assert len(edp) == 0 and edp.semantics.dropped_items == 4  # type: ignore[attr-defined]


def test_select_many_peek_resets_the_peeking_flag_after_an_error() -> None:
    edp = _on_policy()
    with pytest.raises(EmptyBufferError):
        select_many(edp.semantics, [None], peek=True)
    assert edp.semantics.peeking is False


def test_an_empty_ingest_of_another_version_neither_seals_nor_blocks_the_open_rollout() -> None:
    edp = _on_policy()
    edp.ingest({"r": torch.ones(3)}, version=1)
    edp.ingest({"r": torch.ones(0)}, version=2)  # no items: nothing arrived
    assert edp.semantics.pending_rollouts == 0, "an empty batch sealed the open rollout"  # type: ignore[attr-defined]
    edp.ingest({"r": torch.ones(2)}, version=1)  # the open rollout is still version 1
    edp.seal()
    _, info = edp.deliver()
    assert info.version == 1 and len(info.handles) == 5, f"expected one rollout of 5 items, got {info}"


@pytest.mark.parametrize("bad", [None, "1", -1, float("nan"), True])
def test_max_staleness_must_be_a_number_at_least_zero(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="max_staleness"):
        OnPolicy(num_minibatches=1, max_staleness=bad)  # type: ignore[arg-type]


# -- replay ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2.0, True, "2"])
def test_replay_batch_size_must_be_an_int(n: object) -> None:
    edp = ExperienceDataPlane(SCALAR, capacity=8)
    edp.ingest({"r": torch.ones(4)})
    with pytest.raises(ConfigurationError, match="positive batch size n \\(an int\\)"):
        edp.deliver(n)  # type: ignore[arg-type]
    batch, _ = edp.deliver(np.int64(3))  # NumPy ints are ints
    assert batch.batch_size == 3


@pytest.mark.parametrize("beta", [-1.0, float("nan"), float("inf"), "x"])
def test_a_bad_beta_override_is_refused_before_the_rng_moves(beta: object) -> None:
    edp = ExperienceDataPlane(SCALAR, capacity=8, semantics=Replay(PrioritizedSampler(), seed=3))
    ref = ExperienceDataPlane(SCALAR, capacity=8, semantics=Replay(PrioritizedSampler(), seed=3))
    for e in (edp, ref):
        e.ingest({"r": torch.arange(8.0)})
    with pytest.raises(ConfigurationError, match="beta"):
        edp.deliver(4, beta=beta)
    assert edp.deliver(16)[1].handles.tolist() == ref.deliver(16)[1].handles.tolist(), "the refused call drew"


@pytest.mark.parametrize("kw", [{"alpha": "x"}, {"beta": None}, {"alpha": True}])
def test_prioritized_sampler_arguments_must_be_numbers(kw: dict) -> None:
    with pytest.raises(ConfigurationError, match="alpha and beta"):
        PrioritizedSampler(**kw)


# -- batches and schemas -------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [[np.float32(1.5), np.float32(2.5)], [torch.tensor(1.5), torch.tensor(2.5)],
                                  [np.array(1.5, dtype=np.float32), np.array(2.5, dtype=np.float32)]],
                         ids=["numpy-scalars", "0d-tensors", "0d-arrays"])
def test_a_list_of_scalars_is_a_fixed_column(rows: list) -> None:
    edp = ExperienceDataPlane(SCALAR, capacity=8)
    edp.ingest({"r": rows})
    batch, _ = edp.deliver(2, replace=False)
    assert sorted(batch["r"].tolist()) == [1.5, 2.5]


def test_a_list_of_numpy_ints_keeps_its_dtype() -> None:
    b = ExperienceBatch.from_mapping({"a": [np.int32(1), np.int32(2)]})
    assert b["a"].dtype == torch.int32 and b["a"].tolist() == [1, 2]  # type: ignore[union-attr]


@pytest.mark.parametrize("rows", [[torch.tensor(1.0), torch.tensor([2.0])], [np.float32(1), "a"],
                                  [torch.tensor([1.0, 2.0]), torch.tensor(3.0)]])
def test_mixed_scalars_and_sequences_are_a_schema_error(rows: list) -> None:
    with pytest.raises(SchemaError):
        ExperienceBatch.from_mapping({"a": rows})


@pytest.mark.parametrize("shape", [4, "ab", None])
def test_a_field_shape_that_is_not_a_tuple_of_sizes_is_a_configuration_error(shape: object) -> None:
    with pytest.raises(ConfigurationError, match="tuple of sizes"):
        Field(shape)  # type: ignore[arg-type]


# -- disk tier -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cap", ["10", 2.5, None])
def test_disk_storage_capacity_must_be_a_positive_int(cap: object, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigurationError, match="capacity must be a positive int"):
        DiskStorage(SCALAR, cap, directory=tmp_path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == [], "a refused disk storage left a directory behind"


def test_a_closed_disk_storage_refuses_appends_and_reads(tmp_path) -> None:  # noqa: ANN001
    st = DiskStorage(SCALAR, 8, directory=tmp_path)
    st.append(ExperienceBatch({"r": torch.ones(3)}, 3))
    state = st.state_dict()
    st.close()
    with pytest.raises(ConfigurationError, match="closed"):
        st.append(ExperienceBatch({"r": torch.ones(2)}, 2))
    assert st.next_handle == 3, "a refused append after close moved the write position"
    with pytest.raises(ConfigurationError, match="closed"):
        st.gather(torch.tensor([0, 1]))
    with pytest.raises(ConfigurationError, match="closed"):
        st.load_state_dict(state)


def test_ragged_lists_that_are_all_empty_take_the_schema_dtype_and_shape() -> None:
    schema = ExperienceSchema(tok=Field((), torch.int64, ragged=True), emb=Field((3,), torch.float16, ragged=True),
                              x=Field((), torch.float32))
    edp = ExperienceDataPlane(schema, capacity=4, ragged_capacity=8)
    edp.ingest({"tok": [[], []], "emb": [[], []], "x": torch.zeros(2)})  # a batch where no item has a token
    edp.ingest({"tok": [[5], []], "emb": [torch.ones(1, 3, dtype=torch.float16), []], "x": torch.ones(2)})
    batch, _ = edp.deliver(4, replace=False)
    assert sorted(batch["tok"].lengths.tolist()) == [0, 0, 0, 1] and batch["tok"].values.tolist() == [5]
    assert batch["emb"].values.dtype == torch.float16 and batch["emb"].values.shape == (1, 3)
    with pytest.raises(SchemaError, match="dtype"):  # a non-empty sequence of another dtype is still refused
        edp.ingest({"tok": [[1.5], []], "emb": [[], []], "x": torch.zeros(2)})


@pytest.mark.parametrize("seqs", [[torch.ones(2, 3), torch.ones(1, 2)], [[[1.0, 2.0, 3.0]], [[1.0, 2.0]]],
                                  [torch.ones(2, 3), "ab"]], ids=["tensors", "lists", "a-string"])
def test_sequences_that_do_not_pack_are_a_schema_error_naming_the_field(seqs: list) -> None:
    schema = ExperienceSchema(vec=Field((3,), torch.float32, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=4)
    with pytest.raises(SchemaError, match="Field 'vec'"):
        edp.ingest({"vec": seqs})
    assert len(edp) == 0


@pytest.mark.parametrize("value", [None, "abc", np.array(["a", "b"]), np.array([1.0, None]), {1: 2}],
                         ids=["none", "str", "str-array", "object-array", "dict"])
def test_a_value_that_is_no_tensor_is_a_schema_error_naming_the_field(value: object) -> None:
    edp = ExperienceDataPlane(SCALAR, capacity=4)
    with pytest.raises(SchemaError, match="Field 'r' cannot be made a tensor"):
        edp.ingest({"r": value})
    assert len(edp) == 0


@pytest.mark.parametrize("column", [0, 1, 2])
def test_the_reference_payload_check_sees_corruption_in_every_column(column: int) -> None:
    from conduit.testing.reference import check_payload, id_batch

    batch = id_batch(np.arange(4))
    check_payload(batch)  # intact
    batch["obs"][2, column] += 1.0
    with pytest.raises(AssertionError, match="payload does not match its id"):
        check_payload(batch)


def test_swapped_handles_and_priorities_are_refused_and_change_nothing() -> None:
    from conduit import PriorityError

    edp = ExperienceDataPlane(SCALAR, capacity=8, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=1))
    edp.ingest({"r": torch.arange(8.0)})
    _, info = edp.deliver(4)
    before = edp.semantics.state_dict()["sampler"]["leaves"].clone()  # type: ignore[attr-defined]
    with pytest.raises(PriorityError, match="Handles must be integers"):
        edp.update_priorities(torch.tensor([0.5, 3.7, 2.2, 1.9]), info.handles)  # arguments swapped
    after = edp.semantics.state_dict()["sampler"]["leaves"]  # type: ignore[attr-defined]
    assert np.array_equal(before, after), "a refused priority update changed priorities"
    assert edp.update_priorities(info.handles.tolist(), [1.0] * 4) == 4  # a list of ints is fine
    assert edp.update_priorities(np.array([], dtype=np.float64), np.array([])) == 0  # nothing to update


# -- damaged checkpoints -------------------------------------------------------------------------
def _damaged(good: dict, case: str) -> dict:
    st = dict(good["storage"])
    if case == "no-storage-entries":
        st = {}
    elif case == "unknown-dtype":
        st["schema"] = {"r": {"shape": [], "dtype": "no_such_dtype"}}
    elif case == "no-data":
        del st["data"]
    elif case == "rows-disagree-with-range":
        st["data"] = {"r": torch.ones(3)}
    elif case == "wrong-dtype":
        st["data"] = {"r": torch.ones(2, dtype=torch.int64)}
    elif case == "range-beyond-capacity":
        st.update(oldest=0, next=9, data={"r": torch.ones(9)})
    return {**good, "storage": st}


@pytest.mark.parametrize("case", ["no-storage-entries", "unknown-dtype", "no-data", "rows-disagree-with-range",
                                  "wrong-dtype", "range-beyond-capacity"])
@pytest.mark.parametrize("placement", ["host", "sharded"])
def test_a_damaged_checkpoint_is_refused_typed_and_changes_nothing(case: str, placement: str) -> None:
    from conduit.placement import ShardedPlacement

    def build() -> ExperienceDataPlane:
        pl = ShardedPlacement(["cpu"] * 2) if placement == "sharded" else None
        return ExperienceDataPlane(SCALAR, capacity=4, placement=pl, semantics=Replay(seed=5))

    src = build()
    src.ingest({"r": torch.tensor([1.0, 2.0])})
    good = src.state_dict()
    dst = build()
    dst.ingest({"r": torch.tensor([7.0, 8.0, 9.0])})
    before = dst.state_dict()
    with pytest.raises(ConfigurationError, match="checkpoint"):
        dst.load_state_dict(_damaged(good, case))
    after = dst.state_dict()
    assert (after["storage"]["oldest"], after["storage"]["next"]) == (0, 3), "a refused load moved the handles"
    assert torch.equal(after["storage"]["data"]["r"], before["storage"]["data"]["r"]), "a refused load changed items"
    assert torch.equal(after["semantics"]["sampler"]["rng"], before["semantics"]["sampler"]["rng"])
    dst.load_state_dict(good)  # the intact checkpoint still loads
    assert dst.state_dict()["storage"]["data"]["r"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("seed", [None, "1", 1.5, True, -1, 2 ** 70])
@pytest.mark.parametrize("make", [lambda s: Replay(seed=s), lambda s: Replay(PrioritizedSampler(), seed=s),
                                  lambda s: OnPolicy(num_minibatches=1, seed=s)],
                         ids=["uniform", "prioritized", "on-policy"])
def test_a_seed_that_is_no_usable_int_is_a_configuration_error(make, seed: object) -> None:  # noqa: ANN001
    with pytest.raises(ConfigurationError, match="seed must be an int"):
        ExperienceDataPlane(SCALAR, capacity=4, semantics=make(seed))


def test_numpy_int_seeds_draw_as_the_same_python_int() -> None:
    a = ExperienceDataPlane(SCALAR, capacity=8, semantics=Replay(PrioritizedSampler(), seed=np.int64(4)))
    b = ExperienceDataPlane(SCALAR, capacity=8, semantics=Replay(PrioritizedSampler(), seed=4))
    for e in (a, b):
        e.ingest({"r": torch.arange(8.0)})
    assert a.deliver(8)[1].handles.tolist() == b.deliver(8)[1].handles.tolist()


@pytest.mark.parametrize("trial", range(40))
def test_peeks_and_checkpoints_never_change_what_on_policy_delivers(trial: int) -> None:
    """Twin buffers get the same calls; one also peeks, the other round-trips through checkpoints.
    Deliveries, errors, live counts and drop counts must stay identical (the policy version moves both ways)."""
    import random

    from conduit import ConduitError

    rnd = random.Random(trial)
    kw = {"num_minibatches": rnd.randint(1, 4), "num_epochs": rnd.randint(1, 3), "max_staleness": rnd.randint(0, 2),
          "on_stale": rnd.choice(["drop", "raise"]), "seed": trial}
    cap = rnd.randint(4, 30)
    schema = ExperienceSchema(id=Field((), torch.int64))

    def make() -> ExperienceDataPlane:
        return ExperienceDataPlane(schema, capacity=cap, semantics=OnPolicy(**kw))  # type: ignore[arg-type]

    def outcome(f):  # noqa: ANN001, ANN202
        try:
            return "ok", f()
        except ConduitError as e:
            return "error", type(e).__name__

    def deliver(edp: ExperienceDataPlane) -> tuple:
        batch, info = edp.deliver()
        assert batch["id"].tolist() == info.handles.tolist(), "a minibatch holds other items' data"
        return batch["id"].tolist(), info.version, info.epoch, info.minibatch, info.last

    peeked, restored = make(), make()
    version = policy = next_id = 0
    for step in range(60):
        op = rnd.random()
        if op < 0.3:
            n = rnd.randint(0, 6)
            version += rnd.random() < 0.3
            ids = torch.arange(next_id, next_id + n)
            got = [outcome(lambda e=e, ids=ids, v=version: e.ingest({"id": ids}, version=v).tolist())
                   for e in (peeked, restored)]
            assert got[0] == got[1], f"step {step}: ingestion differs {got}"
            next_id += n if got[0][0] == "ok" else 0
        elif op < 0.4:
            peeked.seal()
            restored.seal()
        elif op < 0.5:
            policy = max(0, policy + rnd.choice([-1, 1, 1]))
            peeked.set_policy_version(policy)
            restored.set_policy_version(policy)
        elif op < 0.6:
            outcome(lambda: peeked.select_now([None] * rnd.randint(1, 3), peek=True))
        elif op < 0.7:
            state = restored.state_dict()
            restored = make()
            restored.load_state_dict(state)
        else:
            got = [outcome(lambda e=e: deliver(e)) for e in (peeked, restored)]
            assert got[0] == got[1], f"step {step}: deliveries differ {got}"
        assert len(peeked) == len(restored), f"step {step}: {len(peeked)} vs {len(restored)} live items"
        assert peeked.semantics.dropped_items == restored.semantics.dropped_items  # type: ignore[attr-defined]


def test_a_checkpoint_between_the_last_minibatchs_selection_and_its_release_round_trips_exactly() -> None:
    """The finished rollout's end (set when its last minibatch is selected, used when it is handed over)
    is part of the on-policy state: a buffer restored in that window frees the rollout's storage when the
    hand-over completes, as the original does (it kept the items live, unknown to its semantics)."""
    from conduit import ExperienceDataPlane, OnPolicy
    from conduit.testing.reference import ID_SCHEMA, id_batch

    def build() -> ExperienceDataPlane:
        return ExperienceDataPlane(ID_SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=2, seed=0))

    edp = build()
    edp.ingest(id_batch(np.arange(4)), version=0)
    edp.seal()
    edp.deliver()
    sels = edp.select_now([None])  # the last minibatch, selected, not yet handed over
    state = edp.state_dict()
    twin = build()
    twin.load_state_dict(state)
    assert twin.state_dict()["semantics"]["finished_end"] == state["semantics"]["finished_end"] == 4
    for buf in (edp, twin):
        buf.release_now(sels[0])
    assert len(edp) == len(twin) == 0, "the restored buffer kept the finished rollout's items live"


def test_fresh_rollouts_counts_the_pending_rollouts_within_the_staleness_bound() -> None:
    from conduit import ExperienceDataPlane, OnPolicy
    from conduit.testing.reference import ID_SCHEMA, id_batch

    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=OnPolicy(num_minibatches=1, max_staleness=1))
    for v in (0, 1, 2):
        edp.ingest(id_batch(np.arange(4 * v, 4 * v + 4)), version=v)
    edp.seal()
    sem = edp.semantics
    assert (sem.pending_rollouts, sem.fresh_rollouts) == (3, 3)
    edp.set_policy_version(2)  # version 0 is 2 behind: stale
    assert (sem.pending_rollouts, sem.fresh_rollouts) == (3, 2)
