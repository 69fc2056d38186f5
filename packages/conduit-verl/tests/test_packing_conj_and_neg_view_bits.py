"""``pack_column`` packs a tensor with a conjugate or negative view bit by value, as its docstring says.

A dense column (or a contiguous jagged one) kept the view bit: its packed values were a lazy view, which
``FieldStore.put`` refused with torch's raw ``RuntimeError`` (``view`` to the stored dtype is not supported with the
bit set) instead of storing the values. Only the wire format (``to_wire``) resolved the bits.
"""

from __future__ import annotations

import pytest
import torch
from conduit_verl.columns import FieldStore, PoolLadder
from conduit_verl.packing import from_wire, pack_column, to_wire, unpack_column


def _columns() -> dict[str, torch.Tensor]:
    z = torch.complex(torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 12.0).reshape(3, 2))
    return {"conj": z.conj(), "neg": z.conj().imag,
            "jagged_neg": torch.nested.nested_tensor_from_jagged(z.conj().imag.reshape(-1),
                                                                offsets=torch.tensor([0, 1, 4, 6]))}


@pytest.mark.parametrize("name", ["conj", "neg", "jagged_neg"])
def test_view_bits_are_packed_by_value_and_stored_exactly(name: str) -> None:
    col = _columns()[name]
    packed = pack_column(col, 3, name)
    assert not packed.values.is_conj() and not packed.values.is_neg(), "packed values kept a lazy view bit"
    want = [s.resolve_conj().resolve_neg() for s in (col.unbind() if col.is_nested else col)]
    fs = FieldStore(name, packed.dtype, int(packed.shapes.shape[1]), PoolLadder(4, 16))
    fs.put([0, 1, 2], packed)
    for back in (unpack_column(fs.get([0, 1, 2])), unpack_column(from_wire(to_wire(packed)))):
        got = list(back.unbind()) if back.is_nested else list(back)
        assert len(got) == 3 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (got, want)
