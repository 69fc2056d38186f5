"""What a verl user does with Conduit under RLHF post-training, followed from the README.

* The backend's documented options: the README's table states the defaults the backend uses, and its keys are set
  the way the README says (hydra needs a leading ``+``: verl's ``transfer_queue`` config has no ``Conduit`` section,
  nor ``sampler_kwargs`` an ``on_stale`` key). ``device`` takes what the README offers (``cpu``, ``auto``): a fixed
  device passed the check and failed mid-run in verl's controller, which has no accelerator.
* The storage's pool ladder refuses a ``growth`` too close to 1 (rungs one element apart: a large pool took millions
  of rungs), naming the useful range, typed, at ``PoolLadder`` and at the backend's config check.
* DAPO's group filter (``algorithm.filter_groups``) and sync mode's ``sync_refill_failed_groups``, which verl 0.9.1
  does not hand to a custom sampler, were silently ignored under ``ConduitReplayBuffer``: verl's own trainer now
  gets a ``ConfigurationError`` that says what to do when it builds the buffer.
* ReMax (``algorithm.adv_estimator=remax``), which verl 0.9.1's V1 trainer cannot compute, failed untyped after the
  first rollout: the Conduit sampler now refuses it, typed, when verl's trainer builds it; so it refuses Pass@k
  (``grpo_passk``) with one rollout per prompt, which verl's advantage step cannot compute either, and GDPO and the
  optimal token baselines, whose inputs the V1 trainer never fetches for that step.
* The usual actor choices (dynamic batch sizes, several PPO epochs, shuffled minibatches, GRPO's n rollouts per
  prompt) train through Conduit's delivery exactly as through verl's own iterator.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ConfigurationError

pytestmark = pytest.mark.requires("verl")

README = Path(__file__).resolve().parents[1] / "README.md"

#: Conduit switched on the README's way (backend and replay-buffer plug), on verl's CPU-sized trainer config
PLUG = ["transfer_queue.backend.storage_backend=Conduit",
        "trainer.v1.sampler.custom_sampler.path=pkg://conduit_verl.replay",
        "trainer.v1.sampler.custom_sampler.name=ConduitReplayBuffer"]


def _readme_config_table() -> dict[str, str]:
    """key -> the default the README's backend configuration table states (as written)."""
    text = README.read_text()
    section = text.split("### Configuration (`transfer_queue.backend.Conduit.*`", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2).strip().strip("`") for m in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)}


# -- 1. the documented options ------------------------------------------------------------------------------------
def test_the_readme_states_the_backends_keys_and_defaults_and_how_to_set_them() -> None:
    """Every key of the README's table, set as the README says (``+transfer_queue.backend.Conduit.KEY=DEFAULT``),
    composes with verl's trainer config and reaches the backend as its own default."""
    from conduit_verl.cpu.config import compose
    from conduit_verl.tq_storage import DEFAULTS, _validated, _with_defaults

    table = _readme_config_table()
    assert table.keys() == DEFAULTS.keys()
    stated = {k: None if v == "null" else type(DEFAULTS[k])(v) for k, v in table.items()}
    assert stated == DEFAULTS, "the README's defaults are not the backend's"

    assert "+transfer_queue.backend.Conduit." in README.read_text(), "the README does not say how to set a key"
    with pytest.raises(Exception, match=r"\+transfer_queue.backend.Conduit.capacity"):  # hydra: "use +..."
        compose([*PLUG, "transfer_queue.backend.Conduit.capacity=8"])
    cfg = compose([*PLUG, *(f"+transfer_queue.backend.Conduit.{k}={v}" for k, v in table.items())])
    assert cfg.transfer_queue.backend.storage_backend == "Conduit"
    assert _validated(_with_defaults(cfg.transfer_queue.backend.Conduit)) == DEFAULTS


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta"])
def test_a_fixed_read_device_is_refused_at_the_config_check_and_auto_named(device: str) -> None:
    """The README offers ``cpu`` and ``auto``. A fixed device used to pass the backend's check (``tq.init`` started
    the units), then every process read onto it: a process without that accelerator (verl's controller has none,
    nor has this CPU host) failed untyped at its first read, mid-run, and ``meta`` returned tensors without data.
    Now refused before anything starts."""
    from conduit_verl.cpu.config import compose
    from conduit_verl.tq_storage import _validated, _with_defaults

    cfg = compose([*PLUG, f"+transfer_queue.backend.Conduit.device={device}"])
    with pytest.raises(ConfigurationError, match=r"Conduit\.device=.*use cpu, or auto"):
        _validated(_with_defaults(cfg.transfer_queue.backend.Conduit))
    for fine in ("cpu", "auto"):
        cfg = compose([*PLUG, f"+transfer_queue.backend.Conduit.device={fine}"])
        assert _validated(_with_defaults(cfg.transfer_queue.backend.Conduit))["device"] == fine


def test_every_override_the_readme_shows_composes_with_verls_config() -> None:
    """A user pastes the README's overrides: each one hydra takes as written (``on_stale=raise`` needed a ``+``, as
    ``sampler_kwargs`` is an empty section of verl's config), and ``on_stale`` reaches the Conduit sampler."""
    from conduit_verl.cpu.config import compose

    top = set(compose([]).keys())
    shown = [o for o in re.findall(r"`(\+?[a-z_]+(?:\.\w+)+=[^`\s]+)`", README.read_text())
             if o.lstrip("+").split(".", 1)[0] in top]
    assert "+trainer.v1.sampler.sampler_kwargs.on_stale=raise" in shown, shown
    for override in shown:
        compose([*PLUG, override])  # hydra raises on an override it cannot apply
    assert _trainer("sync", "+trainer.v1.sampler.sampler_kwargs.on_stale=raise").replay_buffer.on_stale == "raise"


@pytest.mark.parametrize(("key", "value"), [("num_units", 2.5), ("capacity", 1024.0), ("mean_length", "256"),
                                            ("max_items", 7.9), ("num_units", True)])
def test_a_whole_number_key_given_a_fraction_or_a_bool_is_refused_named(key: str, value: Any) -> None:
    """``num_units=2.5`` started two units and ``max_items=7.9`` held seven (the check ran ``int()`` on them), and
    ``num_units=True`` was one unit. Each is refused before anything starts, naming the key and the value."""
    from conduit_verl.tq_storage import DEFAULTS, _validated

    with pytest.raises(ConfigurationError, match=rf"transfer_queue\.backend\.Conduit\.{key}=.*whole number"):
        _validated(dict(DEFAULTS, **{key: value}))
    assert _validated(dict(DEFAULTS, max_items=None, num_units=2))["num_units"] == 2


# -- 2. the pool ladder's growth ------------------------------------------------------------------------------------
@pytest.mark.parametrize("growth", [1.0000001, 1.001, 1.0099])
def test_a_growth_too_close_to_one_is_refused_with_the_useful_range(growth: float) -> None:
    """A growth barely above 1 used to be accepted: rungs one element apart, so a field that needed a pool of ten
    million elements walked (and kept) ten million rungs. Now PoolLadder and the backend's config check refuse it,
    typed, naming the smallest growth; growth <= 1 keeps its documented refusal."""
    from conduit_verl.columns import PoolLadder
    from conduit_verl.cpu.config import compose
    from conduit_verl.tq_storage import DEFAULTS, _validated, _with_defaults

    with pytest.raises(ConfigurationError, match=r"growth must be at least 1\.01.*about 4"):
        PoolLadder(1024, 1024 * 256, growth=growth)
    cfg = compose([*PLUG, f"+transfer_queue.backend.Conduit.growth={growth}"])
    with pytest.raises(ConfigurationError, match=r"transfer_queue\.backend\.Conduit.*at least 1\.01"):
        _validated(_with_defaults(cfg.transfer_queue.backend.Conduit))
    with pytest.raises(ConfigurationError, match="growth must be > 1 and finite"):
        _validated(dict(DEFAULTS, growth=1.0))

    from conduit_verl.columns import MIN_GROWTH

    assert MIN_GROWTH == 1.01
    ladder = PoolLadder(1, 1, growth=MIN_GROWTH)  # the smallest growth reaches any size in a few thousand rungs
    k = ladder.pool(2**62)
    assert ladder.elements[k] >= 2**62 and len(ladder.elements) < 4000
    assert ladder.items[ladder.slots(10**7)] >= 10**7 and len(ladder.items) < 4000


# -- 3. what verl does not hand a custom sampler ---------------------------------------------------------------------
def _trainer(mode: str, *extra: str, plug: list[str] = PLUG) -> Any:
    """verl's own V1 trainer of ``mode`` (its constructor builds the replay buffer) on the tiny CPU config."""
    import verl.trainer.ppo.v1  # noqa: F401  (registers the trainer modes)
    from conduit_verl.cpu.config import compose, cpu_overrides
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    cfg = compose([*cpu_overrides("/nonexistent/model", n=2, mini_batch=1), *plug, "algorithm.adv_estimator=grpo",
                   "data.train_batch_size=4", f"trainer.v1.trainer_mode={mode}", *extra])
    return get_trainer_cls(mode)(cfg)


DAPO = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc"]


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_dapo_group_filtering_with_the_conduit_sampler_is_refused_not_ignored(mode: str) -> None:
    """verl 0.9.1 builds a custom sampler without DAPO's filter metric: ConduitReplayBuffer used to be built and to
    train every group, DAPO's filtered ones included. verl's trainer now stops with a ConfigurationError that says to
    keep verl's own sampler for DAPO; without DAPO the same trainer builds the Conduit sampler."""
    from conduit_verl.replay import ConduitReplayBuffer

    assert type(_trainer(mode).replay_buffer) is ConduitReplayBuffer
    with pytest.raises(ConfigurationError, match=r"filter_groups.*custom_sampler overrides"):
        _trainer(mode, *DAPO)
    # the advice works: with the Conduit backend but verl's own sampler, DAPO's filter is in force
    assert _trainer(mode, *DAPO, plug=PLUG[:1]).replay_buffer.filter_groups_metric == "acc"


def test_sync_refill_of_failed_groups_with_the_conduit_sampler_is_refused_in_sync_mode() -> None:
    """In sync mode verl's own sampler refills failed groups when asked; ConduitReplayBuffer never got the option
    and trained them. Now refused, typed; in the async modes (where verl's sampler refills failed groups anyway)
    it stays accepted."""
    refill = "trainer.v1.sampler.sync_refill_failed_groups=True"
    with pytest.raises(ConfigurationError, match=r"sync_refill_failed_groups.*custom_sampler overrides"):
        _trainer("sync", refill)
    assert not _trainer("colocate_async", refill).replay_buffer.sync_refill_failed_groups


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_remax_with_the_conduit_sampler_is_refused_before_any_rollout(mode: str) -> None:
    """``algorithm.adv_estimator=remax`` through ``main_ppo`` with Conduit on started every worker, generated a whole
    rollout and then died in verl's advantage step with an untyped ``TypeError`` (Conduit off dies the same way): verl
    0.9.1's V1 trainer never generates ReMax's greedy baseline. verl's trainer now stops when it builds the Conduit
    sampler, with a ConfigurationError that says which estimators to use instead."""
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    with pytest.raises(ConfigurationError, match=r"adv_estimator=remax.*reward_baselines.*grpo, rloo.*use_v1=False"):
        _trainer(mode, "algorithm.adv_estimator=remax")
    # what is refused cannot run: the V1 advantage step, given what the V1 trainer has, has no ReMax baseline
    data = DataProto.from_dict(tensors={"token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.5]]),
                                        "response_mask": torch.ones(2, 2)},
                               non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    with pytest.raises(TypeError, match="reward_baselines"):
        compute_advantage_for_multi_trajectories(data, ["a_0_0", "b_0_0"], "remax")
    assert type(_trainer(mode, "algorithm.adv_estimator=rloo").replay_buffer).__name__ == "ConduitReplayBuffer"


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_grpo_passk_with_one_rollout_per_prompt_is_refused_before_any_rollout(mode: str) -> None:
    """``algorithm.adv_estimator=grpo_passk`` with ``actor_rollout_ref.rollout.n=1`` through ``main_ppo`` started every
    worker, generated and scored a whole rollout, then died in verl's advantage step with an untyped ``ValueError``
    ("Pass@k requires at least 2 samples per group"), Conduit on or off. The Conduit sampler now refuses it when
    verl's trainer builds it, saying to raise ``rollout.n`` or which estimator takes one response per prompt."""
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    one = "actor_rollout_ref.rollout.n=1"
    refused = r"grpo_passk.*rollout\.n=1.*rollout\.n=2 or more.*reinforce_plus_plus"
    with pytest.raises(ConfigurationError, match=refused):
        _trainer(mode, "algorithm.adv_estimator=grpo_passk", one)
    # what is refused cannot run: verl's advantage step on one response per prompt, as the V1 trainer calls it
    data = DataProto.from_dict(tensors={"token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.5]]),
                                        "response_mask": torch.ones(2, 2)},
                               non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_advantage_for_multi_trajectories(data, ["a_0_0", "b_0_0"], "grpo_passk", num_repeat=1,
                                                 config=_trainer(mode).config.algorithm)
    # what it says to use instead is built: grpo_passk with two rollouts, and reinforce_plus_plus with one
    assert type(_trainer(mode, "algorithm.adv_estimator=grpo_passk").replay_buffer).__name__ == "ConduitReplayBuffer"
    assert _trainer(mode, "algorithm.adv_estimator=reinforce_plus_plus", one).config.actor_rollout_ref.rollout.n == 1


@pytest.mark.parametrize("estimator", ["gdpo", "optimal_token_baseline", "tir_optimal_token_baseline"])
def test_estimators_whose_inputs_the_v1_trainer_never_fetches_are_refused_before_any_rollout(estimator: str) -> None:
    """GDPO and the optimal token baselines through ``main_ppo`` started every worker, generated and scored a whole
    rollout, then died in verl's advantage step with an untyped ``AssertionError``, Conduit on or off, even configured
    as the assertion asks (``actor.calculate_sum_pi_squared=True``): verl 0.9.1's V1 trainer reads only a few fields
    from TransferQueue for that step, never the reward components or ``sum_pi_squared``. The Conduit sampler now
    refuses them when verl's trainer builds it, saying what to use instead."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    refused = rf"adv_estimator={estimator} needs .*never hands its advantage step.*grpo, rloo.*use_v1=False"
    with pytest.raises(ConfigurationError, match=refused):
        _trainer("sync", f"algorithm.adv_estimator={estimator}",
                 "actor_rollout_ref.actor.calculate_sum_pi_squared=True")
    # what is refused cannot run: the fields the V1 trainer's advantage step has, configured as each estimator asks
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.5], [1.0, 0.0], [0.0, 0.0]])
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": torch.ones(4, 2),
                                        "old_log_probs": torch.zeros(4, 2), "rollout_log_probs": torch.zeros(4, 2)},
                               non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    with pytest.raises((AssertionError, KeyError), match=r"sum_pi_squared|prompts"):  # GDPO: no prompts either
        compute_advantage_for_multi_trajectories(data, ["a_0_0", "a_1_0", "b_0_0", "b_1_0"], estimator, num_repeat=2,
                                                 config=OmegaConf.create({"gdpo_reward_keys": ["acc"]}))


# -- 4. the actor's usual choices, through Conduit's delivery ---------------------------------------------------------
@pytest.mark.parametrize(("choice", "kw", "extra"), [
    pytest.param("dynamic batch sizes, 2 shuffled epochs", dict(n=4, mini_batch=1, micro_batch=2, epochs=2,
                                                                shuffle=True),
                 ["actor_rollout_ref.actor.use_dynamic_bsz=True",
                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
                  "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
                  "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40"], id="dynamic-bsz"),
    pytest.param("n=2, minibatch of 2 prompts, micro batch 1, 3 epochs", dict(n=2, mini_batch=2, micro_batch=1,
                                                                             epochs=3, shuffle=True), [],
                 id="n2-mini2-micro1-epochs3"),
])
def test_the_actors_usual_choices_train_the_same_through_conduit(tiny: dict[str, Path], gloo: None, choice: str,
                                                                  kw: dict[str, Any], extra: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's real actor worker (FSDP2 on gloo, in process): the same losses, gradient norms and weights with
    Conduit's prefetching delivery as with verl's own iterator, for every optimizer step."""
    from conduit_verl.cpu.config import compose, cpu_overrides

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    run_update = importlib.import_module("test_actor_inprocess").run_update  # verl's helpers: one GRPO actor update

    cfg = compose([*cpu_overrides(str(tiny["model"]), **kw), *extra])
    ref_metrics, ref_params = run_update(cfg, "off")
    got_metrics, got_params = run_update(cfg, "prefetch")
    steps = 2 // kw["mini_batch"] * kw["epochs"]  # run_update's rollout: 2 prompts x n
    for key in ("actor/pg_loss", "actor/grad_norm"):
        assert len(ref_metrics[key]) == steps, (choice, key, ref_metrics[key])
        assert got_metrics[key] == ref_metrics[key], (choice, key)
    assert any(g > 0 for g in ref_metrics["actor/grad_norm"]), "the update trained nothing"
    assert all(torch.equal(got_params[k], ref_params[k]) for k in ref_params), choice


# -- 5. PPO with a critic on a CPU host -------------------------------------------------------------------------------
def test_a_critic_on_a_cpu_host_is_refused_typed_saying_what_to_use(tiny: dict[str, Path], gloo: None) -> None:
    """PPO with a critic (``algorithm.adv_estimator=gae``) on the README's CPU setup: verl 0.9.1 loads the value model
    with flash-attention hard-coded, which a CPU host cannot run, and the run died mid-start with "please install
    trl" (an untyped RuntimeError over an ImportError; installing trl fails the same way). The CPU platform registers
    the critic engine, so it now refuses at the critic's start with a ConfigurationError naming the cause and the
    critic-free estimator to use instead."""
    from conduit_verl.cpu.config import compose, cpu_overrides
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    model = str(tiny["model"])
    cfg = compose([*cpu_overrides(model), "algorithm.adv_estimator=gae", "critic.strategy=fsdp2",
                   f"critic.model.path={model}", "+critic.model.override_config.attn_implementation=sdpa",
                   "critic.model.enable_gradient_checkpointing=False", "critic.fsdp.use_torch_compile=False",
                   "critic.ppo_micro_batch_size_per_gpu=4"])
    critic = omega_conf_to_dataclass(cfg.critic)  # as verl's V1 trainer builds its critic worker
    worker = TrainingWorker(config=TrainingWorkerConfig(
        model_type="value_model", model_config=critic.model, engine_config=critic.engine,
        optimizer_config=critic.optim, checkpoint_config=critic.checkpoint))
    with pytest.raises(ConfigurationError, match=r"flash_attention_2.*algorithm\.adv_estimator=grpo.*GPU"):
        worker.reset()
