"""The RLlib internals the adapter relies on, checked so that a moved hook fails loudly.

conduit-rllib changes nothing in RLlib, but it plugs into a few places that are not public
API (underscore methods, the off-policy training step's call sequence). :func:`problems`
inspects the installed RLlib and lists every expectation that no longer holds;
:func:`check` raises :class:`RLlibCompatibilityError` with that list. ``enable`` calls it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from conduit import ConfigurationError

__all__ = ["RLlibCompatibilityError", "HOOKS", "problems", "check", "TESTED_RAY"]

#: the Ray release line this adapter was written and tested against
TESTED_RAY = "2.60."


class RLlibCompatibilityError(ConfigurationError):
    """The installed RLlib moved a hook conduit-rllib relies on; install ``ray[rllib]`` 2.60.x."""


def _source(obj: object) -> str:
    return inspect.getsource(obj)  # type: ignore[arg-type]


def _params(fn: Callable[..., object]) -> list[str]:
    """Parameter names, without the ``_ray_trace_ctx`` Ray adds to methods of classes it runs as actors."""
    return [p for p in inspect.signature(fn).parameters if p != "_ray_trace_ctx"]


def _hooks() -> list[tuple[str, Callable[[], bool]]]:
    import ray
    from ray.rllib.algorithms.algorithm import Algorithm
    from ray.rllib.algorithms.dqn.dqn import DQN
    from ray.rllib.core.learner.learner import Learner
    from ray.rllib.core.learner.learner_group import LearnerGroup
    from ray.rllib.core.learner.training_data import TrainingData
    from ray.rllib.utils.checkpoints import Checkpointable
    from ray.rllib.utils.replay_buffers import utils as rb_utils

    def step() -> str:  # read inside each check: a renamed or moved training step is reported, not raised
        return _source(DQN._training_step_new_api_stack)

    return [
        (f"ray {ray.__version__} is the tested release line {TESTED_RAY}x",
         lambda: ray.__version__.startswith(TESTED_RAY)),
        ("Learner._make_batch_if_necessary(self, training_data) exists",
         lambda: _params(Learner._make_batch_if_necessary) == ["self", "training_data"]),
        ("Learner._create_iterator_if_necessary takes training_data, num_total_minibatches, num_epochs, "
         "minibatch_size, shuffle_batch_per_epoch",
         lambda: {"training_data", "num_total_minibatches", "num_epochs", "minibatch_size",
                  "shuffle_batch_per_epoch"} <= set(_params(Learner._create_iterator_if_necessary))),
        ("Learner.update iterates self._create_iterator_if_necessary(...) and calls self._update per minibatch",
         lambda: "self._create_iterator_if_necessary(" in _source(Learner.update)
         and "self._update(" in _source(Learner.update)),
        ("Learner._create_iterator_if_necessary builds the batch with self._make_batch_if_necessary(...)",
         lambda: "self._make_batch_if_necessary(" in _source(Learner._create_iterator_if_necessary)),
        ("Learner.device is a property",
         lambda: isinstance(inspect.getattr_static(Learner, "device"), property)),
        ("Checkpointable._check_component(name, components, not_components) exists",
         lambda: _params(Checkpointable._check_component) == ["self", "name", "components", "not_components"]),
        ("LearnerGroup.foreach_learner exists", lambda: callable(getattr(LearnerGroup, "foreach_learner", None))),
        ("Algorithm.iteration is a property (the buffer logs its metrics in every training iteration)",
         lambda: isinstance(inspect.getattr_static(Algorithm, "iteration"), property)),
        ("Algorithm.setup creates self.local_replay_buffer, then runs on_algorithm_init callbacks",
         lambda: "self.local_replay_buffer = " in _source(Algorithm.setup)
         and '"on_algorithm_init"' in _source(Algorithm.setup)),
        ("DQN's new-stack training step adds to and samples from self.local_replay_buffer",
         lambda: "self.local_replay_buffer.add(" in step() and "self.local_replay_buffer.sample(" in step()),
        ("DQN's training step passes n_step, gamma, beta and sample_episodes=True to sample()",
         lambda: all(s in step() for s in ("n_step=", "gamma=", "beta=", "sample_episodes=True"))),
        ("DQN's training step hands the sample unchanged to learner_group.update(episodes=...)",
         lambda: "self.learner_group.update(" in step() and "episodes=episodes" in step()),
        ("DQN's training step concatenates the learners' TD errors in learner order (remote learners)",
         lambda: "for res in learner_results" in step() and "np.concatenate(" in step()),
        ("LearnerGroup.update takes episodes=, batches= and training_data=, and sends batches[k] to learner k",
         lambda: {"episodes", "batches", "training_data"} <= set(_params(LearnerGroup.update))
         and "TrainingData(batch=b)" in _source(TrainingData.shard)
         and "for b in self.batches" in _source(TrainingData.shard)),
        ("LearnerGroup saves and restores through save_to_path / restore_from_path and its _worker_manager",
         lambda: callable(getattr(LearnerGroup, "save_to_path", None))
         and callable(getattr(LearnerGroup, "restore_from_path", None))
         and "self._worker_manager" in _source(LearnerGroup.get_checkpointable_components)),
        ("DQN's training step updates priorities via update_priorities_in_episode_replay_buffer",
         lambda: "update_priorities_in_episode_replay_buffer(" in step()),
        ("update_priorities_in_episode_replay_buffer calls update_priorities for PrioritizedEpisodeReplayBuffer",
         lambda: "isinstance(replay_buffer, PrioritizedEpisodeReplayBuffer)"
         in _source(rb_utils.update_priorities_in_episode_replay_buffer)
         and ".update_priorities(" in _source(rb_utils.update_priorities_in_episode_replay_buffer)),
    ]


#: what is checked, by description (evaluated lazily: importing RLlib is slow)
HOOKS: Callable[[], list[tuple[str, Callable[[], bool]]]] = _hooks


def problems() -> list[str]:
    """Every relied-on RLlib hook that is missing or changed (empty when all hold)."""
    try:
        hooks = _hooks()
    except ImportError as e:  # a module conduit-rllib inspects moved: that is a moved hook too
        return [f"the RLlib modules conduit-rllib inspects import ({type(e).__name__}: {e})"]
    out = []
    for desc, ok in hooks:
        try:
            good = bool(ok())
        except Exception as e:  # noqa: BLE001 - a vanished attribute is exactly what we report
            good, desc = False, f"{desc} ({type(e).__name__}: {e})"
        if not good:
            out.append(desc)
    return out


def check() -> None:
    """Raise :class:`RLlibCompatibilityError` naming every hook that moved."""
    bad = problems()
    if bad:
        raise RLlibCompatibilityError("conduit-rllib relies on RLlib internals that changed in this installation:\n  - "
                                      + "\n  - ".join(bad) + "\nInstall ray[rllib]>=2.60,<2.61, the tested release.")
