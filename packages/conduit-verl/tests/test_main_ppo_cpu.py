"""RLHF post-training as a user runs it: ``python -m verl.trainer.main_ppo`` with Conduit, on a CPU.

verl's real entry point, V1 trainer, agent loop, reward loop, FSDP2 actor and TransferQueue,
with Conduit switched on by hydra overrides only (the storage backend, the replay-buffer
plug) and conduit-verl's CPU platform and ``hf`` rollout standing in for a GPU and vLLM.
Two GRPO steps on the tiny model, bounded by a timeout; every process the run leaves behind
is found by a marker in its environment and ended by id.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

# two bounded runs per test at most (1200 s each, below) and their checks: above the suite's 900 s default
pytestmark = [pytest.mark.requires("verl"), pytest.mark.slow, pytest.mark.timeout(2700)]

README = Path(__file__).resolve().parents[1] / "README.md"


def _main_ppo(overrides: list[str], tmp_path: Path, reaper: Callable[[str], None]) -> tuple[str, Path]:
    """``python -m verl.trainer.main_ppo OVERRIDES`` in a fresh process; its output and the trace directory."""
    marker = uuid.uuid4().hex
    trace = tmp_path / "trace"
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", CONDUIT_VERL_TRACE_DIR=str(trace), CONDUIT_TEST_RUN=marker)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides,
           f"+ray_kwargs.ray_init.runtime_env.env_vars.CONDUIT_VERL_TRACE_DIR={trace}",
           f"+ray_kwargs.ray_init.runtime_env.env_vars.CONDUIT_TEST_RUN={marker}"]
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    finally:
        reaper(marker)  # Ray workers outliving the driver, if any
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out, trace


def _step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if " step:" in line and "actor/pg_loss" in line]


def _turned_off(overrides: list[str]) -> list[str]:
    """``overrides`` with Conduit switched off the way the README says: its lines dropped, its stated override added."""
    off = re.search(r"\*\*Turning Conduit off\*\*(.*?)\n\n", README.read_text(), re.S)
    assert off, "the README does not say how to turn Conduit off again"
    conduit_keys = r"transfer_queue\.backend\.storage_backend|trainer\.v1\.sampler\.custom_sampler\.\w+"
    dropped = re.findall(rf"`((?:{conduit_keys})=[^`]+)`", off.group(1))
    added = re.findall(r"add `([^`]+=[^`]+)`", off.group(1))
    assert len(dropped) == 3 and set(dropped) <= set(overrides), dropped
    return [o for o in overrides if o not in dropped] + added


def _step_metrics(line: str) -> dict[str, float]:
    """The numbers of one console step line (``step:1 - actor/pg_loss:0.1 - ...``)."""
    out = {}
    for item in line.split(" step:", 1)[1].split(" - ")[1:]:
        key, _, value = item.partition(":")
        value = re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip())  # pprint of a NumPy scalar
        try:
            out[key.strip()] = float(value)
        except ValueError:
            pass
    return out


def test_main_ppo_runs_grpo_steps_through_conduit(tiny: dict[str, Path], tmp_path: Path,
                                                   reaper: Callable[[str], None]) -> None:
    from conduit_verl.cpu.config import main_ppo_overrides

    out, trace = _main_ppo(main_ppo_overrides(str(tiny["model"].parent), steps=2), tmp_path, reaper)
    steps = _step_lines(out)
    assert len(steps) == 2, out[-4000:]
    for line in steps:
        assert "conduit/staleness/max:0" in line  # the Conduit replay buffer sampled, nothing stale
        assert "actor/grad_norm" in line and "critic/advantages/mean" in line

    deliveries = [json.loads(p.read_text()) for p in trace.glob("delivery-*.json")]
    assert len(deliveries) == 2  # one actor update per step, iterated through Conduit
    for d in deliveries:
        assert d["mode"] == "prefetch" and d["minibatches"] == d["num_minibatches"] == 2  # 8 rows / minibatch 4
    storage = [json.loads(p.read_text()) for p in trace.glob("storage-*.json")]
    assert len({s["run"] for s in storage}) == 1  # every process spoke to the same Conduit units
    puts = sum(s["telemetry"].get("put", {}).get("calls", 0) for s in storage)
    gets = sum(s["telemetry"].get("get", {}).get("calls", 0) for s in storage)
    assert puts >= 2 * 3 and gets >= 2 * 3  # trajectories, log-probs, advantages written; workers read them
    assert len(storage) >= 3  # the agent loop, the trainer and the actor worker each used Conduit storage


def _replaced(overrides: list[str], *extra: str) -> list[str]:
    """``overrides`` with each key ``extra`` sets given its value there (a ``+`` prefix ignored when matching)."""
    keys = {e.split("=", 1)[0].lstrip("+") for e in extra}
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+") not in keys] + list(extra)


def test_main_ppo_saves_and_resumes_an_async_run_through_conduits_units(
        tiny: dict[str, Path], tmp_path: Path, reaper: Callable[[str], None]) -> None:
    """What a user changes past the README's command, in one async run: RLOO with two rollouts per prompt, two
    shuffled PPO epochs, dynamic batch sizes, no sequence balancing, a checkpoint every step. A first ``main_ppo``
    trains step 1 and saves it (actor, dataloader, and TransferQueue with Conduit's unit file); a second one resumes
    from it (``resume_mode=auto``), restores the prompt groups the first left in Conduit's units and trains step 2."""
    from conduit_verl.cpu.config import main_ppo_overrides

    ckpt = tmp_path / "ckpt"
    overrides = _replaced(
        main_ppo_overrides(str(tiny["model"].parent), steps=1),
        "trainer.v1.trainer_mode=colocate_async", "algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40", "trainer.balance_batch=False",
        "trainer.save_freq=1", f"trainer.default_local_dir={ckpt}")
    (tmp_path / "first").mkdir()
    out, trace = _main_ppo(overrides, tmp_path / "first", reaper)
    assert [line.split(" step:")[1].split()[0] for line in _step_lines(out)] == ["1"], out[-4000:]
    assert (ckpt / "global_step_1" / "transfer_queue" / "conduit_unit_0.pt").is_file()
    deliveries = [json.loads(p.read_text()) for p in trace.glob("delivery-*.json")]
    assert len(deliveries) == 1 and deliveries[0]["epochs"] == 2  # 2 prompts x 2 rollouts, minibatch 1 prompt
    assert deliveries[0]["minibatches"] == 2 * deliveries[0]["num_minibatches"] == 4

    (tmp_path / "second").mkdir()
    out, trace = _main_ppo(_replaced(overrides, "trainer.total_training_steps=2", "trainer.resume_mode=auto"),
                           tmp_path / "second", reaper)
    restored = re.search(r"Restored (\d+) training prompt groups from TransferQueue", out)
    assert restored and int(restored.group(1)) >= 1, out[-4000:]
    steps = _step_lines(out)
    assert [line.split(" step:")[1].split()[0] for line in steps] == ["2"], out[-4000:]  # resumed after step 1
    assert "conduit/staleness/max" in steps[0] and "actor/grad_norm" in steps[0]
    assert len(list(trace.glob("delivery-*.json"))) == 1


#: a learning rate that moves the policy enough in one update for a fp32 ``low_var_kl`` to leave 0 (1e-6 does not)
KL_LR = "actor_rollout_ref.actor.optim.lr=1e-2"

#: step-line metrics that are timings, throughput or memory (they differ from run to run)
_RUN_DEPENDENT = re.compile(r"^(timing|perf|timing_s|timing_per_token_ms|conduit)/|/(time|throughput)|memory|mfu")


#: the reference's two uses, both on in one run (each run pair costs minutes on this CPU): KL in the actor's loss
#: (verl's default ``low_var_kl``) and KL in the reward, with the step metric each one logs
KL_SWITCHES = ("actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True")
KL_METRICS = ("actor/kl_loss", "actor/reward_kl_penalty")


def test_main_ppo_with_a_reference_model_matches_conduit_off(
        tiny: dict[str, Path], tmp_path: Path, reaper: Callable[[str], None]) -> None:
    """GRPO with verl's reference model on this CPU, KL in the loss and in the reward, Conduit on and off: the
    reference starts (conduit-verl's CPU platform builds its offloaded FSDP2 engine unpinned), ``ref_log_prob`` goes
    through Conduit's storage and delivery, and every step's losses, rewards and KL match verl's own path to float
    rounding. Each KL is 0 on the first update (the policy is the reference) and finite and non-zero once the
    policy has moved.

    The run with Conduit off is the README's command switched off the way its text says (the Conduit lines dropped,
    its stated override added): it trains through verl's own storage and iterator, with no Conduit storage anywhere.
    Dropping the Conduit lines alone used to hang forever, silently: verl's SimpleStorage starts 8 units reserving a
    CPU each, more than the command's ``num_cpus=8`` leaves beside the trainer and TransferQueue's controller, and
    ``tq.init`` waits for them."""
    from conduit_verl.cpu.config import main_ppo_overrides, reference_overrides

    # one minibatch per step (the README's way to compare): verl batches trajectories in the order they finish
    overrides = _replaced(main_ppo_overrides(str(tiny["model"].parent), steps=2), *KL_SWITCHES, *reference_overrides(),
                          KL_LR, "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    out_on, trace = _main_ppo(overrides, tmp_path / "on", reaper)
    out_off, trace_off = _main_ppo(_turned_off(overrides), tmp_path / "off", reaper)
    on, off = [[_step_metrics(line) for line in _step_lines(o)] for o in (out_on, out_off)]
    assert len(on) == len(off) == 2, (out_on[-3000:], out_off[-3000:])
    assert len(list(trace.glob("delivery-*.json"))) == 2  # Conduit delivered both updates
    assert not list(trace_off.glob("delivery-*.json"))  # off: verl's own minibatch iterator
    assert not list(trace_off.glob("storage-*.json"))  # off: no Conduit storage anywhere
    assert all("conduit/" not in line for line in _step_lines(out_off)), out_off[-3000:]  # verl's own sampler
    for step, (a, b) in enumerate(zip(on, off, strict=True), 1):
        assert "conduit/staleness/max" in a and "conduit/staleness/max" not in b, step
        compared = {k for k in b if not _RUN_DEPENDENT.search(k)}
        assert {"actor/pg_loss", "actor/grad_norm", *KL_METRICS} <= compared <= a.keys(), step
        # abs 1e-5: differences of fp32 log-probs near -6 (ulp ~5e-7), e.g. rollout_corr/*, are rounding noise there
        differ = {k: (a[k], b[k]) for k in sorted(compared)
                  if a[k] != pytest.approx(b[k], rel=1e-4, abs=1e-5, nan_ok=True)}
        assert not differ, (step, differ)
        assert all(math.isfinite(a[m]) for m in KL_METRICS), (step, a)
    assert all(on[1][m] > 0 for m in KL_METRICS), on  # the policy moved off the reference after step 1
