"""The V1 replay-buffer plug: Conduit's staleness rule inside verl's sampler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, OnPolicy, StaleExperienceError

pytestmark = pytest.mark.requires("verl")


def buffer(mode: str = "separate_async", threshold: int | None = 2, **sampler_kwargs: Any) -> Any:
    from conduit_verl.replay import ConduitReplayBuffer

    return ConduitReplayBuffer(trainer_mode=mode, trainer_config={}, max_off_policy_threshold=threshold,
                               max_off_policy_strategy="drop", sampler_kwargs=sampler_kwargs, refill_fn=lambda k: None)


def with_groups(buf: Any, steps: dict[str, int]) -> Any:
    buf.finished_keys["train"] = set(steps)
    buf.prompt_global_steps["train"] = dict(steps)
    return buf


def test_stale_groups_match_conduit_on_policy() -> None:
    """A group is stale exactly when conduit.OnPolicy would drop a rollout of that version (max_staleness = T - 1)."""
    steps = {"a": 5, "b": 4, "c": 3, "d": 2}
    got = with_groups(buffer(threshold=2), steps)._stale_terminal_keys(5, "train")
    edp = ExperienceDataPlane(ExperienceSchema(v=Field((), torch.int64)), capacity=16,
                              semantics=OnPolicy(num_minibatches=1, max_staleness=1, on_stale="drop"))
    for uid in sorted(steps, key=steps.get):  # rollouts oldest first, one per group version
        edp.ingest({"v": torch.tensor([steps[uid]])}, version=steps[uid])
    edp.seal()
    edp.set_policy_version(5)
    delivered = {int(edp.deliver()[0]["v"][0]) for _ in range(2)}  # what Conduit still serves
    assert delivered == {5, 4}
    assert got == {u for u, s in steps.items() if s not in delivered} == {"c", "d"}


def test_raise_and_wait_and_off() -> None:
    """on_stale=raise stops with a typed error when stale groups would be evicted, not when they are only
    counted (the separate-async trainer counts for the next step too); wait never evicts; a null threshold
    disables the check."""
    buf = with_groups(buffer(on_stale="raise"), {"x": 1})
    reasons = buf._terminal_eviction_reasons(9, "train")
    assert reasons[0] == {"x"}
    with pytest.raises(StaleExperienceError, match="8 policy versions behind step 9"):
        buf._evict_terminal_groups(9, "train", reasons)
    assert buf.finished_keys["train"] == {"x"}, "a refused eviction cleared the group"
    assert with_groups(buffer(on_stale="wait"), {"x": 1})._stale_terminal_keys(9, "train") == set()
    assert with_groups(buffer(threshold=None), {"x": 1})._stale_terminal_keys(9, "train") == set()
    assert with_groups(buffer(), {"x": 1})._stale_terminal_keys(9, "val") == set()


def test_sampled_groups_past_the_bound_stop_the_run_except_under_verls_dropless_wait() -> None:
    """verl's wait holds sampling until stale in-flight groups finish, then trains them: no guard there."""
    with pytest.raises(StaleExperienceError, match="2 versions behind"):
        buffer(on_stale="drop")._check_sampled([0, 2], 3)
    buffer(on_stale="drop")._check_sampled([0, 1], 3)  # within max_staleness = threshold - 1 = 1
    buffer(on_stale="wait")._check_sampled([0, 2], 3)
    buffer(threshold=None)._check_sampled([7], 9)


def test_bad_on_stale_is_a_configuration_error() -> None:
    from conduit import ConfigurationError

    with pytest.raises(ConfigurationError):
        buffer(on_stale="sometimes")
