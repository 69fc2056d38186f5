"""Environments with large observations, for the demo and the benchmarks.

:class:`LargeObsCartPole` is CartPole-v1 whose observation is ``d`` float32 values: the 4
state variables followed by ``d - 4`` fixed random features of the state (``tanh(W s)``,
``W`` drawn once from ``feature_seed``). The task is unchanged and the observation is fully
informative, but every transition carries ``2 * d * 4`` bytes of observations: the regime
where moving experience, not computing on it, dominates.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["LargeObsCartPole"]


class LargeObsCartPole(gym.Wrapper):
    """CartPole-v1 with ``obs_dim``-dimensional float32 observations.

    Args:
        config: RLlib's ``env_config``: ``obs_dim`` (default 5000, at least 4) and
            ``feature_seed`` (default 0).
    """

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        config = dict(config or {})
        d = int(config.get("obs_dim", 5000))
        if d < 4:
            raise ValueError(f"obs_dim must be >= 4 (CartPole's state), got {d}.")
        super().__init__(gym.make("CartPole-v1"))
        rng = np.random.default_rng(int(config.get("feature_seed", 0)))
        self._w = (rng.standard_normal((4, d - 4)) / 2).astype(np.float32)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (d,), np.float32)
        self._out = np.empty(d, dtype=np.float32)

    def _observe(self, state: np.ndarray) -> np.ndarray:
        out = np.empty_like(self._out)
        out[:4] = state
        np.tanh(state.astype(np.float32) @ self._w, out=out[4:])
        return out

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict[str, Any]]:
        state, info = self.env.reset(**kwargs)
        return self._observe(state), info

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        state, reward, terminated, truncated, info = self.env.step(action)
        return self._observe(state), float(reward), terminated, truncated, info
