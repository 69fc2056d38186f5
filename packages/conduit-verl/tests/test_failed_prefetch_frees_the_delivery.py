"""A delivery whose prefetch failed is freed by reference counting, and its prefetch thread ends.

``MinibatchPrefetch.deliver`` raised a failed staged job's error while its frame still held the job: the job holds the
error, whose traceback holds that frame, a cycle only the cyclic garbage collector frees. So after one failed prefetch
(here: the user's DataLoader sampler failing to draw the second epoch's order, on the prefetch thread) the scheduler,
and with it the buffer of a delivery that was let go unclosed, and the ``conduit-prefetch`` thread (stopped when the
scheduler is collected) lived on until a collection happened to run. The test runs with that collector disabled.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conduit.testing.lifecycle import holds_within, live_workers
from tensordict import TensorDict
from torch.utils.data import Sampler

pytestmark = pytest.mark.requires("verl")


class _OnePass(Sampler[int]):
    """Visits the rows once in order; a second pass (the second epoch's order) fails."""

    def __init__(self, n: int) -> None:
        self.n, self.passes = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        if self.passes > 1:
            raise RuntimeError("this sampler draws one pass")
        return iter(range(self.n))




def _fail_one_prefetch(close: bool) -> list[weakref.ref[Any]]:
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=2, epochs=2, seed=0, device="cpu", prefetch=True,
                          dataloader_kwargs={"sampler": _OnePass(8)})
    d.ingest(TensorDict({"x": torch.arange(32.0).reshape(8, 4)}, batch_size=[8]), version=0)
    d.seal()
    d.next_minibatch()  # stages the epoch's last minibatch on the prefetch thread, which draws the next epoch's order
    try:
        d.next_minibatch()
    except RuntimeError as e:
        assert "one pass" in str(e)
    else:
        raise AssertionError("the failed prefetch's error was not raised")
    assert d.scheduler.staged >= 1 and d.edp is not None
    refs = [weakref.ref(d), weakref.ref(d.scheduler), weakref.ref(d.edp.storage)]
    if close:
        d.close()
    return refs


@pytest.fixture(autouse=True)
def _no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.parametrize("close", [False, True], ids=["dropped", "closed"])
def test_a_delivery_whose_prefetch_failed_is_freed_without_gc(close: bool) -> None:
    before = live_workers()
    refs = _fail_one_prefetch(close)
    assert holds_within(lambda: refs[0]() is None), "the delivery is alive without a garbage collection"
    assert holds_within(lambda: refs[1]() is None), "its scheduler is alive without a collection (the failed job)"
    assert refs[2]() is None, "its buffer's storage is alive"
    assert holds_within(lambda: live_workers() <= before), f"prefetch threads still run: {live_workers() - before}"
