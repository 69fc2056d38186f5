"""Conduit's side of RLlib's Learner: two mixins and the learner classes ``enable`` installs.

* :class:`ConduitOffPolicyLearner` (DQN, SAC): when the training step hands the learner a
  :class:`~conduit_rllib.delivery.ConduitSampledEpisodes`, its columns are the train batch:
  the learner connector (episodes -> batch -> tensors) is skipped because Conduit already
  delivered the batch, assembled, on the learner's device. Anything else goes through
  RLlib's path unchanged. It also checkpoints the Conduit replay buffer with the learner's
  state when the config says ``store_buffer_in_checkpoints=True`` (RLlib's flag, default False;
  RLlib's new API stack itself saves no replay buffer even then).
* :class:`ConduitOnPolicyLearner` (PPO): RLlib's learner connector still builds the train
  batch (advantages, value targets); Conduit then delivers its minibatches through
  ``conduit.OnPolicy`` (:class:`~conduit_rllib.on_policy.MinibatchFeed`) instead of RLlib's
  minibatch iterator.

Both override private ``Learner`` hooks (``_make_batch_if_necessary``,
``_create_iterator_if_necessary``); :mod:`conduit_rllib.compat` checks they are where we expect.
A custom learner class gets Conduit by listing the mixin first::

    class MyDQNLearner(ConduitOffPolicyLearner, MyDQNTorchLearnerSubclass): ...
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Collection, Iterable, Iterator
from typing import Any, cast

from conduit import ConfigurationError, EmptyBufferError, SchemaError
from conduit.checks import is_real
from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.algorithms.sac.torch.sac_torch_learner import SACTorchLearner
from ray.rllib.core.learner.learner import Learner
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from conduit_rllib.delivery import CONDUIT_SAMPLES
from conduit_rllib.errors import UnsupportedConfigError
from conduit_rllib.multi_agent import (
    MULTI_AGENT_STATE_FORMAT,
    ConduitMultiAgentEpisodeReplayBuffer,
    ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
)
from conduit_rllib.on_policy import MinibatchFeed, _cyclic_plan
from conduit_rllib.replay import (
    STATE_FORMAT,
    ConduitEpisodeReplayBuffer,
    ConduitPrioritizedEpisodeReplayBuffer,
    fresh_seed,
    module_seed,
)

__all__ = [
    "ConduitOffPolicyLearner",
    "ConduitOnPolicyLearner",
    "ConduitDQNTorchLearner",
    "ConduitSACTorchLearner",
    "ConduitPPOTorchLearner",
    "REPLAY_COMPONENT",
    "ON_POLICY_COMPONENT",
    "CONFIG_KEY",
]

#: key of the replay buffer's state inside the learner's state (and checkpoint)
REPLAY_COMPONENT = "conduit_replay_buffer"
#: key of the on-policy feed's state (update count, permutation RNG) inside the learner's state (and checkpoint)
ON_POLICY_COMPONENT = "conduit_on_policy"
#: key of Conduit's options in ``config.learner_config_dict``
CONFIG_KEY = "conduit"


def _minibatch_rows(batch: MultiAgentBatch, rows: int, minibatch_size: int | None, num_epochs: int) -> int:
    """Rows per minibatch as RLlib's ``Learner._create_iterator_if_necessary`` cuts ``batch`` (``rows`` module rows).

    With a ``minibatch_size``: that many. Without one and ``num_epochs > 1``: RLlib's
    ``MiniBatchCyclicIterator`` with ``minibatch_size = batch.count``, i.e. the train batch's *env
    steps* (not its module rows: the two differ when the batch reports other env steps than it has
    rows), so ``ceil(num_epochs * rows / env_steps)`` minibatches of ``env_steps`` rows. Without one and
    ``num_epochs <= 1``: RLlib's ``MiniBatchDummyIterator``, the whole batch once.

    Raises:
        UnsupportedConfigError: no ``minibatch_size``, ``num_epochs > 1`` and the train batch reports no
            env steps (RLlib would cut empty minibatches forever); or a ``minibatch_size`` with
            ``num_epochs < 1`` (no minibatch at all).
    """
    if minibatch_size:
        if num_epochs < 1:
            raise UnsupportedConfigError(f"num_epochs={num_epochs} with minibatch_size={minibatch_size} cuts no "
                                         f"minibatch, so the update would train nothing (stock RLlib fails on it); "
                                         f"set num_epochs >= 1.")
        return int(minibatch_size)
    if num_epochs <= 1:
        return rows
    env_steps = int(batch.env_steps())
    if env_steps <= 0:
        raise UnsupportedConfigError(f"This train batch has {rows} rows but reports {env_steps} env steps; without a "
                                     f"minibatch_size RLlib cuts minibatches of the batch's env steps, so it cannot "
                                     f"cut this one. Set minibatch_size (config.training(minibatch_size=...)) or "
                                     f"num_epochs=1, or pass a batch whose env_steps is positive.")
    return env_steps


def _passes(num_epochs: Any) -> int:
    """``num_epochs`` as the whole passes RLlib's ``MiniBatchCyclicIterator`` makes: it cuts minibatches while some
    row has been covered fewer than ``num_epochs`` times, so a fractional count (e.g. 2.5) makes ``ceil`` passes (3),
    and one in (0, 1) one pass.

    Raises:
        UnsupportedConfigError: ``num_epochs`` is no finite real number (RLlib would fail on it, or cut forever).
    """
    if not is_real(num_epochs) or not math.isfinite(num_epochs):
        raise UnsupportedConfigError(f"num_epochs must be a finite number of passes over the train batch, got "
                                     f"{num_epochs!r}; set config.training(num_epochs=...) to an int (e.g. 10).")
    return int(math.ceil(num_epochs))


#: the note a refusal of a config changed after ``enable`` ends with (``enable`` refused that setting)
CHANGED_AFTER_ENABLE = (" (conduit_rllib.enable accepted this config before it was changed: make the change before "
                        "enable(), or call enable() again after it.)")


def refuse_stateful_model_config(config: Any) -> None:
    """Refuse a ``model_config`` that asks RLlib's default module for an LSTM or attention (a stateful module).

    Raises:
        UnsupportedConfigError: ``use_lstm`` or ``use_attention`` is set.
    """
    if config.model_config.get("use_lstm") or config.model_config.get("use_attention"):
        raise UnsupportedConfigError("Stateful (LSTM/attention) modules need sequence sampling, which Conduit's "
                                     "RLlib adapter does not support; use a feed-forward model.")


def _refuse_stateful_modules(modules: Any, why: str, instead: str) -> None:
    """Refuse a built learner's stateful RLModules (an initial state: LSTM, attention or other recurrent modules),
    which ``enable`` sees only when ``model_config`` asks for one (``use_lstm``/``use_attention``), not when the
    module is given as a class. Called on the modules the learner's build just made (none is built for the
    check), so such a config is refused when the learner (and so the algorithm) is built, not in the first
    sample or update. ``why``: why Conduit's path cannot train it; ``instead``: RLlib's own path it would take
    without ``enable``.

    Raises:
        UnsupportedConfigError: a module of ``modules`` (a MultiRLModule) is stateful.
    """
    for module_id in modules.keys():
        module = modules[module_id]
        if module.is_stateful():
            raise UnsupportedConfigError(
                f"RLModule {module_id!r} ({type(module).__name__}) is stateful (it has an initial state, as LSTM or "
                f"attention modules do); {why}. Use a feed-forward module, or build this config without "
                f"conduit_rllib.enable ({instead}).")


#: RLlib's ``Learner.update`` signature: how :meth:`ConduitOffPolicyLearner.update` finds the episodes it is given
_UPDATE_ARGS = inspect.signature(Learner.update)


def _check_unattached_replay_part(state: Any) -> None:
    """Check a replay part restored before a buffer is attached, as far as it can be without that buffer: its
    own consistency, loaded (as ``check_state`` does, into a scratch plane that takes no memory) by a buffer of
    the kind and capacity that saved it. Whether the buffer attached later is of that kind and capacity is
    checked when it is attached (:meth:`ConduitOffPolicyLearner.conduit_attach_replay`).

    Raises:
        conduit.ConfigurationError: no Conduit replay-buffer state, or a damaged one.
    """
    if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, MULTI_AGENT_STATE_FORMAT):
        raise ConfigurationError(f"This learner state's {REPLAY_COMPONENT!r} part is not a Conduit replay-buffer "
                                 f"state (get_state() of a Conduit buffer); load a checkpoint a Conduit-enabled "
                                 f"DQN/SAC learner saved, or leave that part out of the state.")
    multi_agent = state["format"] == MULTI_AGENT_STATE_FORMAT
    prioritized, capacity = state.get("prioritized"), state.get("capacity")
    try:  # (a saved plane has one n-step link per slot: checked first, so no scratch is sized by a damaged capacity)
        parts = list(state["modules"].values()) if multi_agent else [state]
        ok = (isinstance(prioritized, bool) and isinstance(capacity, int) and not isinstance(capacity, bool)
              and capacity > 0 and all(part["edp"] is None or len(part["succ"]) == capacity for part in parts))
    except (KeyError, TypeError, AttributeError) as e:
        raise ConfigurationError(f"This Conduit replay-buffer state is damaged ({type(e).__name__}: {e}); load an "
                                 f"undamaged get_state().") from e
    if not ok:
        raise ConfigurationError(f"This Conduit replay-buffer state is damaged (prioritized {prioritized!r} and "
                                 f"capacity {capacity!r} do not describe its contents); load an undamaged "
                                 f"get_state().")
    kinds: tuple[type, type] = ((ConduitMultiAgentEpisodeReplayBuffer, ConduitMultiAgentPrioritizedEpisodeReplayBuffer)
                                if multi_agent else (ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer))
    kinds[bool(prioritized)](capacity=cast(int, capacity), seed=0).check_state(state)


def includes_replay_part(owner: Any, components: str | Collection[str] | None,
                         not_components: str | Collection[str] | None, stores_buffer: bool) -> bool:
    """Whether a learner state asked for with ``components``/``not_components`` includes the replay part:
    ``components=None`` means everything RLlib saves, so the buffer only with ``stores_buffer`` (RLlib's
    ``store_buffer_in_checkpoints``); a ``components`` that names it includes it whatever the flag; a
    ``not_components`` that names it never. ``owner``: the Checkpointable asked (for its ``_check_component``)."""
    if not owner._check_component(REPLAY_COMPONENT, components, not_components):
        return False
    # when components is given, _check_component was True only because it names the replay part
    return components is not None or stores_buffer


class ConduitOffPolicyLearner:
    """Mixin for DQN/SAC learners: Conduit-delivered batches skip the learner connector.

    A learner in the driver (``num_learners=0``) owns the buffer: a batch sampled from a Conduit buffer is
    trained on only while a buffer is attached (:meth:`update` refuses it otherwise: the learner would not own the
    buffer it trains from). A remote learner (``num_learners >= 1``, see :attr:`conduit_replay_in_driver`) owns
    none: the buffer stays in the driver, which sends each learner its slice of every sample and saves and
    restores the buffer with the learners' state (:class:`~conduit_rllib.remote.ConduitLearnerGroup`).

    The buffer's contents are part of the learner's state (:meth:`get_state`) only with
    ``config.training(store_buffer_in_checkpoints=True)`` (RLlib's DQN/SAC flag, default False), or when asked
    for by name (``get_state(components=REPLAY_COMPONENT)``); :meth:`set_state` restores a state's replay part
    whatever the flag.

    Attributes:
        conduit_replay: the Conduit replay buffer attached by ``enable`` (checkpointed with the learner when
            ``store_buffer_in_checkpoints`` is True).
        conduit_batches: train batches received from Conduit so far (the fast path).
        native_batches: train batches that went through RLlib's learner connector.
        conduit_last_handles: the Conduit handles of the last such batch, in row order (a remote learner's:
            its slice of the driver's sample).
    """

    conduit_replay: Any = None
    conduit_batches: int = 0
    native_batches: int = 0
    conduit_last_handles: Any = None
    _conduit_pending_state: Any = None

    def build(self) -> None:
        """RLlib's build, then a check of the module it built (a second call, which RLlib skips, checks again).

        Raises:
            UnsupportedConfigError: a ``model_config`` asking for an LSTM/attention (``enable`` refuses it: the
                config was changed after ``enable``; refused before anything is built), or
                a stateful (recurrent) RLModule, e.g. one given as a module class, which
                ``enable`` cannot see in ``model_config`` (see :func:`_refuse_stateful_modules`): Conduit's buffer
                samples one-step (n-step) transitions, and RLlib's DQN/SAC training step would ask it for sequences
                (or, without a ``max_seq_len`` in the config's ``model_config``, train the module on stateless
                one-step batches).
        """
        try:  # (enable refuses it: named as a change after enable, before a module is built)
            refuse_stateful_model_config(self.config)  # type: ignore[attr-defined]
        except UnsupportedConfigError as e:
            raise UnsupportedConfigError(f"{e}{CHANGED_AFTER_ENABLE}") from e
        super().build()  # type: ignore[misc]
        _refuse_stateful_modules(self.module,  # type: ignore[attr-defined]
                                 "Conduit's replay buffer samples one-step (n-step) transitions, not the sequences "
                                 "and states a stateful module trains on", "RLlib's own replay buffer")

    def conduit_attach_replay(self, buffer: Any) -> None:
        """Attach the driver's Conduit replay buffer (local learner only): it is saved with this learner (see
        :meth:`get_state`) and closed by its :meth:`shutdown`.

        A replay part :meth:`set_state` kept because no buffer was attached yet (checked there as far as it can
        be without a buffer) is restored into ``buffer`` first. If ``buffer`` refuses it (a checkpoint's buffer
        of another kind or capacity than this one), nothing changes: ``buffer`` is not attached (and is as it
        was), and the part is still kept, to be restored into the next buffer attached, or given up with
        :meth:`conduit_drop_kept_replay_state`.

        Raises:
            conduit.ConfigurationError: ``buffer`` refused the kept replay part (the message says what it
                refused and what to do).
        """
        kept = self._conduit_pending_state
        if kept is not None:
            try:
                buffer.set_state(kept)  # all-or-nothing: a refused state leaves the buffer as it was
            except ConfigurationError as e:
                raise ConfigurationError(
                    f"The restored learner state's replay buffer part cannot be loaded into the buffer being "
                    f"attached: {e} That buffer was not attached, and the part is still kept. Attach a buffer "
                    f"like the one that saved it (for an algorithm: config.training(replay_buffer_config=...) "
                    f"with the checkpoint's buffer type and capacity), or call the learner's "
                    f"conduit_drop_kept_replay_state() to give the checkpoint's buffer contents up and attach "
                    f"this buffer as it is.") from e
            self._conduit_pending_state = None
        self.conduit_replay = buffer

    def conduit_keep_replay_state(self, state: Any) -> None:
        """Keep ``state`` (a replay buffer's ``get_state()``) as the part :meth:`get_state` saves while no buffer is
        attached: how the driver's group of remote learners has learner 0 save the driver's buffer."""
        self._conduit_pending_state = state

    def conduit_take_kept_replay_state(self) -> Any:
        """The replay part kept for a buffer not attached yet (None if none), given up here: how the driver's group
        of remote learners takes a restored checkpoint's buffer for the driver's buffer."""
        kept, self._conduit_pending_state = self._conduit_pending_state, None
        return kept

    def conduit_drop_kept_replay_state(self) -> bool:
        """Give up the replay part :meth:`set_state` kept for a buffer not attached yet (e.g. one the attached
        buffer refused): the next :meth:`conduit_attach_replay` attaches its buffer as it is.

        Returns:
            Whether a part was kept (and is now dropped).
        """
        kept, self._conduit_pending_state = self._conduit_pending_state, None
        return kept is not None

    def shutdown(self) -> None:
        """Close the attached replay buffer, then RLlib's shutdown (``LearnerGroup.shutdown`` calls this, and
        ``algo.stop()`` reaches it): its scheduler's worker threads end and its delivery buffers go, also while
        the algorithm object lives on. The closed buffer still answers ``len()``, ``get_metrics`` and
        ``get_state`` (so the stopped algorithm can still be saved), and refuses ``add``/``sample`` and restores
        (build a new algorithm to go on training; see ``ConduitEpisodeReplayBuffer.close``)."""
        buffer = self.conduit_replay
        try:
            if buffer is not None:
                buffer.close()
        finally:  # a close that raised (a background store failing) still shuts RLlib's part down
            super().shutdown()  # type: ignore[misc]

    def update(self, *args: Any, **kwargs: Any) -> Any:
        """RLlib's ``update``, refusing (before anything changes) a batch sampled from a Conduit replay buffer while
        no buffer is attached to this learner: the learner would train from a buffer it does not own, so its state
        could not hold that buffer (with ``store_buffer_in_checkpoints=True`` or asked for by name), a replay part
        restored from a checkpoint and kept for the buffer would not reach it, and :meth:`shutdown` would not close
        it.

        Raises:
            conduit.ConfigurationError: such a batch (attach the buffer with :meth:`conduit_attach_replay` first;
                ``conduit_rllib.enable`` does it for an algorithm built from the config).
        """
        if self.conduit_replay is None and not self.conduit_replay_in_driver:
            given = _UPDATE_ARGS.bind_partial(self, *args, **kwargs).arguments
            data = given.get("training_data")
            episodes = getattr(data, "episodes", None) if data is not None else given.get("episodes")
            if isinstance(episodes, CONDUIT_SAMPLES):
                kept = (" It holds a replay part restored for a buffer not attached yet: attaching the buffer "
                        "restores that part into it first (or call conduit_drop_kept_replay_state() to give it up)."
                        if self._conduit_pending_state is not None else "")
                raise ConfigurationError(
                    f"This learner got a batch sampled from a Conduit replay buffer, but no buffer is attached to it, "
                    f"so it does not own the buffer it trains from: its state (get_state, with "
                    f"store_buffer_in_checkpoints=True or components={REPLAY_COMPONENT!r}) could not hold that "
                    f"buffer, a replay part restored from a checkpoint would not reach it, and shutdown would not "
                    f"close it. Attach the buffer first "
                    f"with learner.conduit_attach_replay(buffer) (conduit_rllib.enable's on_algorithm_init does this "
                    f"for an algorithm built from the config).{kept} Nothing was updated.")
        return super().update(*args, **kwargs)  # type: ignore[misc]

    def _make_batch_if_necessary(self, training_data: Any) -> Any:
        episodes = training_data.episodes
        if isinstance(episodes, CONDUIT_SAMPLES):  # delivered onto this learner's device
            self.conduit_batches += 1
            self.conduit_last_handles = episodes.handles
            return episodes.to_multi_agent_batch()
        piece = training_data.batch
        if isinstance(piece, CONDUIT_SAMPLES):  # a remote learner's slice, in host memory
            self.conduit_batches += 1
            self.conduit_last_handles = piece.handles
            batch = piece.to_multi_agent_batch()
            device = self.device  # type: ignore[attr-defined]
            on_device = all(col.device == device for part in batch.policy_batches.values() for col in part.values())
            return batch if on_device else self._convert_batch_type(batch)  # type: ignore[attr-defined]
        self.native_batches += 1
        return super()._make_batch_if_necessary(training_data)  # type: ignore[misc]

    def get_state(self, components: str | Collection[str] | None = None, *,
                  not_components: str | Collection[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """RLlib's learner state, with the Conduit replay buffer's under :data:`REPLAY_COMPONENT` when this
        learner's config says ``store_buffer_in_checkpoints=True`` (RLlib's DQN/SAC flag; a config without it
        counts as False, RLlib's default) or when ``components`` names :data:`REPLAY_COMPONENT` (then whatever the
        flag); ``not_components`` naming it leaves it out always. So ``algo.save_to_path`` saves the buffer only
        with the flag set (a buffer can be large: capacity x observation size).

        The replay part is the attached buffer's state, or before one is attached the part :meth:`set_state` kept
        for it (a copy), so a learner restored and saved again before ``enable`` attached its buffer still saves
        the buffer's contents (when the replay part is included, as above)."""
        state = super().get_state(components, not_components=not_components, **kwargs)  # type: ignore[misc]
        if not includes_replay_part(self, components, not_components, self.conduit_stores_buffer_in_checkpoints):
            return state
        if self.conduit_replay is not None:
            state[REPLAY_COMPONENT] = self.conduit_replay.get_state()
        elif self._conduit_pending_state is not None:
            state[REPLAY_COMPONENT] = copy.deepcopy(self._conduit_pending_state)
        return state

    @property
    def conduit_replay_in_driver(self) -> bool:
        """Whether this is a remote learner (its config's ``num_learners >= 1``): the replay buffer lives in the
        driver, never in this learner, which trains the slices of its samples the driver sends."""
        return int(getattr(getattr(self, "config", None), "num_learners", 0) or 0) > 0

    @property
    def conduit_stores_buffer_in_checkpoints(self) -> bool:
        """Whether :meth:`get_state` (without ``components``) includes the replay buffer: the learner config's
        ``store_buffer_in_checkpoints`` (RLlib's DQN/SAC flag), False for a config without it (RLlib's
        default)."""
        return bool(getattr(getattr(self, "config", None), "store_buffer_in_checkpoints", False))

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore RLlib's part of ``state``, then the Conduit replay buffer's.

        A state that holds a replay part (:data:`REPLAY_COMPONENT`) restores it whatever this learner's
        ``store_buffer_in_checkpoints``: a checkpoint saved with the flag on brings its buffer back also into an
        algorithm whose config leaves the flag off. A state without one (saved with the flag off) leaves the
        buffer as it is: an algorithm built from such a checkpoint starts with an empty buffer.

        The buffer's part is checked (``check_state``) before anything is restored and applied only once
        RLlib's part was restored, so a refused state (the buffer's part damaged, or RLlib's ``set_state``
        raising) leaves both parts as they were. Before ``enable`` attached the buffer, its part is checked
        as far as it can be without the buffer (its own consistency, by a buffer of the kind and capacity that
        saved it), kept (once RLlib's part was restored) and restored when the buffer is attached (see
        :meth:`conduit_attach_replay`, which refuses a buffer of another kind or capacity).

        A remote learner (:attr:`conduit_replay_in_driver`) never has a buffer attached: it keeps the part, and
        the driver's learner group takes it for the driver's buffer (``ConduitLearnerGroup.restore_from_path``).

        Raises:
            conduit.ConfigurationError: the buffer's part is no Conduit replay state or is damaged, or was saved
                by a buffer of another kind or capacity than the attached one, or the attached buffer is closed
                (nothing is restored then).
        """
        rb_state: Any = None
        restore_replay = REPLAY_COMPONENT in state
        if restore_replay:
            state = dict(state)
            rb_state = state.pop(REPLAY_COMPONENT)
            if self.conduit_replay is not None:
                self.conduit_replay.check_state(rb_state)
            else:
                _check_unattached_replay_part(rb_state)
        super().set_state(state)  # type: ignore[misc]
        if restore_replay:
            if self.conduit_replay is not None:  # checked above: refused only if its memory cannot be allocated
                self.conduit_replay.set_state(rb_state)
            else:  # restored before enable's on_algorithm_init attached the buffer
                self._conduit_pending_state = rb_state


def _in_lock_step(iterators: dict[str, Iterator[MultiAgentBatch]], env_steps: int) -> Iterator[MultiAgentBatch]:
    """One train batch per step holding every module's next minibatch, as RLlib's iterator walks a multi-agent
    batch (each feed cuts the same count; the minibatches each report the train batch's ``env_steps``). When
    the caller stops early each feed keeps what it delivered and did not hand over, as a single feed does."""
    try:
        while True:
            parts = {m: next(it, None) for m, it in iterators.items()}
            if all(p is None for p in parts.values()):
                return
            done = sorted(m for m, p in parts.items() if p is None)
            if done:  # pragma: no cover - the feeds are configured with one count
                raise RuntimeError(f"The minibatch feeds of modules {done} ended before the others'.")
            yield MultiAgentBatch({m: p.policy_batches[m] for m, p in parts.items() if p is not None}, env_steps)
    finally:
        for it in iterators.values():
            close = getattr(it, "close", None)
            if close is not None:
                close()


class ConduitOnPolicyLearner:
    """Mixin for PPO learners: minibatches come from Conduit's on-policy delivery.

    Per ``update``: RLlib's connector builds the train batch; it is ingested as one rollout of
    policy version v (v counts this learner's updates), sealed, and delivered in the updates stock
    RLlib makes (its ``MiniBatchCyclicIterator``): K = ceil(num_epochs * rows / minibatch_size)
    minibatches of exactly ``minibatch_size`` rows (without a ``minibatch_size``, as RLlib: with
    ``num_epochs > 1`` minibatches of the train batch's env steps, with one epoch the whole batch once;
    see :func:`_minibatch_rows`; a fractional ``num_epochs`` counts, as in RLlib's iterator, as ceil(num_epochs)
    passes). The epochs run as one stream, so a minibatch may end one epoch and begin
    the next; every row trains in each of the ``num_epochs`` epochs, and when ``num_epochs * rows``
    is no multiple of ``minibatch_size`` the K * minibatch_size - num_epochs * rows rows that fill
    the last minibatch come from the head of one more (reshuffled) pass, as in RLlib (e.g. 250 rows,
    minibatch_size 64, 2 epochs: 8 minibatches of 64; 12 rows train a third time). Every minibatch
    reports the train batch's env steps, so ``num_env_steps_trained`` is K * env steps and
    ``num_module_steps_trained`` K * minibatch_size, as with RLlib's iterator. With several learners
    (``num_learners >= 2``) RLlib gives each learner its shard of the episodes and one count of minibatches
    for all (``num_total_minibatches``, so that they step in lock step); each learner's feed then cuts its
    shard into exactly that many, cycling over it as RLlib's iterator does. Options come from
    ``config.learner_config_dict["conduit"]`` (``prefetch``: gather minibatch k + 1 while k trains,
    default True; ``placement``). The reshuffles are seeded by ``config.seed``; without one (RLlib's default) each
    learner takes a fresh seed, so unseeded runs train different orders, as RLlib's unseeded reshuffles do.
    The update count and the feed's permutation RNG are saved with the learner's state, so a
    learner restored from a state saved between updates continues the versions and the minibatch order
    where the saved one was (inside an update :meth:`get_state` refuses Conduit's part: see there).

    Multi-agent: each RLModule's rows go through a feed of their own (:attr:`conduit_feeds`), and every
    minibatch RLlib trains carries each module's next minibatch, as RLlib's iterator walks the modules'
    batches in lock step: with a ``minibatch_size``, each module cuts minibatches of that many of its own rows
    until every module has had ``num_epochs`` passes, K = ceil(num_epochs * the largest module's rows /
    minibatch_size) (or RLlib's ``num_total_minibatches`` with several learners), so a module with fewer rows
    cycles through more passes, as in RLlib.

    Attributes:
        conduit_feeds: one :class:`~conduit_rllib.on_policy.MinibatchFeed` per RLModule trained, by module id (its
            ``delivered`` lists the SampleInfo of each delivery of the latest update: one per minibatch, or
            several for a minibatch that spans an epoch boundary).
        conduit_version: the version the next rollout is ingested under.
    """

    conduit_feeds: dict[str, MinibatchFeed]
    conduit_version: int = 0
    _conduit_updating: bool = False  # inside update(): a checkpoint now would not be exact (see get_state)

    def build(self) -> None:
        """RLlib's build, then the minibatch feed. Like RLlib's, a second call changes nothing: the feed built
        first (its state, permutation RNG and prefetch thread) stays.

        Raises:
            conduit.ConfigurationError: ``learner_config_dict["conduit"]`` holds a ``prefetch`` that is no bool or a
                ``placement`` that is no conduit Placement, or a key that is neither (it would not be used).
            UnsupportedConfigError: a stateful (recurrent) RLModule, e.g. one given as a module class, which
                ``enable`` cannot see in ``model_config`` (see :func:`_refuse_stateful_modules`).
        """
        config = self.config  # type: ignore[attr-defined]
        opts = dict(config.learner_config_dict.get(CONFIG_KEY, {}))
        unknown = sorted(map(repr, set(opts) - {"placement", "prefetch"}))
        if unknown:  # (before RLlib's build: a refused config builds nothing)
            raise ConfigurationError(f"learner_config_dict[{CONFIG_KEY!r}] holds {', '.join(unknown)}, which Conduit's "
                                     f"PPO learner does not take (it takes 'placement' and 'prefetch'), so the value "
                                     f"would not be used; remove it, or set the options with "
                                     f"conduit_rllib.enable(config, placement=..., prefetch=...).")
        super().build()  # type: ignore[misc]
        _refuse_stateful_modules(self.module,  # type: ignore[attr-defined]
                                 "Conduit's on-policy delivery cuts minibatches by timestep and cannot keep its "
                                 "sequences whole", "RLlib's own minibatching")
        if getattr(self, "conduit_feeds", None) is not None:
            return
        # without a seed RLlib reshuffles from an unseeded generator: a fresh seed here, so unseeded runs differ too
        seed = config.seed
        self._conduit_seed = fresh_seed() if seed is None else int(seed)
        self._conduit_opts = opts
        self.conduit_feeds = {}
        for module_id in self.module.keys():  # type: ignore[attr-defined]
            self._conduit_feed_of(module_id)

    def _conduit_feed_of(self, module_id: str) -> MinibatchFeed:
        """The feed of ``module_id``, made on first use (a module added after the build gets one then). Its
        permutations are seeded by the learner's seed (the default module's by the seed itself, so a
        single-agent learner reshuffles as before; any other module's by the seed and its id)."""
        feed = self.conduit_feeds.get(module_id)
        if feed is None:
            seed = module_seed(self._conduit_seed, module_id)
            opts = self._conduit_opts
            feed = self.conduit_feeds[module_id] = MinibatchFeed(
                seed=seed, max_staleness=0, on_stale="drop", placement=opts.get("placement"),
                prefetch=opts.get("prefetch", True))
        return feed

    @property
    def conduit_feed(self) -> MinibatchFeed:
        """The feed of a single-agent learner's one RLModule (:attr:`conduit_feeds` has every module's).

        Raises:
            AttributeError: the learner is not built, or trains several modules (use :attr:`conduit_feeds`).
        """
        feeds = self.__dict__.get("conduit_feeds")
        if feeds is None or len(feeds) != 1:
            raise AttributeError("conduit_feed is the feed of a single-agent PPO learner's one module once built; "
                                 f"this learner has {'none' if feeds is None else sorted(feeds)}: use conduit_feeds.")
        return next(iter(feeds.values()))

    def _create_iterator_if_necessary(self, *, training_data: Any, num_total_minibatches: int = 0,
                                      num_epochs: int = 1, minibatch_size: int | None = None,
                                      shuffle_batch_per_epoch: bool = False, **kwargs: Any) -> Iterable[Any]:
        if training_data.data_iterators:  # offline data: RLlib's own iterator
            return super()._create_iterator_if_necessary(  # type: ignore[misc]
                training_data=training_data, num_total_minibatches=num_total_minibatches, num_epochs=num_epochs,
                minibatch_size=minibatch_size, shuffle_batch_per_epoch=shuffle_batch_per_epoch, **kwargs)
        batch: MultiAgentBatch = self._make_batch_if_necessary(training_data=training_data)  # type: ignore
        for module_id in list(batch.policy_batches):
            if not self.should_module_be_updated(module_id, batch):  # type: ignore[attr-defined]
                del batch.policy_batches[module_id]
        if not batch.policy_batches:
            return {}
        have = sorted(self.module.keys())  # type: ignore[attr-defined]
        unknown = sorted(set(batch.policy_batches) - set(have))
        if unknown:  # (RLlib's loop refuses them at the first minibatch: here before anything is ingested)
            raise SchemaError(f"The train batch holds rows of modules {unknown} this learner has no RLModule for (it "
                              f"has {have}); add them (learner.add_module) or leave their rows out. Nothing was "
                              f"ingested.")
        rows = {}
        for module_id, module_batch in batch.policy_batches.items():
            if module_batch.zero_padded or module_batch.get(SampleBatch.SEQ_LENS) is not None:
                raise UnsupportedConfigError("Conduit's on-policy delivery cuts minibatches by timestep; stateful "
                                             "(RNN) modules with time-padded batches are not supported.")
            rows[module_id] = len(module_batch)
            if rows[module_id] == 0:
                raise EmptyBufferError(f"The train batch for module {module_id!r} has no rows; an update needs at "
                                       f"least one timestep (sample some before calling update).")
        num_epochs = _passes(num_epochs)  # (RLlib's iterator makes ceil(num_epochs) passes)
        # RLlib's cuts: ceil(E * rows / size) minibatches of size rows (see _minibatch_rows), or with several
        # learners num_total_minibatches of them (RLlib's one-batch iterator, without minibatch_size and with
        # one epoch, ignores that count); several modules step together until the largest had E passes
        cyclic = bool(minibatch_size) or num_epochs > 1
        sizes = {m: _minibatch_rows(batch, n, minibatch_size, num_epochs) for m, n in rows.items()}
        total = int(num_total_minibatches) if cyclic else 0
        if cyclic and total <= 0 and len(rows) > 1:
            total = max(_cyclic_plan(n, sizes[m], num_epochs)[0] for m, n in rows.items())
        feeds = {m: self._conduit_feed_of(m) for m in rows}
        version = self.conduit_version
        for feed in self.conduit_feeds.values():
            feed.set_policy_version(version)
            feed.drop_leftovers()  # an earlier update that stopped mid-epoch may have left its (now stale) rollout
        ingested = []
        try:
            for m, feed in feeds.items():
                feed.configure(minibatch_size=sizes[m], num_epochs=max(1, num_epochs),
                               shuffle=bool(shuffle_batch_per_epoch and num_epochs > 1), num_total_minibatches=total)
                feed.ingest(m, batch.policy_batches[m], version=version)
                ingested.append(feed)
        finally:
            # counted once ingested: a train batch refused whole is no update. One refused for a module after
            # another module's rows were ingested leaves those as a stopped update does: sealed, and dropped by
            # the next update (counted in their feed's dropped_items)
            for feed in ingested:
                feed.seal()
            if ingested:
                self.conduit_version = version + 1
        env_steps = batch.env_steps()  # RLlib reports the train batch's on each minibatch
        iterators = {m: feed.minibatches(env_steps=env_steps) for m, feed in feeds.items()}
        if len(iterators) == 1:
            return next(iter(iterators.values()))
        return _in_lock_step(iterators, env_steps)

    def shutdown(self) -> None:
        """Stop the feed's prefetch thread and data plane (``LearnerGroup.shutdown`` calls this); the
        feed's state is kept, and a later update starts them again."""
        for feed in getattr(self, "conduit_feeds", {}).values():  # (none when build() did not run or failed)
            feed.close()
        super().shutdown()  # type: ignore[misc]

    def remove_module(self, module_id: str, **kwargs: Any) -> Any:
        """RLlib's ``remove_module``, then the module's feed is closed and dropped (its prefetch thread and data
        plane end with it; a module added again under that id gets a fresh feed). A league that keeps adding
        and removing modules keeps no feed of a module it removed."""
        spec = super().remove_module(module_id, **kwargs)  # type: ignore[misc]
        feed = getattr(self, "conduit_feeds", {}).pop(module_id, None)
        if feed is not None:
            feed.close()
        return spec

    def update(self, *args: Any, **kwargs: Any) -> Any:
        """RLlib's ``update``; while it runs, :meth:`get_state` refuses Conduit's part (see there)."""
        self._conduit_updating = True
        try:
            return super().update(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._conduit_updating = False

    def get_state(self, components: str | Collection[str] | None = None, *,
                  not_components: str | Collection[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """RLlib's learner state, with Conduit's part (the update count and each module's feed state) under
        :data:`ON_POLICY_COMPONENT`.

        Exact between updates: a learner restored from it delivers the minibatches this one does from here
        on. After an update that stopped part-way (it raised), too: the rollout it left is not saved, and this
        learner's next update drops it (its rows counted as dropped in both). Inside an update (e.g. from a
        loss, or another thread) the rest of the update's minibatches cannot be saved, so Conduit's part is
        refused then.

        Raises:
            conduit.ConfigurationError: Conduit's part was asked for while an update runs; checkpoint between
                updates (e.g. ``algo.save_to_path`` between ``algo.train()`` calls).
        """
        state = super().get_state(components, not_components=not_components, **kwargs)  # type: ignore[misc]
        if self._check_component(ON_POLICY_COMPONENT, components, not_components):  # type: ignore[attr-defined]
            if self._conduit_updating:
                raise ConfigurationError(
                    "This PPO learner is inside an update: the minibatches it has still to train cannot be saved, "
                    "so a learner restored from this state would not train them. Checkpoint between updates (e.g. "
                    "algo.save_to_path between algo.train() calls), or leave Conduit's part out "
                    f"(get_state(not_components={ON_POLICY_COMPONENT!r})).")
            # (outside an update nothing is waiting, or a stopped update's leftover our next update drops)
            feeds = {m: feed.state_dict(drop_pending=True) for m, feed in self.conduit_feeds.items()}
            state[ON_POLICY_COMPONENT] = {"version": self.conduit_version, "feeds": feeds}
        return state

    def _conduit_feed_states(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The feed states of Conduit's part ``saved``, by module id, each checked as its feed would load it (a
        module without a feed yet by a feed of the defaults). A part saved before multi-agent learners (one
        ``"feed"``) is the state of a single-agent learner's one feed.

        Raises:
            conduit.ConfigurationError: the part or a feed state in it is damaged.
        """
        if "feeds" in saved:
            states = saved["feeds"]
        elif "feed" in saved and len(self.conduit_feeds) == 1:
            states = {next(iter(self.conduit_feeds)): saved["feed"]}
        else:
            states = None
        if not isinstance(states, dict) or not all(isinstance(m, str) for m in states):
            raise ConfigurationError(f"This checkpoint's {ON_POLICY_COMPONENT!r} state is damaged (expected "
                                     f"{{'version': int >= 0, 'feeds': {{module_id: feed state}}}}); load an "
                                     f"undamaged checkpoint.")
        for m, feed_state in states.items():
            (self.conduit_feeds.get(m) or MinibatchFeed()).check_state_dict(feed_state)
        return states

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore RLlib's part of ``state``, then Conduit's (the update count and each module's feed state; a
        module this learner has no feed for yet gets one).

        Conduit's part is checked before anything is restored and applied only once RLlib's part was
        restored, so a refused state (Conduit's part damaged, or RLlib's ``set_state`` raising) leaves
        Conduit's part as it was.

        Raises:
            ValueError: RLlib's own, before ``build()`` (which makes the feed Conduit's part goes to).
            conduit.ConfigurationError: Conduit's part is damaged (nothing is restored then).
        """
        saved: Any = None
        version: Any = None
        self._check_is_built()  # type: ignore[attr-defined]
        if ON_POLICY_COMPONENT in state:
            state = dict(state)
            saved = state.pop(ON_POLICY_COMPONENT)
            version = saved.get("version") if isinstance(saved, dict) else None
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ConfigurationError(f"This checkpoint's {ON_POLICY_COMPONENT!r} state is damaged (expected "
                                         f"{{'version': int >= 0, 'feeds': ...}}); load an undamaged checkpoint.")
            feed_states = self._conduit_feed_states(saved)
        super().set_state(state)  # type: ignore[misc]
        if saved is not None:  # checked above: cannot be refused now
            for m, feed_state in feed_states.items():
                self._conduit_feed_of(m).load_state_dict(feed_state)
            self.conduit_version = version


class ConduitDQNTorchLearner(ConduitOffPolicyLearner, DQNTorchLearner):
    """RLlib's DQN torch learner, taking Conduit-delivered batches."""


# RLlib's own SACLearner and TorchLearner disagree on remove_module's signature (hence the ignore).
class ConduitSACTorchLearner(ConduitOffPolicyLearner, SACTorchLearner):  # type: ignore[misc]
    """RLlib's SAC torch learner, taking Conduit-delivered batches."""


class ConduitPPOTorchLearner(ConduitOnPolicyLearner, PPOTorchLearner):
    """RLlib's PPO torch learner, with minibatches delivered by Conduit's on-policy path."""
