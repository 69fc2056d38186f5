"""``SrlDriver.run`` closes the trainer's Conduit consumer, not only its socket.

A run over a claimed stream (``stream_policy``) into a full ``on_full="raise"`` buffer that nothing delivers from
ends in a TimeoutError, with the sample the buffer refused kept by the consumer. The driver closed only the ZMQ
socket under it, so the consumer was garbage-collected still holding that sample: a SamplesLostWarning blamed the
caller ("garbage-collected without close()") at some later collection, and ``lost_without_close()`` counted it.
Now the driver closes the consumer and says in its error how many samples that returned.
"""

from __future__ import annotations

import gc
import warnings

import pytest
from conduit_srl import ConduitBuffer, SamplesLostWarning, StreamPolicy
from conduit_srl.streams import lost_without_close
from conduit_srl.testing.driver import SrlDriver

pytest.importorskip("zmq")


def run_until_timeout(timeout_s: float) -> str:
    buffer = ConduitBuffer(semantics="on_policy", capacity=8, rollout_size=4, num_minibatches=1, on_full="raise",
                           pin_memory=False)
    try:
        driver = SrlDriver(buffer, actors=1, samples_per_actor=12, per_poll=12, max_steps=0,
                           stream_policy=StreamPolicy())
        try:
            driver.run(timeout_s=timeout_s)
        except TimeoutError as e:  # (nothing delivers: the 9th sample never fits)
            return str(e)
        raise AssertionError("the run completed although nothing delivered from a buffer too small for it")
    finally:
        buffer.close()


def test_a_timed_out_run_closes_its_conduit_consumer_and_reports_what_it_returned() -> None:
    before = lost_without_close()["unreturned"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for timeout_s in (3.0, 30.0):  # (the second only on a machine too slow to receive 9 samples in the first)
            why = run_until_timeout(timeout_s)
            if "only 8 of 12" in why:
                break
        gc.collect()  # (a consumer dropped while holding samples reports them here)
    assert "only 8 of 12" in why, why
    assert "1 more samples were received" in why, why
    assert not [w for w in caught if issubclass(w.category, SamplesLostWarning)], [str(w.message) for w in caught]
    assert lost_without_close()["unreturned"] == before
