"""A replay-buffer plug for verl's V1 trainer that enforces Conduit's staleness policy.

verl's V1 trainer samples GRPO groups from TransferQueue through a replay buffer and lets
a user swap it by configuration only::

    trainer.v1.sampler.custom_sampler.path=pkg://conduit_verl.replay
    trainer.v1.sampler.custom_sampler.name=ConduitReplayBuffer

:class:`ConduitReplayBuffer` keeps verl's sampling (GRPO group status, DAPO filtering,
refills) and replaces its staleness rule with Conduit's on-policy one
(:class:`conduit.OnPolicy`): a group produced by policy version ``v`` has staleness
``policy_version - v`` (here ``global_steps - group_steps``) and may be trained on while
``staleness <= max_staleness``. verl's ``max_off_policy_threshold`` counts the versions a
trajectory *spans* (staleness + 1), so ``max_staleness = max_off_policy_threshold - 1`` and
the two agree where both apply. On top of verl's ``drop`` and ``wait`` it adds Conduit's
``raise`` (``trainer.v1.sampler.sampler_kwargs.on_stale=raise``): a stale group stops the
run with :class:`conduit.StaleExperienceError` instead of being silently dropped. Under
``drop`` and ``raise`` every sampled batch is re-checked against the bound before it reaches
the learner; verl's ``wait`` is dropless (it holds sampling until stale in-flight groups finish,
then trains them, past the bound by design), so there the bound is not enforced. Every sampled
batch's staleness is reported (``conduit/staleness/mean``, ``.../max``, ``conduit/stale_groups``).
"""

from __future__ import annotations

from typing import Any

from conduit import ConfigurationError, StaleExperienceError
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

__all__ = ["ConduitReplayBuffer", "staleness"]


def staleness(global_steps: int, group_steps: int) -> int:
    """Conduit's staleness of a group: learner version minus producing version (verl's span - 1)."""
    return int(global_steps) - int(group_steps)


class ConduitReplayBuffer(ReplayBufferAsync):
    """verl's V1 replay buffer with Conduit's staleness policy (see the module docstring).

    Works for every trainer mode: ``sync`` keeps verl's synchronous sampling (on-policy, so
    nothing is ever stale and the check is a guard), the async modes keep verl's async one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = dict(self.sampler_kwargs or {})
        on_stale = str(extra.get("on_stale", self.max_off_policy_strategy))
        if on_stale not in ("drop", "wait", "raise"):
            raise ConfigurationError(f"trainer.v1.sampler.sampler_kwargs.on_stale={on_stale!r}; use drop, wait "
                                     f"or raise.")
        self.on_stale = on_stale
        self.max_staleness = None if self.max_off_policy_threshold is None else self.max_off_policy_threshold - 1
        # verl's async sampler evicts only under its "drop" strategy and holds sampling only under "wait"
        self.max_off_policy_strategy = "wait" if on_stale == "wait" else "drop"
        #: finished groups evicted as stale (each counted once, when it is cleared)
        self.stale_groups = 0

    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str) -> Any:
        if self.trainer_mode == "sync":  # verl's synchronous eviction rules (failed groups stay sampleable)
            return ReplayBuffer._terminal_eviction_reasons(self, global_steps, partition_id)
        return ReplayBufferAsync._terminal_eviction_reasons(self, global_steps, partition_id)

    def _stale_terminal_keys(self, global_steps: int, partition_id: str) -> set[str]:
        if partition_id == "val" or self.max_staleness is None or self.on_stale == "wait":
            return set()
        steps = self.prompt_global_steps[partition_id]
        return {uid for uid in self.finished_keys[partition_id]
                if staleness(global_steps, steps.get(uid, global_steps)) > self.max_staleness}

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons: Any) -> Any:
        """verl's eviction; counts the stale groups it cleared (``get_sampleable_count`` only looks at them).

        Raises:
            StaleExperienceError: ``on_stale="raise"`` and stale groups would be dropped (nothing is
                cleared). Only eviction raises: counting sampleable groups, which the separate-async
                trainer also does for the next step, does not.
        """
        stale = eviction_reasons[0]
        if stale and self.on_stale == "raise":
            steps = self.prompt_global_steps[partition_id]
            worst = max(staleness(global_steps, steps.get(u, global_steps)) for u in stale)
            raise StaleExperienceError(
                f"{len(stale)} finished GRPO group(s) are up to {worst} policy versions behind step {global_steps} "
                f"(max_staleness={self.max_staleness}, i.e. max_off_policy_threshold={self.max_off_policy_threshold})"
                f"; raise the threshold, generate closer to training, or use on_stale=drop.")
        out = super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)
        self.stale_groups += out[1]
        return out

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        steps_before = dict(self.prompt_global_steps[partition_id])
        if self.trainer_mode == "sync":
            batch, metrics = ReplayBuffer.sample(self, global_steps, partition_id, batch_size)
        else:
            batch, metrics = ReplayBufferAsync.sample(self, global_steps, partition_id, batch_size)
        if partition_id == "val":
            return batch, metrics
        groups = {key.split("_")[0] for key in batch.keys}
        steps = {**steps_before, **self.prompt_global_steps[partition_id]}
        ages = [staleness(global_steps, steps[g]) for g in groups if g in steps]
        self._check_sampled(ages, global_steps)
        if ages:
            metrics["conduit/staleness/mean"] = sum(ages) / len(ages)
            metrics["conduit/staleness/max"] = max(ages)
        metrics["conduit/stale_groups"] = self.stale_groups
        return batch, metrics

    def _check_sampled(self, ages: list[int], global_steps: int) -> None:
        """Raise if a sampled group is past the bound (not under ``wait``: verl trains what it waited for)."""
        if self.on_stale == "wait" or self.max_staleness is None or not ages or max(ages) <= self.max_staleness:
            return
        raise StaleExperienceError(f"The sampler selected a group {max(ages)} versions behind step "
                                   f"{global_steps} (max_staleness={self.max_staleness}); nothing was trained.")
