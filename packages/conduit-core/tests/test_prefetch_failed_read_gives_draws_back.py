"""A prefetch job whose read fails after it drew (a storage read error) prepares nothing, and the next delivery
prepares in its call; the job's draw advanced the sampler's RNG, so that call (and every later one) drew other items
than a synchronous buffer's, with the same seed and the same calls. The job now gives its draws back."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Overlapped, Replay, Synchronous
from conduit.semantics.replay import PrioritizedSampler, UniformSampler

SCHEMA = ExperienceSchema(obs=Field((1,)))


def _plane(scheduler: Any, sampler: Any) -> ExperienceDataPlane:
    edp = ExperienceDataPlane(SCHEMA, capacity=256, semantics=Replay(sampler, seed=7), scheduler=scheduler)
    edp.ingest({"obs": torch.arange(256, dtype=torch.float32)[:, None]})
    edp.flush()
    return edp


@pytest.mark.parametrize("sampler", [UniformSampler, PrioritizedSampler])
def test_a_prefetch_read_that_fails_leaves_the_draws_a_synchronous_buffer_makes(sampler: Any) -> None:
    ref = _plane(Synchronous(), sampler())
    want = [ref.deliver(8)[1].handles.tolist() for _ in range(4)]
    ref.close()

    edp = _plane(Overlapped(overlap=True, g_del=1), sampler())
    storage = edp.storage
    gather = storage.gather
    failed = threading.Event()

    def flaky_gather(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread() and not failed.is_set():
            failed.set()  # the first read on the prefetch worker fails, once (a transient read error)
            raise OSError("injected read error")
        return gather(*args, **kwargs)

    storage.gather = flaky_gather  # type: ignore[method-assign]
    try:
        got = [edp.deliver(8)[1].handles.tolist()]  # (prepared in the call; then the prefetch job fails)
        got += [edp.deliver(8)[1].handles.tolist() for _ in range(3)]
        assert failed.is_set()
        assert got == want, "after the failed prefetch read, the deliveries skipped the job's draw"
    finally:
        edp.close()
