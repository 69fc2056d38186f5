"""How ExperienceBatch and Ragged turn what a caller gives into columns, and refuse what they cannot."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Ragged, SchemaError
from conduit.batch import ExperienceBatch


def test_a_list_of_python_complex_scalars_is_one_complex_column() -> None:
    # a list of per-item Python scalars is a fixed column whether it starts with an int or a complex; a list that
    # starts with a complex was read as a list of sequences and refused ("give every item a sequence")
    edp = ExperienceDataPlane(ExperienceSchema(z=Field((), torch.complex64)), capacity=4)
    assert edp.ingest({"z": [1 + 2j, 3]}).tolist() == [0, 1]
    assert edp.ingest({"z": [4, 5j]}).tolist() == [2, 3]
    batch, info = edp.deliver(4, replace=False)
    got = dict(zip(info.handles.tolist(), batch.tensor("z").tolist(), strict=True))
    assert got == {0: 1 + 2j, 1: 3, 2: 4, 3: 5j}


@pytest.mark.parametrize("seqs", [[torch.ones(2, 3), torch.ones(1, 4)], [torch.ones(2, 3), torch.ones(2)]])
def test_sequences_whose_elements_differ_in_shape_are_refused_typed(seqs: list[torch.Tensor]) -> None:
    # Ragged.from_sequences raised torch.cat's RuntimeError, which names nothing the caller gave
    with pytest.raises(SchemaError, match="elements of different shapes"):
        Ragged.from_sequences(seqs)


def test_numpy_reads_columns_that_require_grad_or_carry_a_view_bit() -> None:
    # ExperienceBatch.numpy() raised torch's RuntimeError ("Can't call numpy() on Tensor that requires grad",
    # "... that has conjugate bit set") where conduit.batch.host_array reads the values
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    r = Ragged(torch.tensor([1.0, 2.0, 3.0], requires_grad=True), torch.tensor([2, 1]))
    out = ExperienceBatch.from_mapping({"x": x, "z": z.conj(), "n": x.detach()._neg_view(), "r": r}).numpy()
    assert out["x"].tolist() == [1.0, 2.0]
    assert out["z"].tolist() == [1 - 2j, 3 + 4j]
    assert out["n"].tolist() == [-1.0, -2.0]
    assert out["r"].tolist() == [[1.0, 2.0], [3.0, 0.0]]
    assert x.tolist() == [1.0, 2.0] and z.tolist() == [1 + 2j, 3 - 4j]  # (the caller's tensors are as given)


@pytest.mark.parametrize("index", [1, -2, np.int64(1), torch.tensor(1)])
def test_select_of_one_integer_is_a_batch_of_that_one_row(index: object) -> None:
    # c[1] dropped the batch dimension: the obs row [2, 3] came back as a "batch" of its 2 elements (batch_size 2),
    # and a scalar or ragged column raised IndexError
    b = ExperienceBatch.from_mapping({"obs": torch.tensor([[0, 1], [2, 3], [4, 5]]), "r": torch.tensor([7, 8, 9]),
                                      "seq": [torch.arange(1), torch.arange(2), torch.arange(3)]})
    one = b.select(index)  # type: ignore[arg-type]
    assert one.batch_size == 1
    assert one.tensor("obs").tolist() == [[2, 3]] and one.tensor("r").tolist() == [8]
    seq = one["seq"]
    assert isinstance(seq, Ragged) and seq.values.tolist() == [0, 1] and seq.lengths.tolist() == [2]


def test_empty_lists_are_an_empty_batch_for_fixed_fields_too() -> None:
    # an empty list already meant "no sequences" for a ragged field; for a fixed field torch read it as float32 [0],
    # refused as "dtype torch.float32, the schema says torch.int64" or "per-item shape ()" for lists of no items
    schema = ExperienceSchema(obs=Field((3,)), act=Field((), torch.int64), seq=Field((), torch.int64, ragged=True))
    edp = ExperienceDataPlane(schema, capacity=4)
    assert edp.ingest({"obs": [], "act": (), "seq": []}).tolist() == []
    assert edp.ingest({"obs": torch.ones(1, 3), "act": [7], "seq": [[5, 6]]}).tolist() == [0]
    assert len(edp) == 1
    b = ExperienceBatch.checked({"obs": [], "act": [], "seq": []}, schema)
    assert b.batch_size == 0 and b.tensor("obs").shape == (0, 3) and b.tensor("act").dtype == torch.int64
