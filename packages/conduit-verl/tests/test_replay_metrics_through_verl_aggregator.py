"""The replay plug's metrics through verl's own
per-step aggregation.

With ``parameter_sync_step`` > 1 (the separate-async trainer's default is 4) verl's ``PPOTrainer.step`` samples
several times per step and reduces each metric over the step's samples with its ``MetricsAggregator``, by name: a
name containing ``max`` by maximum, ``sum``/``total`` by sum, any other by a mean weighted with each sample's
trajectory count. ``conduit/stale_groups`` (the drops since the previous sample) was averaged, so a step that dropped
3 stale groups over 3 samples logged 8/9; it is now ``conduit/stale_groups/sum``. ``conduit/staleness/mean`` was each
sample's mean over its *groups*, which verl then weighted by *trajectories*: the step's value was neither mean when
groups have different trajectory counts; it is now the mean over the sample's trajectories, so verl's weighting
gives the step's trajectory mean exactly.

The step runs verl's real ``PPOTrainer.step`` (aggregator included) over the real plug on a live TransferQueue with
the Conduit backend. Its trainer object stands in for the PPO stages after sampling (log-probs, advantages, updates:
they need model workers and add no Conduit metric): ``prepare_step`` is the separate-async trainer's wait for
sampleable groups and ``_step_once`` samples as verl's does.
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
from test_sync_sample_staleness import _live_tq  # noqa: E402, I001  (a live TransferQueue with the Conduit backend)

pytestmark = pytest.mark.requires("verl")

README = Path(__file__).resolve().parents[1] / "README.md"

#: the step every group below is sampled at
STEP = 5


def _groups(groups: dict[str, tuple[int, int]]) -> None:
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
        _groups(self.arrivals[0])
        mini = self.config.data.train_batch_size // self.parameter_sync_step
        _, metrics = self.replay_buffer.wait_for_sampleable(self.global_steps, "train", mini)
        return metrics

    def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int) -> Any:
        """verl's ``_step_once`` up to its sampling: the sampler's metrics go into the iteration's."""
        if self.local_trigger_step > 0:
            _groups(self.arrivals[self.local_trigger_step])
        batch, off_policy_metrics = self.replay_buffer.sample(global_steps=self.global_steps, partition_id="train",
                                                              batch_size=sample_batch_size)
        metrics.update(off_policy_metrics)
        self.sampled.append(dict(off_policy_metrics))
        return batch


def _run_step(tq_session: Any) -> tuple[dict[str, Any], Any, _SeparateAsyncSampling]:
    """One step of verl's separate-async trainer at ``STEP``: 3 samples of 2 groups, threshold 2 (a group may be
    one version behind). Stale groups: ``x`` (dropped in the wait before the step), ``y`` and ``z`` (dropped in the
    second sample). Trained: ``a`` (1 behind, 3 trajectories), ``b`` (fresh, 1); ``c``, ``d`` (fresh, 1 each);
    ``e`` (1 behind, 1), ``f`` (1 behind, 2)."""
    from conduit_verl.replay import ConduitReplayBuffer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    _live_tq(tq_session)
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


@pytest.mark.slow
def test_a_steps_conduit_metrics_through_verls_aggregator_are_the_readmes(tq_session: Any) -> None:
    """Through verl's ``PPOTrainer.step`` (3 samples a step): the step drops 3 stale groups, its 9 trajectories are
    1, 1, 1, 0 | 0, 0 | 1, 1, 1 versions behind. The step's metrics must be: ``conduit/stale_groups/sum`` 3 (verl's
    own ``training/off_policy/evicted_samples`` agrees), ``conduit/staleness/max`` 1, ``conduit/staleness/mean`` 6/9.
    The old names and values gave ``conduit/stale_groups`` 8/9 (averaged) and a mean of 5/9 (group means 0.5, 0,
    1 weighted by 4, 2, 3 trajectories)."""
    metrics, batch, trainer = _run_step(tq_session)
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
