"""``PrioritizedSampler(max_from_ingest=...)`` takes a bool only.

Bug found: the flag was read with ``bool(...)``, so ``max_from_ingest="no"`` (or ``"False"``, ``0.0``... any truthy
non-bool) silently meant True: priorities given at ingestion then raised later items' default priority, the opposite
of what was asked. Now anything but a Python or NumPy bool is refused with a ConfigurationError, as the buffer's
other flags are (e.g. ``deliver(replace=...)``).
"""

from __future__ import annotations

import numpy as np
import pytest
from conduit import ConfigurationError, PrioritizedSampler


@pytest.mark.parametrize("flag", ["no", "False", 0, 1.0, None, [False]])
def test_a_flag_that_is_no_bool_is_refused(flag: object) -> None:
    with pytest.raises(ConfigurationError, match="max_from_ingest"):
        PrioritizedSampler(max_from_ingest=flag)  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", [True, False, np.bool_(True), np.bool_(False)])
def test_python_and_numpy_bools_are_taken(flag: object) -> None:
    assert PrioritizedSampler(max_from_ingest=flag).max_from_ingest is bool(flag)  # type: ignore[arg-type]
