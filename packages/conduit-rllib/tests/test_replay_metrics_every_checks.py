"""``metrics_every`` (log on every n-th ``get_metrics`` call) is checked as a count.

Defect found and fixed: the buffers read it with ``int()``, so ``None`` raised an untyped ``TypeError`` and a
bool, a fraction or a string were taken silently (``True`` -> 1, ``2.7`` -> 2, ``"3"`` -> 3). A subclass of
Conduit's buffers built by ``enable`` gets ``replay_buffer_config["metrics_every"]`` as is, so such a value
came straight from a config. Now all of them are a ``conduit.ConfigurationError`` that says what to pass.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conduit import ConfigurationError  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402

KINDS = [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [None, True, np.True_, 2.7, 2.0, "3", 0, -1])
def test_a_metrics_every_that_is_no_count_is_a_typed_error(kind: type, bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="metrics_every must be an int >= 1"):
        kind(capacity=8, metrics_every=bad)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("good", [1, 3, np.int64(2)])
def test_whole_counts_are_taken(kind: type, good: Any) -> None:
    assert kind(capacity=8, metrics_every=good).metrics_every == int(good)
