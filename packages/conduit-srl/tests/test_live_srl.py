"""Optional: the adapter inside a real SRL checkout (the user's own; SRL cannot be installed here).

Set ``CONDUIT_SRL_PATH`` to an openpsi-project/srl checkout (and, if this interpreter cannot import
it, ``CONDUIT_SRL_PYTHON`` to one that can: SRL needs Python <= 3.10, NumPy < 2, torch, pyzmq, redis,
wandb, prometheus_client and psutil, with conduit-core and conduit-srl installed). The check runs in
a separate interpreter with the checkout on ``PYTHONPATH``: ``install()`` patches SRL's real
``base.buffer.make_buffer``, real ``SampleBatch`` samples travel through SRL's own IP sample stream
on 127.0.0.1 into a Conduit buffer, and the entry is read the way SRL's trainer reads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SRL_PATH = os.environ.get("CONDUIT_SRL_PATH")

SCRIPT = textwrap.dedent("""
    import socket, time
    import numpy as np
    import conduit_srl

    inst = conduit_srl.install(streams=False)
    import base.buffer, base.namedarray
    import api.trainer
    import distributed.system.sample_stream as ss

    buffer = base.buffer.make_buffer("conduit", batch_size=4, capacity=64)
    assert isinstance(buffer, conduit_srl.ConduitBuffer), type(buffer)
    assert base.buffer.make_buffer("simple_queue") is not None

    def sample(i, version):
        t = 5
        return api.trainer.SampleBatch(
            obs=base.namedarray.NamedArray(x=np.full((t, 3), i, np.float32)),
            on_reset=np.zeros((t, 1), np.uint8), reward=np.full((t, 1), i, np.float32),
            policy_version_steps=np.full((t, 1), version, np.int64))

    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    consumer = ss.IpSampleConsumer(f"127.0.0.1:{port}")
    producer = ss.IpSampleProducer(f"127.0.0.1:{port}", "pickle")
    for i in range(8):
        producer.post(sample(i, version=i // 4))
        producer.flush()
    got, deadline = 0, time.monotonic() + 30
    while got < 8:
        assert time.monotonic() < deadline, got
        got += consumer.consume_to(buffer, max_iter=64)
        time.sleep(0.001)
    assert not buffer.empty()
    entry = buffer.get()
    sb = entry.sample
    assert type(sb).__name__ == "SampleBatch", type(sb)
    assert sb.length(0) * sb.length(1) == 20 and sb.obs.x.shape == (5, 4, 3)
    assert sb.min_of("policy_version_steps") == 0 and entry.reuses == 0
    assert sorted(sb.reward[0, :, 0].tolist()) == [0.0, 1.0, 2.0, 3.0]
    buffer.close()
    conduit_srl.uninstall()
    print("LIVE-OK", inst.flavours)
""")


@pytest.mark.skipif(SRL_PATH is None, reason="set CONDUIT_SRL_PATH to your own SRL checkout (openpsi-project/srl) "
                                              "to run the adapter against the real SRL")
def test_conduit_buffer_inside_a_real_srl_checkout() -> None:
    assert SRL_PATH is not None
    python = os.environ.get("CONDUIT_SRL_PYTHON", sys.executable)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRL_PATH, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([python, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env,
                         cwd=SRL_PATH)
    assert out.returncode == 0 and "LIVE-OK" in out.stdout, (
        f"the live SRL check failed (SRL needs Python <= 3.10 and NumPy < 2; point CONDUIT_SRL_PYTHON at such an "
        f"interpreter):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
