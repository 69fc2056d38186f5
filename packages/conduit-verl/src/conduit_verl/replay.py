"""A replay-buffer plug for verl's V1 trainer that enforces Conduit's staleness policy.

verl's V1 trainer samples GRPO groups from TransferQueue through a replay buffer and lets
a user swap it by configuration only::

    trainer.v1.sampler.custom_sampler.path=pkg://conduit_verl.replay
    trainer.v1.sampler.custom_sampler.name=ConduitReplayBuffer

:class:`ConduitReplayBuffer` keeps verl's sampling (GRPO group status, refills) and replaces
its staleness rule with Conduit's on-policy one
(:class:`conduit.OnPolicy`): a group produced by policy version ``v`` has staleness
``policy_version - v`` (here ``global_steps - group_steps``) and may be trained on while
``staleness <= max_staleness``. verl's ``max_off_policy_threshold`` counts the versions a
trajectory *spans* (staleness + 1), so ``max_staleness = max_off_policy_threshold - 1`` and
the two agree where both apply. On top of verl's ``drop`` and ``wait`` it adds Conduit's
``raise`` (``+trainer.v1.sampler.sampler_kwargs.on_stale=raise``): a stale group stops the
run with :class:`StaleGroupsError` (a :class:`conduit.StaleExperienceError`) instead of being silently dropped. Under
``drop`` and ``raise`` every selected batch is re-checked against the bound before
TransferQueue is touched (a refused sample clears nothing); verl's ``wait`` is dropless (it
holds sampling until stale in-flight groups finish, then trains them, past the bound by design),
so there the bound is not enforced. ``on_stale`` is the one ``sampler_kwargs`` key it reads; any
other is refused (a misspelt one would silently leave verl's strategy in force).

Every ``sample`` of the train partition reports three metrics. With ``parameter_sync_step`` > 1
verl's trainer samples several times per step and its ``MetricsAggregator`` reduces each metric over
the step's samples by its name (a name containing ``max`` by maximum, ``sum`` by sum, any other by
a mean weighted with each sample's trajectory count); the names are chosen so that the step's value
is the one stated:

* ``conduit/staleness/mean``: the mean staleness of the trajectories sampled (each has its group's
  staleness); over a step, the mean over the step's trajectories.
* ``conduit/staleness/max``: the largest staleness sampled; over a step, the step's largest.
* ``conduit/stale_groups/sum``: the stale groups dropped since the previous ``sample`` reported
  (drops made outside ``sample``, e.g. by the separate-async trainer's wait before a step, count in
  the step's first sample); over a step, the step's drops, like verl's
  ``training/off_policy/evicted_samples``. It holds no state across steps, so a resumed run reports
  what an uninterrupted one does (verl's trainer checkpoints no replay-buffer state). It was named
  ``conduit/stale_groups``, which verl's aggregator averaged over the step's samples.

The two staleness metrics are absent when the batch has no trajectory.

verl 0.9.1 hands a custom sampler neither DAPO's group filter (``algorithm.filter_groups``) nor
``trainer.v1.sampler.sync_refill_failed_groups``, so this plug could neither DAPO-filter groups nor
(``sync`` mode) refill failed ones. Rather than train unfiltered groups silently, it refuses a trainer
config that turns either on (:class:`conduit.ConfigurationError` when verl's trainer builds it): for
DAPO keep verl's own sampler (Conduit's storage backend and delivery still apply). It refuses
``algorithm.adv_estimator=remax`` the same way: verl 0.9.1's V1 trainer never generates ReMax's
greedy baseline and fails untyped at its first step, with any sampler; so ``gdpo``,
``optimal_token_baseline`` and ``tir_optimal_token_baseline``, whose inputs (reward components,
the actor's ``sum_pi_squared``) that trainer never fetches for its advantage step; and
``grpo_passk`` with fewer than two rollouts per prompt (``actor_rollout_ref.rollout.n=1``), whose
advantage step raises after the first rollout, with any sampler.

The rule holds in every trainer mode, ``sync`` included: there verl ignores staleness (its sync
sampling is meant to be on-policy), but a finished group can still be left for a later step
(``data.gen_batch_size`` larger than ``train_batch_size`` leaves the surplus), and it is then
stale like any other. In ``sync`` mode:

* ``drop`` evicts stale finished (and failed) groups before selection, as the async modes do,
  and selects the batch from the fresh ones. verl's sync trainer refills nothing that was
  dropped, so when the groups left (sampleable or still generating, all fresh) cannot make up
  the batch, sampling would wait forever: instead ``sample`` raises
  :class:`conduit.StaleExperienceError` *before* dropping anything (TransferQueue unchanged).
* ``raise`` raises as soon as a stale group would be dropped, before anything is cleared.

Going on after ``raise``. The refusal clears nothing (as :class:`conduit.OnPolicy`'s ``raise`` leaves its
state unchanged), and a group's staleness only grows, so the stale groups stay and every later
``sample`` raises again until they are dropped: ``raise`` stops the run unless the caller decides.
:class:`StaleGroupsError` says exactly what is stale (``uids``, the number of ``trajectories``, at
``global_steps`` in ``partition_id``); a caller that catches it and chooses to go on calls
:meth:`ConduitReplayBuffer.drop_stale` (verl's trainer keeps the buffer as ``trainer.replay_buffer``),
which drops every group stale at that step as ``on_stale=drop`` would (cleared from TransferQueue,
counted in ``stale_groups`` and reported by the next ``sample``'s ``conduit/stale_groups/sum``), then
samples again. The raise does not drop them itself: a run stopped by it keeps the evidence, and a
drop is never made without a caller asking for it, so nothing is lost unseen. In ``sync`` mode
verl's trainer refills nothing dropped: after ``drop_stale`` the next ``sample`` waits for groups
still generating to make up the batch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from conduit import ConfigurationError, StaleExperienceError
from omegaconf import DictConfig, OmegaConf
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

__all__ = ["ConduitReplayBuffer", "StaleGroupsError", "staleness", "SAMPLER_KWARGS"]

#: the ``trainer.v1.sampler.sampler_kwargs`` keys :class:`ConduitReplayBuffer` reads (any other is refused)
SAMPLER_KWARGS = frozenset({"on_stale"})

#: advantage estimators verl 0.9.1 registers whose inputs its V1 trainer's advantage step never fetches (refused):
#: estimator -> what it needs
V1_ADVANTAGE_INPUTS_MISSING = {
    "gdpo": "each reward component (algorithm.gdpo_reward_keys, from compute_score's dict) and the prompts",
    "optimal_token_baseline": "the actor's sum_pi_squared (actor.calculate_sum_pi_squared=True)",
    "tir_optimal_token_baseline": "the actor's sum_pi_squared (actor.calculate_sum_pi_squared=True)",
}


def _v1_cannot(why: str, *, legacy: str, after: str = "") -> ConfigurationError:
    """The refusal of an advantage estimator verl 0.9.1's V1 trainer cannot compute (``why``), pointing to the
    estimators it does compute and to verl's legacy trainer (``legacy``: why that one can)."""
    return ConfigurationError(
        f"{why}, so every run fails at its first advantage computation{after}, Conduit on or off. Use a critic-free "
        f"estimator the V1 trainer computes (grpo, rloo, reinforce_plus_plus), or verl's legacy trainer "
        f"(trainer.use_v1=False), {legacy}; Conduit's storage backend and sampler do not apply there (drop the Conduit "
        f"overrides).")


def staleness(global_steps: int, group_steps: int) -> int:
    """Conduit's staleness of a group: learner version minus producing version (verl's span - 1)."""
    return int(global_steps) - int(group_steps)


class StaleGroupsError(StaleExperienceError):
    """``on_stale="raise"``: finished GRPO groups are past the staleness bound; nothing was cleared.

    Attributes:
        uids: the stale groups' prompt uids, sorted.
        trajectories: how many trajectories (TransferQueue keys ``{uid}_{session}_{index}``) they hold.
        global_steps: the step they are stale at.
        partition_id: their TransferQueue partition.

    To go on, call :meth:`ConduitReplayBuffer.drop_stale` ``(global_steps, partition_id)`` and sample again.
    """

    def __init__(self, message: str, *, uids: list[str], trajectories: int, global_steps: int,
                 partition_id: str) -> None:
        super().__init__(message)
        self.uids = uids
        self.trajectories = trajectories
        self.global_steps = global_steps
        self.partition_id = partition_id


class ConduitReplayBuffer(ReplayBufferAsync):
    """verl's V1 replay buffer with Conduit's staleness policy (see the module docstring).

    Works for every trainer mode: ``sync`` keeps verl's synchronous sampling plus Conduit's
    staleness rule (stale groups are left-over groups of earlier steps), the async modes keep
    verl's async one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = dict(self.sampler_kwargs or {})
        unknown = sorted(str(k) for k in extra.keys() - SAMPLER_KWARGS)
        if unknown:  # a misspelt on_stale would silently fall back to verl's strategy
            raise ConfigurationError(f"trainer.v1.sampler.sampler_kwargs has unknown key(s) {unknown}; "
                                     f"ConduitReplayBuffer reads {sorted(SAMPLER_KWARGS)}.")
        on_stale = str(extra.get("on_stale", self.max_off_policy_strategy))
        if on_stale not in ("drop", "wait", "raise"):
            raise ConfigurationError(f"trainer.v1.sampler.sampler_kwargs.on_stale={on_stale!r}; use drop, wait "
                                     f"or raise.")
        self.on_stale = on_stale
        self.max_staleness = None if self.max_off_policy_threshold is None else self.max_off_policy_threshold - 1
        # verl's async sampler evicts only under its "drop" strategy and holds sampling only under "wait"
        self.max_off_policy_strategy = "wait" if on_stale == "wait" else "drop"
        #: finished groups evicted as stale by this buffer (each counted once, when it is cleared); not checkpointed
        self.stale_groups = 0
        #: :attr:`stale_groups` when ``sample`` last reported ``conduit/stale_groups/sum`` (the drops since)
        self._stale_reported = 0
        #: (global_steps, batch_size) of the sample() under way, None between samples
        self._sampling: tuple[int, int] | None = None
        #: staleness of each trajectory the current sample() selected (its group's)
        self._selected_ages: list[int] = []
        self._refuse_options_not_passed()

    def _refuse_options_not_passed(self) -> None:
        """Refuse the trainer options verl 0.9.1 does not pass to a custom sampler, which this one would ignore.

        The trainer's config is read from ``refill_fn``, the bound ``_add_prompts_to_generate`` of the verl trainer
        that builds the buffer (a buffer built otherwise, with no such config, is not checked).

        Raises:
            ConfigurationError: ``algorithm.filter_groups.enable`` is on (DAPO), or ``sync`` mode with
                ``trainer.v1.sampler.sync_refill_failed_groups`` on, and the trainer did not pass it here; or
                ``algorithm.adv_estimator=remax``, which verl's V1 trainer cannot compute (it has no greedy
                baseline): refused before any rollout instead of failing untyped at the first step; or
                ``algorithm.adv_estimator`` one of :data:`V1_ADVANTAGE_INPUTS_MISSING` (GDPO, the optimal token
                baselines), whose inputs verl's V1 trainer never fetches for its advantage step; or
                ``algorithm.adv_estimator=grpo_passk`` with ``actor_rollout_ref.rollout.n`` below 2 (Pass@k needs two
                responses per prompt; verl's advantage step raises after the first rollout).
        """
        cfg = getattr(getattr(self.refill_fn, "__self__", None), "config", None)
        if not isinstance(cfg, DictConfig):
            return
        keep = ("drop the trainer.v1.sampler.custom_sampler overrides to use verl's own sampler (Conduit's storage "
                "backend and minibatch delivery stay on)")
        estimator = str(OmegaConf.select(cfg, "algorithm.adv_estimator", default="")).lower()
        if estimator == "remax":
            raise _v1_cannot("algorithm.adv_estimator=remax, but verl 0.9.1's V1 trainer never computes ReMax's greedy "
                             "baseline (reward_baselines)", legacy="which generates the baseline")
        if estimator in V1_ADVANTAGE_INPUTS_MISSING:
            raise _v1_cannot(f"algorithm.adv_estimator={estimator} needs {V1_ADVANTAGE_INPUTS_MISSING[estimator]}, "
                             f"which verl 0.9.1's V1 trainer never hands its advantage step (it reads only uid, "
                             f"response_mask, rm_scores, log-probs and values from TransferQueue)",
                             legacy="whose advantage step gets the whole batch", after=", after a whole rollout")
        n = OmegaConf.select(cfg, "actor_rollout_ref.rollout.n", default=None)
        if estimator == "grpo_passk" and isinstance(n, int) and n < 2:
            raise ConfigurationError(
                f"algorithm.adv_estimator=grpo_passk with actor_rollout_ref.rollout.n={n}: Pass@k compares the best "
                f"two responses of each prompt, so verl's advantage step fails (ValueError) after the first rollout "
                f"with fewer than 2 responses per prompt, Conduit on or off. Set actor_rollout_ref.rollout.n=2 or "
                f"more, or for one response per prompt use reinforce_plus_plus (which needs no groups).")
        if self.filter_groups_metric is None and OmegaConf.select(cfg, "algorithm.filter_groups.enable", default=False):
            raise ConfigurationError(
                f"algorithm.filter_groups.enable=True (DAPO), but verl 0.9.1 does not hand the group filter to a "
                f"custom sampler, so ConduitReplayBuffer would train the groups DAPO filters out. For DAPO, {keep}; or "
                f"set algorithm.filter_groups.enable=False.")
        if (self.trainer_mode == "sync" and not self.sync_refill_failed_groups
                and OmegaConf.select(cfg, "trainer.v1.sampler.sync_refill_failed_groups", default=False)):
            raise ConfigurationError(
                f"trainer.v1.sampler.sync_refill_failed_groups=True, but verl 0.9.1 does not hand it to a custom "
                f"sampler, so ConduitReplayBuffer would train failed groups instead of refilling them. To refill them, "
                f"{keep}; or set trainer.v1.sampler.sync_refill_failed_groups=False.")

    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str) -> Any:
        if self.trainer_mode == "sync":  # verl's synchronous rules (failed groups stay sampleable), plus staleness
            _, dapo, failed, counts = ReplayBuffer._terminal_eviction_reasons(self, global_steps, partition_id)
            return self._stale_terminal_keys(global_steps, partition_id), dapo, failed, counts
        return ReplayBufferAsync._terminal_eviction_reasons(self, global_steps, partition_id)

    def _stale_terminal_keys(self, global_steps: int, partition_id: str) -> set[str]:
        """Terminal groups past the bound: finished ones (async modes evict failed ones anyway), and failed ones
        too in ``sync`` mode, where failed groups are otherwise trained."""
        if partition_id == "val" or self.max_staleness is None or self.on_stale == "wait":
            return set()
        steps = self.prompt_global_steps[partition_id]
        terminal = self.finished_keys[partition_id]
        if self.trainer_mode == "sync":
            terminal = terminal | self.failure_keys[partition_id]
        return {uid for uid in terminal
                if staleness(global_steps, steps.get(uid, global_steps)) > self.max_staleness}

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons: Any) -> Any:
        """verl's eviction; counts the stale groups it cleared (``get_sampleable_count`` only looks at them).

        Raises:
            StaleExperienceError: ``on_stale="raise"`` and stale groups would be dropped, or (``sync``
                mode, ``on_stale="drop"``) dropping them would leave too few groups for the batch
                being sampled, which nothing would refill; nothing is cleared. Only eviction raises:
                counting sampleable groups, which the separate-async trainer also does for the next
                step, does not.
        """
        stale = eviction_reasons[0]
        if stale and self.on_stale == "raise":
            steps = self.prompt_global_steps[partition_id]
            worst = max(staleness(global_steps, steps.get(u, global_steps)) for u in stale)
            uids = sorted(stale)
            trajectories = sum(key.split("_")[0] in stale for key in self.partitions[partition_id])
            shown = ", ".join(repr(u) for u in uids[:8]) + (f", ... ({len(uids) - 8} more)" if len(uids) > 8 else "")
            raise StaleGroupsError(
                f"{len(stale)} finished GRPO group(s) ({trajectories} trajectories: {shown}) are up to {worst} policy "
                f"versions behind step {global_steps} (max_staleness={self.max_staleness}, i.e. "
                f"max_off_policy_threshold={self.max_off_policy_threshold}); nothing was cleared, and every sample "
                f"raises again while they stay. To go on, drop them with replay_buffer.drop_stale({global_steps}, "
                f"{partition_id!r}) and sample again; or raise the threshold, generate closer to training, or use "
                f"on_stale=drop.", uids=uids, trajectories=trajectories, global_steps=int(global_steps),
                partition_id=partition_id)
        if stale and self.trainer_mode == "sync":
            self._check_refillable(global_steps, partition_id, eviction_reasons)
        out = super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)
        self.stale_groups += out[1]
        return out

    def drop_stale(self, global_steps: int, partition_id: str = "train") -> int:
        """Drop the finished groups stale at ``global_steps`` (``sync`` mode: failed ones too), as ``on_stale=drop``
        would: cleared from TransferQueue and counted in :attr:`stale_groups` (the next ``sample`` reports them in
        ``conduit/stale_groups/sum``). The way on after a :class:`StaleGroupsError`; under ``wait``, with no
        threshold, or for the ``val`` partition nothing is stale and nothing is dropped.

        Returns:
            The number of groups dropped.
        """
        self._sync_metadata_from_transfer_queue()
        stale = self._stale_terminal_keys(int(global_steps), partition_id)
        if not stale:
            return 0
        out = ReplayBuffer._evict_terminal_groups(self, int(global_steps), partition_id,
                                                  (stale, set(), set(), Counter()))
        self.stale_groups += out[1]
        return int(out[1])

    def _check_refillable(self, global_steps: int, partition_id: str, eviction_reasons: Any) -> None:
        """``sync`` mode: refuse to drop stale groups when the groups left could never make up the batch.

        verl's sync sampling refills failed groups (opt-in) and DAPO-filtered ones, never stale
        ones, so it would poll forever for the missing groups. Counted as able to fill the batch:
        every group that is not stale, terminal or still pending/running (a group generating now
        cannot become stale during this sample). With DAPO filtering on, verl refills past that
        count, so nothing is refused.
        """
        if self._sampling is None or self.filter_groups_metric is not None:
            return
        stale = eviction_reasons[0]
        _, batch_size = self._sampling
        steps = self.prompt_global_steps[partition_id]
        terminal = self.finished_keys[partition_id] | self.failure_keys[partition_id]
        inflight = self.pending_keys[partition_id] | self.running_keys[partition_id]
        bound = self.max_staleness if self.max_staleness is not None else 0
        fresh = len(terminal - stale) + sum(staleness(global_steps, steps.get(u, global_steps)) <= bound
                                            for u in inflight)
        if fresh >= batch_size:
            return
        worst = max(staleness(global_steps, steps.get(u, global_steps)) for u in stale)
        raise StaleExperienceError(
            f"on_stale=drop would drop {len(stale)} GRPO group(s) up to {worst} policy versions behind step "
            f"{global_steps} (max_staleness={self.max_staleness}), leaving {fresh} fresh group(s) (finished or "
            f"generating) for a batch of {batch_size}; verl's sync trainer refills nothing dropped, so sampling would "
            f"wait forever. Nothing was dropped. Raise max_off_policy_threshold, or set data.gen_batch_size equal to "
            f"data.train_batch_size so no group is left for a later step.")

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str],
                           partition_snapshot: dict[str, dict]) -> KVBatchMeta:
        """verl's materialisation (it clears the selected prompts from TransferQueue), after the staleness check.

        Raises:
            StaleExperienceError: a selected group is past the bound (not under ``wait``); nothing is cleared.
        """
        if partition_id == "val" or self._sampling is None:
            return super()._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)
        global_steps, _ = self._sampling
        steps = self.prompt_global_steps[partition_id]
        group_ages = {u: staleness(global_steps, steps[u]) for u in selected_prompt_uids if u in steps}
        self._check_sampled(list(group_ages.values()), global_steps)
        batch = super()._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)
        # one age per trajectory (verl's keys are ``{uid}_{session}_{index}``): the batch's mean then weighs a group
        # by its trajectories, as verl's MetricsAggregator weighs a step's samples
        uids = (key.split("_")[0] for key in batch.keys)
        self._selected_ages = [group_ages[u] for u in uids if u in group_ages]
        return batch

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        """verl's sampling of ``trainer_mode`` with Conduit's staleness rule (see the module docstring); the metrics
        add ``conduit/staleness/mean`` and ``.../max`` over the batch's trajectories and ``conduit/stale_groups/sum``,
        the stale groups dropped since the previous report.

        Raises:
            StaleExperienceError: under ``on_stale="raise"`` a stale group would be dropped; in ``sync`` mode under
                ``on_stale="drop"`` the groups left after dropping the stale ones cannot make up ``batch_size``.
                Either way TransferQueue is left as it was.
        """
        self._sampling, self._selected_ages = (int(global_steps), int(batch_size)), []
        try:
            if self.trainer_mode == "sync":
                batch, metrics = ReplayBuffer.sample(self, global_steps, partition_id, batch_size)
            else:
                batch, metrics = ReplayBufferAsync.sample(self, global_steps, partition_id, batch_size)
        finally:
            self._sampling = None
        if partition_id == "val":
            return batch, metrics
        ages = self._selected_ages
        if ages:
            metrics["conduit/staleness/mean"] = sum(ages) / len(ages)
            metrics["conduit/staleness/max"] = max(ages)
        # "sum" in the name: verl's MetricsAggregator sums it over a step's samples (it would average a plain name)
        metrics["conduit/stale_groups/sum"] = self.stale_groups - self._stale_reported
        self._stale_reported = self.stale_groups
        return batch, metrics

    def _check_sampled(self, ages: list[int], global_steps: int) -> None:
        """Raise if a sampled group is past the bound (not under ``wait``: verl trains what it waited for)."""
        if self.on_stale == "wait" or self.max_staleness is None or not ages or max(ages) <= self.max_staleness:
            return
        raise StaleExperienceError(f"The sampler selected a group {max(ages)} versions behind step {global_steps} "
                                   f"(max_staleness={self.max_staleness}); nothing was trained or cleared.")
