"""Deliveries across the host/GPU boundary when the GPU lags behind the CPU.

``torch.cuda._sleep`` keeps the learner's stream busy, so the delivery copies queue behind it while the CPU
goes on. Two orders were missing: a host-storage buffer delivered to a GPU learner is gathered into page-locked
buffers that rotate every ``output_depth`` deliveries, and the CPU rewrote one before the copy enqueued out of it
had read it (the learner got a later batch's rows); a GPU-storage buffer delivered to a host learner copied its
ragged columns with ``non_blocking`` into page-locked memory that the learner read before the bytes arrived.
"""

from __future__ import annotations

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay
from conduit.batch import Ragged
from conduit.placement import DevicePlacement, HostPlacement

pytestmark = pytest.mark.gpu

WIDE = ExperienceSchema(id=Field((), torch.int64), obs=Field((4096,), torch.float32))
SEQ = ExperienceSchema(id=Field((), torch.int64), tokens=Field((), torch.int64, ragged=True))
_LAG_CYCLES = 2_000_000_000  # about a second of GPU time at GPU clocks


def test_a_page_locked_gather_buffer_is_not_rewritten_before_its_copy_to_the_gpu_ran() -> None:
    n = 256
    edp = ExperienceDataPlane(WIDE, capacity=n, placement=HostPlacement(), device="cuda:0", semantics=Replay(seed=0))
    try:
        ids = torch.arange(n)
        edp.ingest({"id": ids, "obs": ids[:, None].float().repeat(1, 4096)})
        depth = edp.scheduler.output_depth
        torch.cuda._sleep(_LAG_CYCLES)  # the copies below queue behind this
        first, info = edp.deliver(64)
        # (enqueued after batch 0's copy and before the copies the next deliveries make)
        snap_id, snap_obs = first.tensor("id").clone(), first.tensor("obs")[:, -1].clone()
        for _ in range(depth + 2):
            edp.deliver(64)
        torch.cuda.synchronize()
        want = info.handles.cpu()
        assert torch.equal(snap_id.cpu(), want), "batch 0 on the GPU holds a later delivery's rows"
        assert torch.equal(snap_obs.cpu().long(), want)
    finally:
        edp.close()


def test_a_ragged_column_copied_to_a_host_learner_is_complete_when_delivered() -> None:
    n = 64
    edp = ExperienceDataPlane(SEQ, capacity=n, placement=DevicePlacement("cuda:0"), device="cpu",
                              semantics=Replay(seed=0), ragged_capacity=n * 4096)
    try:
        edp.ingest({"id": torch.arange(n), "tokens": [torch.full((4096,), i + 1) for i in range(n)]})
        for _ in range(5):
            torch.cuda._sleep(_LAG_CYCLES // 4)  # the gather and the copy to the host queue behind this
            batch, info = edp.deliver(16)
            tokens = batch["tokens"]
            assert isinstance(tokens, Ragged)
            firsts = tokens.values[tokens.offsets]  # read at once, as a host learner does
            assert torch.equal(firsts, info.handles.cpu() + 1), "the host learner read the copy before it arrived"
    finally:
        edp.close()
