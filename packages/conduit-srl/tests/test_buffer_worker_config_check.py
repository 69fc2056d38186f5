"""A buffer-worker configuration whose on-policy Conduit buffer would wait for room is refused when it is built.

SRL's buffer worker puts (inside ``consume_to``) and gets on one thread. With ``on_full="wait"`` (the default) a put
that does not fit waits for a ``get()`` that only that thread could make: the worker hangs once the buffer fills.
``install()`` checked trainer configurations only, so such a buffer-worker configuration was accepted silently.
"""

from __future__ import annotations

import conduit_srl
import pytest
from conduit import ConfigurationError
from conduit_srl import check_buffer_worker_config
from conduit_srl.testing.driver import run_buffer_worker
from conduit_srl.testing.records import make_sample

ON_POLICY = {"capacity": 8, "rollout_size": 4, "num_minibatches": 2}


@pytest.mark.parametrize("flavour", ["distributed", "local"])
def test_buffer_worker_with_a_waiting_on_policy_buffer_is_refused_when_built(srl_layout, flavour: str) -> None:
    layout = srl_layout(flavour)
    inst = conduit_srl.install()
    cfg = layout["api.config"]
    with pytest.raises(ConfigurationError, match="on_full='keep'"):
        cfg.BufferWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY))
    assert "api.config.BufferWorker.__init__ (config check)" in inst.patched
    with pytest.raises(ConfigurationError, match="on_full='keep'"):
        cfg.BufferWorker(buffer_name="conduit", buffer_args=dict(ON_POLICY, semantics="on_policy", on_full="wait"))
    # what works on one thread, other semantics, and SRL's own buffers are built as before
    cfg.BufferWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY, on_full="keep"))
    cfg.BufferWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY, on_full="raise"))
    cfg.BufferWorker(buffer_name="conduit", buffer_args={"batch_size": 4})
    cfg.BufferWorker(buffer_name="priority_queue")
    # a trainer puts and gets on two threads: waiting is right there
    cfg.TrainerWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY))
    conduit_srl.uninstall()
    cfg.BufferWorker(buffer_name="conduit:on_policy", buffer_args=dict(ON_POLICY))  # hook gone


def test_check_buffer_worker_config_needs_no_srl() -> None:
    class Cfg:
        buffer_name = "conduit:on_policy"
        buffer_args = dict(ON_POLICY)

    with pytest.raises(ConfigurationError, match="hang"):
        check_buffer_worker_config(Cfg())
    Cfg.buffer_args = dict(ON_POLICY, on_full="keep")
    check_buffer_worker_config(Cfg())


def test_the_refused_configuration_does_hang_a_one_thread_buffer_worker() -> None:
    """What the check prevents: the driver's buffer worker (SRL's one-thread poll loop) never finishes."""
    upstream = [make_sample([i], version=0) for i in range(24)]
    buffer = conduit_srl.ConduitBuffer(semantics="on_policy", **ON_POLICY)
    downstream = conduit_srl.ConduitBuffer(batch_size=1, capacity=64)
    try:
        with pytest.raises(TimeoutError, match="buffer worker"):
            run_buffer_worker(upstream, buffer, downstream, timeout_s=3.0)
    finally:
        buffer.close()  # (releases the worker's waiting put: a closed buffer refuses it)
        downstream.close()
