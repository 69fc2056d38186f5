"""Numbers given as text (or a flag) to ``sample(beta=...)`` and ``add(weight=...)`` are refused, as the data plane
refuses them.

Defect found and fixed: both were read with ``float()``, which parses text, so ``beta="0.4"`` and ``beta=True``
(which ``ExperienceDataPlane.deliver`` refuses with ``ConfigurationError``) drew with beta 0.4 and 1.0, and
``add(..., weight="2.0")`` stored its steps with priority 2.0, while the docstrings promise a typed error for a
beta or a weight that is no number (RLlib's own buffers fail on such text with an untyped ``TypeError``). Now a
``ConfigurationError`` (beta) or ``PriorityError`` (weight), nothing drawn or stored.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit import ConfigurationError, PriorityError  # noqa: E402
from conduit_rllib import ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW  # noqa: E402
from conduit_rllib.testing import id_episode  # noqa: E402


def _pair() -> tuple[ConduitPrioritizedEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer]:
    bufs = ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=0.6, seed=3), \
        ConduitPrioritizedEpisodeReplayBuffer(capacity=8, alpha=0.6, seed=3)
    for b in bufs:
        b.add([id_episode(np.arange(5))])
    return bufs


@pytest.mark.parametrize("beta", ["0.4", b"0.4", True, np.True_])
def test_a_beta_given_as_text_or_a_flag_is_refused_and_draws_nothing(beta: Any) -> None:
    buf, twin = _pair()
    with pytest.raises(ConfigurationError, match="beta"):
        buf.sample(num_items=4, n_step=1, beta=beta, **DQN_KW)
    x = buf.sample(num_items=4, n_step=1, beta=0.4, **DQN_KW)
    y = twin.sample(num_items=4, n_step=1, beta=0.4, **DQN_KW)
    assert np.array_equal(x.handles.numpy(), y.handles.numpy()), "the refused sample drew"


@pytest.mark.parametrize("beta", [0.4, np.float32(0.4), 1, np.int64(0)])
def test_a_numeric_beta_is_taken(beta: Any) -> None:
    buf, _ = _pair()
    assert len(buf.sample(num_items=4, n_step=1, beta=beta, **DQN_KW)) == 4


@pytest.mark.parametrize("weight", ["2.0", b"2.0"])
def test_an_add_weight_given_as_text_is_refused_and_stores_nothing(weight: Any) -> None:
    buf, _ = _pair()
    with pytest.raises(PriorityError, match="weight"):
        buf.add([id_episode(np.arange(10, 13))], weight=weight)
    assert len(buf) == 5 and buf.get_added_timesteps() == 5, "a refused add stored nothing"
