"""``transfer_queue.backend.Conduit.unit_num_cpus`` is a finite number of CPUs >= 0.

NaN passed the backend's config check (``cpus < 0`` is false for NaN) and ``tq.init`` then failed inside Ray's actor
options with an untyped ``ValueError: cannot convert float NaN to integer``; ``True`` was taken as one CPU, although
the whole-number keys refuse booleans. Both are now a ``ConfigurationError`` naming the key.
"""

from __future__ import annotations

import math

import pytest
from conduit import ConfigurationError
from conduit_verl.tq_storage import DEFAULTS, _validated


@pytest.mark.parametrize("cpus", [math.nan, True, -1, math.inf])
def test_a_bad_unit_num_cpus_is_a_configuration_error(cpus: object) -> None:
    with pytest.raises(ConfigurationError, match="unit_num_cpus"):
        _validated(dict(DEFAULTS, unit_num_cpus=cpus))


@pytest.mark.parametrize("cpus", [0, 1, 0.5, 2.0])
def test_a_finite_unit_num_cpus_is_kept(cpus: float) -> None:
    assert _validated(dict(DEFAULTS, unit_num_cpus=cpus))["unit_num_cpus"] == cpus
