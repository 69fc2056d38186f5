"""The RLlib workloads the demo, the benchmarks and the learning-curve scripts run (one local EnvRunner and learner).

Each builder returns a fresh ``AlgorithmConfig``; pass it to ``conduit_rllib.enable`` for the
Conduit variant. Everything runs in the calling process (``num_env_runners=0``,
``num_learners=0``), so a comparison measures the experience path, not Ray's transport.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dqn_large_obs", "dqn_cartpole", "dqn_multi_agent_cartpole", "sac_pendulum", "ppo_cartpole",
           "ppo_multi_agent_cartpole"]


def _model(hidden: int) -> Any:
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    return DefaultModelConfig(fcnet_hiddens=[hidden, hidden], head_fcnet_hiddens=[hidden])


def _replay(prioritized: bool, capacity: int) -> dict[str, Any]:
    if prioritized:
        return {"type": "PrioritizedEpisodeReplayBuffer", "capacity": capacity, "alpha": 0.6, "beta": 0.4}
    return {"type": "EpisodeReplayBuffer", "capacity": capacity}


def dqn_large_obs(obs_dim: int, *, steps: int = 200, batch: int = 32, capacity: int = 5000, seed: int = 0,
                  prioritized: bool = True, hidden: int = 64, learning_starts: int | None = None) -> Any:
    """DQN on :class:`~conduit_rllib.envs.LargeObsCartPole` with ``obs_dim`` float32 observations.

    RLlib's DQN defaults otherwise: one env step and one learner update per training step,
    ``steps`` env steps per iteration, learning from the end of the first iteration.
    """
    from ray.rllib.algorithms.dqn import DQNConfig

    from conduit_rllib.envs import LargeObsCartPole

    return (DQNConfig()
            .environment(LargeObsCartPole, env_config={"obs_dim": obs_dim})
            .env_runners(num_env_runners=0)
            .learners(num_learners=0)
            .training(lr=5e-4, train_batch_size=batch, replay_buffer_config=_replay(prioritized, capacity),
                      num_steps_sampled_before_learning_starts=steps if learning_starts is None else learning_starts)
            .rl_module(model_config=_model(hidden))
            .reporting(min_sample_timesteps_per_iteration=steps, metrics_num_episodes_for_smoothing=20)
            .debugging(seed=seed, log_level="ERROR"))


def _agents(agents: int) -> dict[str, Any]:
    """``config.multi_agent`` arguments: ``agents`` modules ``p0``, ``p1``, ..., agent i trained by ``p{i}``."""
    return {"policies": {f"p{i}" for i in range(agents)},
            "policy_mapping_fn": lambda agent_id, *args, **kwargs: f"p{agent_id}"}


def dqn_multi_agent_cartpole(*, agents: int = 2, steps: int = 200, batch: int = 32, capacity: int = 5000,
                             seed: int = 0, prioritized: bool = True, hidden: int = 64) -> Any:
    """Multi-agent DQN: RLlib's ``MultiAgentCartPole`` with ``agents`` CartPoles, each agent trained by its own
    module, replayed from RLlib's multi-agent buffer of the kind (Conduit: a data plane per module), ``batch``
    transitions per module per update; otherwise RLlib's DQN defaults, as :func:`dqn_large_obs`."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

    replay = _replay(prioritized, capacity)
    replay["type"] = f"MultiAgent{replay['type']}"
    return (DQNConfig()
            .environment(MultiAgentCartPole, env_config={"num_agents": agents})
            .multi_agent(**_agents(agents))
            .env_runners(num_env_runners=0)
            .learners(num_learners=0)
            .training(lr=5e-4, train_batch_size=batch, replay_buffer_config=replay,
                      num_steps_sampled_before_learning_starts=steps)
            .rl_module(model_config=_model(hidden))
            .reporting(min_sample_timesteps_per_iteration=steps, metrics_num_episodes_for_smoothing=20)
            .debugging(seed=seed, log_level="ERROR"))


def dqn_cartpole(*, seed: int = 0, steps: int = 1000, prioritized: bool = True) -> Any:
    """DQN tuned to learn CartPole-v1 in a few thousand env steps (double, dueling, 3-step, 1 update per 4 steps)."""
    from ray.rllib.algorithms.dqn import DQNConfig

    return (DQNConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=4)
            .learners(num_learners=0)
            .training(lr=1e-3, train_batch_size=64, n_step=3, target_network_update_freq=500, training_intensity=16,
                      num_steps_sampled_before_learning_starts=1000, double_q=True, dueling=True,
                      epsilon=[(0, 1.0), (6000, 0.02)], replay_buffer_config=_replay(prioritized, 50_000))
            .rl_module(model_config=_model(64))
            .reporting(min_sample_timesteps_per_iteration=steps, metrics_num_episodes_for_smoothing=20)
            .debugging(seed=seed, log_level="ERROR"))


def sac_pendulum(*, seed: int = 0, steps: int = 200, batch: int = 256, prioritized: bool = True,
                 learning_starts: int | None = None) -> Any:
    """SAC on Pendulum-v1 (RLlib's SAC defaults: one env step and one update per training step)."""
    from ray.rllib.algorithms.sac import SACConfig

    return (SACConfig()
            .environment("Pendulum-v1")
            .env_runners(num_env_runners=0)
            .learners(num_learners=0)
            .training(train_batch_size_per_learner=batch, replay_buffer_config=_replay(prioritized, 100_000),
                      num_steps_sampled_before_learning_starts=steps if learning_starts is None else learning_starts)
            .rl_module(model_config=_model(64))
            .reporting(min_sample_timesteps_per_iteration=steps, metrics_num_episodes_for_smoothing=5)
            .debugging(seed=seed, log_level="ERROR"))


def ppo_cartpole(*, seed: int = 0, batch: int = 2000, minibatch: int = 128, epochs: int = 6) -> Any:
    """PPO on CartPole-v1 (``batch`` env steps per iteration, ``epochs`` passes in minibatches)."""
    from ray.rllib.algorithms.ppo import PPOConfig

    return (PPOConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0)
            .learners(num_learners=0)
            .training(lr=3e-4, train_batch_size_per_learner=batch, minibatch_size=minibatch, num_epochs=epochs,
                      gamma=0.99, lambda_=0.95, vf_loss_coeff=0.01)
            .rl_module(model_config=_model(64))
            .reporting(metrics_num_episodes_for_smoothing=20)
            .debugging(seed=seed, log_level="ERROR"))


def ppo_multi_agent_cartpole(*, agents: int = 2, seed: int = 0, batch: int = 2000, minibatch: int = 128,
                             epochs: int = 6) -> Any:
    """Multi-agent PPO: RLlib's ``MultiAgentCartPole`` with ``agents`` CartPoles, each agent trained by its own
    module (``p0``, ``p1``, ...), otherwise as :func:`ppo_cartpole`."""
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

    return (ppo_cartpole(seed=seed, batch=batch, minibatch=minibatch, epochs=epochs)
            .environment(MultiAgentCartPole, env_config={"num_agents": agents})
            .multi_agent(**_agents(agents)))
