"""Off-policy delivery to remote learners (DQN/SAC with ``num_learners >= 1``).

The Conduit replay buffer stays in the driver, where RLlib's training step adds to it, samples
it and updates its priorities; the buffer delivers each sample into host memory there.
:class:`ConduitLearnerGroup` is that algorithm's learner group: a Conduit sample given to its
``update`` goes out as one contiguous slice of rows per learner, in learner order (learner k gets
rows ``[s_k, s_{k+1})``, the first ``B % n`` slices one row longer), each slice in tensors of
its own (the sample's columns are reused delivery buffers, and Ray would ship a view's whole
storage). Each learner moves its slice onto its device and trains it as the train batch
(:class:`~conduit_rllib.learner.ConduitOffPolicyLearner`); with several learners RLlib averages
their gradients as it does for its own batches.

Slices in order are what keeps prioritized replay right: the training step concatenates the
learners' TD errors in learner order and applies them, in that order, to the items of the last
sample, so each error reaches the item it was computed for. (RLlib's own path hands the sampled
one-step episodes out one at a time to the learner with the fewest rows, i.e. round robin,
so with two or more learners its concatenated errors do not follow the sample's order.)
"""

from __future__ import annotations

import inspect
from collections.abc import Collection
from typing import Any, TypeVar, cast

import ray
from conduit import ConfigurationError
from ray.rllib.core import COMPONENT_LEARNER
from ray.rllib.core.learner.learner_group import LearnerGroup

from conduit_rllib.delivery import CONDUIT_SAMPLES, ConduitMultiAgentSample, ConduitSampledEpisodes
from conduit_rllib.errors import UnsupportedConfigError
from conduit_rllib.learner import REPLAY_COMPONENT, includes_replay_part

__all__ = ["ConduitLearnerGroup", "split_sample", "route_to_remote_learners"]

#: RLlib's ``LearnerGroup.update`` signature: where :meth:`ConduitLearnerGroup.update` finds the sample it is given
_UPDATE_ARGS = inspect.signature(LearnerGroup.update)
#: a Conduit sample: one module's, or a multi-agent one
_S = TypeVar("_S", ConduitSampledEpisodes, ConduitMultiAgentSample)
#: the arguments that name the training data (one of them carries the sample)
_DATA_ARGS = frozenset({"batch", "batches", "batch_refs", "episodes", "episodes_refs", "data_iterators",
                        "training_data"})


def split_sample(sample: _S, num_shards: int) -> list[_S]:
    """``sample``'s rows in ``num_shards`` contiguous slices, in order, on the host (a multi-agent sample: each
    module's rows so, slice k holding every module's k-th slice).

    Slice k holds rows ``[k * q + min(k, r), (k + 1) * q + min(k + 1, r))`` with ``q, r = divmod(B, num_shards)``
    (the first ``r`` slices one row longer), columns and handles copied into tensors of its own. Episode ids are
    not carried (a slice's ``episode_ids`` read None).

    Raises:
        conduit.ConfigurationError: ``num_shards < 1``, or fewer rows than slices (a learner would get an empty
            batch); raise ``train_batch_size_per_learner`` or lower ``num_learners``.
    """
    if isinstance(sample, ConduitMultiAgentSample):
        parts = {m: split_sample(part, num_shards) for m, part in sample.parts.items()}
        return [ConduitMultiAgentSample({m: slices[k] for m, slices in parts.items()}) for k in range(num_shards)]
    rows = len(sample)
    if num_shards < 1 or rows < num_shards:
        raise ConfigurationError(f"A sample of {rows} rows cannot be split among {num_shards} learners (each needs "
                                 f"at least one row). Sample at least one row per learner: raise "
                                 f"train_batch_size_per_learner or lower num_learners.")
    q, r = divmod(rows, num_shards)
    out = []
    start = 0
    for k in range(num_shards):
        stop = start + q + (k < r)
        columns = {name: col[start:stop].to("cpu", copy=True) for name, col in sample.columns.items()}
        out.append(ConduitSampledEpisodes(columns, sample.handles[start:stop].to("cpu", copy=True),
                                          module_id=sample.module_id, observation_space=sample.observation_space,
                                          action_space=sample.action_space))
        start = stop
    return out


class ConduitLearnerGroup(LearnerGroup):
    """A group of remote learners whose Conduit replay buffer lives in the driver.

    ``conduit_rllib.enable``'s ``on_algorithm_init`` callback turns the algorithm's ``LearnerGroup`` into this
    class (:func:`route_to_remote_learners`); what changes:

    * :meth:`update`: a Conduit sample (``episodes=``, or ``training_data=`` holding it) goes to
      RLlib's ``update`` as ``batches=``, one slice per learner (:func:`split_sample`), every other argument
      unchanged; any other call goes through unchanged.
    * checkpoints: the buffer is saved and restored under the learner's state as with a learner in the driver
      (:data:`~conduit_rllib.learner.REPLAY_COMPONENT`, with ``store_buffer_in_checkpoints=True`` or asked for by
      name), so a checkpoint moves between ``num_learners=0`` and remote learners. :meth:`get_state` adds the
      driver's buffer; :meth:`save_to_path` lends learner 0 a copy for the save (RLlib writes a remote learner's
      state from inside its actor); :meth:`set_state` checks the part here before anything is restored;
      :meth:`restore_from_path` loads the part the learners kept into the driver's buffer.
    * :meth:`shutdown` closes the buffer, as a learner in the driver does.

    Attributes:
        conduit_replay: the driver's Conduit replay buffer (the algorithm's ``local_replay_buffer``).
    """

    conduit_replay: Any

    def update(self, *args: Any, **kwargs: Any) -> Any:
        given = _UPDATE_ARGS.bind_partial(self, *args, **kwargs).arguments
        data = given.get("training_data")
        sample = getattr(data, "episodes", None) if data is not None else given.get("episodes")
        if not isinstance(sample, CONDUIT_SAMPLES):
            return super().update(*args, **kwargs)
        rest = {k: v for k, v in given.items() if k not in _DATA_ARGS and k not in ("self", "kwargs")}
        slices: Any = split_sample(sample, len(self))  # (RLlib types batches= as MultiAgentBatch only)
        return super().update(batches=slices, **rest, **given.get("kwargs", {}))

    def _stores_buffer(self) -> bool:
        return bool(getattr(self.config, "store_buffer_in_checkpoints", False))

    def get_state(self, components: str | Collection[str] | None = None, *,
                  not_components: str | Collection[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """RLlib's state, with the driver's buffer in the learner's part when that part would include it for a
        learner in the driver (see ``ConduitOffPolicyLearner.get_state``)."""
        state = super().get_state(components, not_components=not_components, **kwargs)
        learner_state = state.get(COMPONENT_LEARNER)
        if isinstance(learner_state, dict) and includes_replay_part(
                self, self._get_subcomponents(COMPONENT_LEARNER, components),
                self._get_subcomponents(COMPONENT_LEARNER, not_components), self._stores_buffer()):
            learner_state[REPLAY_COMPONENT] = self.conduit_replay.get_state()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """RLlib's ``set_state``; a replay part in the learner's state is checked by the driver's buffer before
        anything is restored and loaded into it after the learners were.

        Raises:
            conduit.ConfigurationError: the driver's buffer refuses the part (nothing is restored then).
        """
        learner_state = state.get(COMPONENT_LEARNER)
        if not (isinstance(learner_state, dict) and REPLAY_COMPONENT in learner_state):
            return super().set_state(state)
        learner_state = dict(learner_state)
        part = learner_state.pop(REPLAY_COMPONENT)
        self.conduit_replay.check_state(part)
        super().set_state({**state, COMPONENT_LEARNER: learner_state})
        self.conduit_replay.set_state(part)

    def save_to_path(self, *args: Any, **kwargs: Any) -> Any:
        """RLlib's ``save_to_path``; with ``store_buffer_in_checkpoints=True`` learner 0, whose state RLlib writes,
        holds a copy of the driver's buffer state for the save (given up afterwards)."""
        if not self._stores_buffer():
            return super().save_to_path(*args, **kwargs)
        first = cast(Any, self._worker_manager).healthy_actor_ids()[:1]  # the learner RLlib's save writes
        self._results(self.foreach_learner(_keep, remote_actor_ids=first, ref=ray.put(self.conduit_replay.get_state())))
        try:
            return super().save_to_path(*args, **kwargs)
        finally:
            self._results(self.foreach_learner(_drop, remote_actor_ids=first))

    def restore_from_path(self, *args: Any, **kwargs: Any) -> None:
        """RLlib's ``restore_from_path``, then the replay part the learners kept (a checkpoint saved with the
        buffer) loaded into the driver's buffer.

        Raises:
            conduit.ConfigurationError: the driver's buffer refuses the checkpoint's part (another kind or capacity):
                the learners were restored, the buffer is as it was.
        """
        super().restore_from_path(*args, **kwargs)
        # RLlib loads learner 0's state into every learner: one copy comes back (a buffer's state may be gigabytes);
        # the others' copies are dropped where they are
        ids = cast(Any, self._worker_manager).healthy_actor_ids()
        kept = self._results(self.foreach_learner(_take, remote_actor_ids=ids[:1])) if ids else []
        if ids[1:]:  # (an empty remote_actor_ids would name every learner)
            self._results(self.foreach_learner(_drop, remote_actor_ids=ids[1:]))
        part = kept[0] if kept else None
        if part is None:
            return
        try:
            self.conduit_replay.set_state(part)  # all-or-nothing
        except ConfigurationError as e:
            raise ConfigurationError(
                f"The checkpoint's replay buffer cannot be loaded into this algorithm's buffer: {e} The learners "
                f"were restored; the buffer is as it was. Build the algorithm with the checkpoint's "
                f"replay_buffer_config (type and capacity) to restore both.") from e

    def shutdown(self) -> None:
        """Close the driver's buffer (its scheduler's threads end; it still answers ``len``, ``get_metrics`` and
        ``get_state``), then RLlib's shutdown: what a learner in the driver does with the buffer it owns."""
        try:
            self.conduit_replay.close()
        finally:
            super().shutdown()

    @staticmethod
    def _results(results: Any) -> list[Any]:
        """The values of a ``foreach_learner`` call, raising the first learner's error."""
        values = []
        for r in results:
            if not r.ok:
                raise r.get()
            values.append(r.get())
        return values


def _keep(learner: Any, ref: Any = None) -> None:
    learner.conduit_keep_replay_state(ray.get(ref))


def _drop(learner: Any, _: Any = None) -> None:
    learner.conduit_drop_kept_replay_state()


def _take(learner: Any, _: Any = None) -> Any:
    return learner.conduit_take_kept_replay_state()


def route_to_remote_learners(group: LearnerGroup, buffer: Any) -> None:
    """Turn an algorithm's group of remote learners into a :class:`ConduitLearnerGroup` holding ``buffer``.

    Raises:
        UnsupportedConfigError: ``group`` is of a ``LearnerGroup`` subclass (Conduit would drop its overrides).
    """
    if not isinstance(group, ConduitLearnerGroup):
        if type(group) is not LearnerGroup:
            raise UnsupportedConfigError(f"Conduit routes DQN/SAC samples to remote learners through RLlib's "
                                         f"LearnerGroup; this algorithm's group is a {type(group).__name__}. Use "
                                         f"RLlib's LearnerGroup, or num_learners=0.")
        group.__class__ = ConduitLearnerGroup
    cast(ConduitLearnerGroup, group).conduit_replay = buffer
