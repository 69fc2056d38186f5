"""Conduit's own buffer options given in ``replay_buffer_config`` are honoured or refused, never dropped.

Defects found and fixed:

* ``"metrics_every"`` reached a subclass of Conduit's buffers (it gets the config's other keys) but was dropped
  silently for RLlib's stock types, whose Conduit buffer was always built with ``metrics_every=1``; now every
  buffer ``enable`` builds takes it (and refuses a bad one, typed, as the buffer does).
* ``"placement"``, ``"scheduler"`` and ``"device"`` were dropped silently for every type: ``enable`` sets them
  itself (``enable(placement=..., scheduler=...)``, the learner's device). ``enable`` now refuses them, naming
  where to set them, and leaves the config unchanged; so does the build of a config given them after ``enable``.
"""

from __future__ import annotations

from typing import Any

import conduit_rllib
import pytest
from conduit import ConfigurationError, HostPlacement, Synchronous
from conduit_rllib import UnsupportedConfigError
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.utils import force_list


def _dqn(**extra: Any) -> Any:
    return (DQNConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0)
            .learners(num_learners=0)
            .training(train_batch_size_per_learner=8, num_steps_sampled_before_learning_starts=16,
                      replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 500, **extra})
            .rl_module(model_config={"fcnet_hiddens": [16]})
            .reporting(min_sample_timesteps_per_iteration=32)
            .debugging(seed=0, log_level="ERROR"))


@pytest.mark.usefixtures("ray_local")
def test_metrics_every_in_the_replay_config_reaches_the_stock_types_buffer() -> None:
    algo: Any = conduit_rllib.enable(_dqn(metrics_every=4)).build_algo()
    try:
        assert algo.local_replay_buffer.metrics_every == 4, "was 1: the config's metrics_every was dropped"
    finally:
        algo.stop()
    with pytest.raises(ConfigurationError, match="metrics_every must be an int >= 1"):
        conduit_rllib.enable(_dqn(metrics_every=0)).build_algo()  # refused as the buffer refuses it


@pytest.mark.parametrize(("key", "value", "where"), [
    ("placement", HostPlacement(), r"enable\(config, placement="),
    ("scheduler", Synchronous(), r"enable\(config, scheduler="),
    ("device", "cpu", "learner's device"),
])
def test_options_enable_sets_itself_are_refused_in_the_replay_config(key: str, value: Any, where: str) -> None:
    config = _dqn(**{key: value})
    rbc_before = dict(config.replay_buffer_config)
    with pytest.raises(UnsupportedConfigError, match=where) as err:
        conduit_rllib.enable(config)  # was: accepted, the value never used
    assert repr(key) in str(err.value), "the error names the key"
    assert config.replay_buffer_config == rbc_before and not conduit_rllib.is_enabled(config)
    assert not force_list(config.callbacks_on_algorithm_init), "nothing was wired in"
    # given after enable, the build refuses it the same way (checked again there)
    later = conduit_rllib.enable(_dqn())
    later.training(replay_buffer_config={**later.replay_buffer_config, key: value})
    from conduit_rllib.enable import _check_still_served

    with pytest.raises(UnsupportedConfigError, match=where):
        _check_still_served(later)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("rb_type", ["EpisodeReplayBuffer", "PrioritizedEpisodeReplayBuffer"])
def test_a_replay_config_without_capacity_or_alpha_gets_the_defaults_rllibs_buffer_has(rb_type: str) -> None:
    """RLlib replaces the whole replay_buffer_config when its type changes, so it may hold no capacity (or alpha):
    RLlib's buffer then has its constructor's defaults. Conduit's buffer was built with capacity 50,000."""
    from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
    from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

    config = _dqn()
    config.training(replay_buffer_config={"type": "EpisodeReplayBuffer"})  # (a type change: the dict replaced)
    config.training(replay_buffer_config={"type": rb_type})
    assert config.replay_buffer_config == {"type": rb_type}, "RLlib's config holds no capacity or alpha"
    native = {"EpisodeReplayBuffer": EpisodeReplayBuffer,
              "PrioritizedEpisodeReplayBuffer": PrioritizedEpisodeReplayBuffer}[rb_type]()
    algo: Any = conduit_rllib.enable(config).build_algo()
    try:
        buf = algo.local_replay_buffer
        assert buf.capacity == native.capacity, f"capacity {buf.capacity}, RLlib's buffer has {native.capacity}"
        if rb_type == "PrioritizedEpisodeReplayBuffer":
            assert buf._alpha == native._alpha, f"alpha {buf._alpha}, RLlib's buffer has {native._alpha}"
    finally:
        algo.stop()
