"""RLlib with and without Conduit: the experience path of one training step, and whole iterations.

Workloads (one local EnvRunner and learner in this process, CPU, one thread):

* ``dqn-d128`` / ``dqn-d5000``: DQN on LargeObsCartPole with d float32 observations, RLlib's
  defaults (batch 32, prioritized replay, one env step and one update per training step);
* ``dqn-2-agent-cartpole``: DQN on RLlib's MultiAgentCartPole with two agents, each trained by its own module,
  batch 32 per module, RLlib's ``MultiAgentPrioritizedEpisodeReplayBuffer`` (Conduit: a data plane per module);
* ``sac-pendulum``: SAC on Pendulum-v1 (batch 256, prioritized replay);
* ``ppo-cartpole``: PPO on CartPole-v1 (2000 steps per update, 6 epochs of minibatch 128);
* ``ppo-2-agent-cartpole``: the same, multi-agent: RLlib's MultiAgentCartPole with two agents, each trained by
  its own module (Conduit: one feed per module, minibatches in lock step).

Two measurements per workload, native vs Conduit, each a ratio table in ``benchmarks/results``:

* ``rllib_experience_step``: the experience path of ONE training step, called the way RLlib's
  training step calls it, on the algorithm's own buffer and learner. Off-policy: ``add`` of a
  fresh one-step chunk from the EnvRunner, ``sample``, ``get_metrics`` (folded into the algorithm's
  metrics, as RLlib's training step does), the learner turning the
  sample into a train batch (``_make_batch_if_necessary``) and ``update_priorities``. PPO: the
  learner building the train batch from 2000 steps of episodes and producing every minibatch of
  the update (no gradient steps). All of it is exposed in RLlib, and with Conduit's default
  (synchronous) scheduler.
* ``rllib_iteration``: one ``algo.train()`` (DQN/SAC: 50 env steps and updates; PPO: 2000 steps).

Before either is timed, each workload's two variants build one train batch (PPO: one update's minibatches, from
one rollout both learners get a copy of) outside the timed region, and the two must be alike
(:func:`check_same_train_batches`: the same modules, columns, dtypes and shapes, rows included): a variant
that built a smaller or an empty batch would otherwise be timed as the faster one.

The longer, interleaved runs and their tables are in ``benchmarks/docs/rllib.md``
(``benchmarks/scripts/rllib_breakdown.py``). Run: ``.venv/bin/python -m pytest benchmarks/test_bench_rllib.py``.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

WORKLOADS = ["dqn-d128", "dqn-d5000", "dqn-2-agent-cartpole", "sac-pendulum", "ppo-cartpole", "ppo-2-agent-cartpole"]
VARIANTS = ["native", "conduit"]
STEPS = 50


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()


def make_config(workload: str) -> Any:
    from conduit_rllib.workloads import (
        dqn_large_obs,
        dqn_multi_agent_cartpole,
        ppo_cartpole,
        ppo_multi_agent_cartpole,
        sac_pendulum,
    )

    if workload == "dqn-2-agent-cartpole":
        return dqn_multi_agent_cartpole(agents=2, steps=STEPS, batch=32, capacity=5000)
    if workload.startswith("dqn"):
        return dqn_large_obs(int(workload.split("-d")[1]), steps=STEPS, batch=32, capacity=5000)
    if workload == "sac-pendulum":
        return sac_pendulum(steps=STEPS, batch=256)
    if workload == "ppo-2-agent-cartpole":
        return ppo_multi_agent_cartpole(agents=2, batch=2000, minibatch=128, epochs=6)
    return ppo_cartpole(batch=2000, minibatch=128, epochs=6)


class Built:
    """One variant of one workload: the algorithm, its learner, and the one-step experience path."""

    def __init__(self, workload: str, variant: str) -> None:
        import conduit_rllib

        cfg = make_config(workload)
        if variant == "conduit":
            conduit_rllib.enable(cfg)
        self.workload, self.variant = workload, variant
        self.algo = cfg.build_algo()
        self.algo.train()  # fills the buffer past learning start, warms every code path
        self.learner = next(iter(self.algo.learner_group.foreach_learner(lambda learner: learner))).get()
        self.runner = self.algo.env_runner

    def next_chunk(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """pytest-benchmark ``setup``: a fresh one-step chunk from the EnvRunner (not timed)."""
        return (self.runner.sample(num_timesteps=1),), {}

    def off_policy_step(self, chunk: list[Any]) -> Any:
        """One training step's experience path; returns the train batch the learner made (a MultiAgentBatch)."""
        from ray.rllib.core.learner.training_data import TrainingData

        cfg = self.algo.config
        buf = self.algo.local_replay_buffer
        buf.add(chunk)
        sample = buf.sample(num_items=cfg.total_train_batch_size, n_step=cfg.n_step, batch_length_T=0, lookback=0,
                            min_batch_length_T=0, gamma=cfg.gamma, beta=cfg.replay_buffer_config.get("beta"),
                            sample_episodes=True)
        self.algo.metrics.aggregate([buf.get_metrics()], key="replay_buffer")
        batch = self.learner._make_batch_if_necessary(TrainingData(episodes=sample))
        if hasattr(buf, "update_priorities"):  # (each module's priorities of its rows, as RLlib's training step)
            for module_id, rows in batch.policy_batches.items():
                buf.update_priorities(np.abs(np.random.randn(len(rows))) + 0.01, module_id)
        return batch

    def rollout(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """pytest-benchmark ``setup`` for PPO: 2000 steps of episodes from the EnvRunner (not timed)."""
        return (self.runner.sample(num_timesteps=self.algo.config.total_train_batch_size),), {}

    def on_policy_update_path(self, episodes: list[Any], keep: list[Any] | None = None) -> None:
        """The train batch and every minibatch of one update of ``episodes``; with ``keep``, the minibatches are
        appended to it (the timed calls keep none)."""
        from ray.rllib.core.learner.training_data import TrainingData

        cfg = self.algo.config
        it = self.learner._create_iterator_if_necessary(
            training_data=TrainingData(episodes=episodes), num_epochs=cfg.num_epochs,
            minibatch_size=cfg.minibatch_size, shuffle_batch_per_epoch=cfg.shuffle_batch_per_epoch)
        for minibatch in it:
            if keep is not None:
                keep.append(minibatch)

    def close(self) -> None:
        self.algo.stop()


def _columns(batch: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, array)`` for every column of a (possibly nested) batch; a nested column's name joins its keys by /."""
    for key, value in batch.items():
        if isinstance(value, Mapping):
            yield from _columns(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def _dtype(value: Any) -> str:
    """A column's dtype, named alike for a torch tensor and a NumPy array (``float32``, ``int64``, ``bool``)."""
    import torch

    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return np.asarray(value).dtype.name


def batch_signature(batches: Sequence[Any]) -> dict[str, list[dict[str, tuple[str, tuple[int, ...]]]]]:
    """What train batches (MultiAgentBatches) are made of, per module and batch: each column's dtype and full shape
    (its rows included). The values are each variant's own experience, so they are not compared."""
    sig: dict[str, list[dict[str, tuple[str, tuple[int, ...]]]]] = {}
    for batch in batches:
        for module_id, module_batch in batch.policy_batches.items():
            sig.setdefault(str(module_id), []).append(
                {name: (_dtype(col), tuple(np.shape(col))) for name, col in _columns(module_batch)})
    return sig


def check_same_train_batches(native: Sequence[Any], conduit: Sequence[Any], workload: str = "") -> None:
    """Raise AssertionError unless the two variants' train batches are alike: the same modules, as many batches
    (minibatches) each, every batch with rows, and in each the same columns with the same dtypes and shapes (hence
    the same rows per module)."""
    a, b = batch_signature(native), batch_signature(conduit)
    assert a and sorted(a) == sorted(b), f"{workload}: modules {sorted(b)} (conduit) vs {sorted(a)} (native)"
    for module_id, want in a.items():
        got = b[module_id]
        assert len(got) == len(want), f"{workload} {module_id}: {len(got)} batches (conduit) vs {len(want)} (native)"
        for i, (x, y) in enumerate(zip(want, got, strict=True)):
            where = f"{workload} {module_id} batch {i}"
            assert x.keys() == y.keys(), (f"{where}: columns only native's {sorted(x.keys() - y.keys())}, only "
                                          f"conduit's {sorted(y.keys() - x.keys())}")
            differ = {k: (x[k], y[k]) for k in x if x[k] != y[k]}
            assert not differ, f"{where}: (dtype, shape) native vs conduit differ: {differ}"
            rows = {shape[0] for _, shape in x.values() if shape}
            assert rows and 0 not in rows, f"{where}: no rows ({rows})"


def check_variants_build_alike(made: dict[str, Built]) -> None:
    """Run each variant's experience path once, untimed, and check their train batches are alike (PPO: one
    rollout, each learner updating on its own copy, since the learner connector changes the episodes it gets)."""
    native = made["native"]
    if native.workload.startswith("ppo"):
        (episodes,), _ = native.rollout()
        kept: dict[str, list[Any]] = {"native": [], "conduit": []}
        for variant, b in made.items():
            b.on_policy_update_path(copy.deepcopy(episodes), keep=kept[variant])
        check_same_train_batches(kept["native"], kept["conduit"], native.workload)
    else:
        batches = {variant: b.off_policy_step(*b.next_chunk()[0]) for variant, b in made.items()}
        check_same_train_batches([batches["native"]], [batches["conduit"]], native.workload)


@pytest.fixture(scope="module", params=WORKLOADS)
def built(request: pytest.FixtureRequest, ray_local: None) -> Iterator[dict[str, Built]]:
    made = {v: Built(request.param, v) for v in VARIANTS}
    check_variants_build_alike(made)  # once per workload, before (and outside) anything timed
    yield made
    for b in made.values():
        b.close()


def conduit_path_count(b: Built) -> int | None:
    """How often Conduit's path has served the learner so far (off-policy: train batches taken from Conduit's
    sample; PPO: train batches its minibatch feed took in); None for a learner without Conduit's parts."""
    if b.workload.startswith("ppo"):
        feeds = getattr(b.learner, "conduit_feeds", None)
        return None if feeds is None else b.learner.conduit_version
    return getattr(b.learner, "conduit_batches", None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_experience_path_of_one_step(benchmark: Any, built: dict[str, Built], variant: str, ratios: Any) -> None:
    b = built[variant]
    benchmark.group = f"rllib-experience-{b.workload}"
    fn: Callable[..., None]
    if b.workload.startswith("ppo"):
        fn, setup, rounds = b.on_policy_update_path, b.rollout, 5
    else:
        fn, setup, rounds = b.off_policy_step, b.next_chunk, 60
    before = conduit_path_count(b)
    benchmark.pedantic(fn, setup=setup, rounds=rounds, iterations=1, warmup_rounds=2)
    # each variant ran its own path: Conduit's fast path on every call (not RLlib's learner connector behind
    # a Conduit buffer), and RLlib's own learner without any Conduit part
    calls = 1 if benchmark.disabled else rounds + 2
    if variant == "conduit":
        after = conduit_path_count(b)
        assert before is not None and after is not None and after - before >= calls, \
            f"{b.workload}: the Conduit path served fewer than {calls} calls ({before} -> {after})"
    else:
        assert before is None, f"{b.workload}: the native variant's learner has Conduit parts"
    ratios.add("rllib_experience_step", b.workload, variant, benchmark, baseline="native",
               note="Experience path of one training step as RLlib calls it (off-policy: add 1 step, sample, "
                    "get_metrics, learner batch, update_priorities; PPO: train batch + all minibatches of one "
                    "update). All exposed in RLlib and with Conduit's default synchronous scheduler.")


@pytest.mark.parametrize("variant", VARIANTS)
def test_iteration(benchmark: Any, built: dict[str, Built], variant: str, ratios: Any) -> None:
    from conduit_rllib.profiling import ExperiencePathProbe

    b = built[variant]
    benchmark.group = f"rllib-iteration-{b.workload}"
    probe = ExperiencePathProbe(b.algo)
    exposed: list[float] = []

    def iteration() -> None:
        probe.take()
        b.algo.train()
        exposed.append(probe.take()["exposed"])

    try:
        benchmark.pedantic(iteration, rounds=3, iterations=1, warmup_rounds=0)
    finally:
        probe.close()
    benchmark.extra_info["exposed_experience_path_s_median"] = float(np.median(exposed))
    ratios.add("rllib_iteration", b.workload, variant, benchmark, baseline="native",
               note=f"One algo.train() (DQN/SAC: {STEPS} env steps and updates; PPO: 2000 steps, 6 epochs).")


def test_the_train_batch_check_refuses_a_planted_difference() -> None:
    """check_same_train_batches passes alike batches (a torch and a NumPy side) and fails each planted difference:
    a column dropped, fewer rows, another dtype, another column shape, an empty batch, another module, a
    minibatch missing."""
    import torch
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    def batch(rows: int = 32, *, drop: str = "", dtype: Any = np.float32, d: int = 4, module: str = "default_policy",
              as_torch: bool = False) -> MultiAgentBatch:
        cols: dict[str, Any] = {"obs": np.zeros((rows, d), dtype=dtype), "actions": np.zeros(rows, dtype=np.int64),
                "weights": np.ones(rows, dtype=np.float32)}
        cols = {k: torch.from_numpy(v) if as_torch else v for k, v in cols.items() if k != drop}
        return MultiAgentBatch({module: SampleBatch(cols)}, env_steps=rows)

    check_same_train_batches([batch()], [batch(as_torch=True)])  # alike: passes
    check_same_train_batches([batch(), batch(8)], [batch(as_torch=True), batch(8, as_torch=True)])
    planted = {"a column dropped": [batch(drop="weights")], "fewer rows": [batch(16)],
               "another dtype": [batch(dtype=np.float64)], "another column shape": [batch(d=5)],
               "an empty batch": [batch(0)], "another module": [batch(module="other")],
               "a minibatch missing": []}
    for what, conduit in planted.items():
        with pytest.raises(AssertionError):
            check_same_train_batches([batch()], conduit)
            pytest.fail(f"{what}: not refused")  # (reached only when the check passed)
    with pytest.raises(AssertionError, match="no rows"):
        check_same_train_batches([batch(0)], [batch(0)])  # both empty: still refused
