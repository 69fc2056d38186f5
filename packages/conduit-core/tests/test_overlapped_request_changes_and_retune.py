"""Overlapped against Synchronous when the request changes (batch size, options), and retune's effect on what is
queued for storage."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    ConfigurationError,
    ExperienceDataPlane,
    OnPolicy,
    Overlapped,
    PrioritizedSampler,
    Replay,
    Scheduler,
    Synchronous,
)
from conduit.testing.lifecycle import wait_until
from conduit.testing.reference import ID_SCHEMA, id_batch

#: batch sizes of consecutive deliveries: every change discards what was prepared for the earlier size
SIZES = (4, 8, 8, 4, 2, 2, 8, 4)


def _handles(scheduler: Scheduler, *, prioritized: bool) -> list[tuple[list[int], list[float]]]:
    sem = Replay(PrioritizedSampler(alpha=1.0), seed=5) if prioritized else Replay(seed=5)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=sem, scheduler=scheduler)
    edp.ingest(id_batch(np.arange(40)))
    edp.flush()
    out = []
    for n in SIZES:
        _, info = edp.deliver(n, beta=0.5) if prioritized else edp.deliver(n)
        out.append((info.handles.tolist(), [] if info.weights is None else info.weights.tolist()))
    edp.close()
    return out


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("kwargs", [{"g_del": 1}, {"g_del": 3}, {"g_del": 2, "overlap": False}])
def test_a_change_of_batch_size_gives_the_prepared_draws_back(kwargs: dict[str, Any], prioritized: bool) -> None:
    """With nothing ingested or updated between deliveries, the draws are the synchronous ones, in order, also across
    changes of batch size: the draws prepared for the old size are made again for the new one, not skipped."""
    want = _handles(Synchronous(), prioritized=prioritized)
    got = _handles(Overlapped(**kwargs), prioritized=prioritized)
    assert [h for h, _ in got] == [h for h, _ in want], "draws prepared for another batch size were skipped"
    for (_, w_got), (_, w_want) in zip(got, want, strict=True):
        np.testing.assert_allclose(w_got, w_want, rtol=1e-6)


def test_retune_to_a_smaller_g_ing_stores_the_groups_it_completes_in_the_background() -> None:
    """Three batches wait for a group of four; retune(g_ing=1) makes each a complete group: the worker stores them
    without waiting for another ingest (the bound on ingestion lag is the new g_ing's)."""
    sched = Overlapped(g_ing=4, g_del=1)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=sched)
    for k in range(3):
        edp.ingest(id_batch(np.arange(2 * k, 2 * k + 2)))
    assert len(sched.pending()) == 3 and len(edp) == 0  # (an incomplete group: not stored yet)
    sched.retune(g_ing=1)
    wait_until(lambda: len(edp) == 6, "the three groups complete at g_ing=1 are stored", timeout=30)
    assert sched.pending() == []
    edp.close()


def test_retune_to_a_smaller_g_ing_in_the_caller_stores_at_the_next_ingest() -> None:
    sched = Overlapped(g_ing=4, g_del=1, overlap=False)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=sched)
    for k in range(3):
        edp.ingest(id_batch(np.arange(2 * k, 2 * k + 2)))
    sched.retune(g_ing=2)
    edp.ingest(id_batch(np.arange(6, 8)))
    assert (len(edp), sched.pending()) == (8, []), "a complete group at the new g_ing was left queued"
    edp.close()


def test_granularities_may_be_numpy_numbers() -> None:
    """Counts elsewhere may be NumPy integers (read from a config array); Overlapped's granularities too. They were
    refused with 'g_ing must be a positive number, got np.int64(2)' and retune's 'g_ing=2 is outside the safe range'."""
    sched = Overlapped(g_ing=np.int64(2), g_del=np.int32(2))
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=sched)
    assert (sched.g_ing, sched.g_del) == (2, 2) and type(sched.g_ing) is int
    sched.retune(g_ing=np.int64(1), g_del=np.int64(3))
    assert (sched.g_ing, sched.g_del) == (1, 3)
    edp.ingest(id_batch(np.arange(8)))
    assert edp.deliver(4)[0].batch_size == 4
    edp.close()
    on = Overlapped(g_ing=np.float32(0.5))
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=OnPolicy(num_minibatches=2), scheduler=on)
    on.retune(g_ing=np.float64(1.0))
    assert on.g_ing == 1.0 and type(on.g_ing) is float
    edp.close()
    for bad in (np.int64(0), np.bool_(True), "2"):
        with pytest.raises(ConfigurationError, match="g_ing must be a positive number"):
            Overlapped(g_ing=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_storage_delivers_to_a_host_learner_under_overlapped(overlap: bool) -> None:
    """Storage on the GPU, learner on the host: the hand-over asked torch.cuda.current_stream for the host device,
    which raises ValueError ('Expected a cuda device'), on every delivery; now the host waits for the copies."""
    from conduit.placement import DevicePlacement

    edp = ExperienceDataPlane(ID_SCHEMA, capacity=512, semantics=Replay(seed=0), placement=DevicePlacement("cuda:0"),
                              device="cpu", scheduler=Overlapped(g_del=2, overlap=overlap))
    edp.ingest(id_batch(np.arange(512)))
    edp.flush()
    for _ in range(10):
        b, info = edp.deliver(64)
        assert b["id"].device.type == "cpu"
        assert torch.equal(b["id"], info.handles.cpu())
    edp.close()


def _versions_seal(scheduler: Scheduler) -> tuple[ExperienceDataPlane, list[int]]:
    """Rollouts of versions 0, 1 and 2, handed over in batches of half a rollout and never sealed by seal(): each new
    version's first batch seals the rollout before it (OnPolicy's documented rule). Returns the buffer and the
    handles of the first minibatch of a synchronous buffer after the same calls."""
    def fill(edp: ExperienceDataPlane) -> None:
        for version, first in ((0, 0), (0, 6), (1, 12), (1, 18), (2, 24)):
            edp.set_policy_version(version)
            edp.ingest(id_batch(np.arange(first, first + 6)), version=version)

    def make(s: Scheduler) -> ExperienceDataPlane:
        return ExperienceDataPlane(ID_SCHEMA, capacity=256, scheduler=s,
                                   semantics=OnPolicy(num_minibatches=3, max_staleness=1, seed=1))
    ref = make(Synchronous())
    fill(ref)
    want = ref.deliver()[1].handles.tolist()
    ref.close()
    edp = make(scheduler)
    fill(edp)
    return edp, want


@pytest.mark.parametrize("kwargs", [{"overlap": False}, {"background_ingest": False}, {"g_ing": 0.5, "overlap": False}])
def test_a_new_versions_first_batch_seals_the_rollout_before_it_as_in_a_synchronous_buffer(
        kwargs: dict[str, Any]) -> None:
    """The version-2 batch waited for the rest of its rollout (g_ing of it) before being stored, so rollout 1 stayed
    open: the delivery raised EmptyBufferError ('call seal()') where the synchronous buffer delivers from rollout 1."""
    edp, want = _versions_seal(Overlapped(**kwargs))
    assert edp.deliver()[1].handles.tolist() == want
    edp.close()


def test_a_new_versions_first_batch_seals_the_rollout_before_it_in_the_background() -> None:
    """In the background the worker stores that batch without waiting for the rest of its rollout (before, it stayed
    queued until the version-2 rollout was whole, or a flush)."""
    sched = Overlapped()
    edp, want = _versions_seal(sched)
    wait_until(lambda: not sched.pending(), "the version-2 batch is stored", timeout=30)
    assert edp.deliver()[1].handles.tolist() == want
    edp.close()


@pytest.mark.parametrize("args", [(0, 4, "8"), ("0", 4, 8), (0, "4", 8), (-1, 4, 8), (float("nan"), 4, 8), (0, -4, 8),
                                  (0, 4.5, 8), (0, 4, float("inf")), (0, True, 8)])
def test_trim_buffers_refuses_bad_arguments_typed_and_keeps_the_buffers(args: tuple[Any, Any, Any]) -> None:
    """A string raised TypeError (its docstring promises ConfigurationError), and a negative or NaN budget or a
    negative batch let go of the idle buffers as if they were a budget."""
    sched = Overlapped(g_del=2, overlap=False)
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=64, semantics=Replay(seed=1), scheduler=sched)
    edp.ingest(id_batch(np.arange(16)))
    edp.flush()
    edp.deliver(4)
    edp.deliver(4)  # (the chunk's second batch: its buffer is idle now)
    held = sched._ring.held_rows()
    with pytest.raises(ConfigurationError, match="must be"):
        sched.trim_buffers(*args, room_for_a_chunk=False)
    assert sched._ring.held_rows() == held
    sched.trim_buffers(0, 4, 8, room_for_a_chunk=False)  # good arguments still let go of the idle ones
    assert sched._ring.held_rows() < held
    edp.close()
