"""A closed delivery's buffer (the rollout's copy and the gather buffers) is freed when the delivery is let go, not at
a later garbage collection: verl builds one per train step."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.requires("verl")


def _shard(n: int) -> TensorDict:
    return TensorDict({"x": torch.randn(n, 4),
                       "j": torch.nested.as_nested_tensor([torch.ones(k) for k in range(n)], layout=torch.jagged)},
                      batch_size=[n])


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_closed_delivery_frees_its_storage_when_let_go(prefetch: bool) -> None:
    """The buffer and its MinibatchPrefetch scheduler refer to each other, so a closed delivery's storage (on a GPU
    host: the rollout page-locked, gather buffers on the device) used to outlive the delivery until a cyclic garbage
    collection, which GPU memory pressure never triggers."""
    from conduit_verl.delivery import MinibatchDelivery

    gc.disable()  # (a collection would hide the leak)
    try:
        d = MinibatchDelivery(num_minibatches=4, epochs=2, seed=0, device="cpu", prefetch=prefetch)
        d.ingest(_shard(8), version=0)
        d.seal()
        assert len(list(d.minibatches())) == 8
        d.close()
        assert d.edp is not None
        storage = weakref.ref(d.edp.storage)
        del d
        assert storage() is None, "the closed delivery's storage outlived it"
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
def test_each_verl_iteration_frees_its_buffer_when_it_ends(mode: str) -> None:
    """verl's train_mini_batch builds one iterator per step; every finished one used to leave its buffer behind."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    gc.disable()
    try:
        with delivery.forced(mode):  # type: ignore[arg-type]
            it = tu.make_iterator(_shard(8), 2, 2, seed=0, dataloader_kwargs={"shuffle": True})
            assert it.gi_frame is not None
            storage = weakref.ref(it.gi_frame.f_locals["delivery"].edp.storage)
            assert len(list(it)) == 8
            del it
        assert storage() is None, "a finished iteration's storage outlived it"
    finally:
        gc.enable()
        gc.collect()
