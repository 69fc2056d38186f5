"""RLlib's ``store_buffer_in_checkpoints`` (DQN/SAC, default False) decides whether checkpoints hold the buffer.

The Conduit off-policy learner saved its replay buffer in every learner state, so every ``algo.save_to_path``
wrote the whole buffer (capacity x observation size: 20 GB for 1M x 5000 float32) although the user left RLlib's
flag at its default. Now the buffer is in the learner's state only with the flag set, or when the caller names
:data:`~conduit_rllib.learner.REPLAY_COMPONENT` in ``components``; a state that holds a replay part is restored
whatever the flag. Real DQN algorithms built through ``conduit_rllib.enable`` on a local Ray, tiny settings.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pickle  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import conduit_rllib  # noqa: E402
import gymnasium as gym  # noqa: E402
import torch  # noqa: E402
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer  # noqa: E402
from conduit_rllib.learner import REPLAY_COMPONENT, ConduitDQNTorchLearner  # noqa: E402
from conduit_rllib.workloads import dqn_large_obs  # noqa: E402
from ray.rllib.algorithms.algorithm import Algorithm  # noqa: E402
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig  # noqa: E402
from ray.rllib.algorithms.dqn import DQNConfig  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_offpolicy_learner_state import filled, same  # noqa: E402, I001  (sibling test helpers)


def learner_of(algo: Algorithm) -> Any:
    return next(iter(algo.learner_group.foreach_learner(lambda learner: learner))).get()


def dqn(*, store: bool | None) -> Algorithm:
    """A Conduit DQN (4-dimensional observations, prioritized buffer of 100, learning from step 20) with
    ``store_buffer_in_checkpoints`` set to ``store`` (None: left at RLlib's default)."""
    config = dqn_large_obs(4, steps=40, batch=8, capacity=100, learning_starts=20)
    if store is not None:
        config.training(store_buffer_in_checkpoints=store)
    return conduit_rllib.enable(config).build_algo()


def saved_replay_parts(path: str | Path) -> list[Path]:
    """The state files under a checkpoint directory whose state holds a Conduit replay part."""
    found = []
    files = sorted(Path(path).rglob("state.pkl"))
    assert files, f"no state.pkl under the checkpoint {path}: the check would look at nothing"
    for f in files:
        with f.open("rb") as fh:
            state = pickle.load(fh)
        if isinstance(state, dict) and REPLAY_COMPONENT in state:
            found.append(f)
    return found


def test_by_default_a_checkpoint_holds_no_buffer_and_the_restored_algorithm_trains_on(
        ray_local: None, tmp_path: Path) -> None:
    algo = dqn(store=None)
    try:
        assert algo.config.store_buffer_in_checkpoints is False, "RLlib's default changed: revisit this test"
        algo.train()
        buf = algo.local_replay_buffer
        assert isinstance(buf, ConduitPrioritizedEpisodeReplayBuffer) and len(buf) == 40
        learner = learner_of(algo)
        assert learner.conduit_batches > 0, "the first iteration trained from Conduit"
        assert not learner.conduit_stores_buffer_in_checkpoints
        assert REPLAY_COMPONENT not in learner.get_state(), "the flag is off, yet the learner state holds the buffer"
        # asked for by name, the buffer's state comes whatever the flag
        same(learner.get_state(components=REPLAY_COMPONENT)[REPLAY_COMPONENT], buf.get_state(), "the named part")
        path = algo.save_to_path(tmp_path / "default")
    finally:
        algo.stop()
    assert saved_replay_parts(path) == [], "a checkpoint saved with the flag off holds the replay buffer"
    restored = Algorithm.from_checkpoint(path)
    try:
        rb = restored.local_replay_buffer
        assert isinstance(rb, ConduitPrioritizedEpisodeReplayBuffer) and rb is not buf
        assert len(rb) == 0 and rb.get_added_timesteps() == 0, "the restored buffer holds contents nobody saved"
        rl = learner_of(restored)
        assert rl.conduit_replay is rb and rl.conduit_batches == 0
        result = restored.train()  # learning already started (the counters were saved): it trains from the new adds
        assert len(rb) == 40
        assert rl.conduit_batches > 0, "the restored algorithm did not train from its (refilled) buffer"
        assert float(result["learners"]["__all_modules__"]["num_env_steps_trained"]) > 0
    finally:
        restored.stop()


def test_with_the_flag_the_checkpoint_holds_the_buffer_and_restores_it(ray_local: None, tmp_path: Path) -> None:
    algo = dqn(store=True)
    try:
        algo.train()
        buf = algo.local_replay_buffer
        assert len(buf) == 40
        assert REPLAY_COMPONENT in learner_of(algo).get_state(), "the flag is on, yet the state lacks the buffer"
        before = buf.get_state()
        path = algo.save_to_path(tmp_path / "stored")
    finally:
        algo.stop()
    assert len(saved_replay_parts(path)) == 1, "one learner state file holds the replay buffer"
    restored = Algorithm.from_checkpoint(path)
    try:
        rb = restored.local_replay_buffer
        assert isinstance(rb, ConduitPrioritizedEpisodeReplayBuffer) and rb is not buf
        assert len(rb) == len(buf) == 40
        after = rb.get_state()
        for k, v in before["edp"]["storage"]["data"].items():
            assert torch.equal(after["edp"]["storage"]["data"][k], v), f"column {k} not restored"
        assert torch.equal(after["edp"]["semantics"]["sampler"]["leaves"],
                           before["edp"]["semantics"]["sampler"]["leaves"]), "the priorities were not restored"
        twin = ConduitPrioritizedEpisodeReplayBuffer(capacity=100, seed=0)
        twin.set_state(before)
        x = twin.sample(num_items=8, n_step=1, beta=0.4, sample_episodes=True)
        y = rb.sample(num_items=8, n_step=1, beta=0.4, sample_episodes=True)
        assert torch.equal(x.columns[Columns.OBS], y.columns[Columns.OBS]), "the restored sampler draws otherwise"
        restored.train()
        assert len(rb) == 80
    finally:
        restored.stop()
    # a state that holds a replay part restores it whatever the flag: into an algorithm that leaves it off
    plain = dqn(store=None)
    try:
        assert len(plain.local_replay_buffer) == 0
        plain.restore_from_path(path)
        assert len(plain.local_replay_buffer) == 40, "a flag-off algorithm ignored the checkpoint's buffer"
        same(plain.local_replay_buffer.get_state()["edp"]["storage"], before["edp"]["storage"], "the restored storage")
    finally:
        plain.stop()


def test_a_named_replay_component_comes_whatever_the_flag_and_not_components_still_excludes_it() -> None:
    """A learner built locally (no Ray), the flag at its default."""
    config = conduit_rllib.enable(DQNConfig().environment("CartPole-v1").debugging(seed=0))
    learner = config.build_learner(env=gym.make("CartPole-v1"))
    assert isinstance(learner, ConduitDQNTorchLearner)
    try:
        buf = filled(ConduitEpisodeReplayBuffer, 0, 6)
        learner.conduit_attach_replay(buf)
        assert REPLAY_COMPONENT not in learner.get_state()
        assert REPLAY_COMPONENT not in learner.get_state(components="rl_module"), "named other parts only"
        same(learner.get_state(components=REPLAY_COMPONENT)[REPLAY_COMPONENT], buf.get_state(), "named alone")
        both = learner.get_state(components=[REPLAY_COMPONENT, "rl_module"])
        assert "rl_module" in both
        same(both[REPLAY_COMPONENT], buf.get_state(), "named with RLlib's part")
        assert REPLAY_COMPONENT not in learner.get_state(components=REPLAY_COMPONENT, not_components=REPLAY_COMPONENT)
        # before a buffer is attached: the kept part likewise only when named
        kept = filled(ConduitPrioritizedEpisodeReplayBuffer, 0, 4).get_state()
        learner.conduit_replay = None
        learner.set_state({REPLAY_COMPONENT: kept})  # restored whatever the flag (kept for the buffer to come)
        assert REPLAY_COMPONENT not in learner.get_state()
        same(learner.get_state(components=REPLAY_COMPONENT)[REPLAY_COMPONENT], kept, "the kept part, named")
        # a config without the attribute (RLlib's base AlgorithmConfig, PPO's) counts as RLlib's default, False
        own = learner.config
        learner.config = AlgorithmConfig()
        try:
            assert not hasattr(learner.config, "store_buffer_in_checkpoints")
            assert not learner.conduit_stores_buffer_in_checkpoints
            assert REPLAY_COMPONENT not in learner.get_state()
        finally:
            learner.config = own
        learner.config.store_buffer_in_checkpoints = True  # (the learner's own copy of the config)
        assert learner.conduit_stores_buffer_in_checkpoints
        same(learner.get_state()[REPLAY_COMPONENT], kept, "the kept part, with the flag on")
    finally:
        learner.conduit_drop_kept_replay_state()
        learner.shutdown()
