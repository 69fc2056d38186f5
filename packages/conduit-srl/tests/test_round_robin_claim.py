"""Review: claiming a NAME_ROUND_ROBIN stream keeps SRL's placement unless a route is asked for.

SRL's round-robin producer sends each post to the next trainer (starting at the actor's rank modulo the number of
trainers). Claimed with the default policy, Conduit sent every sample of an actor to trainer ``rank % n``: the
other trainers of that actor got nothing, a silent change of where experience goes.
"""

from __future__ import annotations

import conduit_srl
import pytest
from conduit import ConfigurationError
from conduit_srl import ConduitSampleProducer, StreamPolicy
from conduit_srl.testing import make_sample


def _producer_sent(srl_layout, stream_type: str, **install: object) -> list[int]:
    layout = srl_layout("distributed")
    ss = layout["distributed.system.sample_stream"]
    cfg = layout["api.config"]
    conduit_srl.install(**install)  # type: ignore[arg-type]
    trainers = [ss.make_consumer("conduit:traj", cfg.WorkerInformation(worker_index=i)) for i in range(2)]
    spec = cfg.SampleStream(type_=getattr(cfg.SampleStream.Type, stream_type), stream_name="conduit:traj")
    producer = ss.make_producer(spec, cfg.WorkerInformation(worker_index=1))
    try:
        assert isinstance(producer, ConduitSampleProducer) and len(producer.targets) == 2
        for i in range(4):
            producer.post(make_sample([i]))
            producer.flush()
        return list(producer.sent)
    finally:
        producer.close()
        for t in trainers:
            t.close()


def test_a_claimed_round_robin_stream_still_alternates_trainers(srl_layout) -> None:
    assert _producer_sent(srl_layout, "NAME_ROUND_ROBIN") == [2, 2]


def test_a_claimed_name_stream_still_sends_to_its_rank(srl_layout) -> None:
    assert _producer_sent(srl_layout, "NAME") == [0, 4]


def test_an_explicit_route_overrides_the_stream_type(srl_layout) -> None:
    assert _producer_sent(srl_layout, "NAME_ROUND_ROBIN", stream_policy=StreamPolicy(route="rank")) == [0, 4]


def test_route_none_is_the_stream_types_rule_and_other_values_are_refused() -> None:
    assert StreamPolicy().route is None
    with pytest.raises(ConfigurationError):
        StreamPolicy(route="random")
