"""``rollout.name=hf``: a small rollout backend on transformers' ``generate()`` (tests and demos).

verl 0.9.1's rollouts (vLLM, SGLang, TensorRT-LLM) are GPU servers, and its trainers create
rollout replicas unconditionally, so ``main_ppo`` cannot run without one. This backend has the
three parts verl's rollout contract asks for, registered through verl's registries:

* :class:`HFGenerationServer`: a Ray actor per replica doing token-in, token-out generation
  with ``model.generate`` (one request at a time) and answering the lifecycle calls (sleep,
  wake up, abort, KV cache) that a GPU engine needs and a CPU one does not;
* :class:`HFReplica` (``RolloutReplicaRegistry`` name ``hf``): starts that server next to
  its trainer workers;
* :class:`HFServerAdapter` (``("hf", "async")`` in the worker-side rollout registry): the
  trainer worker's end of the weight sync. It receives the engine's full tensors after each
  update and hands them to its replica's server, which reports the weights' version as
  ``global_steps`` with each trajectory (verl's staleness tags).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Generator, Sequence
from typing import Any, cast

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

__all__ = ["HFGenerationServer", "HFReplica", "HFServerAdapter", "server_name"]

logger = logging.getLogger(__name__)


def server_name(replica_rank: int, suffix: str = "", role: str = "") -> str:
    """The Ray actor name of replica ``replica_rank``'s server; ``role`` (``reward``, ``teacher``) keeps a reward or
    teacher model's replicas apart from the policy's rollout replicas of the same rank, as verl's servers are."""
    return f"conduit_hf_{role}_server_{replica_rank}{suffix}" if role else f"conduit_hf_server_{replica_rank}{suffix}"


def request_seed(seed: int, prompt_ids: Sequence[int], occurrence: int) -> int:
    """The sampling seed of a request: ``rollout.seed``, the prompt's tokens and how many times the server was given
    that prompt before (``occurrence``), hashed. It does not depend on the order requests reach the server, which
    verl's agent loop does not fix (its requests race), so one seed gives each prompt the same responses run after
    run; the ``rollout.n`` copies of a prompt differ by ``occurrence``."""
    digest = hashlib.blake2b(repr((int(seed), int(occurrence), [int(t) for t in prompt_ids])).encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class _Server:
    """The generation engine behind :class:`HFGenerationServer` (plain Python, testable in-process)."""

    def __init__(self, model_path: str, *, response_length: int, max_model_len: int | None, seed: int,
                 trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32,
                                                          attn_implementation="sdpa",
                                                          trust_remote_code=trust_remote_code).eval()
        tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.eos = tok.eos_token_id
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.response_length = int(response_length)
        self.max_model_len = int(max_model_len
                                 or cast(int, getattr(self.model.config, "max_position_embeddings", 2048)))
        self.seed = int(seed)
        self.global_steps: int | None = None
        self.requests = 0
        #: how many requests each prompt (its tokens) has had, for :func:`request_seed`
        self.prompt_requests: Counter[tuple[int, ...]] = Counter()
        self.weight_updates = 0
        self._lock = threading.Lock()

    def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        params = dict(sampling_params)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"Prompt length ({len(prompt_ids)}) leaves no room within max_model_len "
                             f"{self.max_model_len}.")
        max_new = params.pop("max_tokens", None) or params.pop("max_new_tokens", None) or self.response_length
        max_new = max(1, min(int(max_new), self.response_length, room))
        temperature = float(params.get("temperature", 1.0) or 0.0)
        top_k = int(params.get("top_k", -1) or -1)
        top_p = float(params.get("top_p", 1.0) or 1.0)
        gen_kwargs: dict[str, Any] = dict(max_new_tokens=max_new, eos_token_id=self.eos, pad_token_id=self.pad,
                                          return_dict_in_generate=True, output_logits=True)
        if temperature > 0:
            gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0)
        else:
            gen_kwargs.update(do_sample=False)
        ids = torch.tensor([prompt_ids], dtype=torch.int64)
        with self._lock, torch.no_grad():
            self.requests += 1
            key = tuple(prompt_ids)
            seed = request_seed(self.seed, key, self.prompt_requests[key])
            self.prompt_requests[key] += 1
            state = torch.get_rng_state()
            torch.manual_seed(seed)
            try:
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen_kwargs)
            finally:
                torch.set_rng_state(state)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        log_probs = None
        if params.get("logprobs"):
            logits = torch.stack(out.logits, 1)[0, :len(tokens)].float()
            log_probs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        return TokenOutput(token_ids=tokens, log_probs=log_probs, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    def load_weights(self, named: dict[str, torch.Tensor], global_steps: int | None) -> int:
        state = self.model.state_dict()
        unknown = [k for k in named if k not in state]
        if unknown:
            raise KeyError(f"The trainer sent weights the rollout model does not have: {unknown[:5]}")
        with self._lock, torch.no_grad():
            for k, v in named.items():
                state[k].copy_(v.to(state[k].dtype))
            self.global_steps = global_steps
            self.weight_updates += 1
        return len(named)


@ray.remote(num_cpus=0)
class HFGenerationServer:
    """A replica's generation server: ``generate`` plus the lifecycle calls verl's replicas answer."""

    def __init__(self, model_path: str, response_length: int, max_model_len: int | None, seed: int,
                 trust_remote_code: bool = False) -> None:
        self.server = _Server(model_path, response_length=response_length, max_model_len=max_model_len, seed=seed,
                              trust_remote_code=trust_remote_code)
        self.awake = True

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, **_: Any) -> TokenOutput:
        if image_data is not None or video_data is not None:
            raise NotImplementedError("The hf rollout is text-only.")
        return await asyncio.to_thread(self.server.generate, list(prompt_ids), sampling_params)

    async def load_weights(self, named: dict[str, torch.Tensor], global_steps: int | None) -> int:
        return await asyncio.to_thread(self.server.load_weights, named, global_steps)

    async def stats(self) -> dict[str, Any]:
        s = self.server
        return {"requests": s.requests, "weight_updates": s.weight_updates, "global_steps": s.global_steps}

    async def wake_up(self) -> None:
        self.awake = True

    async def sleep(self) -> None:
        self.awake = False

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **_: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class HFReplica(RolloutReplica):
    """One ``hf`` rollout replica: a :class:`HFGenerationServer` on the node of its first worker (named per role:
    the policy's rollout, a reward model or a teacher model, see :func:`server_name`)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        role = "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""
        options: dict[str, Any] = {"name": server_name(self.replica_rank, self.name_suffix, role), "num_cpus": 0,
                                   "max_concurrency": self.max_concurrency}
        if self.workers:  # next to the trainer worker that sends it weights
            node = await self.workers[0].__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=True)
        model_path = self.model_config.local_path if hasattr(self.model_config, "local_path") else \
            self.model_config.path
        handle = HFGenerationServer.options(**options).remote(  # type: ignore[attr-defined]
            model_path, self.config.response_length, self.config.max_model_len, self.config.seed,
            bool(getattr(self.model_config, "trust_remote_code", False)))
        await handle.stats.remote()
        self.servers = [handle]
        self._server_handle = handle
        self._server_address = f"hf://{options['name']}"


class HFServerAdapter(BaseRollout):
    """The trainer worker's side of an ``hf`` replica: weight updates go to the replica's server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, replica_rank: int = -1,
                 **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size * \
            self.config.pipeline_model_parallel_size
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader = rank % world == 0
        self._server: Any = None

    def _handle(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"The hf rollout takes full named tensors, not {wire_format!r}.")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("The hf rollout does not load LoRA adapters; set model.lora.merge=True.")
        named = {}
        for name, t in weights:  # every rank drains the generator: FSDP gathers the full tensors collectively
            if self.is_leader:
                named[name] = t.detach().to("cpu").clone()
        if self.is_leader:
            await self._handle().load_weights.remote(named, kwargs.get("global_steps"))
