"""``replay_buffer_config["type"]`` forms ``enable`` accepts must be ones RLlib 2.60's ``build_algo`` builds.

Two of them failed at ``build_algo`` with RLlib's untyped ``ValueError`` after ``enable`` had accepted them:

* a plain Conduit name (``"ConduitPrioritizedEpisodeReplayBuffer"``), which ``enable`` resolves but RLlib's
  buffer set-up does not (it looks plain names up among its own buffers), for DQN and SAC;
* for SAC, any form but RLlib's own buffer names: ``SACConfig.validate`` takes the literal names only, so
  Conduit's own buffer given as a class or dotted path failed too.

``enable`` now writes Conduit's own buffers (and RLlib's, and RLlib subclasses Conduit replaces) where RLlib would
not build them as RLlib's name of their kind, and refuses a subclass of Conduit's buffer for SAC, typed, with the
config unchanged (SAC's check cannot take it, with or without Conduit).
"""

from __future__ import annotations

from typing import Any

import conduit_rllib
import pytest
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, UnsupportedConfigError
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.sac import SACConfig


class MySACBuffer(ConduitPrioritizedEpisodeReplayBuffer):
    """A user's subclass of Conduit's prioritized buffer, defined at module level (DQN builds it)."""


def _tiny(make: type, rb_type: object) -> Any:
    env = "CartPole-v1" if make is DQNConfig else "Pendulum-v1"
    return (make()
            .environment(env)
            .env_runners(num_env_runners=0)
            .learners(num_learners=0)
            .training(train_batch_size_per_learner=8, num_steps_sampled_before_learning_starts=16,
                      replay_buffer_config={"type": rb_type, "capacity": 500})
            .rl_module(model_config={"fcnet_hiddens": [16]})
            .reporting(min_sample_timesteps_per_iteration=32)
            .debugging(seed=0, log_level="ERROR"))


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(("make", "rb_type", "want"), [
    (DQNConfig, "ConduitPrioritizedEpisodeReplayBuffer", ConduitPrioritizedEpisodeReplayBuffer),
    (DQNConfig, "ConduitEpisodeReplayBuffer", ConduitEpisodeReplayBuffer),
    (SACConfig, "ConduitPrioritizedEpisodeReplayBuffer", ConduitPrioritizedEpisodeReplayBuffer),
    (SACConfig, ConduitEpisodeReplayBuffer, ConduitEpisodeReplayBuffer),
    (SACConfig, "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer", ConduitPrioritizedEpisodeReplayBuffer),
], ids=["dqn-conduit-name", "dqn-conduit-uniform-name", "sac-conduit-name", "sac-conduit-class",
        "sac-conduit-dotted-path"])
def test_a_type_enable_accepts_builds_and_trains_on_conduits_buffer_of_that_kind(make: type, rb_type: object,
                                                                                 want: type) -> None:
    config = conduit_rllib.enable(_tiny(make, rb_type))
    # was: ValueError from RLlib's build ("String specifier ... must be a valid filename" for a plain Conduit
    # name; SAC: "the replay buffer must be of type `EpisodeReplayBuffer`")
    algo: Any = config.build_algo()
    try:
        buf = algo.local_replay_buffer
        assert type(buf) is want, f"type {rb_type!r}: Conduit's {want.__name__} is used, got {type(buf).__name__}"
        assert buf.capacity == 500, "the config's other keys still reach the buffer"
        algo.train()
        assert algo.local_replay_buffer is buf and buf.get_added_timesteps() > 0, "the iteration stored into it"
        updates = next(iter(algo.learner_group.foreach_learner(lambda learner: learner.conduit_batches))).get()
        assert updates > 0, "the learner trained on Conduit's samples"
    finally:
        algo.stop()


@pytest.mark.parametrize("rb_type", [MySACBuffer, f"{__name__}.MySACBuffer"], ids=["class", "dotted-path"])
def test_sac_with_a_subclass_of_conduits_buffer_is_refused_typed_and_the_config_unchanged(rb_type: object) -> None:
    config = _tiny(SACConfig, rb_type)
    learner_before = config._learner_class
    with pytest.raises(UnsupportedConfigError, match=r"SAC.*'PrioritizedEpisodeReplayBuffer'") as err:
        conduit_rllib.enable(config)  # was: accepted, then build_algo raised RLlib's ValueError
    assert "MySACBuffer" in str(err.value), "the error names the class SAC cannot build"
    assert config.replay_buffer_config == {"type": rb_type, "capacity": 500}, "the replay config is unchanged"
    assert config._learner_class is learner_before and not conduit_rllib.is_enabled(config)
    # DQN builds the same subclass (its config check takes a dotted path): still accepted there
    assert conduit_rllib.is_enabled(conduit_rllib.enable(_tiny(DQNConfig, rb_type)))
