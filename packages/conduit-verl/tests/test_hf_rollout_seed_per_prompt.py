"""The CPU ``hf`` rollout samples the same responses for one ``rollout.seed`` whatever order requests arrive in.

verl's agent loop sends a step's requests concurrently (``rollout.n`` sessions per prompt, several prompts), so the
order they reach the rollout server differs from run to run. The server seeded each request by its arrival number:
two ``main_ppo`` runs with the same seed (Conduit on and off, or Conduit off twice) sampled different responses for a
prompt and trained differently, so a user comparing them per step could not tell Conduit from chance. Each request's
seed now comes from the seed, the prompt and how many times the server had that prompt before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.requires("verl")

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


def _responses(model: Path, order: list[list[int]]) -> dict[tuple[int, ...], list[list[int]]]:
    """prompt -> its responses, in the order that prompt's requests reached a fresh server given ``order``."""
    from conduit_verl.cpu.rollout import _Server

    server = _Server(str(model), response_length=8, max_model_len=None, seed=42)
    got: dict[tuple[int, ...], list[list[int]]] = {}
    for prompt in order:
        got.setdefault(tuple(prompt), []).append(server.generate(prompt, dict(SAMPLING)).token_ids)
    return got


def test_a_prompts_responses_do_not_depend_on_the_order_requests_arrive(tiny: dict[str, Path]) -> None:
    a, b = [5, 6, 7, 8], [9, 10, 11]
    first = _responses(tiny["model"], [a, a, b, b])  # rollout.n=2 for two prompts, one arrival order
    second = _responses(tiny["model"], [b, a, b, a])  # the same requests racing another way
    assert first == second
    assert first[tuple(a)][0] != first[tuple(a)][1]  # the n copies of a prompt still sample apart
