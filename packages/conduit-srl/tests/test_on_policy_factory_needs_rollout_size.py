"""Review: an on-policy buffer built through SRL's make_buffer must seal rollouts by itself.

SRL's trainer (and buffer worker) only put, get, empty and qsize: nothing calls ``seal()``, and the policy
version the samples carry moves only after the trainer has trained on something. An on-policy buffer whose
rollouts are sealed only by ``seal()`` or a newer version therefore never delivers there: the training thread
sees ``empty()`` forever, and once ``capacity`` samples are stored the main thread's ``put`` waits for ever.
"""

from __future__ import annotations

import pytest
from conduit import ConfigurationError
from conduit_srl import ConduitBuffer, make_conduit_buffer
from conduit_srl.testing import make_sample


def test_without_rollout_size_srl_calls_alone_never_deliver(closing) -> None:
    """The hang, shown with the calls SRL makes (no seal, one version): everything stored, nothing deliverable."""
    b = closing(semantics="on_policy", capacity=4, num_minibatches=2)
    for i in range(4):
        b.put(make_sample([i], version=0))
    b.flush()
    assert b.empty() and b.qsize() == 4  # the next put would wait for a get() that never comes


@pytest.mark.parametrize("name", ["conduit:on_policy", "conduit"])
def test_make_buffer_refuses_on_policy_without_rollout_size(name: str) -> None:
    args = {"capacity": 64, "num_minibatches": 2}
    if name == "conduit":
        args["semantics"] = "on_policy"
    with pytest.raises(ConfigurationError, match="rollout_size"):
        make_conduit_buffer(name, args)


def test_make_buffer_builds_on_policy_with_rollout_size() -> None:
    b = make_conduit_buffer("conduit:on_policy", {"capacity": 64, "num_minibatches": 2, "rollout_size": 8})
    try:
        assert isinstance(b, ConduitBuffer) and b.config.rollout_size == 8
    finally:
        b.close()
