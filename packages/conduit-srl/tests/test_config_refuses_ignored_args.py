"""Review of buffer_args checking: what a config that cannot mean what it says gets."""

from __future__ import annotations

from typing import Any

import pytest
from conduit import ConfigurationError
from conduit_srl import ConduitBuffer
from conduit_srl.testing import make_sample

ON_POLICY = {"semantics": "on_policy", "capacity": 8, "num_minibatches": 2}


@pytest.mark.parametrize(("args", "name"), [
    ({"batch_size": 4, "num_epochs": 3}, "num_epochs"),  # forgot semantics="on_policy": one pass, not three
    ({"batch_size": 4, "num_minibatches": 2}, "num_minibatches"),
    ({"batch_size": 4, "minibatch_size": 2}, "minibatch_size"),
    ({"batch_size": 4, "max_staleness": 2}, "max_staleness"),
    ({"batch_size": 4, "on_stale": "raise"}, "on_stale"),
    ({"batch_size": 4, "version_field": "version"}, "version_field"),
    ({"batch_size": 4, "warmup": 4}, "warmup"),  # a queue delivers as soon as a batch waits
    ({"semantics": "replay", "batch_size": 4, "capacity": 8, "alpha": 1.0}, "alpha"),  # uniform: no priorities
    ({"semantics": "replay", "batch_size": 4, "capacity": 8, "beta": 1.0}, "beta"),
    ({"semantics": "replay", "batch_size": 4, "capacity": 8, "num_epochs": 2}, "num_epochs"),
    ({**ON_POLICY, "warmup": 4}, "warmup"),
    ({**ON_POLICY, "alpha": 1.0}, "alpha"),
])
def test_an_argument_the_semantics_would_ignore_is_refused(args: dict[str, Any], name: str) -> None:
    """from_args promises ConfigurationError for arguments that do not fit the semantics; these were accepted
    and silently ignored (a queue built with num_epochs=3 delivers each batch once)."""
    with pytest.raises(ConfigurationError, match=name):
        ConduitBuffer(**args)


def test_default_values_of_other_semantics_arguments_are_accepted(closing) -> None:
    """A value equal to the default changes nothing, so a shared config dict still works."""
    b = closing(batch_size=1, num_epochs=1, max_staleness=0, on_stale="drop", alpha=0.6, beta=0.4)
    b.put(make_sample([0]))
    assert b.get().sample.id.shape == (4, 1)
