"""The multi-node plane's lower layers: the packed wire format and the link probes.

The packed format (one byte buffer per torch.distributed transfer) must view every column in
place whatever the dtypes before it; link probes must refuse settings that cannot measure
anything instead of failing late or pricing every transfer as free.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceSchema, Field, Replay
from conduit.batch import ExperienceBatch
from conduit.distributed.server import ShardServer
from conduit.distributed.wire import from_wire, pack_rows, packed_nbytes, ragged_lengths, to_wire, unpack_rows

#: a 1-byte column before a 16-byte one: with 8-byte alignment the complex column starts at byte 8 for n = 8
WIDE = ExperienceSchema(id=Field((), torch.int64), flag=Field((), torch.bool), z=Field((2,), torch.complex128),
                        seq=Field((), torch.complex128, ragged=True))


def _wide_batch(ids: np.ndarray) -> ExperienceBatch:
    g = torch.Generator().manual_seed(int(ids[0]) + 1)
    n = len(ids)
    return ExperienceBatch.checked({
        "id": torch.as_tensor(ids, dtype=torch.int64),
        "flag": torch.as_tensor(ids % 3 == 0),
        "z": torch.randn(n, 2, dtype=torch.complex128, generator=g),
        "seq": [torch.full((int(i) % 3 + 1,), complex(int(i), -int(i)), dtype=torch.complex128) for i in ids]}, WIDE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


@pytest.mark.parametrize("n", [1, 3, 8, 9])
def test_packed_rows_view_complex128_after_a_narrow_column(n):
    """Every column of a packed buffer can be viewed as its dtype: complex128 needs a 16-byte offset."""
    b = _wide_batch(np.arange(100, 100 + n))
    lengths = ragged_lengths(b, WIDE)
    payload = pack_rows(b, WIDE)
    assert payload.numel() == packed_nbytes(n, lengths, WIDE)
    got = unpack_rows(payload.clone(), n, lengths, WIDE)
    for name in ("id", "flag", "z"):
        assert torch.equal(_bits(got[name]), _bits(b[name])), name
    assert torch.equal(got["seq"].lengths, b["seq"].lengths)
    assert torch.equal(_bits(got["seq"].values), _bits(b["seq"].values))


def _at_8_mod_16(a: np.ndarray, keep: list) -> np.ndarray:
    """``a``'s bytes, read-only, at an address that is 8 mod 16 (where Ray's object store may place a column)."""
    raw = np.zeros(a.nbytes + 64, dtype=np.uint8)
    keep.append(raw)
    at = (-raw.ctypes.data) % 16 + 8
    raw[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
    out = raw[at:at + a.nbytes].view(a.dtype).reshape(a.shape)
    out.flags.writeable = False
    return out


def test_wire_columns_at_an_8_byte_boundary_are_read_aligned_and_stored():
    """A complex128 column Ray hands over at an 8-byte (not 16-byte) address: from_wire gives tensors torch can
    read (an append of such a ragged column used to kill the shard server with SIGSEGV), with the same values."""
    b = _wide_batch(np.arange(8))
    keep: list = []
    cols = to_wire(b, WIDE)
    cols["z"] = _at_8_mod_16(cols["z"], keep)
    cols["seq"] = (_at_8_mod_16(cols["seq"][0], keep), cols["seq"][1])
    assert cols["z"].ctypes.data % 16 == 8 and cols["seq"][0].ctypes.data % 16 == 8
    got = from_wire(cols, WIDE)
    for t in (got["z"], got["seq"].values):
        assert t.data_ptr() % t.element_size() == 0
    assert torch.equal(_bits(got["z"]), _bits(b["z"]))
    assert torch.equal(_bits(got["seq"].values), _bits(b["seq"].values))
    server = ShardServer()
    server.open("buf", WIDE.to_dict(), 16, 64)
    assert server.append("buf", cols, 2, 5, 0) == (0, 5, 5)
    back = from_wire(server.gather("buf", np.arange(5)), WIDE)
    assert back.tensor("id").tolist() == [2, 3, 4, 5, 6]
    assert torch.equal(_bits(back["z"]), _bits(b["z"][2:7]))
    assert torch.equal(_bits(back["seq"].values), _bits(b.select(slice(2, 7))["seq"].values))


def test_torch_transport_delivers_complex128_without_retiring_the_group(cluster, servers):
    """A schema with complex128 after a bool column is stored (its ingestion used to crash every shard server it
    tried) and goes over torch.distributed bit for bit, the group staying in use (a receive that could not view
    its bytes used to retire the group for every buffer)."""
    from conduit.distributed import DistributedDataPlane

    nodes = [cluster.head, cluster.workers[0]]
    with DistributedDataPlane(WIDE, capacity=64, semantics=Replay(seed=3), servers=servers, health_period=None,
                              transport="torch") as p:
        ref: dict[int, tuple] = {}
        for i, node in enumerate(nodes):
            b = _wide_batch(np.arange(20 * i, 20 * i + 8))
            p.ingest(b, node=node)
            seq = b["seq"]
            for k in range(8):
                ref[20 * i + k] = (b["z"][k], seq.values[seq.offsets[k]:seq.offsets[k] + seq.lengths[k]])
        got, _ = p.deliver(16)
        assert p.transports == ["torch", "torch"], "the torch group was retired by a delivery"
        assert servers.torch_group(create=False).broken is None
        seq = got["seq"]
        for k, i in enumerate(got.tensor("id").tolist()):
            assert bool(got["flag"][k]) == (i % 3 == 0)
            assert torch.equal(_bits(got["z"][k]), _bits(ref[i][0]))
            v = seq.values[seq.offsets[k]:seq.offsets[k] + seq.lengths[k]]
            assert torch.equal(_bits(v), _bits(ref[i][1]))


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"sizes": ()}, {"sizes": (0,)}, {"sizes": (-4,)},
                                    {"sizes": (1.5,)}, {"timeout": 0.0}, {"sizes": 1 << 20}, {"sizes": None}])
def test_link_probes_refuse_settings_that_measure_nothing(cluster, servers, kwargs):
    """Object-store probes: a typed error before anything is sent; the cached profile is kept."""
    before = servers.links()
    with pytest.raises(ConfigurationError):
        servers.links(refresh=True, **kwargs)
    assert servers.links() is before


@pytest.mark.parametrize("kwargs", [{"repeats": 0}, {"sizes": ()}, {"sizes": (0,)}, {"sizes": 1 << 20}])
def test_torch_link_probes_refuse_settings_that_measure_nothing(cluster, servers, kwargs):
    """torch.distributed probes: the same typed error, and the group stays usable."""
    g = servers.torch_group()
    with pytest.raises(ConfigurationError):
        g.measure(**kwargs)
    assert g.broken is None
    assert g.measure(sizes=(1 << 12,), repeats=1).links


def test_links_asked_with_other_probe_settings_are_measured_with_them(cluster, servers):
    """``servers.links(sizes=..., repeats=...)`` returned the profile cached by an earlier measurement (a buffer's,
    with the default probes), silently: the user asked for other probe sizes and more repeats and got neither.
    Other settings measure again; the same settings (or none) reuse the cache."""
    first = servers.links(refresh=True, sizes=(1 << 12,), repeats=1)
    assert servers.links() is first and servers.links(sizes=[1 << 12], repeats=1) is first
    again = servers.links(sizes=(1 << 12, 1 << 16), repeats=2)
    assert again is not first
    assert again.sizes == (1 << 12, 1 << 16) and again.repeats == 2
    assert servers.links() is again
