"""Convergence: with Conduit, DQN and PPO on CartPole-v1 reach the return native RLlib reaches, in the same budget.

Budgets are env steps (not seconds: this machine is shared), thresholds well below what both
reach with these settings, so the tests check that learning is intact, not who is luckier. Native RLlib
runs only when Conduit's run falls short, to tell a broken setting from a Conduit failure.
"""

from __future__ import annotations

from typing import Any

import conduit_rllib
import pytest
from conduit_rllib.workloads import dqn_cartpole, ppo_cartpole

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def steps_to_reach(config: Any, threshold: float, budget: int) -> tuple[int | None, list[float]]:
    """Train until the mean return of the last episodes reaches ``threshold``; the env steps it took (or None)."""
    algo = config.build_algo()
    returns: list[float] = []
    try:
        while True:
            r = algo.train()["env_runners"]
            steps = int(r["num_env_steps_sampled_lifetime"])
            ret = r.get("episode_return_mean")
            returns.append(float("nan") if ret is None else float(ret))
            if ret is not None and ret >= threshold:
                return steps, returns
            if steps >= budget:
                return None, returns
    finally:
        algo.stop()


@pytest.mark.parametrize(("name", "make", "threshold", "budget"), [
    ("dqn", lambda: dqn_cartpole(seed=0, steps=1000), 100.0, 16_000),
    ("ppo", lambda: ppo_cartpole(seed=0, batch=2000, minibatch=128, epochs=6), 150.0, 40_000),
])
def test_conduit_reaches_the_native_threshold_in_the_same_budget(name: str, make: Any, threshold: float,
                                                                 budget: int) -> None:
    conduit, conduit_curve = steps_to_reach(conduit_rllib.enable(make()), threshold, budget)
    if conduit is None:  # native RLlib, same settings, tells a broken setup from a Conduit failure (only then run)
        native, native_curve = steps_to_reach(make(), threshold, budget)
        assert native is not None, (f"neither native {name} nor Conduit's reached {threshold} in {budget} steps: "
                                    f"the settings are off. Native: {native_curve}; Conduit: {conduit_curve}")
        raise AssertionError(f"{name} with Conduit did not reach {threshold} in {budget} env steps (native reached "
                             f"it at {native}): {conduit_curve}")
