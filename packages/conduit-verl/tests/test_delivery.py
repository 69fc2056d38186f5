"""Conduit's delivery of verl minibatches: same rows as verl's iterator, prefetch, gating, fallbacks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conduit import ConfigurationError
from tensordict import NonTensorData, NonTensorStack, TensorDict

pytestmark = pytest.mark.requires("verl")


def shard(n: int = 12) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 100, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(n)]
    return TensorDict({
        "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
        "loss_mask": torch.nested.as_nested_tensor([torch.ones_like(i) for i in ids], layout=torch.jagged),
        "advantages": torch.randn(n, generator=g),
        "rows": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2),
        "uid": NonTensorStack(*[f"u{i}" for i in range(n)]),
        "temperature": NonTensorData(0.7),
    }, batch_size=[n])


def verl_iterator() -> Any:
    from conduit_verl import delivery

    return delivery._verl_iterator()


def as_lists(td: TensorDict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in td.keys():
        v = td.get(k)
        if isinstance(v, torch.Tensor) and v.is_nested:
            out[k] = [r.tolist() for r in v.unbind()]
        elif isinstance(v, torch.Tensor):
            out[k] = v.tolist()
        elif isinstance(v, NonTensorData):
            out[k] = v.data
        else:
            out[k] = list(v.tolist())
    return out


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_minibatches_as_verl(mode: str, shuffle: bool) -> None:
    """Row for row, column for column, epoch for epoch: Conduit's minibatches are verl's."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    td = shard()
    kw = {"shuffle": shuffle}
    ref = [as_lists(m) for m in verl_iterator()(td, 3, 2, seed=11, dataloader_kwargs=kw)]
    with delivery.forced(mode):  # type: ignore[arg-type]
        got = [as_lists(m) for m in tu.make_iterator(td, 3, 2, seed=11, dataloader_kwargs=kw)]
    assert got == ref and len(got) == 8


def test_padded_view_of_a_jagged_minibatch_is_its_longest_row() -> None:
    """Delivered jagged columns know their row lengths (TensorDict.to_padded_tensor pads to the longest row)."""
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=2, epochs=1, seed=0, device="cpu")
    td = shard()
    d.ingest(td, version=0)
    d.seal()
    for m, _ in d.minibatches():
        longest = max(len(r) for r in m["input_ids"].unbind())
        assert m.select("input_ids").to_padded_tensor()["input_ids"].shape[1] == longest


def test_unsupported_shard_falls_back_to_verl() -> None:
    """A shard Conduit cannot pack (a nested sub-TensorDict) goes to verl's iterator, unchanged."""
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    td = TensorDict({"x": torch.arange(4.0), "sub": TensorDict({"y": torch.ones(4)}, batch_size=[4])},
                    batch_size=[4])
    with delivery.forced("prefetch"):
        got = [m["x"].tolist() for m in tu.make_iterator(td, 2, 1, seed=0)]
    assert got == [[0.0, 1.0], [2.0, 3.0]]


def test_indivisible_shard_and_bad_mode_are_typed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import verl.utils.tensordict_utils as tu
    from conduit_verl import delivery

    delivery.install()
    with delivery.forced("sync"), pytest.raises(ConfigurationError):
        tu.make_iterator(shard(10), 3, 1)
    monkeypatch.setenv(delivery.ENV, "sometimes")
    with pytest.raises(ConfigurationError):
        delivery.delivery_mode()


def test_version_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook refuses a verl outside 0.9.x with a clear error."""
    from conduit_verl import compat, delivery

    monkeypatch.setattr(compat, "verl_version", lambda: "0.10.0")
    with pytest.raises(compat.UnsupportedVerlError, match="0.9.x"):
        delivery.install()
    monkeypatch.setattr(compat, "verl_version", lambda: None)
    with pytest.raises(compat.UnsupportedVerlError, match="not installed"):
        compat.require_supported_verl()


def test_set_policy_version_mid_rollout_is_refused() -> None:
    from conduit_verl.delivery import MinibatchDelivery

    d = MinibatchDelivery(num_minibatches=3, epochs=1, seed=0, device="cpu")
    d.ingest(shard(), version=0)
    d.seal()
    d.next_minibatch()
    with pytest.raises(ConfigurationError):
        d.set_policy_version(1)
    while not d.next_minibatch()[1].last:
        pass
    d.set_policy_version(1)


@pytest.mark.gpu
def test_prefetch_on_cuda_matches_verl_on_cpu() -> None:
    """On a GPU: page-locked staging, side-stream copies; the minibatches equal verl's (moved to the device)."""
    from conduit_verl.delivery import MinibatchDelivery

    td = shard()
    ref = [as_lists(m) for m in verl_iterator()(td, 3, 2, seed=5, dataloader_kwargs={"shuffle": True})]
    d = MinibatchDelivery(num_minibatches=4, epochs=2, seed=5, dataloader_kwargs={"shuffle": True}, device="cuda")
    d.ingest(td, version=0)
    d.seal()
    got = []
    for m, _ in d.minibatches():
        assert m["input_ids"].is_cuda and m["advantages"].is_cuda
        got.append(as_lists(m.cpu()))
    assert got == ref and d.scheduler.staged == 7


@pytest.mark.parametrize("mode", ["sync", "prefetch"])
def test_zero_epochs_yields_nothing_like_verl(mode: str) -> None:
    """verl's iterator yields no minibatch for epochs=0; the drop-in must not raise instead."""
    from conduit_verl import delivery

    delivery.install()
    td = TensorDict({"x": torch.arange(8, dtype=torch.float32)}, batch_size=[8])
    ref = list(delivery._verl_iterator()(td, 4, 0, seed=1))
    with delivery.forced(mode):  # type: ignore[arg-type]
        got = list(delivery.conduit_make_iterator(td, 4, 0, seed=1))
    assert ref == [] and got == []
