"""ExperienceBatch.select with a negative-step slice, and Ragged.from_sequences of empty sequences only."""

import pytest
import torch
from conduit import Ragged
from conduit.batch import ExperienceBatch
from conduit.errors import SchemaError


def test_select_with_a_negative_step_slice_gives_the_rows_in_that_order():
    b = ExperienceBatch.from_mapping({"x": torch.arange(5.0), "r": [[1.0], [2.0, 3.0], [], [4.0], [5.0, 6.0]]})
    rev = b.select(slice(None, None, -2))  # torch slices refuse a negative step (an untyped ValueError)
    assert rev.batch_size == 3
    assert rev.tensor("x").tolist() == [4.0, 2.0, 0.0]
    r = rev["r"]
    assert isinstance(r, Ragged)
    assert [r[i].tolist() for i in range(3)] == [[5.0, 6.0], [], [1.0]]


def test_empty_sequences_of_different_element_shapes_are_a_schema_error():
    with pytest.raises(SchemaError, match="element shape"):
        Ragged.from_sequences([torch.zeros(0, 2), torch.zeros(0, 3)])
    assert Ragged.from_sequences([torch.zeros(0, 2), torch.zeros(0, 2)]).values.shape == (0, 2)
