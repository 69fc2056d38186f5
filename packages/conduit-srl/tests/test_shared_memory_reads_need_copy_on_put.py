"""A Conduit buffer fed by an unbatched SHARED_MEMORY stream needs copy_on_put=True; the config check says so.

SRL's shared-memory reader (``SharedMemoryReader.read`` in openpsi-project/srl ``base/shared_memory.py``) reads one
sample as ``buf[:, slot]`` (a view of the slot), releases the slot to the writers, and only then returns it to
``consume_to``, which puts it. A Conduit put reads the sample's arrays only when it stores them: in a later put
where ``g_ing`` groups puts, or on a Conduit worker with ``overlap=True``; by then an actor may have written the
next sample into that slot. The trainer then gets
later samples in place of earlier ones, silently. ``check_trainer_config`` accepted such a configuration.
"""

from __future__ import annotations

from typing import Any

import conduit_srl
import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_srl import check_buffer_worker_config, check_trainer_config
from conduit_srl.testing.records import Record


class _SharedMemoryDock:
    """SRL's shared-memory sample path, from its behaviour: slots laid out ``[T, qsize, ...]``; a writer takes the
    lowest writable slot; a read views one slot and releases it before the sample is put."""

    def __init__(self, qsize: int, time_steps: int = 1, dim: int = 3) -> None:
        self.obs = np.zeros((time_steps, qsize, dim), np.float32)
        self.id = np.zeros((time_steps, qsize), np.int64)
        self.writable = list(range(qsize))
        self.readable: list[int] = []

    def write(self, i: int) -> None:
        slot = min(self.writable)
        self.writable.remove(slot)
        self.obs[:, slot] = i
        self.id[:, slot] = i
        self.readable.append(slot)

    def consume_to(self, buffer: Any, max_iter: int = 16) -> int:
        count = 0
        while self.readable and count < max_iter:
            slot = self.readable.pop(0)
            sample = Record(obs=self.obs[:, slot], id=self.id[:, slot])  # views of the slot
            self.writable.append(slot)  # released before the put
            buffer.put(sample)
            count += 1
        return count


@pytest.mark.parametrize("copy_on_put", [False, True])
def test_a_put_of_a_released_slot_keeps_its_sample_only_with_copy_on_put(copy_on_put: bool) -> None:
    """What the check prevents. (Puts are stored two at a time in the caller, so the overwrite happens before the
    first of them is stored on every run; with ``overlap=True`` it depends on when Conduit's worker stores.)"""
    dock = _SharedMemoryDock(qsize=4)
    buffer = conduit_srl.ConduitBuffer(batch_size=1, capacity=8, overlap=False, g_ing=2, copy_on_put=copy_on_put)
    try:
        for i in range(4):  # an actor writes a sample, the trainer's main thread consumes it
            dock.write(i)
            dock.consume_to(buffer)
        buffer.flush()
        got = [int(buffer.get().sample.id[0, 0]) for _ in range(4)]
    finally:
        buffer.close()
    if copy_on_put:
        assert got == [0, 1, 2, 3]
    else:
        assert got != [0, 1, 2, 3], "the slot was overwritten before the put sample was stored"


def test_trainer_and_buffer_worker_configs_over_unbatched_shared_memory_need_copy_on_put(srl_layout) -> None:
    layout = srl_layout("distributed")
    conduit_srl.install()
    cfg = layout["api.config"]
    shm = cfg.SampleStream(type_=cfg.SampleStream.Type.SHARED_MEMORY, stream_name="s")
    with pytest.raises(ConfigurationError, match="copy_on_put=True"):
        cfg.TrainerWorker(buffer_name="conduit", buffer_args={"batch_size": 8}, sample_stream=shm)
    with pytest.raises(ConfigurationError, match="copy_on_put=True"):
        cfg.BufferWorker(buffer_name="conduit", buffer_args={"batch_size": 8}, from_sample_stream=shm)
    ok = cfg.TrainerWorker(buffer_name="conduit", buffer_args={"batch_size": 8, "copy_on_put": True},
                           sample_stream=shm)
    check_trainer_config(ok)
    check_buffer_worker_config(cfg.BufferWorker(buffer_name="conduit", buffer_args={"batch_size": 8,
                                                                                     "copy_on_put": True},
                                                from_sample_stream=shm))
    # a batched read gathers its slots (a copy): batched_puts is what it needs, as before
    batched = cfg.SampleStream(type_=cfg.SampleStream.Type.SHARED_MEMORY, stream_name="s", batch_size=4)
    cfg.TrainerWorker(buffer_name="conduit", buffer_args={"batch_size": 8, "batched_puts": True},
                      sample_stream=batched)
    with pytest.raises(ConfigurationError, match="batched_puts=True"):
        cfg.BufferWorker(buffer_name="conduit", buffer_args={"batch_size": 8}, from_sample_stream=batched)
    # other streams and SRL's own buffers are left alone
    cfg.TrainerWorker(buffer_name="conduit", buffer_args={"batch_size": 8}, sample_stream=cfg.SampleStream())
    cfg.TrainerWorker(buffer_name="priority_queue", sample_stream=shm)
