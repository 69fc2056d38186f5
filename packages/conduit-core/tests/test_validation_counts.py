"""The host-delivery check's counts: no rounds or no repetitions leave no median to take.

``check_host_delivery(rounds=0)`` filled its buffers, then returned checks whose ``error`` raised
``statistics.StatisticsError``; ``reps=0`` (and ``measure_host_delivery(reps=0)``) raised it from inside the timing
loop; ``rounds=True`` ran one round. They are refused now with a ``ConfigurationError`` naming the count, before
any buffer is filled (or, for the isolated check, any process started).
"""

from __future__ import annotations

import pytest
from conduit.errors import ConfigurationError
from conduit.placement.validation import check_host_delivery, check_host_delivery_isolated, measure_host_delivery


@pytest.mark.parametrize(("kwargs", "name"), [({"rounds": 0}, "rounds"), ({"reps": 0}, "reps"),
                                              ({"rounds": True}, "rounds"), ({"reps": 2.5}, "reps")])
def test_a_check_without_rounds_or_repetitions_is_refused(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"{name} must be an int >= 1"):
        check_host_delivery((16,), batch=8, buffer_bytes=1 << 20, **kwargs)  # type: ignore[arg-type]


def test_a_measurement_without_repetitions_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"reps must be an int >= 1, got 0"):
        measure_host_delivery(16, batch=8, capacity=64, reps=0)
    with pytest.raises(ConfigurationError, match=r"warmup must be an int >= 0, got -1"):
        measure_host_delivery(16, batch=8, capacity=64, warmup=-1)


def test_the_isolated_check_refuses_no_rounds_before_starting_a_process() -> None:
    with pytest.raises(ConfigurationError, match=r"rounds must be an int >= 1, got 0"):
        check_host_delivery_isolated((16,), rounds=0)
