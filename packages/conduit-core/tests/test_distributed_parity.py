"""DistributedDataPlane keeps the contracts core's ExperienceDataPlane got stricter on.

A closed buffer takes no more work; misspelt delivery options and options to an on-policy delivery are
typed refusals; roles of the wrong kind and unknown devices are refused typed at construction, before
any partition is opened; an on-policy selection is handed over exactly once, also when reading it fails.

The tests use the in-process harness of ``test_distributed_bookkeeping`` (real shard server bodies
called through a stand-in for Ray's remote calls), so they need no cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import CapacityError, ConfigurationError, OnPolicy, PrioritizedSampler, Replay
from conduit.distributed.errors import RemoteTimeoutError
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed_bookkeeping import _Ref, _plane, _servers, fake_ray  # noqa: E402, F401, I001

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("fake_ray")]


def _on_policy(**kw: Any) -> Any:
    return _plane(["a", "b"], capacity=8, semantics=OnPolicy(num_minibatches=2, num_epochs=1), **kw)


# -- 1. a closed buffer takes no more work ------------------------------------------------------------
def test_a_closed_on_policy_plane_refuses_seal_versions_and_hand_overs_and_keeps_its_state():
    p = _on_policy()
    p.ingest(id_batch(np.arange(4)), version=0)
    p.seal()
    p.ingest(id_batch(np.arange(4, 6)), version=0)  # an open rollout, not sealed
    sel = p.select_now([None])[0]
    sem = p.semantics
    before = sem.state_dict()
    p.close()
    p.close()  # idempotent
    assert p.closed
    calls = {"seal": p.seal, "set_policy_version": lambda: p.set_policy_version(3),
             "release_now": lambda: p.release_now(sel),
             "ingest": lambda: p.ingest(id_batch(np.arange(6, 8)), version=0),
             "ingest without a version": lambda: p.ingest(id_batch(np.arange(6, 8))),
             "deliver": p.deliver, "deliver_now": p.deliver_now, "select_now": lambda: p.select_now([None]),
             "gather_now": lambda: p.gather_now([sel]), "prepare_now": lambda: p.prepare_now([None]),
             "ingest_now": lambda: p.ingest_now(_plain(np.arange(6, 8)), version=0)}
    for name, call in calls.items():
        with pytest.raises(ConfigurationError, match="closed") as info:
            call()
        assert "new" in str(info.value), f"{name}: the refusal should say what to do: {info.value}"
    after = sem.state_dict()
    assert after["open"] == before["open"] and after["policy_version"] == before["policy_version"], (
        "a refused call after close() changed the on-policy state (sealed the open rollout or set the version)")
    assert after["outstanding"] == before["outstanding"], "release_now after close() handed a selection over"


def test_a_closed_replay_plane_refuses_priorities_and_loads_and_says_why_state_dict_cannot_read():
    p = _plane(["a", "b"], capacity=8, semantics=Replay(sampler=PrioritizedSampler()))
    h = p.ingest(id_batch(np.arange(4)))
    state = p.state_dict()
    p.close()
    for call in (lambda: p.update_priorities(h, torch.ones(4)), lambda: p.load_state_dict(state),
                 lambda: p.deliver(2)):
        with pytest.raises(ConfigurationError, match="closed"):
            call()
    # unlike a single-node buffer, a closed distributed one has dropped its shards' partitions: the refusal
    # must say to take the checkpoint before close()
    with pytest.raises(ConfigurationError, match=r"state_dict\(\) taken before close\(\)"):
        p.state_dict()


def _plain(ids: np.ndarray) -> Any:
    from conduit import ExperienceBatch
    return ExperienceBatch.checked(id_batch(ids), ID_SCHEMA)


# -- 2. delivery options --------------------------------------------------------------------------------
def test_misspelt_and_on_policy_delivery_options_are_typed_refusals_that_change_nothing():
    r = _plane(["a", "b"], capacity=8)
    r.ingest(id_batch(np.arange(4)))
    with pytest.raises(ConfigurationError, match="betta"):
        r.deliver(4, betta=0.4)
    with pytest.raises(ConfigurationError, match="betta"):
        r.prepare_now([4], betta=0.4)
    assert r.deliver(4)[0].batch_size == 4
    p = _on_policy()
    p.ingest(id_batch(np.arange(4)), version=0)
    p.seal()
    for kw in ({"replace": False}, {"beta": 0.4}):
        with pytest.raises(ConfigurationError, match="no options"):
            p.deliver(**kw)
    _, info = p.deliver()
    assert (info.epoch, info.minibatch) == (0, 0), "a refused on-policy delivery consumed a minibatch"


# -- 3. roles of the wrong kind, unknown devices --------------------------------------------------------
@pytest.mark.parametrize("kw", [{"semantics": "replay"}, {"scheduler": "sync"}, {"device": "no-such-device"},
                                {"device": 3.5}])
def test_roles_of_the_wrong_kind_and_unknown_devices_are_refused_typed_before_any_partition_opens(kw):
    from conduit.distributed.plane import DistributedDataPlane

    group = _servers(["a", "b"])
    with pytest.raises(ConfigurationError, match=next(iter(kw))):
        DistributedDataPlane(ID_SCHEMA, capacity=8, servers=group, learner_node="a", measure=False,
                             health_period=None, transport="object_store", **kw)
    assert [len(info.actor.server._parts) for info in group.servers] == [0, 0], "a refused build left partitions"


# -- 4. on-policy: every real selection handed over exactly once ----------------------------------------
def test_an_on_policy_delivery_whose_read_times_out_still_hands_its_selection_over():
    p = _plane(["a", "b"], capacity=8, semantics=OnPolicy(num_minibatches=1, num_epochs=1), timeout=1.0)
    p.ingest(id_batch(np.arange(4)), version=0, node="a")
    p.seal()
    actor = p.servers[0].actor
    real = actor.call

    def stuck(name: str, args: tuple[Any, ...]) -> Any:
        if name == "gather":  # the shard answers health checks, but its read does not come back in time
            return _Ref(error=TimeoutError("no answer"), lost=True)
        return real(name, args)

    actor.call = stuck
    try:
        with pytest.raises(RemoteTimeoutError):
            p.deliver()
    finally:
        actor.call = real
    assert p.semantics.state_dict()["outstanding"] == [], "the failed delivery's selection stays outstanding"
    # the rollout was consumed by that delivery: its storage is free again for the next rollouts
    for first in (4, 8):
        try:
            p.ingest(id_batch(np.arange(first, first + 4)), version=0)
        except CapacityError as e:
            pytest.fail(f"storage of the rollout whose delivery failed was never freed: {e}")
        p.seal()
        batch, info = p.deliver()
        assert sorted(check_payload(batch).tolist()) == list(range(first, first + 4)) and info.last


def test_on_policy_minibatches_skipped_for_lost_items_are_each_handed_over_once():
    p = _plane(["a", "b"], capacity=8, semantics=OnPolicy(num_minibatches=2, num_epochs=1))
    p.ingest(id_batch(np.arange(4)), version=0, node="b")
    p.seal()
    assert p.index.live_handles().tolist() == [0, 1, 2, 3]
    p.servers[1].actor.dead = True  # every item of the rollout is on shard 1: both minibatches are all lost
    batch, info = p.deliver()
    assert batch.batch_size == 0 and info.last, "the rollout's last minibatch should end it, empty"
    assert p.semantics.state_dict()["outstanding"] == [], "a skipped minibatch's selection stays outstanding"
    assert p.index.oldest == 4, "the finished rollout's storage was not released"
    p.ingest(id_batch(np.arange(4, 12)), version=0, node="a")  # the whole capacity: only possible once released
    p.seal()
    seen = []
    for _ in range(2):
        b, _ = p.deliver()
        seen += check_payload(b).tolist()
    assert sorted(seen) == list(range(4, 12))
