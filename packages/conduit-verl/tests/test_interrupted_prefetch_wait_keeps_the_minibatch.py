"""A delivery interrupted (Ctrl-C) while it waits for the staged minibatch does not lose that minibatch.

``MinibatchPrefetch.deliver`` took the staged job off the scheduler before waiting for it, so a KeyboardInterrupt
during the wait dropped the job: the minibatch it staged (already selected) was never handed out, and the next
delivery silently went on with the one after it (a verl user resuming after Ctrl-C in a notebook trained on a rollout
with a minibatch missing). Now the job stays staged until its minibatch is handed out.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import torch
from conduit.testing.lifecycle import HANG_S, thread_frame
from tensordict import TensorDict
from torch.utils.data import Sampler

pytestmark = pytest.mark.requires("verl")

N = 8


class _SlowSecondPass(Sampler[int]):
    """Rows in order; the second pass (epoch 1's order, drawn by the job staging epoch 0's last minibatch) waits
    for ``go``."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered, self.go = threading.Event(), threading.Event()

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            assert self.go.wait(HANG_S)
        return iter(range(N))


def _waiting_for_the_job(main: int) -> bool:
    frame: FrameType | None = thread_frame(main)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("worker.py"):
            return True
        frame = frame.f_back
    return False


def _interrupt_when_waiting(sampler: _SlowSecondPass, main: int) -> None:
    """Interrupt the main thread once it waits for the staged job."""
    assert sampler.entered.wait(HANG_S)
    end = time.monotonic() + HANG_S
    while not _waiting_for_the_job(main) and time.monotonic() < end:
        time.sleep(0.01)
    signal.pthread_kill(main, signal.SIGUSR1)  # (its handler raises KeyboardInterrupt there, as Ctrl-C does)


def test_ctrl_c_while_waiting_for_the_staged_minibatch_keeps_it_next() -> None:
    from conduit_verl.delivery import MinibatchDelivery

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    assert threading.current_thread() is threading.main_thread(), "signals are handled on the main thread only"
    old = signal.signal(signal.SIGUSR1, interrupt)
    sampler = _SlowSecondPass()
    d = MinibatchDelivery(num_minibatches=2, epochs=2, seed=0, device="cpu", prefetch=True,
                          dataloader_kwargs={"sampler": sampler})
    try:
        d.ingest(TensorDict({"x": torch.arange(float(N))}, batch_size=[N]), version=0)
        d.seal()
        got = []
        _, info = d.next_minibatch()  # stages epoch 0's last minibatch, whose job draws epoch 1's order (waits)
        got.append((info.epoch, info.minibatch))
        t = threading.Thread(target=_interrupt_when_waiting, args=(sampler, threading.main_thread().ident))
        t.start()
        with pytest.raises(KeyboardInterrupt):
            d.next_minibatch()
        t.join(HANG_S)
        signal.signal(signal.SIGUSR1, old)
        sampler.go.set()
        while True:
            td, info = d.next_minibatch()
            got.append((info.epoch, info.minibatch))
            if info.last:
                break
        assert got == [(0, 0), (0, 1), (1, 0), (1, 1)], "the minibatch staged before Ctrl-C was lost"
    finally:
        signal.signal(signal.SIGUSR1, old)
        sampler.go.set()
        d.close()
