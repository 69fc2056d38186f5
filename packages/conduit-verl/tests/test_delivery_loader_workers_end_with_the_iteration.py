"""The delivery's per-rollout DataLoader (verl's ``dataloader_kwargs``) ends its worker processes when the
iteration ends, as verl's own iterator does."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch
from tensordict import TensorDict

pytestmark = pytest.mark.requires("verl")


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
def test_persistent_loader_workers_end_when_the_iteration_ends(mode: str) -> None:
    """With ``num_workers`` and ``persistent_workers`` the loader keeps its worker processes between passes. The
    delivery's loader used to live on in the closed buffer's reference cycle, so every finished iteration (one per
    verl train step) left its worker processes running until a full garbage collection; verl's ends them at once."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    td = TensorDict({"x": torch.arange(8), "y": torch.randn(8, 2)}, batch_size=[8])
    kw = {"shuffle": True, "num_workers": 1, "persistent_workers": True}
    ref = [m["x"].tolist() for m in delivery._verl_iterator()(td, 2, 2, seed=0, dataloader_kwargs=dict(kw))]
    assert multiprocessing.active_children() == []
    gc.disable()  # (a collection would hide the leak)
    try:
        with delivery.forced(mode):  # type: ignore[arg-type]
            for _ in range(2):
                got = [m["x"].tolist() for m in tu.make_iterator(td, 2, 2, seed=0, dataloader_kwargs=dict(kw))]
                assert got == ref
                left = multiprocessing.active_children()
                assert left == [], f"the finished iteration left its loader's workers running: {left}"
    finally:
        gc.enable()
        gc.collect()
