"""Review of buffer_args that were accepted although the buffer they build could never store a sample."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conduit import ConfigurationError
from conduit_srl import ConduitBuffer
from conduit_srl.config import BufferConfig
from conduit_srl.testing import make_sample

ON_POLICY = {"semantics": "on_policy", "capacity": 8, "num_minibatches": 2}


@pytest.mark.parametrize("args", [
    {**ON_POLICY, "drop_fields": ("policy_version_steps",)},  # the default version_field, dropped
    {**ON_POLICY, "drop_fields": "policy_version_steps"},  # (one name given as a string)
    {**ON_POLICY, "version_field": "id", "drop_fields": ("policy_name", "id")},
    {**ON_POLICY, "version_field": "policy_state.hx", "drop_fields": ("policy_state",)},  # its parent record
])
def test_on_policy_refuses_dropping_the_field_it_reads_versions_from(args: dict[str, Any]) -> None:
    """The version field is read from the stored sample; a dropped field is never stored, so every put of such a
    buffer raised SchemaError saying the sample lacks the field (it has it). Refused at construction instead."""
    with pytest.raises(ConfigurationError, match="drop_fields"):
        BufferConfig.from_args(**args)


def test_dropping_other_fields_of_an_on_policy_buffer_still_works(closing) -> None:
    b = closing(**ON_POLICY, drop_fields=("policy_name", "reward"))
    b.put_batch(make_sample(np.arange(4), batched=True))
    b.seal()
    entry = b.get()
    assert entry.sample.reward is None and entry.sample.policy_version_steps is not None


def test_dropping_the_default_version_field_is_fine_when_not_on_policy() -> None:
    b = ConduitBuffer(semantics="queue", batch_size=2, drop_fields=("policy_name", "policy_version_steps"))
    try:
        b.put_batch(make_sample(np.arange(2), batched=True))
        assert b.get().sample.policy_version_steps is None
    finally:
        b.close()
