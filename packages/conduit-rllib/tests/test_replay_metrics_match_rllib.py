"""Replay-buffer metrics next to RLlib's own buffers: each iteration's sums and the lifetime counts are RLlib's.

Reported (session 24): Conduit's buffer logged its counts on the first ``get_metrics`` call of an iteration
and on every 16th, so an iteration's ``num_env_steps_added``/``_sampled``/``num_episodes_added`` were the
counts since the previous log (a DQN run's first iteration reported 10 steps added and 8 sampled where
RLlib's reported 20 and 88), and the lifetime counts trailed by as much. RLlib's buffers log on every add
and sample and DQN folds ``get_metrics()`` into the iteration's results after every sample.

Compared: counts only (eviction is per transition in Conduit, per episode in RLlib, so ``..._evicted`` and
``num_env_steps_stored`` differ by design; see the README).
"""

from __future__ import annotations

from typing import Any

import conduit_rllib
import numpy as np
import pytest
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer
from conduit_rllib.testing import id_episode
from conduit_rllib.workloads import dqn_large_obs
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer

#: the counters whose values do not depend on how a buffer evicts
COUNTS = ("num_env_steps_added", "num_env_steps_added_lifetime", "num_env_steps_sampled",
          "num_env_steps_sampled_lifetime", "num_episodes_added", "num_episodes_added_lifetime")
SAMPLE_KW: dict[str, Any] = dict(n_step=1, gamma=0.99, batch_length_T=0, lookback=0, min_batch_length_T=0,
                                 sample_episodes=True)


def _counts(results: dict[str, Any]) -> dict[str, float | None]:
    replay = results.get("replay_buffer", {})
    return {k: (None if replay.get(k) is None else float(replay[k])) for k in COUNTS}


def _iterations(buf: Any, iteration: list[int]) -> list[dict[str, float | None]]:
    """Three iterations of DQN's calls: each training step adds an episode of 3 steps and, from the third step
    on (learning starts), samples and folds ``get_metrics()`` into the iteration's results, as DQN does."""
    results = MetricsLogger(root=True)
    step, out = 0, []
    for it in range(3):
        iteration[0] = it
        for _ in range(4):
            buf.add([id_episode(np.arange(3) + 10 * step, terminated=True)])
            step += 1
            if step > 2:
                buf.sample(num_items=5, **SAMPLE_KW)
                results.aggregate([buf.get_metrics()], key="replay_buffer")
        out.append(_counts(results.compile()))
    return out


def test_logging_on_every_call_gives_rllibs_counts_and_the_class_default_is_late() -> None:
    """The buffer as ``enable`` builds it (``metrics_every=1``) reports RLlib's counts for the same calls; one
    built with ``metrics_every=16`` (the class default until session 25, now opt-in) reports the first
    iteration's 3 adds and 1 sample before its first get_metrics call only, as the README states."""
    iteration = [0]
    native = _iterations(EpisodeReplayBuffer(capacity=1000), iteration)
    reports = {}
    for every in (1, 16):
        conduit = ConduitEpisodeReplayBuffer(capacity=1000, seed=0, metrics_every=every)
        conduit.iteration_of = lambda: iteration[0]  # as enable() sets it
        reports[every] = _iterations(conduit, iteration)
    assert reports[1] == native, f"per-iteration counts\n conduit {reports[1]}\n rllib   {native}"
    assert native[0]["num_env_steps_added"] == 12 and native[0]["num_env_steps_sampled"] == 10, native[0]
    late = reports[16][0]
    assert (late["num_env_steps_added"], late["num_env_steps_sampled"]) == (9, 5), f"not late as documented: {late}"


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("prioritized", [False, True])
def test_a_dqn_runs_replay_counts_match_rllibs_iteration_by_iteration(prioritized: bool) -> None:
    """The same seeded DQN config, native and with Conduit: random actions (epsilon 1), so both add the same
    episodes; 20 env steps per iteration, learning from step 10. Failed before: iteration 0 reported 10 steps
    added and 8 sampled (RLlib: 20 and 88), the lifetime counts trailing after it."""

    def run(enabled: bool) -> list[dict[str, float | None]]:
        config = dqn_large_obs(4, steps=20, batch=8, capacity=1000, learning_starts=10, prioritized=prioritized)
        config.training(epsilon=[(0, 1.0), (10 ** 6, 1.0)])
        algo = (conduit_rllib.enable(config) if enabled else config).build_algo()
        try:
            if enabled:
                assert isinstance(algo.local_replay_buffer, (ConduitEpisodeReplayBuffer,
                                                             ConduitPrioritizedEpisodeReplayBuffer))
            return [_counts(algo.train()) for _ in range(3)]
        finally:
            algo.stop()

    native, got = run(False), run(True)
    assert native[0]["num_env_steps_sampled"] == 88, f"the run should make 11 updates of 8 in iteration 0: {native}"
    assert got == native, f"per-iteration counts\n conduit {got}\n rllib   {native}"
