"""The replay plug's staleness metrics and ``on_stale="raise"``, against a live TransferQueue with the Conduit backend.

* A stale group under ``raise`` stayed in TransferQueue (the refusal clears nothing, by contract), and staleness only
  grows, so every later ``sample`` raised again: nothing said which groups were stale and nothing public let a caller
  drop them and continue. The error is now a :class:`~conduit_verl.replay.StaleGroupsError` naming the groups and
  their trajectories, and ``ConduitReplayBuffer.drop_stale`` drops them (cleared, counted in
  ``conduit/stale_groups/sum``) so sampling goes on.
* ``conduit/stale_groups`` was the replay plug's running total since the buffer was built: verl's trainer
  checkpoints no replay-buffer state, so after a resume it restarted from zero and a resumed run logged other values
  than an uninterrupted one. It is now a per-step value: the stale groups dropped since the previous ``sample``
  reported (drops made by the separate-async trainer's wait before a step included).
* The metrics through verl's own per-step aggregation. With ``parameter_sync_step`` > 1 (the separate-async
  trainer's default is 4) verl's ``PPOTrainer.step`` samples several times per step and reduces each metric over the
  step's samples with its ``MetricsAggregator``, by name: a name containing ``max`` by maximum, ``sum``/``total`` by
  sum, any other by a mean weighted with each sample's trajectory count. ``conduit/stale_groups`` (the drops since
  the previous sample) was averaged, so a step that dropped 3 stale groups over 3 samples logged 8/9; it is now
  ``conduit/stale_groups/sum``. ``conduit/staleness/mean`` was each sample's mean over its *groups*, which verl then
  weighted by *trajectories*: the step's value was neither mean when groups have different trajectory counts; it is
  now the mean over the sample's trajectories, so verl's weighting gives the step's trajectory mean exactly.

  That step runs verl's real ``PPOTrainer.step`` (aggregator included) over the real plug. Its trainer object stands
  in for the PPO stages after sampling (log-probs, advantages, updates: they need model workers and add no Conduit
  metric): ``prepare_step`` is the separate-async trainer's wait for sampleable groups and ``_step_once`` samples as
  verl's does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).parent))
from test_sync_sample_staleness import _buffer, _groups, _listing, _sample  # noqa: E402, I001

pytestmark = pytest.mark.requires("verl")

README = Path(__file__).resolve().parents[1] / "README.md"

#: the step every group of the aggregation test is sampled at
STEP = 5


def _async_buffer(on_stale: str) -> Any:
    """The plug as verl's separate-async trainer builds it (threshold 2: a group may be one version behind)."""
    from conduit_verl.replay import ConduitReplayBuffer

    return ConduitReplayBuffer(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                               max_off_policy_strategy="drop", sampler_kwargs={"on_stale": on_stale},
                               poll_interval=0.05)


def _reported(buf: Any, global_steps: int, partition: str) -> tuple[list[str], int]:
    """The keys one ``sample`` of a one-group batch returns, and its ``conduit/stale_groups/sum``."""
    result, err = _sample(buf, global_steps, 1, partition)
    assert err is None, f"sample({global_steps}) raised {err!r}"
    batch, metrics = result
    return list(batch.keys), metrics["conduit/stale_groups/sum"]


def _trajectory_groups(groups: dict[str, tuple[int, int]]) -> None:
    """Register finished GRPO groups as verl's trainer and agent loop do: ``uid -> (global_steps, trajectories)``;
    trajectory ``i`` of a group is the key ``{uid}_{i}_0`` (verl's ``{uid}_{session}_{index}``)."""
    import transfer_queue as tq

    uids = list(groups)
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "finished", "global_steps": groups[u][0]} for u in uids])
    keys = [f"{u}_{i}_0" for u in uids for i in range(groups[u][1])]
    tags = [{"status": "success", "global_steps": groups[u][0]} for u in uids for _ in range(groups[u][1])]
    fields = TensorDict({"responses": torch.arange(len(keys) * 3, dtype=torch.int64).reshape(len(keys), 3)},
                        batch_size=[len(keys)])
    tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)


class _SeparateAsyncSampling:
    """The trainer ``PPOTrainer.step`` runs on: verl's separate-async sampling, without the stages after it.

    ``arrivals[k]`` are the groups that finish before the step's ``k``-th sample (index 0: before the step's wait).
    """

    def __init__(self, buf: Any, parameter_sync_step: int, train_batch_size: int,
                 arrivals: list[dict[str, tuple[int, int]]]) -> None:
        from omegaconf import OmegaConf

        self.replay_buffer = buf
        self.global_steps = STEP
        self.parameter_sync_step = parameter_sync_step
        self.config = OmegaConf.create({"data": {"train_batch_size": train_batch_size}})
        self.local_trigger_step = 0
        self.arrivals = arrivals
        #: the plug's metrics of each sample, in order
        self.sampled: list[dict[str, Any]] = []

    def prepare_step(self) -> dict:
        """The separate-async trainer's wait before a step (it evicts stale groups outside ``sample``)."""
        _trajectory_groups(self.arrivals[0])
        mini = self.config.data.train_batch_size // self.parameter_sync_step
        _, metrics = self.replay_buffer.wait_for_sampleable(self.global_steps, "train", mini)
        return metrics

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> Any:
        """verl's ``_step_once`` up to its sampling: the sampler's metrics go into the iteration's."""
        if self.local_trigger_step > 0:
            _trajectory_groups(self.arrivals[self.local_trigger_step])
        batch, off_policy_metrics = self.replay_buffer.sample(global_steps=self.global_steps, partition_id="train",
                                                              batch_size=sample_batch_size)
        metrics.update(off_policy_metrics)
        self.sampled.append(dict(off_policy_metrics))
        return batch


def _run_step() -> tuple[dict[str, Any], Any, _SeparateAsyncSampling]:
    """One step of verl's separate-async trainer at ``STEP``: 3 samples of 2 groups, threshold 2 (a group may be
    one version behind). Stale groups: ``x`` (dropped in the wait before the step), ``y`` and ``z`` (dropped in the
    second sample). Trained: ``a`` (1 behind, 3 trajectories), ``b`` (fresh, 1); ``c``, ``d`` (fresh, 1 each);
    ``e`` (1 behind, 1), ``f`` (1 behind, 2)."""
    from conduit_verl.replay import ConduitReplayBuffer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    buf = ConduitReplayBuffer(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                              max_off_policy_strategy="drop", sampler_kwargs={"on_stale": "drop"}, poll_interval=0.05)
    trainer = _SeparateAsyncSampling(buf, parameter_sync_step=3, train_batch_size=6, arrivals=[
        {"x": (3, 1), "a": (4, 3), "b": (5, 1)},
        {"y": (2, 1), "z": (3, 2), "c": (5, 1), "d": (5, 1)},
        {"e": (4, 1), "f": (4, 2)},
    ])
    metrics: dict[str, Any] = {}
    batch = PPOTrainer.step(trainer, metrics, {})  # type: ignore[arg-type]  # (verl's step on the stand-in)
    return metrics, batch, trainer


class TestRaiseAndDropStale:
    """The tests share one live TransferQueue (``tq_shared``, ``_live_tq``'s configuration); each registers its groups
    in a partition of its own. (verl prefixes its own metrics of a partition other than ``train`` with
    ``validation/``; these tests check Conduit's ``conduit/...`` metrics, whose names do not depend on it, but for the
    aggregation test, which checks verl's ``training/...`` too: it alone uses ``train``, a name ``tq_shared`` never
    gives.)"""

    TQ_BACKEND = ("Conduit", {"num_units": 1, "capacity": 8, "mean_length": 4})

    @pytest.mark.slow
    @pytest.mark.parametrize("mode", ["sync", "separate_async"])
    def test_raise_names_the_stale_groups_and_drop_stale_lets_sampling_go_on(self, tq_shared: Any, mode: str) -> None:
        from conduit import StaleExperienceError
        from conduit_verl.replay import StaleGroupsError

        part = tq_shared("train")  # this test's partition
        step = 2 if mode == "sync" else 4  # sync: threshold 1 (no version behind); async: threshold 2 (one behind)
        _groups({"old": ("finished", 1), "older": ("finished", 0), "new": ("finished", step)}, part)
        buf = _buffer("raise") if mode == "sync" else _async_buffer("raise")
        before = _listing(part)
        for _ in range(2):  # refused again and again while nothing drops them, TransferQueue unchanged
            _, err = _sample(buf, step, 1, part)
            assert isinstance(err, StaleGroupsError) and isinstance(err, StaleExperienceError), repr(err)
            assert _listing(part) == before, f"the refused sample changed TransferQueue ({err})"
        assert isinstance(err, StaleGroupsError)
        assert (err.uids, err.trajectories, err.global_steps, err.partition_id) == (["old", "older"], 2, step, part)
        assert "drop_stale" in str(err) and "'old'" in str(err), str(err)
        assert buf.drop_stale(step, part) == 2
        assert sorted(_listing(part)) == ["new", "new_0_0"], f"left in TransferQueue: {sorted(_listing(part))}"
        result, err2 = _sample(buf, step, 1, part)
        assert err2 is None, f"sampling did not go on after drop_stale: {err2!r}"
        batch, metrics = result
        assert list(batch.keys) == ["new_0_0"]
        assert metrics["conduit/stale_groups/sum"] == 2, "the groups drop_stale dropped were not reported"
        assert buf.drop_stale(step, part) == 0  # nothing stale left: a no-op

    @pytest.mark.slow
    def test_drop_stale_drops_nothing_under_wait_or_without_a_threshold(self, tq_shared: Any) -> None:
        """verl's dropless ``wait`` trains stale groups by design, and a null threshold disables the bound."""
        from conduit_verl.replay import ConduitReplayBuffer

        part = tq_shared("train")  # this test's partition
        _groups({"old": ("finished", 1), "new": ("finished", 9)}, part)
        before = _listing(part)
        wait = _buffer("wait")
        assert wait.drop_stale(9, part) == 0
        off = ConduitReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None,
                                  max_off_policy_strategy="drop", sampler_kwargs={"on_stale": "raise"})
        assert off.drop_stale(9, part) == 0
        assert _listing(part) == before

    @pytest.mark.slow
    def test_stale_groups_is_the_steps_drops_so_a_resumed_run_reports_alike(self, tq_shared: Any) -> None:
        """Step 3 drops one stale group (in the trainer's wait before the step), step 4 one more, step 5 none. An
        uninterrupted run must report 1, 1, 0, and a run resumed at step 4 (a new buffer, as verl builds on restart)
        must report what the uninterrupted one does there; the running total reported 1, 2, 2 and, resumed, 1."""
        part = tq_shared("train")  # this test's partition
        run = _async_buffer("drop")
        _groups({"a": ("finished", 1), "b": ("finished", 3)}, part)
        run.wait_for_sampleable(3, part, 1)  # the separate-async trainer's prepare_step: drops "a", outside sample
        assert run.stale_groups == 1
        assert _reported(run, 3, part) == (["b_0_0"], 1), \
            "a drop made before the step's sample was not reported with it"
        _groups({"c": ("finished", 2), "d": ("finished", 4)}, part)
        step4 = _reported(run, 4, part)
        assert step4 == (["d_0_0"], 1), f"step 4 dropped one stale group, reported {step4}"
        _groups({"g": ("finished", 5)}, part)
        assert _reported(run, 5, part) == (["g_0_0"], 0), "a step that dropped nothing reported drops"

        resumed = _async_buffer("drop")  # verl's trainer after a restart: a new replay buffer, nothing old restored
        _groups({"e": ("finished", 2), "f": ("finished", 4)}, part)
        assert _reported(resumed, 4, part) == (["f_0_0"], step4[1]), \
            "a resumed run reports another value at the same step"

    @pytest.mark.slow
    def test_a_steps_conduit_metrics_through_verls_aggregator_are_the_readmes(self, tq_shared: Any) -> None:
        """Through verl's ``PPOTrainer.step`` (3 samples a step): the step drops 3 stale groups, its 9 trajectories
        are 1, 1, 1, 0 | 0, 0 | 1, 1, 1 versions behind. The step's metrics must be: ``conduit/stale_groups/sum`` 3
        (verl's own ``training/off_policy/evicted_samples`` agrees), ``conduit/staleness/max`` 1,
        ``conduit/staleness/mean`` 6/9. The old names and values gave ``conduit/stale_groups`` 8/9 (averaged) and a
        mean of 5/9 (group means 0.5, 0, 1 weighted by 4, 2, 3 trajectories)."""
        metrics, batch, trainer = _run_step()  # (in partition "train": see the class)
        assert sorted(batch.keys) == ["a_0_0", "a_1_0", "a_2_0", "b_0_0", "c_0_0", "d_0_0", "e_0_0", "f_0_0", "f_1_0"]
        per_sample = [{k: v for k, v in m.items() if k.startswith("conduit/")} for m in trainer.sampled]
        assert [m["conduit/stale_groups/sum"] for m in per_sample] == [1, 2, 0], per_sample

        conduit = {k: v for k, v in metrics.items() if k.startswith("conduit/")}
        assert "conduit/stale_groups" not in conduit, "the old name (which verl averaged) is still reported"
        assert conduit["conduit/stale_groups/sum"] == 3 == metrics["training/off_policy/evicted_samples"], conduit
        assert conduit["conduit/staleness/max"] == 1, conduit
        assert conduit["conduit/staleness/mean"] == pytest.approx(6 / 9), \
            f"{conduit['conduit/staleness/mean']} is not the mean over the step's trajectories (6/9)"

        listed = set(re.findall(r"^\| `(conduit/[a-z_/]+)` \|", README.read_text(), re.M))
        assert listed == set(conduit), f"README lists {sorted(listed)}, a step reports {sorted(conduit)}"
