"""The RLlib internals conduit-rllib relies on are where it expects them, and a moved one fails loudly."""

from __future__ import annotations

import pytest
from conduit_rllib import compat, enable
from conduit_rllib.compat import RLlibCompatibilityError
from ray.rllib.core.learner.learner import Learner


def test_every_relied_on_hook_is_in_place() -> None:
    assert compat.problems() == [], "\n".join(compat.problems())
    compat.check()


def test_a_moved_hook_is_reported_by_name_and_enable_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(Learner, "_make_batch_if_necessary")
    found = compat.problems()
    assert any("_make_batch_if_necessary" in p for p in found), found
    with pytest.raises(RLlibCompatibilityError, match="_make_batch_if_necessary"):
        compat.check()
    from ray.rllib.algorithms.dqn import DQNConfig

    with pytest.raises(RLlibCompatibilityError):
        enable(DQNConfig())


def test_a_changed_call_sequence_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.rllib.algorithms.dqn.dqn import DQN

    def training_step_without_the_buffer(self: object) -> None:  # what a refactored RLlib might do
        return None

    monkeypatch.setattr(DQN, "_training_step_new_api_stack", training_step_without_the_buffer)
    found = compat.problems()
    assert any("local_replay_buffer" in p for p in found), found


def test_ray_actor_tracing_parameters_are_not_a_moved_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray adds ``_ray_trace_ctx`` to methods of classes it runs as actors (EnvRunner, Learner): still compatible."""
    from ray.rllib.utils.checkpoints import Checkpointable

    def traced(self, name, components, not_components, *, _ray_trace_ctx=None):  # noqa: ANN001, ANN202
        return True

    monkeypatch.setattr(Checkpointable, "_check_component", traced)
    assert compat.problems() == []
