"""Priority updates of the prioritized replay buffer read their values as the data plane does.

Defects found and fixed (``update_priorities`` converted the priorities with NumPy before the data plane saw them):

1. Complex priorities (e.g. a complex TD error) were accepted: NumPy dropped their imaginary parts with only a
   ``ComplexWarning``, so ``1j`` became priority 0 (raised to RLlib's floor) and ``5 + 3j`` became 5, while
   ``ExperienceDataPlane.update_priorities`` refuses complex values. Now a ``conduit.PriorityError``; no priority
   changes.
2. A bfloat16 tensor (a mixed-precision learner's TD errors) was refused with ``PriorityError`` ("Got unsupported
   ScalarType BFloat16", NumPy has no bfloat16), while the data plane takes it. Now converted by torch first and
   applied, as the data plane applies it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from conduit import PriorityError  # noqa: E402
from conduit_rllib import ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode  # noqa: E402


def _filled() -> tuple[ConduitPrioritizedEpisodeReplayBuffer, torch.Tensor]:
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=1.0, seed=0)
    buf.add([id_episode(np.arange(4))])
    sample = buf.sample(num_items=4, n_step=1, beta=0.4, **DQN_KW)
    return buf, sample.handles


def _priorities(buf: ConduitPrioritizedEpisodeReplayBuffer) -> np.ndarray:
    assert buf.edp is not None
    return buf.edp.semantics.sampler.priorities(np.arange(4))  # type: ignore[attr-defined]


@pytest.mark.parametrize("complex_priorities", [
    np.array([5 + 3j, 1j, 2, 3]),
    [5 + 3j, 1j, 2, 3],
    torch.tensor([5 + 3j, 1j, 2, 3]),
])
@pytest.mark.parametrize("by_handle", [False, True])
def test_complex_priorities_are_refused_typed_and_change_nothing(complex_priorities: Any, by_handle: bool) -> None:
    buf, handles = _filled()
    before = _priorities(buf).copy()
    with pytest.raises(PriorityError, match="complex"):
        if by_handle:
            buf.update_priorities(complex_priorities, handles=handles)
        else:
            buf.update_priorities(complex_priorities)
    assert np.array_equal(_priorities(buf), before)
    if not by_handle:  # the refused update leaves the last sample's update to be made
        assert buf.update_priorities(np.full(4, 2.0)) == 4


@pytest.mark.parametrize("by_handle", [False, True])
def test_a_bfloat16_tensor_of_priorities_is_applied_as_the_data_plane_applies_it(by_handle: bool) -> None:
    buf, handles = _filled()
    p = torch.full((4,), 2.5, dtype=torch.bfloat16)  # (exact in bfloat16; one value: a draw may repeat an item)
    applied = buf.update_priorities(p, handles=handles) if by_handle else buf.update_priorities(p)
    assert applied == 4
    drawn = np.isin(np.arange(4), handles.numpy())
    assert np.array_equal(_priorities(buf), np.where(drawn, 2.5, 1.0))
