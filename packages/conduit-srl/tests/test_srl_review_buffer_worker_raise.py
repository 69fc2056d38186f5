"""A buffer worker whose on-policy Conduit buffer raises when full, over SRL's own sample stream, was accepted.

SRL's native ``consume_to`` takes a message off its socket and then calls ``put``; a ``BufferFullError`` leaves its
loop and SRL's worker loop re-raises it, so the worker stops the first time the buffer fills (README: "use 'keep'
there"). Only a claimed ``conduit:<name>`` stream's consumer keeps what a full buffer refuses. The config check
refused ``on_full="wait"`` only; ``"raise"`` over a native stream is refused now, at build time.
"""

from __future__ import annotations

from types import SimpleNamespace

import conduit_srl
import pytest
from conduit import ConfigurationError
from conduit_srl import check_buffer_worker_config

ON_POLICY = {"capacity": 8, "rollout_size": 4, "num_minibatches": 2}


def worker(stream: object, on_full: str, name: str = "conduit:on_policy") -> SimpleNamespace:
    return SimpleNamespace(buffer_name=name, buffer_args=dict(ON_POLICY, on_full=on_full), from_sample_stream=stream)


@pytest.mark.parametrize("stream", ["actors", SimpleNamespace(stream_name="actors", type_=None)])
def test_raise_over_a_native_stream_is_refused(stream: object) -> None:
    with pytest.raises(ConfigurationError, match="on_full='keep'"):
        check_buffer_worker_config(worker(stream, "raise"))
    with pytest.raises(ConfigurationError, match="stops the worker"):
        check_buffer_worker_config(SimpleNamespace(
            buffer_name="conduit", buffer_args=dict(ON_POLICY, semantics="on_policy", on_full="raise"),
            from_sample_stream=stream))


@pytest.mark.parametrize("stream", ["conduit:actors", SimpleNamespace(stream_name="conduit:actors", type_=None)])
def test_raise_over_a_claimed_stream_and_keep_over_a_native_one_are_accepted(stream: object) -> None:
    check_buffer_worker_config(worker(stream, "raise"))
    check_buffer_worker_config(worker("actors", "keep"))
    check_buffer_worker_config(worker(None, "raise"))  # (no stream given: nothing to tell)
    check_buffer_worker_config(SimpleNamespace(buffer_name="conduit", buffer_args={"batch_size": 4},
                                               from_sample_stream="actors"))


def test_a_marked_stream_is_native_when_install_left_streams_alone(srl_layout) -> None:
    layout = srl_layout("distributed")
    conduit_srl.install(streams=False)
    try:
        cfg = layout["api.config"]
        with pytest.raises(ConfigurationError, match="on_full='keep'"):
            cfg.BufferWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY, on_full="raise"),
                             from_sample_stream="conduit:actors")
        cfg.BufferWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY, on_full="keep"),
                         from_sample_stream="conduit:actors")
    finally:
        conduit_srl.uninstall()
    conduit_srl.install()
    try:
        layout["api.config"].BufferWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY, on_full="raise"),
                                          from_sample_stream="conduit:actors")
    finally:
        conduit_srl.uninstall()
