"""The RLlib adapter, as a demanding user: stopping an off-policy algorithm ends its replay
buffer's worker threads, a second ``build()`` of a PPO learner keeps its minibatch feed, a ``sample()`` with an
``n_step`` or ``gamma`` it cannot use is refused typed before it draws, and ``enable`` on a frozen config says
what to do."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, cast

import conduit
import conduit_rllib
import gymnasium as gym
import numpy as np
import pytest
import torch
from conduit import ConfigurationError
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, UnsupportedConfigError
from conduit_rllib.learner import ON_POLICY_COMPONENT, ConduitDQNTorchLearner
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from conduit_rllib.testing import id_episode
from conduit_rllib.workloads import dqn_large_obs
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch


def overlapped() -> conduit.Overlapped:
    """The scheduler the README suggests for DQN/SAC (draws prepared on a worker thread)."""
    return conduit.Overlapped(g_del=2, background_ingest=False)


def conduit_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("conduit") and t.is_alive()}


# -- close/cleanup: the off-policy learner's shutdown closes the replay buffer ---------------------------------

def test_learner_shutdown_ends_the_replay_buffers_worker_threads() -> None:
    """``LearnerGroup.shutdown`` (what ``algo.stop()`` calls) reaches ``Learner.shutdown``; for PPO that stops the
    feed's thread, and for DQN/SAC it left the replay buffer's prefetch thread (and its delivery buffers) alive."""
    learner = conduit_rllib.enable(DQNConfig().environment("CartPole-v1")).build_learner(
        env=gym.make("CartPole-v1"))
    assert isinstance(learner, ConduitDQNTorchLearner)
    before = conduit_threads()
    buf = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, seed=0, scheduler=overlapped())
    learner.conduit_attach_replay(buf)
    buf.add([id_episode(np.arange(30), episode_id="e")])
    buf.sample(num_items=8, n_step=1, beta=0.4, **DQN_KW)
    started = conduit_threads() - before
    assert started, "the overlapped scheduler runs a worker thread"
    learner.shutdown()
    assert not [t.name for t in started if t.is_alive()], "the learner's shutdown left the buffer's threads running"
    assert buf.edp is not None and buf.edp.closed
    assert len(buf) == 30 and buf.get_state()["next"] == 30, "a closed buffer still reports and saves its contents"
    with pytest.raises(ConfigurationError):
        buf.add([id_episode(np.arange(3), episode_id="f")])
    assert len(buf) == 30
    learner.shutdown()  # a second stop is harmless


def test_shutting_down_a_learner_without_a_buffer_is_harmless() -> None:
    learner: Any = conduit_rllib.enable(DQNConfig().environment("CartPole-v1")).build_learner(
        env=gym.make("CartPole-v1"))
    learner.shutdown()
    assert learner.conduit_replay is None


@pytest.mark.usefixtures("ray_local")
def test_stopping_a_dqn_algorithm_stops_its_replay_buffers_threads(tmp_path: Path) -> None:
    """``algo.stop()`` left the prefetch thread running as long as the algorithm object lived. Now it closes the
    buffer: the stopped algorithm still saves it, a checkpoint taken then trains on in a new algorithm, and the
    stopped one refuses to train, saying what to do."""
    before = conduit_threads()
    config = dqn_large_obs(4, steps=40, batch=8, capacity=100, learning_starts=20)
    config.training(store_buffer_in_checkpoints=True)  # its checkpoints hold the buffer
    algo = conduit_rllib.enable(config, scheduler=overlapped).build_algo()
    try:
        algo.train()
        buf: Any = algo.local_replay_buffer
        started = conduit_threads() - before
        assert started, "training with the overlapped scheduler runs the buffer's worker thread"
        stored = len(buf)
    finally:
        algo.stop()
    assert not [t.name for t in started if t.is_alive()], "algo.stop() left the replay buffer's threads running"
    path = algo.save_to_path(tmp_path / "after_stop")
    with pytest.raises(ConfigurationError, match=r"closed.*stop\(\).*from_checkpoint"):
        algo.train()
    assert len(buf) == stored, "the refused training step stored nothing"
    restored = Algorithm.from_checkpoint(path)
    try:
        rb: Any = restored.local_replay_buffer
        assert rb is not buf and len(rb) == stored, "the checkpoint taken after stop() holds the buffer"
        restored.train()
        assert len(rb) == min(100, stored + 40)
    finally:
        restored.stop()


# -- PPO: Learner.build() is idempotent (RLlib skips a second build) -----------------------------------------------

def ppo_train_batch(n: int) -> MultiAgentBatch:
    ids = torch.arange(n)
    return MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({
        Columns.OBS: ids.float()[:, None].repeat(1, 4) / n, Columns.ACTIONS: ids % 2,
        Columns.ACTION_LOGP: torch.full((n,), -0.69), Columns.ACTION_DIST_INPUTS: torch.zeros(n, 2),
        "advantages": ids.float() / n, "value_targets": torch.zeros(n), Columns.VF_PREDS: torch.zeros(n),
        "row_id": ids})}, env_steps=n)


def minibatch_rows(learner: Any, rows: int) -> list[list[int]]:
    """The row ids of each minibatch of one update (64 rows, 2 epochs, shuffled), as RLlib's update loop takes them."""
    it = learner._create_iterator_if_necessary(training_data=TrainingData(batch=ppo_train_batch(rows)),
                                               num_epochs=2, minibatch_size=64, shuffle_batch_per_epoch=True)
    return [mb.policy_batches[DEFAULT_MODULE_ID]["row_id"].tolist() for mb in it]


def test_a_second_build_keeps_the_ppo_feed_its_state_and_its_thread() -> None:
    """``config.build_learner()`` returns a built learner, and RLlib's ``Learner.build()`` skips a second call; the
    Conduit mixin built a new feed each time: the minibatch order restarted from the seed (the same shuffles
    again), the version-stamped state was lost, and the old feed's prefetch thread stayed behind."""
    def built() -> Any:
        return conduit_rllib.enable(PPOConfig().environment("CartPole-v1").debugging(seed=0)).build_learner(
            env=gym.make("CartPole-v1"))

    learner, reference = built(), built()
    try:
        assert minibatch_rows(learner, 200) == minibatch_rows(reference, 200)
        feed, state = learner.conduit_feed, learner.conduit_feed.state_dict()
        threads = conduit_threads()
        learner.build()
        assert learner.conduit_feed is feed, "a second build() replaced the feed"
        after = feed.state_dict()
        assert after.keys() == state.keys() and all(
            torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k] for k, v in state.items())
        assert conduit_threads() == threads
        assert minibatch_rows(learner, 200) == minibatch_rows(reference, 200), \
            "the next update's minibatches are the ones a learner built once makes"
        assert learner.conduit_version == 2
    finally:
        learner.shutdown()
        reference.shutdown()


def test_a_ppo_learners_set_state_before_build_raises_rllibs_own_error() -> None:
    """RLlib's ``Learner.set_state`` before ``build()`` raises its ValueError saying build() must be called; the PPO
    mixin read its feed (which build makes) first, so a state with Conduit's part raised AttributeError instead."""
    env = gym.make("CartPole-v1")
    config = conduit_rllib.enable(PPOConfig().environment("CartPole-v1"))
    built = config.build_learner(env=env)
    try:
        state = built.get_state()
    finally:
        built.shutdown()
    assert ON_POLICY_COMPONENT in state
    unbuilt = config.learner_class(config=config, module_spec=config.get_multi_rl_module_spec(env=env))
    with pytest.raises(ValueError, match=r"build\(\) must be called"):
        unbuilt.set_state(state)


# -- sample(): n_step and gamma are checked before anything is drawn -------------------------------------------

BAD = [{"n_step": "3"}, {"n_step": 2.5}, {"n_step": True}, {"n_step": (1, 3, 9)}, {"n_step": (1, "x")},
       {"n_step": (1.0, 3)}, {"n_step": 3, "gamma": float("nan")}, {"n_step": 3, "gamma": float("inf")},
       {"n_step": 3, "gamma": None}, {"n_step": 3, "gamma": "0.9"}, {"n_step": 1, "gamma": None}]


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "prioritized"])
@pytest.mark.parametrize("bad", BAD, ids=[repr(b) for b in BAD])
def test_an_n_step_or_gamma_sample_cannot_use_is_refused_typed_and_draws_nothing(
        prioritized: bool, bad: dict[str, Any]) -> None:
    """Before: n_step "3" or 2.5 or a 3-tuple was read silently (as 3, 2 and its first two values), a NaN gamma
    delivered NaN rewards, and gamma=None raised a TypeError after the draw had moved the sampler on."""
    cls = ConduitPrioritizedEpisodeReplayBuffer if prioritized else ConduitEpisodeReplayBuffer
    a, b = cls(capacity=100, seed=0), cls(capacity=100, seed=0)
    for buf in (a, b):
        buf.add([id_episode(np.arange(40), episode_id="e")])
    with pytest.raises(ConfigurationError, match="n_step|gamma"):
        a.sample(num_items=8, **(DQN_KW | {"beta": 0.4, "gamma": 0.9} | bad))
    x = a.sample(num_items=16, n_step=3, gamma=0.9, beta=0.4, **DQN_KW)
    y = b.sample(num_items=16, n_step=3, gamma=0.9, beta=0.4, **DQN_KW)
    assert torch.equal(x.handles, y.handles), "the refused sample() consumed a draw"
    assert a.get_sampled_timesteps() == 16


def test_numpy_n_step_and_gamma_are_taken_as_their_values() -> None:
    a, b = ConduitEpisodeReplayBuffer(capacity=100, seed=1), ConduitEpisodeReplayBuffer(capacity=100, seed=1)
    for buf in (a, b):
        buf.add([id_episode(np.arange(40), episode_id="e")])
    x = a.sample(num_items=16, n_step=cast(Any, np.int64(3)), gamma=cast(Any, np.float32(0.5)), **DQN_KW)
    y = b.sample(num_items=16, n_step=3, gamma=0.5, **DQN_KW)
    for k in x.columns:
        assert torch.equal(x.columns[k], y.columns[k]), k
    r = a.sample(num_items=64, n_step=cast(Any, (np.int64(1), np.int64(4))), gamma=0.5, **DQN_KW)
    assert set(r.columns["n_step"].tolist()) <= {1, 2, 3}


# -- bad configuration: a frozen config ---------------------------------------------------------------------------

@pytest.mark.parametrize("config_class", [DQNConfig, PPOConfig], ids=["dqn", "ppo"])
def test_enable_on_a_frozen_config_is_refused_typed_and_says_what_to_do(config_class: Any) -> None:
    """``enable(algo.config)`` (the config a built algorithm holds, frozen) raised RLlib's AttributeError."""
    config = config_class().environment("CartPole-v1")
    config.freeze()
    with pytest.raises(UnsupportedConfigError, match="copy_frozen=False"):
        conduit_rllib.enable(config)
    assert config._learner_class is None and not conduit_rllib.is_enabled(config), "the refused call changed it"
    assert conduit_rllib.is_enabled(conduit_rllib.enable(config.copy(copy_frozen=False)))


BAD_OPTIONS = [("dqn", {"scheduler": conduit.Overlapped(g_del=2, background_ingest=False)}),
               ("dqn", {"scheduler": "overlapped"}), ("dqn", {"placement": "cuda"}),
               ("dqn", {"placement": conduit.HostPlacement}), ("ppo", {"placement": "cpu"}),
               # a factory that needs an argument: accepted, then a bare TypeError inside build_algo
               ("dqn", {"scheduler": lambda g_del: conduit.Overlapped(g_del=g_del, background_ingest=False)})]


@pytest.mark.parametrize(("algo", "options"), BAD_OPTIONS,
                         ids=[f"{a}-{k}={getattr(v, '__name__', None) or v!r}" for a, o in BAD_OPTIONS
                              for k, v in o.items()])
def test_enable_refuses_a_scheduler_or_placement_of_the_wrong_kind_and_changes_nothing(
        algo: str, options: dict[str, Any]) -> None:
    """A Scheduler instance where a factory belongs (what the buffer itself takes), a name, or a Placement class was
    accepted and failed only once the algorithm was built or trained, untyped (``'Overlapped' object is not
    callable``, an AttributeError at the first add or update); so was a factory that cannot be called without
    arguments (``<lambda>() missing 1 required positional argument``, a TypeError from ``build_algo``)."""
    config = (DQNConfig() if algo == "dqn" else PPOConfig()).environment("CartPole-v1")
    with pytest.raises(UnsupportedConfigError, match="factory|Placement instance"):
        conduit_rllib.enable(config, **options)
    assert config._learner_class is None and not config.callbacks_on_algorithm_init, "the refused call changed it"


@pytest.mark.usefixtures("ray_local")
def test_a_scheduler_factory_returning_no_scheduler_is_refused_typed_at_build() -> None:
    config = conduit_rllib.enable(dqn_large_obs(4, steps=20, batch=8, capacity=50, learning_starts=10),
                                  scheduler=cast(Any, lambda: "overlapped"))
    with pytest.raises(UnsupportedConfigError, match="returned 'overlapped', not a conduit Scheduler"):
        config.build_algo()
