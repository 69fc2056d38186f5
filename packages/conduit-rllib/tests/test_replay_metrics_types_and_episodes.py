"""The off-policy replay path as an RLlib user meets it: the buffer's metrics in every training iteration's
results, ``replay_buffer_config["type"]`` as a dotted path (resolved as RLlib resolves it), and sampled
transitions that carry their source episode's id.

Buffer-level tests drive Conduit's buffers through the calls RLlib's DQN training step makes (no Ray needed);
the test marked with ``ray_local`` builds a real (tiny) DQN.
"""

from __future__ import annotations

from typing import Any

import conduit_rllib
import numpy as np
import pytest
from conduit_rllib import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, UnsupportedConfigError
from conduit_rllib.testing import DQN_SAMPLE_KWARGS as DQN_KW
from conduit_rllib.testing import id_episode
from conduit_rllib.workloads import dqn_large_obs
from ray.rllib.algorithms.dqn import DQNConfig
from ray.rllib.utils.metrics import NUM_ENV_STEPS_ADDED_LIFETIME, NUM_ENV_STEPS_SAMPLED_LIFETIME, REPLAY_BUFFER_RESULTS
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer


class TaggedPrioritizedBuffer(ConduitPrioritizedEpisodeReplayBuffer):
    """A user's subclass of Conduit's buffer, with an option of its own from replay_buffer_config."""

    def __init__(self, *args: Any, tag: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


class MyRLlibUniformBuffer(EpisodeReplayBuffer):
    """A user's subclass of RLlib's EpisodeReplayBuffer (the class Conduit replaces)."""


class MyRLlibPrioritizedBuffer(PrioritizedEpisodeReplayBuffer):
    """A user's subclass of RLlib's PrioritizedEpisodeReplayBuffer (the class Conduit replaces)."""


def _dqn(rb_type: object) -> Any:
    return DQNConfig().training(replay_buffer_config={"type": rb_type, "capacity": 100, "alpha": 0.5})


# -- 1. the buffer's metrics in every iteration's results --------------------------------------------------
@pytest.mark.usefixtures("ray_local")
def test_an_iteration_with_few_updates_reports_the_replay_buffer_metrics_and_types_resolve_by_dotted_path() -> None:
    """20 env steps per iteration, learning from step 10: the first iteration makes about 11 learner updates,
    fewer than the 16 calls after which get_metrics logged (its results had no replay_buffer metrics). The
    buffer type is a dotted path naming a user's subclass of Conduit's buffer (was refused by enable)."""
    config = dqn_large_obs(4, steps=20, batch=8, capacity=100, learning_starts=10)
    config.training(replay_buffer_config={"type": f"{__name__}.TaggedPrioritizedBuffer", "capacity": 100,
                                          "alpha": 0.6, "beta": 0.4, "tag": "mine"})
    algo = conduit_rllib.enable(config).build_algo()
    try:
        buf = algo.local_replay_buffer
        assert type(buf) is TaggedPrioritizedBuffer and buf.tag == "mine" and buf._alpha == 0.6, (
            f"the dotted type names the user's subclass, built with the config's keys: got {type(buf)}")
        first = algo.train()
        updates = next(iter(algo.learner_group.foreach_learner(lambda learner: learner.conduit_batches))).get()
        assert 0 < updates < 16, f"the test needs an iteration with fewer than 16 updates, got {updates}"
        got = first.get(REPLAY_BUFFER_RESULTS, {})
        assert NUM_ENV_STEPS_ADDED_LIFETIME in got and NUM_ENV_STEPS_SAMPLED_LIFETIME in got, (
            f"an iteration with {updates} learner updates reported no replay buffer metrics: {sorted(got)}")
        assert 0 < got[NUM_ENV_STEPS_ADDED_LIFETIME] <= buf.get_added_timesteps(), got
        second = algo.train()
        again = second.get(REPLAY_BUFFER_RESULTS, {})
        assert again.get(NUM_ENV_STEPS_ADDED_LIFETIME, 0) > got[NUM_ENV_STEPS_ADDED_LIFETIME], (
            f"the second iteration reports the buffer's metrics too, counted on: {again}")
    finally:
        algo.stop()


@pytest.mark.parametrize("cls", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer])
def test_metrics_are_logged_on_the_first_call_of_each_iteration_not_on_every_call(cls: type) -> None:
    iteration = [0]
    buf = cls(capacity=20, seed=0, metrics_every=16)
    buf.iteration_of = lambda: iteration[0]
    buf.add([id_episode(np.arange(6))])

    def step() -> bool:
        buf.sample(num_items=4, n_step=1, beta=0.4, **DQN_KW)
        return bool(buf.get_metrics())

    logged = [step() for _ in range(5)]
    assert logged == [True, False, False, False, False], f"once per iteration (and every 16th call): {logged}"
    iteration[0] = 1
    assert [step() for _ in range(3)] == [True, False, False], "the next iteration's first call logs again"
    buf.iteration_of = None
    assert [step() for _ in range(8)] == [False] * 7 + [True], "without an iteration: every 16th call, as before"


def test_the_iteration_logged_last_is_part_of_the_checkpoint() -> None:
    a = ConduitEpisodeReplayBuffer(capacity=20, seed=0, metrics_every=16)
    a.iteration_of = lambda: 3
    a.add([id_episode(np.arange(6))])
    a.sample(num_items=4, n_step=1, **DQN_KW)
    assert a.get_metrics()
    b = ConduitEpisodeReplayBuffer(capacity=20, seed=0, metrics_every=16)
    b.iteration_of = lambda: 3
    b.set_state(a.get_state())
    for buf in (a, b):
        buf.sample(num_items=4, n_step=1, **DQN_KW)
    assert a.get_metrics() == {} and b.get_metrics() == {}, "iteration 3 logged already: the restored buffer knows"


# -- 2. replay_buffer_config["type"] as RLlib resolves it -----------------------------------------------------
@pytest.mark.parametrize(("rb_type", "want"), [
    (f"{__name__}.TaggedPrioritizedBuffer", TaggedPrioritizedBuffer),
    (f"{__name__}.MyRLlibPrioritizedBuffer", ConduitPrioritizedEpisodeReplayBuffer),
    (f"{__name__}.MyRLlibUniformBuffer", ConduitEpisodeReplayBuffer),
    ("conduit_rllib.ConduitEpisodeReplayBuffer", ConduitEpisodeReplayBuffer),
    ("ray.rllib.utils.replay_buffers.PrioritizedEpisodeReplayBuffer", ConduitPrioritizedEpisodeReplayBuffer),
    ("EpisodeReplayBuffer", ConduitEpisodeReplayBuffer),
    (TaggedPrioritizedBuffer, TaggedPrioritizedBuffer),
], ids=["conduit-subclass", "rllib-prioritized-subclass", "rllib-uniform-subclass", "conduit-class-by-path",
        "rllib-class-by-path", "plain-name", "class-object"])
def test_a_dotted_type_naming_a_supported_class_is_accepted(rb_type: object, want: type) -> None:
    from conduit_rllib.enable import _replay_class  # the class InstallReplayBuffer builds

    config = _dqn(rb_type)
    conduit_rllib.enable(config)  # was: UnsupportedConfigError for every dotted path of a user's class
    assert conduit_rllib.is_enabled(config)
    assert _replay_class(config) is want, f"{rb_type!r} builds {want.__name__}"


@pytest.mark.parametrize(("rb_type", "words"), [
    ("no_such_pkg_for_conduit.buffers.MyBuffer", r"does not resolve.*ModuleNotFoundError.*importable"),
    (f"{__name__}.NoSuchBuffer", r"does not resolve.*AttributeError"),
    ("collections.OrderedDict", r"Conduit replaces RLlib's episode replay buffers only"),
    # (a multi-agent buffer for a single-agent config; a multi-agent config takes it)
    ("ray.rllib.utils.replay_buffers.MultiAgentEpisodeReplayBuffer", r"single-agent, but .*a multi-agent buffer"),
    (f"{__name__}.DQN_KW", r"Conduit replaces RLlib's episode replay buffers only"),
], ids=["no-module", "no-class", "not-a-buffer", "multi-agent", "not-a-class"])
def test_a_dotted_type_that_does_not_resolve_or_names_another_class_is_a_typed_error(rb_type: str, words: str) -> None:
    config = _dqn(rb_type)
    learner_before = config._learner_class
    with pytest.raises(UnsupportedConfigError, match=words) as err:
        conduit_rllib.enable(config)
    assert "ConduitEpisodeReplayBuffer" in str(err.value), "the error says what to set instead"
    assert config._learner_class is learner_before and not conduit_rllib.is_enabled(config)


# -- 3. sampled transitions carry their source episode's id ---------------------------------------------------
def _filled(cls: type = ConduitPrioritizedEpisodeReplayBuffer) -> Any:
    buf = cls(capacity=30, seed=1)
    buf.add([id_episode(np.arange(0, 4), episode_id="ep-a"), id_episode(np.arange(10, 15), episode_id="ep-b")])
    buf.add([id_episode(np.arange(4, 7), episode_id="ep-a", terminated=True, t_started=4)])  # ep-a's second chunk
    return buf


def _source(obs_id: float) -> str:
    return "ep-a" if obs_id < 10 else "ep-b"


@pytest.mark.parametrize("cls", [ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer])
def test_a_sampled_transition_carries_its_source_episode_id_on_every_access(cls: type) -> None:
    s = _filled(cls).sample(num_items=24, n_step=1, beta=0.4, **DQN_KW)
    for i in range(len(s)):
        ep = s[i]
        want = _source(float(ep.get_observations(0)[0]))
        assert ep.id_ == want, f"transition {i} is from {want} but its episode has id {ep.id_!r}"
        assert s[i].id_ == s[i - len(s)].id_ == ep.id_, "the same id on every access (and by negative index)"
    assert {e.id_ for e in s} == {"ep-a", "ep-b"}


def test_episode_ids_survive_a_checkpoint_exactly() -> None:
    a = _filled()
    b = ConduitPrioritizedEpisodeReplayBuffer(capacity=30, seed=1)
    state = a.get_state()
    b.set_state(state)
    assert list(b.get_state()["episode_ids"]) == list(state["episode_ids"])
    sa, sb = (buf.sample(num_items=16, n_step=3, beta=0.4, **DQN_KW) for buf in (a, b))
    assert [e.id_ for e in sa] == [e.id_ for e in sb] and set(sa.episode_ids) <= {"ep-a", "ep-b"}
    # ids of steps added after the restore too, also through ring wrap-around
    for buf in (a, b):
        buf.add([id_episode(np.arange(20, 45), episode_id="ep-c")])
    sa, sb = (buf.sample(num_items=16, n_step=1, beta=0.4, **DQN_KW) for buf in (a, b))
    assert [e.id_ for e in sa] == [e.id_ for e in sb]
    assert all(e.id_ == ("ep-c" if e.get_observations(0)[0] >= 20 else _source(e.get_observations(0)[0]))
               for e in sa)


def test_a_state_saved_before_episode_ids_were_kept_loads_with_stable_ids() -> None:
    state = _filled().get_state()
    del state["episode_ids"]
    b = ConduitPrioritizedEpisodeReplayBuffer(capacity=30, seed=1)
    b.set_state(state)
    s = b.sample(num_items=8, n_step=1, beta=0.4, **DQN_KW)
    assert [s[i].id_ for i in range(8)] == [s[i].id_ for i in range(8)], "unknown sources: one id, kept"


@pytest.mark.parametrize("bad", [["ep"] * 3, [1] * 30], ids=["wrong-length", "not-str"])
def test_damaged_episode_ids_in_a_state_are_refused_and_change_nothing(bad: list[object]) -> None:
    from conduit import ConfigurationError

    state = _filled().get_state()
    state["episode_ids"] = bad
    b = _filled(ConduitPrioritizedEpisodeReplayBuffer)
    before = b.get_state()
    with pytest.raises(ConfigurationError, match="damaged"):
        b.set_state(state)
    after = b.get_state()
    assert list(after["episode_ids"]) == list(before["episode_ids"]) and after["next"] == before["next"]
