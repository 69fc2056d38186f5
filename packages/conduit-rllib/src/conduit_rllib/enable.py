"""``conduit_rllib.enable(config)``: wire Conduit into an RLlib ``AlgorithmConfig``.

What it sets, all through RLlib's public configuration API:

* DQN, SAC (off-policy): an ``on_algorithm_init`` callback that replaces
  ``algorithm.local_replay_buffer`` by a Conduit buffer of the same kind (uniform or
  prioritized, same capacity and alpha; ``replay_buffer_config["type"]`` may be a class, a name
  or a dotted path, resolved as RLlib resolves it, and a subclass of Conduit's buffers is built
  itself) delivering on the learner's device (with remote learners, ``num_learners >= 1``: into
  host memory in the driver, each learner sent its contiguous slice of every sample, see
  :mod:`conduit_rllib.remote`), and a learner class with
  :class:`~conduit_rllib.learner.ConduitOffPolicyLearner` mixed in. The training step, the loss and
  the replay-buffer config stay RLlib's, except that a type given as a class is written into it
  as its name or dotted path, the only forms RLlib 2.60's ``build_algo`` takes (a class defined in
  a function, which no dotted path names, is refused), and a type RLlib's build would not take for
  the algorithm (a plain Conduit name; for SAC, whose config check takes RLlib's buffer names only,
  any form of a buffer Conduit replaces or of its own two) as RLlib's name of its kind (a subclass of
  Conduit's buffers is refused for SAC).
* PPO (on-policy): a learner class with :class:`~conduit_rllib.learner.ConduitOnPolicyLearner`
  mixed in, and Conduit's options in ``config.learner_config_dict["conduit"]``.

``config.algo_class`` may be the class or, as RLlib allows, a name registered with
``ray.tune.register_trainable`` (resolved the way ``AlgorithmConfig.build_algo`` does).
Anything else raises :class:`~conduit_rllib.errors.UnsupportedAlgorithmError` or
:class:`~conduit_rllib.errors.UnsupportedConfigError` saying what is supported.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from conduit import Placement, Scheduler
from conduit.checks import is_bool
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
from ray.rllib.algorithms.dqn.dqn import DQN, DQNConfig
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.algorithms.ppo.ppo import PPO
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.algorithms.sac.sac import SAC, SACConfig
from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner
from ray.rllib.utils import force_list
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer import (
    MultiAgentPrioritizedEpisodeReplayBuffer,
)
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer
from ray.tune.error import TuneError
from ray.tune.registry import get_trainable_cls

from conduit_rllib import compat
from conduit_rllib.errors import UnsupportedAlgorithmError, UnsupportedConfigError
from conduit_rllib.learner import (
    CHANGED_AFTER_ENABLE,
    CONFIG_KEY,
    ConduitDQNTorchLearner,
    ConduitOffPolicyLearner,
    ConduitOnPolicyLearner,
    ConduitPPOTorchLearner,
    ConduitSACTorchLearner,
    refuse_stateful_model_config,
)
from conduit_rllib.multi_agent import (
    ConduitMultiAgentEpisodeReplayBuffer,
    ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
    _ConduitMultiAgentReplay,
)
from conduit_rllib.remote import route_to_remote_learners
from conduit_rllib.replay import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer

__all__ = ["enable", "is_enabled", "SUPPORTED_ALGORITHMS", "InstallReplayBuffer"]

#: what ``enable`` accepts: algorithm -> (kind, RLlib's default learner, Conduit's learner)
_TABLE: dict[type, tuple[str, type, type]] = {
    SAC: ("off_policy", SACTorchLearner, ConduitSACTorchLearner),
    DQN: ("off_policy", DQNTorchLearner, ConduitDQNTorchLearner),
    PPO: ("on_policy", PPOTorchLearner, ConduitPPOTorchLearner),
}
SUPPORTED_ALGORITHMS = ("DQN", "SAC", "PPO")
_SUPPORTED = "DQN and SAC (off-policy replay) and PPO (on-policy), on RLlib's new API stack with torch"


def _resolve(algo: object) -> object:
    """``algo_class`` as RLlib builds it: a name is looked up in Ray Tune's trainable registry."""
    if not isinstance(algo, str):
        return algo
    try:
        return get_trainable_cls(algo)
    except (TuneError, ValueError, KeyError) as e:
        raise UnsupportedAlgorithmError(
            f"This config's algo_class is the name {algo!r}, which is not a registered trainable ({e}). Pass the "
            f"algorithm class itself (e.g. DQNConfig(algo_class=MyDQN)), or register it first with "
            f"ray.tune.register_trainable({algo!r}, MyDQN).") from e


def _algorithm(config: AlgorithmConfig) -> type:
    """The supported RLlib algorithm ``config`` builds (its ``algo_class``, or the class a registered name names)."""
    algo = _resolve(config.algo_class)
    name = getattr(algo, "__name__", repr(algo))
    if isinstance(config.algo_class, str):
        name = f"{name} (registered as {config.algo_class!r})"
    if isinstance(algo, type):
        for base in _TABLE:  # SAC before DQN: SAC subclasses DQN
            if algo is base or (issubclass(algo, base) and not algo.__module__.startswith("ray.rllib.")):
                return base
    raise UnsupportedAlgorithmError(f"conduit_rllib.enable supports {_SUPPORTED} (and your own subclasses of "
                                    f"DQN, SAC and PPO); this config builds {name}.")


#: names RLlib resolves inside ``ray.rllib.utils.replay_buffers`` (and Conduit's own classes, by name)
_PLAIN_NAMES: dict[str, type] = {
    "EpisodeReplayBuffer": ConduitEpisodeReplayBuffer,
    "PrioritizedEpisodeReplayBuffer": ConduitPrioritizedEpisodeReplayBuffer,
    "ConduitEpisodeReplayBuffer": ConduitEpisodeReplayBuffer,
    "ConduitPrioritizedEpisodeReplayBuffer": ConduitPrioritizedEpisodeReplayBuffer,
    "MultiAgentEpisodeReplayBuffer": ConduitMultiAgentEpisodeReplayBuffer,
    "MultiAgentPrioritizedEpisodeReplayBuffer": ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
    "ConduitMultiAgentEpisodeReplayBuffer": ConduitMultiAgentEpisodeReplayBuffer,
    "ConduitMultiAgentPrioritizedEpisodeReplayBuffer": ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
}
#: the buffers ``enable`` builds for RLlib's stock types (any other Conduit buffer class is a user's subclass)
_STOCK = (ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer, ConduitMultiAgentEpisodeReplayBuffer,
          ConduitMultiAgentPrioritizedEpisodeReplayBuffer)
_WHAT_TO_SET = ("Set 'EpisodeReplayBuffer' (uniform) or 'PrioritizedEpisodeReplayBuffer' (for a multi-agent config: "
                "'MultiAgentEpisodeReplayBuffer' or 'MultiAgentPrioritizedEpisodeReplayBuffer'), or the dotted path "
                "of your subclass of a Conduit buffer, e.g. conduit_rllib.ConduitEpisodeReplayBuffer "
                "('my_pkg.buffers.MyBuffer').")


def _resolve_buffer_type(rb_type: str) -> object:
    """A string ``replay_buffer_config["type"]`` as RLlib's ``from_config`` resolves it: ``"module.Class"`` is
    imported, a plain name is looked up in ``ray.rllib.utils.replay_buffers``.

    Raises:
        UnsupportedConfigError: the module does not import, or has no such attribute.
    """
    if rb_type in _PLAIN_NAMES:
        return _PLAIN_NAMES[rb_type]
    module_name, _, attr = rb_type.rpartition(".")
    module_name = module_name or "ray.rllib.utils.replay_buffers"
    try:
        return getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # noqa: BLE001 - whatever importing the user's module raises: report it typed
        raise UnsupportedConfigError(
            f"replay_buffer_config['type'] is {rb_type!r}, which does not resolve to a class ({type(e).__name__}: "
            f"{e}). RLlib imports a dotted type as 'module.Class': make that module importable in the driver (and "
            f"spell the class as it is defined there). {_WHAT_TO_SET}") from e


def _replay_class(config: AlgorithmConfig) -> type:
    """The Conduit buffer class ``replay_buffer_config["type"]`` asks for: a subclass of Conduit's buffers is
    built itself; RLlib's ``EpisodeReplayBuffer`` / ``PrioritizedEpisodeReplayBuffer`` and their multi-agent
    kinds (or a subclass of them) are replaced by Conduit's buffer of the same kind. The type may be the class, or
    its name or dotted path (resolved as RLlib resolves it).

    Raises:
        UnsupportedConfigError: a type that does not resolve, or names anything else (old-stack buffers,
            non-classes).
    """
    # only DQN/SAC (sub)class configs come here; they define replay_buffer_config
    rb_type = cast("DQNConfig | SACConfig", config).replay_buffer_config.get("type")
    cls = _resolve_buffer_type(rb_type) if isinstance(rb_type, str) else rb_type
    if isinstance(cls, type) and issubclass(cls, EpisodeReplayBuffer):
        if issubclass(cls, (ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer,
                            _ConduitMultiAgentReplay)):
            return cls
        if issubclass(cls, MultiAgentEpisodeReplayBuffer):
            return (ConduitMultiAgentPrioritizedEpisodeReplayBuffer if issubclass(
                cls, MultiAgentPrioritizedEpisodeReplayBuffer) else ConduitMultiAgentEpisodeReplayBuffer)
        return (ConduitPrioritizedEpisodeReplayBuffer if issubclass(cls, PrioritizedEpisodeReplayBuffer)
                else ConduitEpisodeReplayBuffer)
    named = f" (which names {cls!r})" if isinstance(rb_type, str) else ""
    raise UnsupportedConfigError(f"replay_buffer_config['type'] is {rb_type!r}{named}; Conduit replaces RLlib's "
                                 f"episode replay buffers only. {_WHAT_TO_SET}")


def _check_served(config: AlgorithmConfig) -> None:
    """Refuse the settings of a supported algorithm's config that the adapter cannot serve (DQN, SAC and PPO).

    Raises:
        UnsupportedConfigError: old API stack, not torch, a stateful (LSTM/attention) model.
    """
    if not (config.enable_rl_module_and_learner and config.enable_env_runner_and_connector_v2):
        raise UnsupportedConfigError("Conduit plugs into RLlib's new API stack (RLModule, Learner, EnvRunner); "
                                     "enable it with config.api_stack(enable_rl_module_and_learner=True, "
                                     "enable_env_runner_and_connector_v2=True).")
    if config.framework_str != "torch":
        raise UnsupportedConfigError(f"Conduit's RLlib adapter supports framework 'torch', not "
                                     f"{config.framework_str!r}.")
    refuse_stateful_model_config(config)


def _check_off_policy(config: AlgorithmConfig) -> None:
    """Refuse what DQN/SAC's Conduit path cannot serve on top of :func:`_check_served`.

    Raises:
        UnsupportedConfigError: a multi-agent config with a single-agent buffer type or the other way round (RLlib's
            buffer would fail at the first add too), custom learner connector pieces (Conduit's batches skip the
            connector), a ``replay_buffer_config["type"]`` Conduit does not replace (see :func:`_replay_class`), or a
            ``replay_buffer_config`` key naming a buffer option ``enable`` sets itself (see :data:`_SET_ELSEWHERE`),
            or Conduit's PPO options in ``learner_config_dict`` (DQN/SAC would not read them).
    """
    if config._learner_connector is not None:
        raise UnsupportedConfigError("Conduit delivers DQN/SAC train batches ready-made, so custom learner "
                                     "connector pieces would be skipped; remove "
                                     "config.learners(learner_connector=...) or run without Conduit.")
    if CONFIG_KEY in config.learner_config_dict:
        raise UnsupportedConfigError(f"learner_config_dict[{CONFIG_KEY!r}] holds Conduit's options for PPO's minibatch "
                                     f"delivery; DQN/SAC do not read it, so its values would not be used. Remove it, "
                                     f"and set DQN/SAC's options with conduit_rllib.enable(config, placement=..., "
                                     f"scheduler=...).")
    rbc = cast("DQNConfig | SACConfig", config).replay_buffer_config
    for key, where in _SET_ELSEWHERE.items():
        if key in rbc:
            raise UnsupportedConfigError(f"replay_buffer_config holds {key!r}, a Conduit buffer option that enable "
                                         f"sets itself, so the value would not be used; remove it from "
                                         f"replay_buffer_config and set it as {where}.")
    multi_agent_buffer = issubclass(_replay_class(config), _ConduitMultiAgentReplay)
    if multi_agent_buffer != bool(config.is_multi_agent):
        kinds, prefix = (("multi", "single"), "MultiAgent") if config.is_multi_agent else (("single", "multi"), "")
        raise UnsupportedConfigError(
            f"This config is {kinds[0]}-agent, but replay_buffer_config['type'] is {rbc.get('type')!r}, a {kinds[1]}"
            f"-agent buffer: its first add would fail (with RLlib's buffers too). Set '{prefix}PrioritizedEpisode"
            f"ReplayBuffer' or '{prefix}EpisodeReplayBuffer': Conduit installs its own buffer of that kind "
            f"(conduit_rllib.Conduit{prefix}EpisodeReplayBuffer or its prioritized kind).")


#: buffer options ``InstallReplayBuffer`` takes from elsewhere, never from ``replay_buffer_config``: where to set them
_SET_ELSEWHERE = {"placement": "conduit_rllib.enable(config, placement=...)",
                  "scheduler": "conduit_rllib.enable(config, scheduler=...), a zero-argument factory",
                  "device": "the learner's device (Conduit delivers there: config.learners(num_gpus_per_learner=...))"}


def _buildable_type(rb_type: type) -> str:
    """``replay_buffer_config["type"]`` given as a class, written the way RLlib 2.60's ``build_algo`` takes it.

    RLlib's buffer set-up tests the type with ``in`` (a class raises ``TypeError`` there, with or without Conduit),
    so it takes a name or a dotted path only. RLlib's own ``EpisodeReplayBuffer`` /
    ``PrioritizedEpisodeReplayBuffer`` become their plain names (the only form SAC's config check accepts), any
    other class its dotted path ``module.Class``, which must resolve back to that very class.

    Raises:
        UnsupportedConfigError: a class no dotted path names (defined in a function, nested in a class, or no
            longer what its module's attribute of that name is).
    """
    if rb_type in _RLLIB_TYPES:
        return rb_type.__name__
    path = f"{rb_type.__module__}.{rb_type.__qualname__}"
    try:
        found: object = _resolve_buffer_type(path)
    except UnsupportedConfigError:
        found = None
    if found is rb_type:
        return path
    raise UnsupportedConfigError(
        f"replay_buffer_config['type'] is the class {rb_type.__qualname__} (module {rb_type.__module__}), which "
        f"cannot be named by an importable dotted path ({path!r} does not import it back). RLlib's build_algo takes "
        f"the type as a name or dotted path only, so define the class at module level in an importable module and "
        f"pass the class or its dotted path (e.g. 'my_pkg.buffers.MyBuffer'). {_WHAT_TO_SET}")


#: RLlib's name of the kind of each buffer Conduit builds for a stock type: the form every build of RLlib 2.60 takes
_RLLIB_NAME: dict[type, str] = {ConduitEpisodeReplayBuffer: "EpisodeReplayBuffer",
                                ConduitPrioritizedEpisodeReplayBuffer: "PrioritizedEpisodeReplayBuffer",
                                ConduitMultiAgentEpisodeReplayBuffer: "MultiAgentEpisodeReplayBuffer",
                                ConduitMultiAgentPrioritizedEpisodeReplayBuffer:
                                    "MultiAgentPrioritizedEpisodeReplayBuffer"}
#: RLlib's stock episode buffers (the types SAC's config check takes, by these names)
_RLLIB_TYPES = (EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer,
                MultiAgentPrioritizedEpisodeReplayBuffer)


def _buildable(base: type, rb_type: object, cls: type) -> str | None:
    """``replay_buffer_config["type"]`` written the way RLlib 2.60's ``build_algo`` of ``base`` (DQN or SAC) takes
    it, or None where it takes the type as it is. ``cls``: the Conduit buffer the type builds (:func:`_replay_class`).

    RLlib resolves a plain name among its own buffers only, so a plain Conduit name (``"ConduitEpisodeReplayBuffer"``)
    becomes RLlib's name of its kind; SAC's config check takes RLlib's buffer names only, so for SAC every type whose
    buffer is Conduit's own (RLlib's buffers and their subclasses, which Conduit replaces, and Conduit's two buffers,
    in any form) becomes RLlib's name of its kind. A class for DQN is written by :func:`_buildable_type`.

    Raises:
        UnsupportedConfigError: SAC with a subclass of Conduit's buffers (no name SAC's check takes builds it, with
            or without Conduit); a class no dotted path names (:func:`_buildable_type`).
    """
    if isinstance(rb_type, str) and rb_type in (t.__name__ for t in _RLLIB_TYPES):
        return None
    if base is SAC or (isinstance(rb_type, str) and rb_type in _PLAIN_NAMES):
        name = _RLLIB_NAME.get(cls)
        if name is None:
            raise UnsupportedConfigError(
                f"replay_buffer_config['type'] is {rb_type!r}, a subclass of Conduit's buffers ({cls.__qualname__}), "
                f"but RLlib 2.60's SAC config check takes only RLlib's buffer names, so SAC cannot build it (with or "
                f"without Conduit). For SAC set 'EpisodeReplayBuffer' (uniform) or 'PrioritizedEpisodeReplayBuffer': "
                f"Conduit installs its own buffer of that kind. (DQN takes the subclass by its dotted path.)")
        return name
    return _buildable_type(rb_type) if isinstance(rb_type, type) else None


class _IterationOf:
    """The algorithm's current training iteration (None once it is gone: the buffer holds no reference to it)."""

    def __init__(self, algorithm: Any) -> None:
        self._algorithm = weakref.ref(algorithm)

    def __call__(self) -> int | None:
        algorithm = self._algorithm()
        return None if algorithm is None else int(algorithm.iteration)


#: the buffer arguments InstallReplayBuffer sets itself (the other replay_buffer_config keys go to a subclass)
_SET_HERE = frozenset({"type", "capacity", "alpha", "seed", "device", "placement", "scheduler",
                       "metrics_num_episodes_for_smoothing"})


def _check_still_served(config: AlgorithmConfig) -> None:
    """What ``enable`` checked, checked again on the config an algorithm is built from: a setting changed after
    ``enable`` (RLlib's config stays mutable) must not be served wrong or fail untyped.

    Raises:
        UnsupportedConfigError: the config is no longer one ``enable`` accepts (made multi-agent with a single-agent
            buffer type or the other way round, a stateful model, a
            learner connector, another replay buffer type, a learner class without ``ConduitOffPolicyLearner``).
    """
    try:
        _check_served(config)
        _check_off_policy(config)
        learner = config.learner_class
        if not (isinstance(learner, type) and issubclass(learner, ConduitOffPolicyLearner)):
            raise UnsupportedConfigError(f"This algorithm's learner class {learner!r} lacks Conduit's mixin, so it "
                                         f"cannot train on Conduit's replay samples. Give it "
                                         f"conduit_rllib.ConduitOffPolicyLearner first in its bases.")
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{e}{CHANGED_AFTER_ENABLE}") from e


@dataclass
class InstallReplayBuffer:
    """The ``on_algorithm_init`` callback: swap in a Conduit replay buffer and attach it to the learner (a
    learner in the driver), or hand it to the learner group (remote learners: a
    :class:`~conduit_rllib.remote.ConduitLearnerGroup`).

    Picklable (it travels inside the config into checkpoints).

    Args:
        placement: where transitions live (default: host memory, pinned for a CUDA learner).
        scheduler: a factory for the data plane's scheduler (default: synchronous).
    """

    placement: Placement | None = None
    scheduler: Callable[[], Scheduler] | None = None

    def __call__(self, *, algorithm: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        """Install the buffer; a refusal (or any error) stops what RLlib's setup started before it is raised.

        RLlib calls this at the end of its setup, from inside ``build_algo``: the env runners (Ray actors with
        ``num_env_runners >= 1``) and the learner group already run, and the algorithm being built is reachable only
        through the raised error's traceback, so without a stop they would hold their CPUs/GPUs until the garbage
        collector freed it (never, while a notebook or the caller keeps the error). What ``algorithm.stop()`` runs
        ends them (and closes a buffer the learner was given): ``cleanup()`` and closing the log files (``stop()``
        itself needs the resource monitor RLlib's ``Trainable`` starts only after setup); the error is then raised
        as it was.

        Raises:
            UnsupportedConfigError: the config was changed after ``enable`` into one Conduit cannot serve, or the
                scheduler factory returned no Scheduler.
            conduit.ConfigurationError: the buffer refuses the config's settings (e.g. its capacity).
        """
        try:
            self._install(algorithm)
        except BaseException as e:
            try:
                algorithm.cleanup()  # (learners, aggregators, env runners: Algorithm.stop() minus the monitor)
                close_logfiles = getattr(algorithm, "_close_logfiles", None)
                if close_logfiles is not None:
                    close_logfiles()
            except Exception as stop_error:  # noqa: BLE001 - the refusal is what the caller must see
                e.add_note(f"(stopping the half-built algorithm after this error failed too: "
                           f"{type(stop_error).__name__}: {stop_error})")
            raise

    def _install(self, algorithm: Any) -> None:
        cfg = algorithm.config
        _check_still_served(cfg)
        group = algorithm.learner_group
        cls = _replay_class(cfg)
        rbc = cfg.replay_buffer_config
        # a remote learner's slice goes through Ray from host memory (conduit_rllib.remote)
        device = (next(iter(group.foreach_learner(lambda learner: learner.device))).get() if group.is_local
                  else torch.device("cpu"))
        kwargs_rb: dict[str, Any] = {}
        if cls not in _STOCK:
            # your subclass gets the config's other keys too, as RLlib passes them to the type it builds
            kwargs_rb.update({k: v for k, v in rbc.items() if k not in _SET_HERE})
        # capacity and alpha only as configured: without them (RLlib replaces the whole dict when its type changes)
        # the buffer has its class's defaults, as RLlib's buffer then has its own (Conduit's equal RLlib's)
        if "capacity" in rbc:
            kwargs_rb["capacity"] = rbc["capacity"]
        if getattr(cls, "prioritized", False) and "alpha" in rbc:
            kwargs_rb["alpha"] = rbc["alpha"]
        # every get_metrics call logs, as RLlib's buffers do (each iteration's replay counts are RLlib's), unless
        # the config says otherwise (the buffer checks it)
        kwargs_rb.setdefault("metrics_every", rbc.get("metrics_every", 1))
        # capacity and alpha as configured: the buffer checks them (a ConfigurationError saying what is wrong)
        # a multi-agent buffer builds one plane, so one scheduler, per module: it takes the factory itself
        multi_agent = issubclass(cls, _ConduitMultiAgentReplay)
        scheduler = self.scheduler() if self.scheduler is not None and not multi_agent else None
        if scheduler is not None and not isinstance(scheduler, Scheduler):
            raise UnsupportedConfigError(f"The scheduler factory given to conduit_rllib.enable(scheduler=...) returned "
                                         f"{scheduler!r}, not a conduit Scheduler; make it return a new one (e.g. "
                                         f"lambda: conduit.Overlapped(g_del=2, background_ingest=False)).")
        buffer = cls(seed=cfg.seed, device=device,
                     placement=self.placement, scheduler=self.scheduler if multi_agent else scheduler,
                     metrics_num_episodes_for_smoothing=cfg.metrics_num_episodes_for_smoothing, **kwargs_rb)
        buffer.iteration_of = _IterationOf(algorithm)  # metrics in every iteration's results
        try:
            if group.is_local:
                # attached first: a buffer the learner refuses (it cannot take a replay part restored before it was
                # attached) is not the one the algorithm samples from either
                for res in group.foreach_learner(lambda learner: learner.conduit_attach_replay(buffer)):
                    res.get()
            else:  # the buffer stays here; each remote learner gets its slice of every sample
                route_to_remote_learners(group, buffer)
        except BaseException:
            buffer.close()  # (no one else holds it: its worker threads end here)
            raise
        algorithm.local_replay_buffer = buffer


def is_enabled(config: AlgorithmConfig) -> bool:
    """Whether ``enable`` has wired Conduit into ``config``: a learner class with Conduit's mixin and, for DQN/SAC,
    the ``on_algorithm_init`` callback that installs the replay buffer (``config.callbacks(on_algorithm_init=...)``
    after ``enable`` replaces RLlib's list of callbacks, Conduit's with it: call ``enable`` again after it)."""
    learner = config.learner_class
    if not isinstance(learner, type):
        return False
    if issubclass(learner, ConduitOnPolicyLearner):
        return True
    return issubclass(learner, ConduitOffPolicyLearner) and any(
        isinstance(hook, InstallReplayBuffer) for hook in force_list(config.callbacks_on_algorithm_init))


def _callable_without_arguments(factory: object) -> bool:
    """Whether ``factory`` can be called with no arguments, as the ``on_algorithm_init`` callback calls it (a
    callable whose signature Python cannot read, e.g. some builtins, counts as one)."""
    if not callable(factory):
        return False
    try:
        inspect.signature(factory).bind()
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


def _learner_class(config: AlgorithmConfig, default: type, conduit: type, mixin: type) -> type:
    """The learner class ``enable`` sets: Conduit's for RLlib's stock learner, the config's own if it has the mixin.

    The config's learner is the one it builds (``config.learner_class``): an explicit ``learner_class``, else its
    ``get_default_learner_class()``, which a config subclass may point at its own learner.

    Raises:
        UnsupportedConfigError: the config's own learner class lacks Conduit's mixin (it is not replaced: that
            would drop the user's learner, e.g. its loss).
    """
    current = config.learner_class
    if current is default:
        return conduit
    if isinstance(current, type) and issubclass(current, mixin):
        return current
    raise UnsupportedConfigError(f"This config uses its own learner class {current!r}. Give it Conduit's mixin "
                                 f"first in its bases, e.g. `class MyLearner(conduit_rllib.{mixin.__name__}, "
                                 f"{getattr(current, '__name__', current)})`, and call enable() again.")


def enable(config: AlgorithmConfig, *, placement: Placement | None = None,
           scheduler: Callable[[], Scheduler] | None = None, prefetch: bool = True) -> AlgorithmConfig:
    """Wire Conduit's Experience Data Plane into ``config`` and return that same config.

    Off-policy (DQN, SAC): replay goes through a Conduit buffer (uniform or prioritized, as
    ``replay_buffer_config["type"]`` says) whose ``sample()`` delivers the assembled train batch
    onto the learner's device. On-policy (PPO): the learner's minibatches are delivered by
    Conduit's on-policy path (each row once per epoch, minibatch k + 1 prepared while k trains).
    Calling it twice is harmless. A ``replay_buffer_config["type"]`` given as a class is replaced in
    ``config`` by its plain name (RLlib's ``EpisodeReplayBuffer`` / ``PrioritizedEpisodeReplayBuffer``) or its
    dotted path ``module.Class`` (any other class), as RLlib 2.60's ``build_algo`` takes no class there; a type
    RLlib's build would not take (a plain Conduit name, or for SAC anything but RLlib's buffer names) by RLlib's name
    of its kind, where Conduit installs its own buffer of that kind.

    Keyword Args:
        placement: where experience lives (default: host memory; a PPO batch stays on its device).
        scheduler: off-policy only, a zero-argument factory for the data plane's scheduler (refused for PPO).
        prefetch: on-policy only, gather minibatch k + 1 on a worker thread while k trains.

    Raises:
        UnsupportedAlgorithmError: not DQN, SAC or PPO (or a subclass), or ``algo_class`` is a name
            no trainable is registered under.
        UnsupportedConfigError: a frozen config (one a built algorithm holds; nothing is changed), a
            ``placement`` that is no Placement, a ``scheduler`` that is no zero-argument factory (e.g. a Scheduler
            instance, or a function that needs an argument), or a ``prefetch`` that is no bool, ``prefetch=False``
            for DQN/SAC (it applies to PPO only), a
            setting the adapter cannot serve (old API stack, non-torch, multi-agent DQN/SAC with a single-agent buffer
            type or the other way round, RNN models, custom learner
            connectors off-policy, a replay buffer class defined in a function or nested in a class, which no
            dotted path names, a subclass of Conduit's buffers for SAC, which SAC's config check refuses, a learner
            class, explicit or the config's default, without Conduit's mixin, PPO on
            two or more learners without a ``minibatch_size``, which RLlib's learner group cannot shard, ...).
        conduit_rllib.compat.RLlibCompatibilityError: the installed RLlib moved a hook we use.
    """
    if not isinstance(config, AlgorithmConfig):
        raise UnsupportedConfigError(f"enable() takes an RLlib AlgorithmConfig (e.g. DQNConfig()), got "
                                     f"{type(config).__name__}.")
    if getattr(config, "_is_frozen", False):  # (RLlib would refuse our first setting with an AttributeError)
        raise UnsupportedConfigError("This config is frozen (it belongs to a built algorithm, e.g. algo.config), so "
                                     "enable() cannot wire Conduit into it. Call enable() before build_algo(), or "
                                     "on an unfrozen copy: conduit_rllib.enable(config.copy(copy_frozen=False)).")
    base = _algorithm(config)
    kind, default_learner, conduit_learner = _TABLE[base]
    _check_served(config)
    if placement is not None and not isinstance(placement, Placement):
        raise UnsupportedConfigError(f"placement= takes a conduit Placement instance (e.g. conduit.HostPlacement() or "
                                     f"conduit.DevicePlacement('cuda')), or None for the default; got {placement!r}.")
    if not is_bool(prefetch):  # (a string such as "no" is truthy: it would prefetch)
        raise UnsupportedConfigError(f"prefetch= takes True or False, got {prefetch!r}.")
    prefetch = bool(prefetch)  # (a NumPy bool, as MinibatchFeed takes, is kept as Python's in the config)
    compat.check()
    if kind == "off_policy":
        if not prefetch:  # (DQN/SAC replay overlaps through scheduler=)
            raise UnsupportedConfigError("prefetch= applies to PPO's minibatch delivery only; DQN/SAC replay is "
                                         "scheduled by scheduler= (synchronous by default). Drop prefetch=False.")
        if scheduler is not None and (isinstance(scheduler, Scheduler) or not _callable_without_arguments(scheduler)):
            raise UnsupportedConfigError(f"scheduler= takes a zero-argument factory that returns a new scheduler "
                                         f"(e.g. lambda: conduit.Overlapped(g_del=2, background_ingest=False)): each "
                                         f"buffer built from this config needs its own scheduler; got {scheduler!r}.")
        _check_off_policy(config)
        replay_config = cast("DQNConfig | SACConfig", config)
        rb_type = replay_config.replay_buffer_config.get("type")
        buildable = _buildable(base, rb_type, _replay_class(config))
        learner = _learner_class(config, default_learner, conduit_learner, ConduitOffPolicyLearner)
        hooks = force_list(config.callbacks_on_algorithm_init)
        hooks = [h for h in hooks if not isinstance(h, InstallReplayBuffer)]
        config.callbacks(on_algorithm_init=[*hooks, InstallReplayBuffer(placement, scheduler)])
        config.learners(learner_class=learner)
        if buildable is not None:  # the whole dict: RLlib replaces it whole when the type changes
            replay_config.training(replay_buffer_config={**replay_config.replay_buffer_config, "type": buildable})
    else:
        if scheduler is not None:  # (the on-policy path prefetches on its own: see prefetch=)
            raise UnsupportedConfigError("scheduler= applies to DQN/SAC replay only; PPO's minibatch delivery is "
                                         "scheduled by Conduit's on-policy path (prefetch=True/False). Drop "
                                         "scheduler= for PPO.")
        if (config.num_learners >= 2 and not config.minibatch_size
                and getattr(_resolve(config.algo_class), "training_step", None) is PPO.training_step):
            # RLlib's LearnerGroup divides by minibatch_size to count the learners' common minibatches
            raise UnsupportedConfigError(
                f"PPO with num_learners={config.num_learners} needs a minibatch_size (it is "
                f"{config.minibatch_size!r}): RLlib's LearnerGroup computes the learners' common count of "
                f"minibatches from it and fails in every training step without one, with or without Conduit. Set "
                f"config.training(minibatch_size=...) (e.g. 128), or use num_learners <= 1.")
        learner = _learner_class(config, default_learner, conduit_learner, ConduitOnPolicyLearner)
        config.learners(learner_class=learner,
                        learner_config_dict={CONFIG_KEY: {"placement": placement, "prefetch": prefetch}})
    return config
