"""Review of buffer_args checking: values of the wrong type get a ConfigurationError, not a crash or a misreading."""

from __future__ import annotations

from typing import Any

import pytest
from conduit import ConfigurationError
from conduit_srl import ConduitBuffer


@pytest.mark.parametrize("args", [
    {"g_ing": float("inf")},  # was OverflowError (cannot convert float infinity to integer)
    {"overlap": "no"},  # was read as True: the work ran in the background
    {"copy_on_put": "false"},
    {"batched_puts": 1},  # was read as True: every [T, ...] put then misread as [T, B, ...]
    {"batched_puts": "no"},
    {"pin_memory": "no"},
    {"drop_fields": [3]},
    {"semantics": "on_policy", "num_minibatches": 2, "version_field": ""},
    {"semantics": "on_policy", "num_minibatches": 2, "version_field": 3},
])
def test_a_value_of_the_wrong_type_is_a_configuration_error(args: dict[str, Any]) -> None:
    args = {"batch_size": 4, **args} if args.get("semantics") != "on_policy" else {"capacity": 8, **args}
    with pytest.raises(ConfigurationError):
        ConduitBuffer(**args)


def test_flags_of_the_right_type_are_accepted(closing) -> None:
    import numpy as np

    b = closing(batch_size=4, overlap=False, copy_on_put=np.bool_(True), batched_puts=False, pin_memory=None)
    assert b.config.copy_on_put


def test_the_flags_are_checked_by_cores_public_bool_check() -> None:
    """The config had its own copy of core's check (``isinstance(v, (bool, np.bool_))``): it uses core's now, so a
    flag core takes is taken here too."""
    import conduit.checks
    import conduit_srl.config

    assert conduit_srl.config.is_bool is conduit.checks.is_bool
