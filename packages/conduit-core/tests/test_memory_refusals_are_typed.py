"""Requests that no machine's memory holds are refused typed, and change nothing.

1. A buffer whose capacity cannot be allocated raised NumPy's ``ValueError: array is too big`` (or its
   ``MemoryError: Unable to allocate ...``) from inside the storage: no Conduit error, nothing saying which
   argument to change.
2. A replay delivery with replacement whose output rows cannot be allocated (``deliver(n)`` with a huge ``n``)
   raised NumPy's ``MemoryError`` after the sampler had drawn: the buffer's next samples were no longer the ones
   it would have drawn, although the delivery returned nothing. Under ``Overlapped`` the chunk buffer kept the size
   it failed to allocate, and every later delivery raised ``KeyError``.

The sizes are far beyond any machine's address space, so the allocations fail at once and nothing is committed.
"""

from __future__ import annotations

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Overlapped, PrioritizedSampler, Replay, Synchronous
from conduit.errors import AllocationError, CapacityError
from conduit.storage.columnar import ColumnarStorage

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))
#: 64 MiB per item: a delivery of 2**22 of them needs 256 TiB
BIG_ITEMS = ExperienceSchema(obs=Field((2**26,), torch.uint8))


@pytest.mark.parametrize("capacity", [2**50, 2**62])
def test_a_capacity_no_memory_holds_is_a_capacity_error_and_the_semantics_stay_usable(capacity: int) -> None:
    semantics = Replay(PrioritizedSampler(), seed=0)
    with pytest.raises(CapacityError, match="lower capacity") as refused:
        ExperienceDataPlane(SCHEMA, capacity=capacity, semantics=semantics)
    assert isinstance(refused.value, AllocationError) and isinstance(refused.value, MemoryError)  # (caught as before)
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=semantics)  # not claimed by the failed buffer
    edp.ingest({"obs": torch.ones(2, 4), "action": torch.zeros(2, dtype=torch.int64)})
    assert len(edp) == 2
    edp.close()


SCHEDULERS = {"synchronous": Synchronous, "overlapped": Overlapped,
              "overlapped-in-call-g_del-2": lambda: Overlapped(overlap=False, g_del=2)}


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
def test_a_delivery_no_memory_holds_is_refused_before_anything_is_drawn(prioritized: bool, scheduler: str) -> None:
    """With an overlapping scheduler the chunk buffer also kept the size it failed to allocate, and every later
    delivery raised ``KeyError: 'obs'``."""
    def build() -> ExperienceDataPlane:
        edp = ExperienceDataPlane(BIG_ITEMS, capacity=2, scheduler=SCHEDULERS[scheduler](),
                                  semantics=Replay(PrioritizedSampler() if prioritized else None, seed=3))
        edp.ingest({"obs": torch.arange(2, dtype=torch.uint8)[:, None].expand(2, 2**26).contiguous()})
        edp.flush()
        return edp

    kwargs = {"beta": 0.4} if prioritized else {}
    edp, twin = build(), build()
    with pytest.raises(CapacityError, match="deliver fewer") as refused:
        edp.deliver(2**22, **kwargs)
    assert isinstance(refused.value, AllocationError) and isinstance(refused.value, MemoryError)
    assert len(edp) == 2
    got, want = edp.deliver(3, **kwargs)[1], twin.deliver(3, **kwargs)[1]
    assert torch.equal(got.handles, want.handles), "the refused delivery advanced the sampler"
    edp.close()
    twin.close()


def test_the_synthetic_loop_still_names_its_own_options_for_a_buffer_no_memory_holds() -> None:
    """The storage's refusal (capacity, ragged_capacity, placement) is turned into the loop's (capacity, obs_dim)."""
    from conduit.demo import run_loop
    from conduit.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="lower capacity or obs_dim"):
        run_loop(obs_dim=4, capacity=2**50, iterations=1, warmup=0, rollout=8, batch=4)


def test_an_allocator_that_raises_a_bare_memory_error_is_refused_typed_too() -> None:
    """A custom allocator (the disk tier's kind of hook) may raise ``MemoryError()`` with no message: quoting its
    first line raised ``IndexError`` instead of the refusal; the refusal names the error's type then."""

    def no_memory(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
        raise MemoryError()

    with pytest.raises(AllocationError, match="lower capacity") as refused:
        ColumnarStorage(SCHEMA, 8, "cpu", allocator=no_memory)
    assert "(MemoryError)" in str(refused.value)
