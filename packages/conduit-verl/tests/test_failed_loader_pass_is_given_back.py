"""A DataLoader pass that fails while drawing an epoch's order is refused (typed) and given back.

``VerlOnPolicy`` draws each epoch's order from a DataLoader built with the user's ``dataloader_kwargs``, i.e. user code
(a sampler, worker processes) that can raise anything. Only a ``ConfigurationError`` was rolled back: any other error
(here a sampler's RuntimeError, as a crashed loader worker raises one) left the on-policy position advanced past a
minibatch that was never delivered and the loader's generator dead, so every later delivery raised a raw IndexError
and the rollout could never be delivered. Now the failure is a ConfigurationError chained to the loader's error, and
delivering again yields the minibatches a run without the failure yields, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conduit import ConfigurationError
from tensordict import TensorDict
from torch.utils.data import Sampler

pytestmark = pytest.mark.requires("verl")

N = 8


class _Passes(Sampler[int]):
    """Every pass visits the rows in one fixed shuffled order (a seeded loader's passes replay exactly); the pass
    started as call number ``fail`` raises, once."""

    ORDER = torch.randperm(N, generator=torch.Generator().manual_seed(5)).tolist()

    def __init__(self, fail: int | None) -> None:
        self.fail, self.calls = fail, 0

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        self.calls += 1
        if self.fail is not None and self.calls == self.fail + 1:
            self.fail = None
            raise RuntimeError("the loader's worker exited unexpectedly")
        return iter(self.ORDER)


def _run(fail: int | None, seed: int | None, prefetch: bool) -> tuple[list[tuple[int, int, list[float]]], int]:
    from conduit_verl.delivery import MinibatchDelivery

    torch.manual_seed(7)
    d = MinibatchDelivery(num_minibatches=2, epochs=3, seed=seed, device="cpu", prefetch=prefetch,
                          dataloader_kwargs={"sampler": _Passes(fail)})
    d.ingest(TensorDict({"x": torch.arange(float(N))}, batch_size=[N]), version=0)
    d.seal()
    got: list[tuple[int, int, list[float]]] = []
    refused = 0
    while True:
        try:
            td, info = d.next_minibatch()
        except ConfigurationError as e:
            assert isinstance(e.__cause__, RuntimeError) and "exited unexpectedly" in str(e)
            refused += 1
            assert refused == 1, "the retry was refused again"
            continue
        got.append((info.epoch, info.minibatch, td["x"].tolist()))
        if info.last:
            break
    d.close()
    return got, refused


@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
@pytest.mark.parametrize("seed", [0, None], ids=["seeded", "unseeded"])
@pytest.mark.parametrize("fail", [0, 1, 2], ids=["first-epoch", "second-epoch", "third-epoch"])
def test_a_failed_order_draw_is_refused_and_the_retry_delivers_every_minibatch(fail: int, seed: int | None,
                                                                                prefetch: bool) -> None:
    want, _ = _run(None, seed, prefetch)
    rng = torch.get_rng_state()
    got, refused = _run(fail, seed, prefetch)
    assert refused == 1
    assert got == want, "the retried rollout's minibatches differ from a run without the failure"
    assert torch.equal(torch.get_rng_state(), rng), "the refused pass's global RNG draws were not given back"
    assert [(e, k) for e, k, _ in got] == [(e, k) for e in range(3) for k in range(2)]
    assert all([x for _, _, rows in got[2 * e:2 * e + 2] for x in rows] == _Passes.ORDER for e in range(3))
