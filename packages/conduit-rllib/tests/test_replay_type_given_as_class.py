"""``replay_buffer_config["type"]`` given as a class, not a name or dotted path.

RLlib 2.60's ``build_algo`` tests the type with ``in`` in its buffer set-up, so a class there raised
``TypeError: argument of type 'ABCMeta' is not iterable`` before Conduit's callback ran, although ``enable``
accepted it. ``enable`` now writes the class into the config as a form RLlib builds (RLlib's own buffers by name,
any other class by its dotted path), and refuses a class no dotted path names (defined in a function, nested in a
class) with a typed error that says what to do, leaving the config unchanged.
"""

from __future__ import annotations

from typing import Any

import conduit_rllib
import pytest
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, UnsupportedConfigError
from conduit_rllib.enable import InstallReplayBuffer
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.utils import force_list
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer


class MyUniformBuffer(ConduitEpisodeReplayBuffer):
    """A user's subclass of Conduit's uniform buffer, defined at module level."""


class Holder:
    class NestedBuffer(ConduitEpisodeReplayBuffer):
        """Nested in a class: its qualname has a dot, so no ``module.Class`` path names it."""


def _dqn(rb_type: object) -> Any:
    return DQNConfig().training(replay_buffer_config={"type": rb_type, "capacity": 500})


def _tiny_cartpole_dqn(rb_type: type) -> Any:
    return (DQNConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0)
            .learners(num_learners=0)
            .training(lr=5e-4, train_batch_size=8, num_steps_sampled_before_learning_starts=16,
                      replay_buffer_config={"type": rb_type, "capacity": 500})
            .rl_module(model_config={"fcnet_hiddens": [16]})
            .reporting(min_sample_timesteps_per_iteration=32)
            .debugging(seed=0, log_level="ERROR"))


# -- a class enable() can name is written into the config as RLlib builds it --------------------------------
@pytest.mark.parametrize(("cls", "written"), [
    (EpisodeReplayBuffer, "EpisodeReplayBuffer"),
    (PrioritizedEpisodeReplayBuffer, "PrioritizedEpisodeReplayBuffer"),
    (ConduitPrioritizedEpisodeReplayBuffer, "conduit_rllib.replay.ConduitPrioritizedEpisodeReplayBuffer"),
    (MyUniformBuffer, f"{__name__}.MyUniformBuffer"),
], ids=["rllib-uniform", "rllib-prioritized", "conduit-class", "user-subclass"])
def test_enable_writes_a_buffer_class_as_the_name_or_dotted_path_rllib_builds(cls: type, written: str) -> None:
    from conduit_rllib.enable import _replay_class  # the class InstallReplayBuffer builds

    config = _dqn(cls)
    want = _replay_class(config)
    conduit_rllib.enable(config)
    assert config.replay_buffer_config == {"type": written, "capacity": 500}, (
        f"the class {cls.__name__} is written as {written!r}, the other keys kept: {config.replay_buffer_config}")
    assert _replay_class(config) is want, "the written type builds the same Conduit buffer as the class did"
    conduit_rllib.enable(config)  # twice: harmless, the written form stays
    assert config.replay_buffer_config["type"] == written and conduit_rllib.is_enabled(config)


# -- and the algorithm builds, trains, and uses Conduit's buffer --------------------------------------------
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(("cls", "want"), [
    (PrioritizedEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer),
    (MyUniformBuffer, MyUniformBuffer),
], ids=["rllib-class", "user-subclass"])
def test_a_dqn_whose_buffer_type_is_a_class_builds_and_trains_on_conduits_buffer(cls: type, want: type) -> None:
    config = conduit_rllib.enable(_tiny_cartpole_dqn(cls))
    algo: Any = config.build_algo()  # was: TypeError: argument of type 'ABCMeta' is not iterable
    try:
        buf = algo.local_replay_buffer
        assert type(buf) is want, f"type {cls.__name__} given as a class: Conduit's {want.__name__} is used, got {buf}"
        algo.train()
        assert algo.local_replay_buffer is buf, "the training iteration ran on the buffer Conduit installed"
        assert buf.get_added_timesteps() > 0, "the env steps of the iteration went into Conduit's buffer"
        updates = next(iter(algo.learner_group.foreach_learner(lambda learner: learner.conduit_batches))).get()
        assert updates > 0, "the learner trained on Conduit's samples"
    finally:
        algo.stop()


# -- a class no dotted path names is refused, the config unchanged ------------------------------------------
def test_a_buffer_class_defined_in_a_function_or_nested_in_a_class_is_refused_and_the_config_unchanged() -> None:
    class LocalBuffer(ConduitEpisodeReplayBuffer):
        """Defined in a function: '<locals>' in its qualname, no module attribute names it."""

    for cls in (LocalBuffer, Holder.NestedBuffer):
        config = _dqn(cls)
        learner_before, hooks_before = config._learner_class, force_list(config.callbacks_on_algorithm_init)
        with pytest.raises(UnsupportedConfigError, match=r"module level.*dotted path") as err:
            conduit_rllib.enable(config)
        assert cls.__qualname__ in str(err.value), "the error names the class it refuses"
        assert config.replay_buffer_config == {"type": cls, "capacity": 500}, "the replay config is unchanged"
        assert config._learner_class is learner_before and not conduit_rllib.is_enabled(config)
        hooks = force_list(config.callbacks_on_algorithm_init)
        assert hooks == hooks_before and not any(isinstance(h, InstallReplayBuffer) for h in hooks)
