"""The conformance suites over every adapter registered in ``conduit.conformance``.

Each registered factory gets its own test classes, generated here, so a failure names the
adapter. Core registers itself too, so this module always runs something.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conduit.testing import EndpointFactory, FreshnessSuite, ReplaySuite, discover_endpoints

FACTORIES = discover_endpoints()


def _bind(make: Any) -> Any:
    def method(self: object, **kwargs: Any) -> Any:
        return make(**kwargs)
    return method


for _f in FACTORIES:
    if _f.make_replay is not None:
        globals()[f"TestReplay_{_f.name}"] = type(f"TestReplay_{_f.name}", (ReplaySuite,),
                                                  {"make_replay": _bind(_f.make_replay)})
    if _f.make_on_policy is not None:
        globals()[f"TestFreshness_{_f.name}"] = type(f"TestFreshness_{_f.name}", (FreshnessSuite,),
                                                     {"make_on_policy": _bind(_f.make_on_policy)})


def test_core_is_registered() -> None:
    """Discovery works: conduit-core registers its reference endpoints."""
    assert "core" in [f.name for f in FACTORIES], [f.name for f in FACTORIES]


def _replay_scenario(f: EndpointFactory) -> tuple[int, list[int]]:
    assert f.make_replay is not None
    ep = f.make_replay(capacity=12, seed=0)
    try:
        for s in range(0, 30, 6):
            ep.insert(np.arange(s, s + 6))
        return len(ep), sorted(ep.contents().tolist())
    finally:
        ep.close()


def _on_policy_scenario(f: EndpointFactory) -> list[tuple[int, int, list[int]]]:
    assert f.make_on_policy is not None
    ep = f.make_on_policy(num_minibatches=3, num_epochs=2, max_staleness=0, seed=0)
    try:
        out = []
        for v in range(2):
            ep.set_policy_version(v)
            ep.ingest(np.arange(100 * v, 100 * v + 20), version=v)
            ep.end_rollout()
            mbs = ep.consume()
            for epoch in range(2):
                ids = sorted(np.concatenate([m.ids for m in mbs if m.epoch == epoch]).tolist())
                out.append((v, sum(m.epoch == epoch for m in mbs), ids))
        return out
    finally:
        ep.close()


@pytest.mark.parametrize("factory", [f for f in FACTORIES if f.make_replay], ids=lambda f: f.name)
def test_same_replay_contents_as_core(factory: EndpointFactory) -> None:
    """The same insertions leave the same live items (FIFO, capacity) in every adapter as in core."""
    core = next(f for f in FACTORIES if f.name == "core")
    assert _replay_scenario(factory) == _replay_scenario(core)


@pytest.mark.parametrize("factory", [f for f in FACTORIES if f.make_on_policy], ids=lambda f: f.name)
def test_same_on_policy_epochs_as_core(factory: EndpointFactory) -> None:
    """The same rollouts give the same per-epoch contents and minibatch counts in every adapter as in core."""
    core = next(f for f in FACTORIES if f.name == "core")
    assert _on_policy_scenario(factory) == _on_policy_scenario(core)
