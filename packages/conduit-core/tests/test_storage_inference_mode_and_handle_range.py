"""The storage tiers (host ring, disk, sharded over CPU "devices"): inference mode, out-of-range handles.

Bugs found:
  * a buffer built under ``torch.inference_mode()`` (an actor's setup often runs there) had inference tensors for
    columns, pools and ragged bookkeeping: every append outside inference mode raised torch's RuntimeError
    ("Inplace update to inference tensor outside InferenceMode"), untyped;
  * a delivery drawn under ``torch.inference_mode()`` (an evaluation loop) made the buffer's reused delivery buffers
    inference tensors: every later delivery of no more rows outside inference mode raised the same RuntimeError;
  * a checkpoint whose handles lie beyond int64 (a damaged one) was loaded, and the buffer then failed on every
    delivery and checkpoint (ValueError "Overflow when unpacking long long") instead of being refused unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conduit import ConfigurationError, ExperienceBatch, ExperienceDataPlane, ExperienceSchema, Field, Overlapped
from conduit.batch import Ragged
from conduit.placement import DiskPlacement, HostPlacement, Placement, ShardedPlacement

# a bfloat16 field (no NumPy view: rows copied by torch) and a ragged field (pool and bookkeeping written in place)
SCHEMA = ExperienceSchema(id=Field((), torch.int64), obs=Field((2,), torch.float32), h=Field((), torch.bfloat16),
                          tok=Field((), torch.int64, ragged=True))
TIERS = ["host", "disk", "sharded2", "sharded3"]


def placement(tier: str, tmp_path: Path) -> Placement:
    if tier == "host":
        return HostPlacement()
    if tier == "disk":
        return DiskPlacement(directory=tmp_path)
    return ShardedPlacement(["cpu"] * int(tier.removeprefix("sharded")))


def items(ids: list[int]) -> dict[str, Any]:
    """Item ``i``: obs ``(i, -i)``, h ``i``, and ``i % 4`` tokens ``10 * i + j`` (zero-length ones included)."""
    t = torch.tensor(ids, dtype=torch.int64)
    return {"id": t, "obs": torch.stack([t.float(), -t.float()], 1), "h": t.bfloat16(),
            "tok": [torch.arange(i % 4, dtype=torch.int64) + 10 * i for i in ids]}


def check(b: ExperienceBatch) -> list[int]:
    """The ids of ``b``, after checking every field of every item against :func:`items`."""
    ids = b.tensor("id").tolist()
    assert b.tensor("obs").tolist() == [[float(i), float(-i)] for i in ids]
    assert b.tensor("h").float().tolist() == [float(i) for i in ids]
    tok = b["tok"]
    assert isinstance(tok, Ragged)
    for j, i in enumerate(ids):
        assert tok[j].tolist() == [10 * i + k for k in range(i % 4)], f"tokens of item {i} corrupted"
    return ids


def live_ids(edp: ExperienceDataPlane) -> list[int]:
    ids: list[int] = edp.state_dict()["storage"]["data"]["id"].tolist()
    return ids


@pytest.mark.parametrize("tier", TIERS)
def test_a_buffer_built_under_inference_mode_stores_and_delivers_outside_it(tier: str, tmp_path: Path) -> None:
    """Built under ``torch.inference_mode()``, the buffer's columns were inference tensors, which torch refuses to
    write in place outside inference mode: the first ingest raised an untyped RuntimeError."""
    with torch.inference_mode():
        edp = ExperienceDataPlane(SCHEMA, capacity=5, ragged_capacity=12, placement=placement(tier, tmp_path))
    edp.ingest(items([0, 1, 2]))
    edp.ingest(items([3, 4, 5, 6]))  # wraps the ring at its last slot, evicts 0 and 1
    assert live_ids(edp) == [2, 3, 4, 5, 6]
    b, _ = edp.deliver(4)
    assert set(check(b)) <= {2, 3, 4, 5, 6}
    state = edp.state_dict()
    edp.ingest(items([7]))
    edp.load_state_dict(state)
    assert live_ids(edp) == [2, 3, 4, 5, 6]
    edp.close()


@pytest.mark.parametrize("tier", TIERS)
def test_a_delivery_under_inference_mode_leaves_later_deliveries_working(tier: str, tmp_path: Path) -> None:
    """A delivery drawn under ``torch.inference_mode()`` allocated the buffer's reused delivery buffers there: every
    later delivery of no more rows, outside inference mode, raised an untyped RuntimeError."""
    edp = ExperienceDataPlane(SCHEMA, capacity=6, ragged_capacity=16, placement=placement(tier, tmp_path))
    with torch.inference_mode():
        edp.ingest(items([0, 1, 2, 3]))
        b, _ = edp.deliver(4)
        assert set(check(b)) <= {0, 1, 2, 3}
    edp.ingest(items([4, 5, 6]))
    for n in (4, 3, 1):
        b, _ = edp.deliver(n)
        assert b.batch_size == n and set(check(b)) <= {1, 2, 3, 4, 5, 6}
    assert live_ids(edp) == [1, 2, 3, 4, 5, 6]
    edp.close()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("oldest", [2**63 - 2, 2**63, 2**64 + 3])
def test_a_checkpoint_with_handles_beyond_int64_is_refused_and_changes_nothing(tier: str, oldest: int,
                                                                               tmp_path: Path) -> None:
    """Handles are int64: a (damaged) checkpoint whose handles lie beyond that was loaded, and every later delivery
    and checkpoint of the buffer failed with an untyped ValueError (overflow)."""
    edp = ExperienceDataPlane(SCHEMA, capacity=4, ragged_capacity=12, placement=placement(tier, tmp_path))
    edp.ingest(items([0, 1, 2]))
    state = edp.state_dict()
    state["storage"]["oldest"], state["storage"]["next"] = oldest, oldest + 3
    with pytest.raises(ConfigurationError, match="int64"):
        edp.load_state_dict(state)
    assert live_ids(edp) == [0, 1, 2]
    b, _ = edp.deliver(3)
    assert set(check(b)) <= {0, 1, 2}
    # the largest handles that fit are loaded and go on working
    state["storage"]["oldest"], state["storage"]["next"] = 2**63 - 1 - 3, 2**63 - 1
    edp.load_state_dict(state)
    assert live_ids(edp) == [0, 1, 2] and edp.storage.next_handle == 2**63 - 1
    b, _ = edp.deliver(3)
    assert set(check(b)) <= {0, 1, 2}
    edp.close()


@pytest.mark.parametrize("g", [1, 2])
def test_a_prefetched_delivery_under_inference_mode_leaves_later_deliveries_working(g: int) -> None:
    """The same with ``Overlapped``: its delivery buffers and its ingestion staging, allocated by a call under
    ``torch.inference_mode()``, were inference tensors, and later deliveries outside the mode failed."""
    edp = ExperienceDataPlane(SCHEMA, capacity=6, ragged_capacity=16, scheduler=Overlapped(g_ing=g, g_del=g))
    with torch.inference_mode():
        edp.ingest(items([0, 1]))
        edp.ingest(items([2, 3]))
        edp.flush()
        b, _ = edp.deliver(4)
        assert set(check(b)) <= {0, 1, 2, 3}
    edp.ingest(items([4, 5]))
    edp.ingest(items([6]))
    edp.flush()
    for n in (4, 4, 3, 1):
        b, _ = edp.deliver(n)
        assert b.batch_size == n and set(check(b)) <= {1, 2, 3, 4, 5, 6}
    assert live_ids(edp) == [1, 2, 3, 4, 5, 6]
    edp.close()
